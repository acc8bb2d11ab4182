"""``GraphRunner``: a denoiser's forward that replays a CUDA graph per call signature (docs/design.md §8).

Installed as the innermost forward of the pipeline's transformer (below any hook on the transformer itself, so an
offloading hook still runs at every call). Per call: key the arguments and the model's state (``keys``); an old key
replays its graph (inputs copied into the graph's static buffers, outputs cloned for the caller); a new key runs the
call eagerly on a side stream (its output is the caller's), records the caches it reads, captures it, and keeps the
graph (least recently used first out, at most ``max_graphs``). A call that cannot be keyed or captured runs eagerly,
counted with its reason. A replay does exactly what the eager call of the same key did, so its bytes are the same.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .backends import CudaBackend, SimulatedBackend, external_tensors
from .keys import ModelWatch, UnkeyableCall, call_key, copy_into, static_like, substitute

_MAX_REFUSED = 64  # keys remembered as uncapturable (a call of such a key runs eagerly without trying again)


@dataclass
class _Graph:
    """One captured call: its graph, the buffers it reads and writes, and the caches it must keep alive."""

    graph: Any
    inputs: list[torch.Tensor]
    outputs: list[Any]  # the output's pytree leaves (static tensors, and any non-tensor leaves)
    spec: pytree.TreeSpec
    weights: int  # ModelWatch's weights version at capture
    keep_alive: list[torch.Tensor]

    def result(self) -> Any:
        return pytree.tree_unflatten([v.clone() if isinstance(v, torch.Tensor) else v for v in self.outputs],
                                     self.spec)


@dataclass
class GraphStats:
    """Counters of one runner, for ``fast_path_report``."""

    captures: int = 0
    replays: int = 0
    evictions: int = 0
    eager_calls: Counter = field(default_factory=Counter)


class GraphRunner:
    """Callable that stands in for ``original`` (a transformer's bound forward, or a compiled one).

    Args:
        model: the module whose state the graphs depend on (the transformer itself, not a compile wrapper).
        original: the forward to run and capture.
        max_graphs: graphs kept; the least recently used is freed first.
        backend: ``"cuda"`` (``torch.cuda.CUDAGraph``) or ``"simulate"`` (the same buffer semantics on any device,
            re-running the call at each replay: for tests).
    """

    def __init__(self, model: nn.Module, original: Callable, *, max_graphs: int = 8, backend: str = "cuda"):
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be at least 1, got {max_graphs}")
        if backend not in ("cuda", "simulate"):
            raise ValueError(f"backend must be 'cuda' or 'simulate', got {backend!r}")
        self.original = original
        self.max_graphs = max_graphs
        self.backend = CudaBackend() if backend == "cuda" else SimulatedBackend()
        self.watch = ModelWatch(model)
        self.stats = GraphStats()
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._refused: dict[tuple, str] = {}  # keys whose capture failed, and why
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            return self.original(*args, **kwargs)  # traced by dynamo, or inside the caller's own capture
        with self._lock:
            try:
                key, tensors = self._key(args, kwargs)
            except UnkeyableCall as why:
                return self._eager(str(why), args, kwargs)
            graph = self._graphs.get(key)
            if graph is not None:
                return self._replay(key, graph, tensors)
            refused = self._refused.get(key)
            if refused is not None:
                return self._eager(refused, args, kwargs)
            return self._capture(key, args, kwargs, tensors)

    def _key(self, args: tuple, kwargs: dict) -> tuple[tuple, list[torch.Tensor]]:
        """(key: the call's structure, the model's weights and its configuration; the call's tensors)."""
        if torch.is_grad_enabled():
            raise UnkeyableCall("grad mode is enabled (graphs replay inference: call under torch.no_grad(), as "
                                "diffusers pipelines do)")
        structure, tensors = call_key(args, kwargs)
        devices = {t.device for t in tensors}
        if not tensors or len(devices) != 1 or not self.backend.runs_on(next(iter(devices))):
            raise UnkeyableCall(f"tensor arguments on {sorted(map(str, devices)) or 'no device'} (CUDA graphs need "
                                "every tensor on one CUDA device)")
        weights, config, reason = self.watch.state()
        if reason is not None:
            raise UnkeyableCall(reason)
        return (structure, weights, config), tensors

    def _eager(self, reason: str, args: tuple, kwargs: dict) -> Any:
        self.stats.eager_calls[reason] += 1
        return self.original(*args, **kwargs)

    def _replay(self, key: tuple, graph: _Graph, tensors: list[torch.Tensor]) -> Any:
        for static, value in zip(graph.inputs, tensors):
            copy_into(static, value)
        graph.graph.replay()
        self._graphs.move_to_end(key)
        self.stats.replays += 1
        return graph.result()

    def _capture(self, key: tuple, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> Any:
        out = self.backend.warm_up(lambda: self.original(*args, **kwargs))  # the caller's own eager call
        weights, config, _ = self.watch.state()
        if (weights, config) != key[1:]:
            return out  # this first call changed the model (a lazy initialisation): capture at the next call
        self._drop_stale(weights)
        try:
            statics = [static_like(t) for t in tensors]
            for static, value in zip(statics, tensors):
                copy_into(static, value)
            s_args, s_kwargs = substitute((args, kwargs), list(statics))
            call = lambda: self.original(*s_args, **s_kwargs)  # noqa: E731
            keep_alive = external_tensors(call, [*statics, *self.watch.tensors()])
            graph, static_out = self.backend.capture(call)
        except Exception as exc:  # noqa: BLE001 (any failure: this key runs eagerly, counted with the error)
            reason = f"capture failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
            self._refused[key] = reason
            while len(self._refused) > _MAX_REFUSED:
                self._refused.pop(next(iter(self._refused)))
            self.stats.eager_calls[reason] += 1
            return out
        leaves, spec = pytree.tree_flatten(static_out)
        self._graphs[key] = _Graph(graph, statics, leaves, spec, weights, keep_alive)
        self.stats.captures += 1
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
            self.stats.evictions += 1
        return out

    def _drop_stale(self, weights: int) -> None:
        """Free the graphs that read parameters no longer where they were (the model moved or was reloaded)."""
        for key in [k for k, g in self._graphs.items() if g.weights != weights]:
            del self._graphs[key]
            self.stats.evictions += 1

    def release(self) -> None:
        """Free every graph (their shared pool goes back to the allocator once no graph holds it), then what the
        backend holds for them (``CudaBackend.release``: the side stream's cuBLAS workspace)."""
        with self._lock:
            self._graphs.clear()
            self._refused.clear()
            self.backend.release()

    def report(self) -> dict:
        return {
            "backend": self.backend.name, "graphs": len(self._graphs), "max_graphs": self.max_graphs,
            "pool_bytes": self.backend.pool_bytes(), "captures": self.stats.captures, "replays": self.stats.replays,
            "evictions": self.stats.evictions, "eager_calls": dict(self.stats.eager_calls),
        }
