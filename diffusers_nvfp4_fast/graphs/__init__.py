"""CUDA-graph replay of a pipeline's denoiser calls: ``capture_cuda_graphs``, ``release_cuda_graphs``.

The runner (``runner.GraphRunner``) does not depend on NVFP4: it serves BF16 transformers too, and compiled ones
(``compile_repeated_blocks``, ``torch.compile(model)``, ``model.compile()``): it captures whatever forward the model
runs. docs/design.md §8 ("CUDA graphs") says what is keyed and what falls back to eager.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from ..module_hooks import offload_device
from ..swaps import current_inner_forward, swap_forward
from .runner import GraphRunner

__all__ = ["GraphRunner", "capture_cuda_graphs", "graph_report", "release_cuda_graphs"]

_ATTR = "_nvfp4_cuda_graphs"  # the one piece of state on the denoiser: its runner and how to take it out


@dataclass
class _Installed:
    runner: GraphRunner
    undo: Callable[[], None]


def denoisers(pipe_or_transformer) -> list[nn.Module]:
    """The objects a pipeline calls as its denoiser (``transformer``, ``transformer_2``; compile wrappers included),
    or the module itself."""
    if isinstance(pipe_or_transformer, nn.Module) and not hasattr(pipe_or_transformer, "components"):
        return [pipe_or_transformer]
    found = [m for name in ("transformer", "transformer_2")
             if isinstance(m := getattr(pipe_or_transformer, name, None), nn.Module)]
    if not found and hasattr(pipe_or_transformer, "components"):
        raise ValueError(f"{type(pipe_or_transformer).__name__} has no transformer (pipe.transformer is None): load "
                         "one, e.g. transformer=load_nvfp4_transformer(...), and pass it to the pipeline")
    if not found:
        raise TypeError(f"expected a diffusers pipeline with a transformer or an nn.Module, got "
                        f"{type(pipe_or_transformer).__name__} (no transformer)")
    return found


def _install(target: nn.Module, max_graphs: int, backend: str) -> _Installed:
    model = getattr(target, "_orig_mod", target)
    compiled_call = target.__dict__.get("_compiled_call_impl")
    if compiled_call is not None:  # model.compile(): the compiled call is what runs; capture it
        runner = GraphRunner(model, compiled_call, max_graphs=max_graphs, backend=backend)
        target.__dict__["_compiled_call_impl"] = runner

        def undo() -> None:
            if target.__dict__.get("_compiled_call_impl") is runner:
                target.__dict__["_compiled_call_impl"] = compiled_call

        return _Installed(runner, undo)
    runner = GraphRunner(model, current_inner_forward(target), max_graphs=max_graphs, backend=backend)
    return _Installed(runner, swap_forward(target, runner))


def capture_cuda_graphs(pipe_or_transformer, *, max_graphs: int = 8, backend: str = "cuda") -> None:
    """Make every call of the pipeline's transformer replay a CUDA graph captured for its call signature.

    A new signature (tensor shapes, strides, dtypes, alignment; other argument values; the model's weights,
    processors, LoRA scales, hooks and kernel-picking switches) runs once eagerly, on a side stream, and is captured
    right after; later calls with that signature replay it (``max_graphs`` kept, least recently used first out, one
    memory pool shared by all). Outputs are fresh tensors the caller may keep. Calls that cannot be captured run
    eagerly, counted by reason in ``fast_path_report`` (a hook inside the model, grad mode, a non-tensor argument
    that cannot be compared, a capture error such as a host copy). Calling it again changes nothing.

    Args:
        pipe_or_transformer: a diffusers pipeline or a transformer (NVFP4 or not, compiled or not).
        max_graphs: graphs kept per transformer.
        backend: ``"cuda"``; ``"simulate"`` keeps the same buffer semantics on any device by re-running the call at
            each replay (the CPU tests use it).
    """
    for target in denoisers(pipe_or_transformer):
        if target.__dict__.get(_ATTR) is None:
            target.__dict__[_ATTR] = _install(target, max_graphs, backend)
            if backend == "cuda":
                _warn_off_cuda(getattr(target, "_orig_mod", target))


def _warn_off_cuda(model: nn.Module) -> None:
    """Say once, at install, that a model outside CUDA memory will run every call eagerly (the report counts them)."""
    param = next(model.parameters(), None)
    device = offload_device(model) or (param.device if param is not None else None)
    if device is not None and device.type != "cuda":
        warnings.warn(f"CUDA graphs: {type(model).__name__} computes on {device}, so its calls run eagerly (counted "
                      "in fast_path_report(pipe)[...]['cuda_graphs']['eager_calls']) until it is moved to a CUDA "
                      "device, e.g. pipe.to('cuda')", stacklevel=3)


def release_cuda_graphs(pipe_or_transformer) -> None:
    """Take the runner out and free its graphs and their memory pool (``disable_fast_paths`` calls it)."""
    for target in denoisers(pipe_or_transformer):
        installed = target.__dict__.pop(_ATTR, None)
        if installed is not None:
            installed.undo()
            installed.runner.release()


def graph_report(target: nn.Module) -> dict | None:
    """The runner's counters (graphs, pool bytes, captures, replays, evictions, eager calls by reason), or None."""
    installed = target.__dict__.get(_ATTR)
    return installed.runner.report() if installed is not None else None
