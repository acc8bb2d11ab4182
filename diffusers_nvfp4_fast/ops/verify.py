"""First-use byte verification of fused ops, and the counters ``fast_path_report`` shows (docs/design.md §8).

A fused call goes through ``run_checked`` (``ops/fused.py`` calls it): at the first call for a (site kind,
verification key) it also runs the unfused reference and compares every output byte; on a mismatch the site kind
falls back for the rest of the process, with a warning naming what differed. Gates (in ``patches/``) decide whether
a site runs fused at all and record their reasons here with ``count_fallback``.

The check runs inside a custom op, so it happens at run time even under ``torch.compile``; during CUDA graph
capture nothing can be compared, so an unverified site records the unfused path into the graph instead.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch

from .. import caches, state_probes
from .dispatch import compiling_only
from .site import Site, SiteKind

VerifyMode = Literal["first", "always", "off"]
# The gate reason of a site that keeps diffusers' op under torch.compile (inductor computes it its own way, and
# compiled on must equal compiled off: docs/design.md §1).
COMPILED = "compiled: kept diffusers' op"
_VERIFY_MODES = ("first", "always", "off")


@dataclass
class FastPathStats:
    """Counters of one model's fast paths; ``fast_path_report`` returns them as a dict."""

    sites: Counter = field(default_factory=Counter)
    fused_calls: Counter = field(default_factory=Counter)
    fallbacks: Counter = field(default_factory=Counter)
    verified: Counter = field(default_factory=Counter)
    verify_failed: Counter = field(default_factory=Counter)
    verify_mode: VerifyMode = "first"
    traced_fallbacks: Counter = field(default_factory=Counter)  # counted once per torch.compile trace, not per call
    site_modules: dict[str, list[str]] = field(default_factory=dict)  # site kind -> modules it is installed on

    def as_dict(self) -> dict:
        return {
            "verify": self.verify_mode,
            "sites": dict(self.sites),
            "fused_calls": dict(self.fused_calls),
            "fallbacks": dict(self.fallbacks + self.traced_fallbacks),
            "verifications": {"passed": sum(self.verified.values()), "failed": sum(self.verify_failed.values()),
                              "passed_by_kind": dict(self.verified), "failed_by_kind": dict(self.verify_failed)},
        }


_lock = threading.Lock()
_STATS: dict[int, FastPathStats] = {}
_NEXT_ID = itertools.count(1)  # never reused: a stale id must not count into another model's stats
# verification key -> passed (process-wide); site kind -> what mismatched
_VERDICTS: dict[str, bool] = caches.register("ops.verify.verdicts", {}, "kept for the process (reset_verification)")
_FAILED_KINDS: dict[SiteKind, str] = caches.register("ops.verify.failed_kinds", {},
                                                     "kept for the process (reset_verification)")


def new_stats(verify: VerifyMode) -> tuple[int, FastPathStats]:
    if verify not in _VERIFY_MODES:
        raise ValueError(f"verify must be one of {_VERIFY_MODES}, got {verify!r}")
    stats = FastPathStats(verify_mode=verify)
    with _lock:
        stats_id = next(_NEXT_ID)
        _STATS[stats_id] = stats
    return stats_id, stats


def site_counter(stats_id: int) -> Callable[[SiteKind, str], None]:
    """``add(kind, module name)`` for a patcher: records where one installed site of ``kind`` is."""
    stats = _STATS.get(stats_id)

    def add(kind: SiteKind, name: str) -> None:
        if stats is not None:
            stats.site_modules.setdefault(kind, []).append(name)

    return add


def live_stats_count() -> int:
    """How many models' counters are held (each until its fast paths are disabled: ``drop_stats``)."""
    return len(_STATS)


@contextlib.contextmanager
def stats_kept(stats_id: int) -> Iterator[None]:
    """Within the block, the counters of ``stats_id`` may change; they are put back at its end (a compile-only pass
    is no call of the model)."""
    stats = _STATS.get(stats_id)
    saved = copy.deepcopy(stats)
    try:
        yield
    finally:
        if stats is not None:
            for name, value in vars(saved).items():  # in place: sites hold the counters themselves
                current = getattr(stats, name)
                if isinstance(current, dict):
                    current.clear()
                    current.update(value)


def drop_stats(stats_id: int) -> None:
    with _lock:
        _STATS.pop(stats_id, None)


def record_fallback(stats: FastPathStats, kind: SiteKind, reason: str) -> None:
    """Called from gates in eager Python; under torch.compile gates call ``count_fallback``, which counts per trace."""
    if torch.compiler.is_compiling():
        return
    stats.fallbacks[f"{kind}: {reason}"] += 1


@torch.compiler.assume_constant_result
def _count_traced_fallback(stats_id: int, key: str) -> bool:
    # torch.compile runs this while tracing and bakes its result into the graph as a constant: the count is a side
    # effect of the trace, so the graph gets no guard on the counter (a count per call would re-trace every call).
    stats = _STATS.get(stats_id)
    if stats is not None:
        with _lock:
            stats.traced_fallbacks[key] += 1
    return True


def count_fallback(site: Site, reason: str) -> None:
    """Count that ``site`` (if its stats still exist) ran unfused, and why: per call in eager mode, once per trace of
    the site under ``torch.compile``."""
    if torch.compiler.is_compiling():
        _count_traced_fallback(site.stats_id, f"{site.kind}: {reason}")
        return
    stats = _STATS.get(site.stats_id)
    if stats is not None:
        record_fallback(stats, site.kind, reason)


def failed_kind_reason(kind: SiteKind) -> str | None:
    """Non-None once a verification of ``kind`` has failed in this process."""
    return _FAILED_KINDS.get(kind)


def failed_kinds_count() -> int:
    """How many site kinds failed a verification in this process (each one runs unfused from then on)."""
    return len(_FAILED_KINDS)


state_probes.register("failed verifications", failed_kinds_count)


def reset_verification() -> None:
    """Forget verdicts (tests; after upgrading torch in-process)."""
    with _lock:
        _VERDICTS.clear()
        _FAILED_KINDS.clear()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes (NaN payloads and -0.0 included)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_as_bytes(a), _as_bytes(b))


def describe_mismatch(names: tuple[str, ...], fused: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...]) -> str:
    parts = []
    for name, a, b in zip(names, fused, ref):
        if a.shape != b.shape or a.dtype != b.dtype:
            parts.append(f"{name}: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}")
        elif not bytes_equal(a, b):
            n = int((_as_bytes(a) != _as_bytes(b)).sum())
            parts.append(f"{name}: {n} of {a.numel() * a.element_size()} bytes differ")
    return "; ".join(parts)


def counted_without_check(stats_id: int, kind: SiteKind, call_key: str) -> bool:
    """True, with the call counted as fused, where ``run_checked`` would run the fused implementation of this call
    class without checking it (verified before in mode "first", or mode "off"); False where the call must go
    through ``run_checked``. Launch plans of fused calls ask this before they skip it."""
    return kind not in _FAILED_KINDS and _counted(_STATS.get(stats_id) or FastPathStats(), kind, call_key)


def _counted(stats: FastPathStats, kind: SiteKind, call_key: str) -> bool:
    mode = stats.verify_mode
    if mode == "off" or (mode == "first" and _VERDICTS.get(f"{kind}|{call_key}")):
        stats.fused_calls[kind] += 1
        return True
    return False


def run_checked(
    site: Site,
    call_key: str,
    output_names: tuple[str, ...],
    fused: Callable[[], tuple[torch.Tensor, ...]],
    reference: Callable[[], tuple[torch.Tensor, ...]],
) -> tuple[torch.Tensor, ...]:
    """Run the fused implementation, verifying it against ``reference`` when the mode asks for it; ``call_key`` is
    the class of calls one verification stands for (``fused.verification_key``).

    Runs inside the eager implementation of a custom op (see ops/fused.py), i.e. at run time in every mode.
    """
    kind = site.kind
    stats = _STATS.get(site.stats_id) or FastPathStats()
    if kind in _FAILED_KINDS:
        stats.fallbacks[f"{kind}: verification failed earlier in this process"] += 1
        return reference()
    if _counted(stats, kind, call_key):  # the steady state: first, so that it pays for no other check
        return fused()
    if compiling_only():  # both paths' kernels compile; nothing is compared (a pass keeps the counters, stats_kept)
        fused()
        return reference()
    key = f"{kind}|{call_key}"
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        stats.fallbacks[f"{kind}: not yet verified when captured into a CUDA graph"] += 1
        return reference()
    out, ref = fused(), reference()
    if all(bytes_equal(a, b) for a, b in zip(out, ref)):
        with _lock:
            _VERDICTS[key] = True
        stats.verified[kind] += 1
        stats.fused_calls[kind] += 1
        return out
    what = describe_mismatch(output_names, out, ref)
    with _lock:
        _VERDICTS[key] = False
        _FAILED_KINDS[kind] = what
    stats.verify_failed[kind] += 1
    warnings.warn(
        f"diffusers-nvfp4-fast: the fused {kind} path differs from the unfused path for {call_key} ({what}); "
        f"{kind} falls back to the unfused path for the rest of this process. Please report this with your torch, "
        "triton and GPU versions.",
        RuntimeWarning,
        stacklevel=2,
    )
    return ref


@contextlib.contextmanager
def exact_fast_math_reference() -> Iterator[None]:
    """Within the block, ``format.quantize_nvfp4(..., fast_math=True)`` on CUDA tensors computes the GPU's recipe:
    its stand-in for ``rcp.approx.ftz.f32`` (a correctly rounded reciprocal, docs/design.md §3) is replaced by the
    instruction itself, so fast-math kernels can be compared byte for byte. Needs Triton and a CUDA GPU."""
    from .. import format as nvfp4
    from ..kernels.rcp_approx import rcp_approx_cuda

    original = nvfp4._rcp_approx
    nvfp4._rcp_approx = rcp_approx_cuda
    try:
        yield
    finally:
        nvfp4._rcp_approx = original
