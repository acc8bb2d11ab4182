"""BFL -> diffusers parameter names, learned from diffusers' own FLUX.2 single-file converter."""

from __future__ import annotations

import functools

import torch

from ..errors import NVFP4CheckpointError

# Rows of the probe tensor fed to the converter: divisible by 2, 3, 4 and 6, so chunk(2) / chunk(3) splits show up
# as exact fractions of the source rows.
_PROBE_ROWS = 12
Segments = tuple[tuple[int, int], ...]


@functools.cache
def diffusers_targets(bfl_key: str) -> tuple[tuple[str, Segments], ...]:
    """Where diffusers' FLUX.2 converter puts one BFL tensor: ``((diffusers_key, row_segments), ...)``.

    The converter is run on a probe tensor ``arange(12)`` under the given key; the rows each output receives are
    read back as segments in units of 1/12 of the source rows (``((0, 4),)`` is the first third, ``((6, 12), (0, 6))``
    the two halves swapped). Raises KeyError (with diffusers' message) for keys the converter does not know.
    """
    try:
        from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers as convert
    except ImportError as e:  # pragma: no cover - diffusers without FLUX.2 single-file support
        raise ImportError(
            "this diffusers has no convert_flux2_transformer_checkpoint_to_diffusers (need >= 0.42)"
        ) from e
    out = convert({bfl_key: torch.arange(_PROBE_ROWS)})
    targets = []
    for key, probe in out.items():
        rows = probe.tolist()
        segments, start = [], 0
        for i in range(1, len(rows) + 1):
            if i == len(rows) or rows[i] != rows[i - 1] + 1:
                segments.append((rows[start], rows[i - 1] + 1))
                start = i
        targets.append((key, tuple(segments)))
    return tuple(targets)


def take_rows(t: torch.Tensor, segments: Segments, what: str) -> torch.Tensor:
    """Rows of ``t`` selected by probe segments (see ``diffusers_targets``)."""
    n = t.shape[0]
    if segments == ((0, _PROBE_ROWS),):
        return t
    parts = []
    for s, e in segments:
        if (n * s) % _PROBE_ROWS or (n * e) % _PROBE_ROWS:
            raise NVFP4CheckpointError(f"{what}: {n} rows cannot be split at {s}/{_PROBE_ROWS} and {e}/{_PROBE_ROWS}")
        parts.append(t[n * s // _PROBE_ROWS: n * e // _PROBE_ROWS])
    return torch.cat(parts, 0).contiguous() if len(parts) > 1 else parts[0].contiguous()


def segment_rows(n: int, segments: Segments) -> int:
    return sum(n * (e - s) for s, e in segments) // _PROBE_ROWS
