"""Single-file names -> diffusers parameter names, learned from diffusers' own single-file key converter of the model
class (``SINGLE_FILE_LOADABLE_CLASSES``, the table ``from_single_file`` reads).

The one place this package reads that diffusers table (``tests/test_loader_comfy.py`` checks it against the installed
diffusers): FLUX.2's ``convert_flux2_transformer_checkpoint_to_diffusers`` (BFL names, fused qkv, ``norm_out``
halves swapped), Qwen-Image's identity mapping, Qwen-Image 2.1's ``convert_qwen_image21_transformer_checkpoint_to_
diffusers`` (ComfyUI's fused ``img_mlp.gate_up``, gate rows first). Keys reach the converter without the file's key
prefix: Qwen-Image's identity mapping would keep ``model.diffusion_model.``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import torch

from ..errors import NVFP4CheckpointError

IDENTITY = "identity"  # in place of a class name: the file already has diffusers' names
# Rows of the probe tensor fed to the converter: divisible by 2, 3, 4 and 6, so chunk(2) / chunk(3) splits show up
# as exact fractions of the source rows.
_PROBE_ROWS = 12
Segments = tuple[tuple[int, int], ...]


def single_file_converter(class_name: str) -> Callable[..., dict]:
    """diffusers' ``checkpoint_mapping_fn`` for ``class_name`` (a diffusers transformer class)."""
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    entry = cast(dict[str, Any], SINGLE_FILE_LOADABLE_CLASSES).get(class_name) or {}
    if "checkpoint_mapping_fn" not in entry:
        raise NVFP4CheckpointError(f"this diffusers has no single-file key converter for {class_name}")
    return entry["checkpoint_mapping_fn"]


@functools.cache
def converter_name(class_name: str) -> str:
    """How ``class_name``'s keys are mapped, for load summaries: the converter's name, or what the mapping does."""
    if class_name == IDENTITY:
        return "none (the file has diffusers' names)"
    fn = single_file_converter(class_name)
    if fn.__name__ == "<lambda>":
        probe = {"probe.weight": torch.zeros(1)}
        kind = "identity" if list(fn(dict(probe))) == list(probe) else "an unnamed mapping"
        return f"diffusers' {kind} mapping for {class_name} (SINGLE_FILE_LOADABLE_CLASSES)"
    return f"diffusers' {fn.__name__}"


@functools.cache
def diffusers_targets(class_name: str, key: str) -> tuple[tuple[str, Segments], ...]:
    """Where diffusers' converter for ``class_name`` (``IDENTITY``: none) puts one stored tensor:
    ``((diffusers_key, row_segments), ...)``.

    The converter is run on a probe tensor ``arange(12)`` under the given key (without the file's key prefix); the
    rows each output receives are read back as segments in units of 1/12 of the source rows (``((0, 4),)`` is the first
    third, ``((6, 12), (0, 6))`` the two halves swapped). Raises whatever the converter raises for keys it has no rule
    for (FLUX.2's: a KeyError).
    """
    if class_name == IDENTITY:
        return ((key, ((0, _PROBE_ROWS),)),)
    out = single_file_converter(class_name)({key: torch.arange(_PROBE_ROWS)})
    targets = []
    for target, probe in out.items():
        rows = probe.tolist()
        segments, start = [], 0
        for i in range(1, len(rows) + 1):
            if i == len(rows) or rows[i] != rows[i - 1] + 1:
                segments.append((rows[start], rows[i - 1] + 1))
                start = i
        targets.append((target, tuple(segments)))
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
