"""The NVFP4 kernels' one-time preparation during a model's first call(s): which of this package's Triton kernels
compiled or came from Triton's cache, how long it took, and a progress bar while they compile (docs/design.md §8,
"Preparation").

One process-wide Triton compilation listener (``kernels/triton_compat.add_compile_listener``) hands each event of
this package's kernels to the model whose call is under way. A model is watched from ``enable_fast_paths`` until a
call of it compiles nothing: its first call, and the next ones while they still compile.
"""

from __future__ import annotations

import importlib
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .ops import dispatch
from .progress import BarFactory, CallProgress, repeated_blocks, tqdm_bar

_WATCHED: weakref.WeakSet[Preparation] = weakref.WeakSet()
_REMOVE_LISTENER: list[Callable[[], None]] = []
NOT_CALLED = ("the model has not been called since enable_fast_paths (calls that torch.compile traces as a whole "
              "are not watched)")
NOTHING_HEARD = ("no NVFP4 Triton kernel was compiled or loaded during the first call (none runs on this device, "
                 "or this process had loaded them before)")


def _compat() -> Any:
    assert dispatch.kernels is not None
    return importlib.import_module(dispatch.kernels.__name__ + ".triton_compat")


def listener_unavailable() -> str | None:
    """Why this process cannot tell compiles from cache loads (None: it can)."""
    if dispatch.kernels is None:
        return f"the Triton kernels are not in use: {dispatch.KERNELS_UNAVAILABLE or 'Triton is not installed'}"
    return _compat().compile_listener_unavailable()


def _on_compile(event: Any) -> None:
    for preparation in list(_WATCHED):
        preparation.heard(event)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)


class Preparation:
    """One model's record of its kernels' preparation, and its progress bar while they compile."""

    def __init__(self, model: nn.Module, device: torch.device, make_bar: BarFactory | None) -> None:
        self.unavailable = listener_unavailable()
        self.events: list[Any] = []
        self.calls = 0
        self._misses_this_call = 0
        self.progress: CallProgress | None = None
        if self.unavailable is not None:
            return
        compat = _compat()
        self._package = compat.__name__.rpartition(".")[0] + "."
        self.description = (f"Compiling NVFP4 kernels for {_device_name(device)}, once per machine (Triton cache: "
                            f"{compat.triton_cache_dir()})")
        self.progress = CallProgress(model, repeated_blocks(model), make_bar or tqdm_bar, self._call_ended)
        if not _REMOVE_LISTENER:
            _REMOVE_LISTENER.append(compat.add_compile_listener(_on_compile))
        _WATCHED.add(self)

    def heard(self, event: Any) -> None:
        """A compile or cache load: recorded when it is this package's kernel during this model's watched call."""
        if self.progress is None or not self.progress.in_call or not (event.module or "").startswith(self._package):
            return
        self.events.append(event)
        if not event.cache_hit:
            self._misses_this_call += 1
            self.progress.show(self.description)
            self.progress.set_postfix(event.name)

    def _call_ended(self) -> bool:
        self.calls += 1
        keep = self._misses_this_call > 0
        self._misses_this_call = 0
        if not keep:
            self.stop()
        return keep

    def stop(self) -> None:
        """Stop watching (the hooks out; the listener too once no model is watched)."""
        if self.progress is not None:
            self.progress.remove()
        _WATCHED.discard(self)
        if not _WATCHED and _REMOVE_LISTENER:
            _REMOVE_LISTENER.pop()()

    def report(self) -> dict:
        """``cache``: "warm" (every kernel from Triton's cache), "cold" (some compiled), "unknown" (with ``reason``);
        ``seconds`` (what triton.compile measured, compiles and loads), ``compiled``, ``from_cache``, ``calls``
        (first calls watched), ``kernels_compiled`` (name -> seconds)."""
        if self.unavailable is not None:
            return {"cache": "unknown", "reason": self.unavailable}
        compiled = [e for e in self.events if not e.cache_hit]
        out: dict[str, Any] = {"cache": "cold" if compiled else "warm" if self.events else "unknown",
                               "seconds": round(sum(e.seconds for e in self.events), 3), "compiled": len(compiled),
                               "from_cache": len(self.events) - len(compiled), "calls": self.calls}
        if not self.events:
            out["reason"] = NOT_CALLED if self.calls == 0 else NOTHING_HEARD
        if compiled:
            by_name: dict[str, float] = {}
            for e in compiled:
                by_name[e.name] = round(by_name.get(e.name, 0.0) + e.seconds, 3)
            out["kernels_compiled"] = by_name
        return out


def pipeline_bar(pipe: Any) -> BarFactory | None:
    """``pipe.progress_bar`` (its ``set_progress_bar_config`` settings hold) for a pipeline, None for a model."""
    progress_bar = getattr(pipe, "progress_bar", None)
    if isinstance(pipe, nn.Module) or not callable(progress_bar):
        return None
    return lambda total: progress_bar(total=total)
