"""The NVFP4 kernels' one-time preparation during a model's first call(s): which of this package's Triton kernels
compiled or came from Triton's cache, how long it took, and a progress bar while they compile (docs/design.md §8,
"Preparation").

One process-wide Triton compilation listener (``kernels/triton_compat.add_compile_listener``) hands each event of
this package's kernels to the model whose call is under way. A model is watched from ``enable_fast_paths`` until a
call of it compiles nothing: its first call, and the next ones while they still compile.

Before the first call runs, the same call runs once as a compile-only pass (``kernels/launch.compile_only``): each
launch starts its binary's compile on a thread pool instead of running, so the kernels the call needs compile side by
side (in worker processes with ``switches.COMPILE_WORKERS``: ``kernels/compile_workers.py``); then the call itself
runs on the compiled binaries. The pass is skipped (the kernels then compile one by one,
as the call reaches them) where a second call could change something: a model with diffusers or accelerate hooks
(caches, offloading), a compiled model, outside CUDA, or with ``switches.PARALLEL_COMPILE`` off.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import importlib
import importlib.metadata
import json
import os
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import torch
from torch import nn

from .graphs.runner import GraphRunner
from .module_hooks import TORCH_FORWARD_HOOK, hooks_on
from .ops import dispatch, verify
from .progress import BarFactory, CallProgress, outside_trace_and_capture, repeated_blocks, tqdm_bar
from .swaps import current_inner_forward
from .switches import COMPILE_WORKERS, PARALLEL_COMPILE, env_enabled, env_value

_WATCHED: weakref.WeakSet[Preparation] = weakref.WeakSet()
_REMOVE_LISTENER: list[Callable[[], None]] = []
NOT_CALLED = ("the model has not been called since enable_fast_paths (calls that torch.compile traces as a whole "
              "are not watched)")
PREPARED_BEFORE = ("this call was prepared before with this Triton cache, so its kernels load from it one by one, "
                   "faster than a pass")
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

    def __init__(self, model: nn.Module, device: torch.device, make_bar: BarFactory | None,
                 stats_id: int | None = None) -> None:
        self.unavailable = listener_unavailable()
        self.events: list[Any] = []
        self.calls = 0
        self._misses_this_call = 0
        self.progress: CallProgress | None = None
        self.parallel: dict[str, Any] = {"ran": False, "reason": NOT_CALLED}
        self._compile_only = False
        self._stats_id, self._device, self._make_bar = stats_id, device, make_bar or tqdm_bar
        self._first_call: Any = None
        self.compiled_elsewhere: list[tuple[str, float]] = []  # (kernel, seconds) compiled by worker processes
        self._awaits_workers = self._awaits_key = False
        self._key_waited_s: float | None = None  # how long the first call waited for Triton's key (None: it did not)
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
        self._first_call = model.register_forward_pre_hook(self._compile_in_parallel, with_kwargs=True, prepend=True)
        self._awaits_workers = device.type == "cuda" and _await_workers()
        self._awaits_key = start_key_parts(device)

    def _done_with_workers(self) -> None:
        if self._awaits_workers:
            self._awaits_workers = False
            _stop_awaiting_workers()

    def heard(self, event: Any) -> None:
        """A compile or cache load: recorded when it is this package's kernel during this model's watched call (or
        its compile-only pass, on the pool's threads)."""
        if self.progress is None or not (self.progress.in_call or self._compile_only):
            return
        if not (event.module or "").startswith(self._package):
            return
        self.events.append(event)
        if not event.cache_hit and not self._compile_only:
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

    def _compile_in_parallel(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        """The first call's compile-only pass (a forward pre-hook that removes itself, and never fails the call: the
        call itself then compiles what it needs, one by one)."""
        if not outside_trace_and_capture():
            return
        self._first_call.remove()
        if self._awaits_key:
            self._key_waited_s = await_key_parts()
        try:
            self._run_pass(model, args, kwargs)
        except Exception as error:  # noqa: BLE001
            self.parallel = {"ran": False, "reason": f"the compile-only pass failed: {type(error).__name__}: {error}"}
        finally:
            self._compile_only = False
            self._done_with_workers()

    def _run_pass(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        forward = _eager_forward(model)
        why = parallel_unavailable(model, self._device, forward)
        if why is not None or forward is None:
            self.parallel = {"ran": False, "reason": why}
            return
        record = prepared_record(model, self._device, args, kwargs)
        if record.exists():
            self.parallel = {"ran": False, "reason": f"{PREPARED_BEFORE} ({record})"}
            return
        launch = cast(ModuleType, dispatch.kernels).launch
        start = time.perf_counter()
        self._compile_only = True
        processes = _WORKERS["pool"] if self._awaits_workers else None
        with verify.stats_kept(self._stats_id or 0), torch.no_grad(), \
                launch.compile_only(processes=processes) as pending:
            forward(*args, **kwargs)
        forward_s = time.perf_counter() - start
        failures = self._wait(pending)
        self.parallel = {"ran": True, "kernels": len(pending.futures), "seconds": round(time.perf_counter() - start, 3),
                         "forward_s": round(forward_s, 3)}
        if processes is not None:
            self.parallel["processes"] = {"workers": processes.count, "compiled": len(pending.in_workers),
                                          "worker_seconds": round(sum(s for _, s in pending.in_workers), 3)}
            if pending.worker_failures:  # compiled in this process instead: the same binaries
                self.parallel["processes"]["failed"] = pending.worker_failures[:3]
        self.compiled_elsewhere = list(pending.in_workers)
        if failures:
            self.parallel["failed"] = [f"{type(e).__name__}: {e}"[:200] for e in failures[:3]]
        else:
            _write_quietly(record)

    def _wait(self, pending: Any) -> list[BaseException]:
        """Wait for the pool, with a progress bar once it has taken longer than half a second."""
        futures = pending.futures
        if not concurrent.futures.wait(futures, timeout=0.5).not_done:
            return pending.wait()
        bar = self._make_bar(len(futures))
        if hasattr(bar, "unit"):
            bar.unit = "kernel"
        bar.set_description(self.description)
        try:
            return pending.wait(lambda: bar.update(1))
        finally:
            bar.close()

    def stop(self) -> None:
        """Stop watching (the hooks out; the listener too once no model is watched; the worker processes once no model
        awaits them)."""
        self._done_with_workers()
        if self._first_call is not None:
            self._first_call.remove()
        if self.progress is not None:
            self.progress.remove()
        _WATCHED.discard(self)
        if not _WATCHED and _REMOVE_LISTENER:
            _REMOVE_LISTENER.pop()()

    def report(self) -> dict:
        """``cache``: "warm" (every kernel from Triton's cache), "cold" (some compiled), "unknown" (with ``reason``);
        ``seconds`` (what triton.compile measured, compiles and loads, here and in worker processes), ``compiled``
        (worker processes' binaries included), ``from_cache``, ``calls``
        (first calls watched), ``kernels_compiled`` (name -> seconds)."""
        if self.unavailable is not None:
            return {"cache": "unknown", "reason": self.unavailable}
        # a binary a worker process compiled is loaded here from the cache: counted as compiled, with the worker's time
        compiled = [(e.name, e.seconds) for e in self.events if not e.cache_hit] + self.compiled_elsewhere
        loaded = [e for e in self.events if e.cache_hit]
        from_cache = max(0, len(loaded) - len(self.compiled_elsewhere))
        out: dict[str, Any] = {"cache": "cold" if compiled else "warm" if self.events else "unknown",
                               "seconds": round(sum(s for _, s in compiled) + sum(e.seconds for e in loaded), 3),
                               "compiled": len(compiled), "from_cache": from_cache, "calls": self.calls,
                               "parallel": self.parallel}
        if self._key_waited_s is not None:
            out["triton_key"] = {"seconds": _KEY_PARTS.get("seconds"), "waited_s": self._key_waited_s,
                                 **({"failed": _KEY_PARTS["failed"]} if "failed" in _KEY_PARTS else {})}
        if not self.events:
            out["reason"] = NOT_CALLED if self.calls == 0 else NOTHING_HEARD
        if compiled:
            by_name: dict[str, float] = {}
            for name, seconds in compiled:
                by_name[name] = round(by_name.get(name, 0.0) + seconds, 3)
            out["kernels_compiled"] = by_name
        return out


# Triton's once-per-process cache-key parts (triton_compat.compute_cache_key_parts), computed on a thread from the
# first enable_fast_paths of a CUDA model, so that they overlap what runs before its first call (docs/design.md §8).
_KEY_PARTS: dict[str, Any] = {}
_KEY_PARTS_LOCK = threading.Lock()


def start_key_parts(device: torch.device) -> bool:
    """Start computing Triton's cache-key parts for ``device``'s architecture, once per process; False off CUDA."""
    if device.type != "cuda":
        return False
    with _KEY_PARTS_LOCK:
        if _KEY_PARTS:
            return True
        major, minor = torch.cuda.get_device_capability(device)
        thread = threading.Thread(target=_compute_key_parts, args=(major * 10 + minor,), name="nvfp4-triton-key",
                                  daemon=True)
        _KEY_PARTS["thread"] = thread
        thread.start()
    return True


def _compute_key_parts(arch: int) -> None:
    start = time.perf_counter()
    try:
        _compat().compute_cache_key_parts(arch)
    except Exception as error:  # noqa: BLE001  (the first compile computes them itself, and raises there if it must)
        _KEY_PARTS["failed"] = f"{type(error).__name__}: {error}"[:200]
    _KEY_PARTS["seconds"] = round(time.perf_counter() - start, 3)


def await_key_parts() -> float | None:
    """Wait for Triton's cache-key parts, so that no compile computes them again; the seconds waited (None: not
    started in this process)."""
    thread = _KEY_PARTS.get("thread")
    if thread is None:
        return None
    start = time.perf_counter()
    thread.join()
    return round(time.perf_counter() - start, 3)


def pipeline_bar(pipe: Any) -> BarFactory | None:
    """``pipe.progress_bar`` (its ``set_progress_bar_config`` settings hold) for a pipeline, None for a model."""
    progress_bar = getattr(pipe, "progress_bar", None)
    if isinstance(pipe, nn.Module) or not callable(progress_bar):
        return None
    return lambda total: progress_bar(total=total)


def parallel_unavailable(model: nn.Module, device: torch.device, forward: Callable | None) -> str | None:
    """Why the first call of ``model`` gets no compile-only pass (None: it does)."""
    value = env_value(PARALLEL_COMPILE)
    if value is not None and not env_enabled(PARALLEL_COMPILE):  # on unless switched off
        return f"{PARALLEL_COMPILE}={value}"
    if device.type != "cuda":
        return f"the model runs on {device}"
    for name, module in model.named_modules():
        hooks = [h for h in hooks_on(module) if name or h != TORCH_FORWARD_HOOK]  # the pass runs below the model's own
        if hooks:
            return f"{name or 'the model'} has hooks ({', '.join(hooks)}): a second call could change their state"
        if getattr(module, "_compiled_call_impl", None) is not None:
            return f"{name or 'the model'} is compiled with torch.compile"
    return None if forward is not None else "the model's forward is wrapped by something unknown"


def compile_workers_wanted() -> int:
    """The worker processes the compile-only pass compiles in (``switches.COMPILE_WORKERS``; 0: on threads)."""
    value = (env_value(COMPILE_WORKERS) or "").strip()
    if not value:
        return 0
    if not value.isdigit():
        raise ValueError(f"{COMPILE_WORKERS}={value!r}: expected a count of worker processes (0: compile on threads)")
    return int(value)


# The worker processes (switches.COMPILE_WORKERS), shared by the models awaiting their compile-only pass: started when
# the first of them is enabled, so that their imports overlap what runs before its first call; ended when none awaits.
_WORKERS: dict[str, Any] = {"pool": None, "awaiting": 0}
_WORKERS_LOCK = threading.Lock()


def _await_workers() -> bool:
    """Count one more model awaiting a pass in worker processes, starting them if wanted; False: none wanted."""
    count = compile_workers_wanted()
    if count == 0:
        return False
    with _WORKERS_LOCK:
        if _WORKERS["pool"] is None:
            module = importlib.import_module(cast(ModuleType, dispatch.kernels).__name__ + ".compile_workers")
            _WORKERS["pool"] = module.CompileWorkers(count)
        _WORKERS["awaiting"] += 1
    return True


def _stop_awaiting_workers() -> None:
    """One model fewer awaiting its pass; the last one ends the workers."""
    with _WORKERS_LOCK:
        _WORKERS["awaiting"] -= 1
        if _WORKERS["awaiting"] == 0 and _WORKERS["pool"] is not None:
            _WORKERS["pool"].close()
            _WORKERS["pool"] = None


def _eager_forward(model: nn.Module) -> Callable | None:
    """The model's own forward below this package's graph runner, or None where another wrapper sits there."""
    forward = current_inner_forward(model)
    if isinstance(forward, GraphRunner):
        forward = forward.original
    return forward if getattr(forward, "__self__", None) is model else None


def prepared_record(model: nn.Module, device: torch.device, args: tuple, kwargs: dict) -> Path:
    """Where a finished compile-only pass of this call leaves its mark: in Triton's cache directory (it goes with the
    binaries), named by what picks the kernels (model class and public config, the call's tensor shapes, dtypes,
    strides and alignments, the GPU, the versions, this package's environment switches), the same in every process."""
    def signature(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), str(value.dtype), value.stride(), value.data_ptr() % 16)
        if isinstance(value, (list, tuple)):
            return [signature(v) for v in value]
        if isinstance(value, dict):
            return {str(k): signature(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
        if isinstance(value, (set, frozenset)):  # iteration order follows PYTHONHASHSEED, which each process draws
            return sorted(repr(v) for v in value)
        return repr(value)

    switches = {k: v for k, v in os.environ.items() if k.startswith("DIFFUSERS_NVFP4_") and k != COMPILE_WORKERS}
    config: Any = getattr(model, "config", None)
    config = config.to_dict() if hasattr(config, "to_dict") else dict(config or {})  # transformers' or diffusers'
    # private entries pick no kernel and some vary by process (diffusers' _use_default_values: a set's order)
    config = {k: v for k, v in config.items() if not str(k).startswith("_")}
    versions = (torch.__version__, importlib.import_module("triton").__version__, _package_version())
    described = json.dumps([type(model).__name__, signature(config), signature(args), signature(kwargs),
                            _device_name(device), versions, sorted(switches.items())], sort_keys=True, default=repr)
    name = hashlib.sha256(described.encode()).hexdigest()[:32]
    return Path(_compat().triton_cache_dir()) / "diffusers_nvfp4_fast" / "prepared" / f"{name}.json"


def _package_version() -> str:
    try:
        return importlib.metadata.version("diffusers-nvfp4-fast")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout without installing: no version to tell
        return "unknown"


def _write_quietly(record: Path) -> None:
    """The mark, atomically; a cache directory that cannot be written only means the next process runs a pass."""
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        temporary = record.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps({"written": time.strftime("%Y-%m-%dT%H:%M:%S")}))
        os.replace(temporary, record)
    except OSError:
        pass
