"""How a runner records and replays: CUDA graphs, or a simulation of their buffer semantics for CPU tests.

``CudaBackend`` warms up and captures on one side stream per runner, into one memory pool shared by all the runner's
graphs (safe: graphs of one runner never run concurrently, and each graph's outputs stay alive while it exists).
``SimulatedBackend`` keeps the same contract on any device (static inputs read at replay, static outputs overwritten
by every replay) by re-running the captured call, so the CPU suite can test keying, buffers and output hand-off.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..torch_compat import clear_cublas_workspaces


class _Replay:
    """What the simulated backend records: replaying re-runs ``fn`` and writes its tensors into the first outputs."""

    def __init__(self, fn: Callable[[], Any], outputs: list[torch.Tensor]):
        self.fn = fn
        self.outputs = outputs

    def replay(self) -> None:
        fresh = [t for t in pytree.tree_leaves(self.fn()) if isinstance(t, torch.Tensor)]
        for static, value in zip(self.outputs, fresh):
            static.copy_(value)


class SimulatedBackend:
    """Graph semantics without a GPU: for tests of the runner (and for debugging a capture problem on CPU)."""

    name = "simulate"

    def runs_on(self, device: torch.device) -> bool:
        return True

    def warm_up(self, fn: Callable[[], Any]) -> Any:
        return fn()

    def capture(self, fn: Callable[[], Any]) -> tuple[Any, Any]:
        out = fn()
        return _Replay(fn, [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]), out

    def pool_bytes(self) -> int | None:
        return None

    def release(self) -> None:
        """Nothing to give back: the simulation holds no device resources of its own."""


# CUDA backends whose side stream has run work: torch gave that stream its own cuBLAS workspace, which their graphs
# read in place. The workspaces are freed (all at once: torch has no per-stream call) when the last one releases.
_WORKSPACE_USERS: weakref.WeakSet = weakref.WeakSet()


class CudaBackend:
    """``torch.cuda.CUDAGraph`` capture (thread-local error mode: other threads' CUDA work is not disturbed)."""

    name = "cuda"

    def __init__(self) -> None:
        self._stream: torch.cuda.Stream | None = None
        self._pool: Any = None

    def runs_on(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
            self._pool = torch.cuda.graph_pool_handle()
        return self._stream

    def warm_up(self, fn: Callable[[], Any]) -> Any:
        _WORKSPACE_USERS.add(self)
        side, current = self._side_stream(), torch.cuda.current_stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            out = fn()
        current.wait_stream(side)
        return out

    def capture(self, fn: Callable[[], Any]) -> tuple[Any, Any]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=self._side_stream(), capture_error_mode="thread_local"):
            out = fn()
        return graph, out

    def pool_bytes(self) -> int | None:
        """Bytes the graphs' shared pool reserves (from the allocator's snapshot); None before the first capture or
        where the snapshot does not name pools."""
        if self._pool is None:
            return None
        pool = tuple(self._pool)
        segments = torch.cuda.memory_snapshot()
        if segments and "segment_pool_id" not in segments[0]:
            return None
        return sum(s["total_size"] for s in segments if tuple(s.get("segment_pool_id", ())) == pool)

    def release(self) -> None:
        """Give back the side stream, the pool handle and, once no other backend's graphs may read it, the cuBLAS
        workspace torch made for the side stream (32 MiB on Hopper, held by torch for the life of the process:
        without this, every enable/disable cycle stranded one; docs/design.md §8). Call after the graphs are freed."""
        if self._stream is None:
            return
        torch.cuda.synchronize()  # replays on any stream may still read the workspace
        self._stream = self._pool = None
        _WORKSPACE_USERS.discard(self)
        if not _WORKSPACE_USERS:
            clear_cublas_workspaces()


class _ExternalTensors(TorchDispatchMode):
    """Records the tensors a call reads that it did not make (by storage): caches a graph reads but does not own."""

    def __init__(self) -> None:
        super().__init__()
        self.made: set[int] = set()
        self.read: dict[int, torch.Tensor] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.numel():
                ptr = t.untyped_storage().data_ptr()
                if ptr not in self.made:
                    self.read.setdefault(ptr, t)
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.made.add(t.untyped_storage().data_ptr())
        return out


def external_tensors(fn: Callable[[], Any], known: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run ``fn`` once (its output is dropped) and return the tensors it read that it neither made nor finds in
    ``known``: module-level caches such as diffusers' ``lru_cache``d RoPE tables. A graph keeps them alive, so an
    eviction from such a cache can never free memory the graph reads."""
    mode = _ExternalTensors()
    # Compiled code cannot run under a dispatch mode (dynamo skips such frames, and fullgraph=True then raises): the
    # eager code it was compiled from reads the same tensors.
    with torch.compiler.set_stance("force_eager"), mode:
        fn()
    owned = {t.untyped_storage().data_ptr() for t in known if t.numel()}
    return [t for ptr, t in mode.read.items() if ptr not in owned]
