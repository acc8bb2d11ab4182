"""Public entry points: ``enable_fast_paths``, ``disable_fast_paths``, ``fast_paths``, ``fast_path_report``."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from .graphs import capture_cuda_graphs, denoisers, graph_report, release_cuda_graphs
from .linear import NVFP4Linear
from .loaders.common import record_checkpoint_config
from .loaders.diffusers_native import SOURCE as BFL_SOURCE
from .loaders.diffusers_native import convert_diffusers_native
from .loaders.finish import install_model_methods
from .module_hooks import offload_device
from .ops.blackwell import GemmSetupError, padded_layers, warm_up
from .ops.dispatch import gemm_backend
from .ops.verify import FastPathStats, VerifyMode, drop_stats, new_stats
from .patches.flux2 import patch_flux2
from .patches.qwenimage import patch_qwenimage
from .patches.qwenimage21 import patch_qwenimage21
from .preparation import Preparation, compile_workers_wanted, pipeline_bar
from .report import FastPathReport

logger = logging.getLogger("diffusers_nvfp4_fast")

_STATE_ATTR = "_nvfp4_fast_paths"


@dataclass
class ModelState:
    """What ``enable_fast_paths`` leaves on a model: its counters, the undo callables (run in reverse), the layers
    it converted (source -> count), the GEMM warm-up it did, its kernels' first-call ``preparation``, whether fused
    sites were asked for (``fused``) and whether the model's class has any (``fused_paths``: False for a class this
    package has no patches for)."""

    stats: FastPathStats
    stats_id: int
    fused: bool
    fused_paths: bool = True
    restore: list[Callable[[], None]] = field(default_factory=list)
    converted: dict[str, int] = field(default_factory=dict)
    gemm_warm_up: dict = field(default_factory=dict)
    preparation: Preparation | None = None


def _state(model: nn.Module) -> ModelState | None:
    return model.__dict__.get(_STATE_ATTR)
_PATCHERS = {
    "Flux2Transformer2DModel": patch_flux2,
    "QwenImageTransformer2DModel": patch_qwenimage,
    "QwenImage21Transformer2DModel": patch_qwenimage21,
}
MODELOPT_SOURCE = "ModelOpt (in memory)"
BFL_NUMERICS = (
    "layers loaded by diffusers' BFLQuantizationConfig compute the checkpoint's W4A4 recipe with its input_scale "
    "(what diffusers computes on SM100+ with FlashInfer); below SM100 diffusers itself dequantizes them to W4A16, "
    "so there the outputs differ from diffusers' own unconverted ones"
)
BFL_FP16_NUMERICS = (
    "; this model runs in FP16, where diffusers' own SM100+ path casts each activation to BF16 before quantizing and "
    "asks the GEMM for BF16 output, while the converted layers quantize the FP16 activation and write FP16: the "
    "outputs differ from diffusers' own (docs/blackwell.md, FP16)"
)


def _runs_fp16(linears: list[NVFP4Linear]) -> bool:
    return any(m.compute_dtype == torch.float16 for m in linears)


def _transformers(pipe_or_model) -> list[nn.Module]:
    """The denoiser(s) of a pipeline, or the model itself; ``torch.compile`` wrappers are looked through."""
    return [getattr(m, "_orig_mod", m) for m in denoisers(pipe_or_model)]


TEXT_ENCODER_COMPONENTS = ("text_encoder", "text_encoder_2")


def _text_encoders(pipe_or_model) -> dict[str, nn.Module]:
    """A pipeline's text encoders that hold ``NVFP4Linear`` layers (``load_nvfp4_text_encoder``), by component name;
    a BF16 text encoder is not visited."""
    if not hasattr(pipe_or_model, "components"):
        return {}
    found = {}
    for name in TEXT_ENCODER_COMPONENTS:
        model = getattr(getattr(pipe_or_model, name, None), "_orig_mod", getattr(pipe_or_model, name, None))
        if isinstance(model, nn.Module) and any(isinstance(m, NVFP4Linear) for m in model.modules()):
            found[name] = model
    return found


def _models(pipe_or_model) -> list[tuple[str | None, nn.Module]]:
    """(component, model) for every model the fast paths visit: the denoiser(s) (component None), then the NVFP4
    text encoders."""
    denoisers_ = [(_component_of(m), m) for m in _transformers(pipe_or_model)]
    return denoisers_ + list(_text_encoders(pipe_or_model).items())


def _component_of(model: nn.Module) -> str | None:
    """None for a denoiser; "text_encoder" for a transformers model passed alone (``enable_fast_paths(encoder)``),
    which must not get the diffusers methods a transformer gets."""
    return "text_encoder" if type(model).__module__.startswith("transformers.") else None


def _convert(model: nn.Module, restore: list, dynamic_input_scale: bool) -> dict[str, int]:
    """Convert NVFP4 layers that diffusers or ModelOpt built to ``NVFP4Linear``; returns {source: count}."""
    from .loaders.modelopt_memory import convert_modelopt_model, has_modelopt_modules

    converted = convert_diffusers_native(model, restore)
    if has_modelopt_modules(model):
        before = sum(isinstance(m, NVFP4Linear) for m in model.modules())
        convert_modelopt_model(model, dynamic_input_scale=dynamic_input_scale, restore=restore)
        converted[MODELOPT_SOURCE] = sum(isinstance(m, NVFP4Linear) for m in model.modules()) - before
    return converted


def _restore_config(model: nn.Module, restore: list) -> None:
    previous = getattr(model, "_internal_dict", None)
    if previous is not None:
        restore.append(lambda: setattr(model, "_internal_dict", previous))


def enable_fast_paths(pipe_or_transformer, *, verify: VerifyMode = "first", fused: bool = True,
                      cuda_graphs: bool = False, dynamic_input_scale: bool = False) -> dict:
    """Make an NVFP4 FLUX.2 / Qwen-Image pipeline (or transformer) faster without changing any output byte.

    Converts NVFP4 layers that diffusers' ``BFLQuantizationConfig`` or an in-memory ModelOpt quantization built to
    ``NVFP4Linear``, puts every NVFP4 layer's block scales in the 128x4 layout (once), and installs the fused paths
    per instance. A pipeline's NVFP4 text encoders (``load_nvfp4_text_encoder``) are covered too: their layers already
    are ``NVFP4Linear`` (the GEMV for one-row calls, the GEMM for a prompt's prefill), nothing is installed on their
    BF16 layers, and the report has an entry for each (``component``). Enabling twice is harmless; a model without
    NVFP4 layers gets a warning and is left alone. Call it before enabling sequential CPU offload or group
    offloading. Where the model's first call compiles Triton kernels
    (a new machine, an empty Triton cache) a progress bar says so, ``pipe.progress_bar`` style
    (``pipe.set_progress_bar_config(disable=True)`` turns it off); the report's ``preparation`` says how long the
    compiles took and whether the cache was warm (docs/design.md §8, "Preparation").

    Args:
        verify: "first" compares each fused site kind with the unfused path byte for byte at its first call per
            shape class and device (default); "always" at every call; "off" never.
        cuda_graphs: also replay every transformer call from a CUDA graph captured for its call signature
            (``capture_cuda_graphs``): the fastest exact mode where the host would otherwise bound the step.
        fused: False converts and swizzles the NVFP4 layers but installs no fused site: the reference that fused
            paths on must equal on every route (below SM100, disabling puts diffusers' W4A16 layers back). Enabling
            again with the other value re-enables from scratch.
        dynamic_input_scale: in-memory ModelOpt layers whose input quantizer has no amax (disabled or never
            calibrated) convert with a per-call activation scale instead of raising (not the calibrated recipe).

    Returns:
        ``fast_path_report`` of the pipeline.
    """
    compile_workers_wanted()  # a bad value fails here, naming the variable, before anything is changed
    for component, model in _models(pipe_or_transformer):
        state = _state(model)
        if state is not None and state.fused != fused:
            disable_fast_paths(model)
        elif state is not None:
            state.stats.verify_mode = verify
            continue
        restore: list = []
        _restore_config(model, restore)
        # a text encoder's NVFP4 layers are loaded as NVFP4Linear: nothing to convert, and no diffusers methods
        converted = _convert(model, restore, dynamic_input_scale) if component is None else {}
        linears = [m for m in model.modules() if isinstance(m, NVFP4Linear)]
        if not linears:
            warnings.warn(
                f"enable_fast_paths: {type(model).__name__} has no NVFP4 layers (load it with load_nvfp4_transformer "
                "or diffusers' BFLQuantizationConfig); nothing was changed.",
                stacklevel=2,
            )
            continue
        if component is None:
            install_model_methods(model)
        swizzled = sum(m.swizzle_weight_scales_() for m in linears)
        record_checkpoint_config(model)
        warmed = _warm_up_gemm(model, linears, restore)
        stats_id, stats = new_stats(verify)
        patcher = _PATCHERS.get(type(model).__name__)
        if patcher is not None and fused:
            stats.sites.update(patcher(model, stats_id, restore))
        preparation = Preparation(model, execution_device(model, linears[0]), pipeline_bar(pipe_or_transformer),
                                  stats_id)
        restore.append(preparation.stop)
        model.__dict__[_STATE_ATTR] = ModelState(stats, stats_id, fused, patcher is not None, restore, converted,
                                                 warmed, preparation)
        logger.info(
            "fast paths on for %s: %d NVFP4 linears (converted now: %s; %d scale tensors swizzled now), fused sites "
            "%s, GEMM backend %s", type(model).__name__, len(linears), converted or "none", swizzled,
            dict(stats.sites), gemm_backend(execution_device(model, linears[0])),
        )
    if cuda_graphs:
        capture_cuda_graphs(pipe_or_transformer)
    return fast_path_report(pipe_or_transformer)


def _warm_up_gemm(model: nn.Module, linears: list[NVFP4Linear], restore: list) -> dict:
    """Warm the Blackwell GEMM up for every layer shape (``ops/blackwell.warm_up``); on failure the converted layers
    are put back before the error (which names what to install) propagates."""
    try:
        return warm_up(linears, execution_device(model, linears[0]))
    except GemmSetupError:
        for undo in reversed(restore):
            undo()
        raise


def disable_fast_paths(pipe_or_transformer) -> None:
    """Undo ``enable_fast_paths``: every replaced processor, forward and converted layer is put back (the same
    objects), and CUDA graphs captured for the pipeline's transformers are freed.

    Block scales of layers that were already ``NVFP4Linear`` stay in the 128x4 layout: that conversion is a property
    of the loaded weights, not a fast path, and both layouts give the same outputs.
    """
    release_cuda_graphs(pipe_or_transformer)
    for _, model in _models(pipe_or_transformer):
        state = _state(model)
        if state is None:
            continue
        for undo in reversed(state.restore):
            undo()
        drop_stats(state.stats_id)
        del model.__dict__[_STATE_ATTR]


@contextlib.contextmanager
def fast_paths(pipe_or_transformer, *, verify: VerifyMode = "first") -> Iterator[dict]:
    """``with fast_paths(pipe): ...`` enables the fast paths for the block and restores the model after it."""
    already = all(_state(m) is not None for _, m in _models(pipe_or_transformer))
    report = enable_fast_paths(pipe_or_transformer, verify=verify)
    try:
        yield report
    finally:
        if not already:
            disable_fast_paths(pipe_or_transformer)


def execution_device(model: nn.Module, layer: nn.Module) -> torch.device:
    """The device ``layer`` computes on: where offloading hooks bring it, else where its weight is."""
    return offload_device(model, layer) or cast(torch.Tensor, layer.weight).device


def fast_path_report(pipe_or_transformer) -> FastPathReport:
    """Per transformer and NVFP4 text encoder (its entry names its ``component``): fused sites, fused calls,
    fallbacks by reason, verifications, NVFP4 layers (and how many were converted from which source), the numerics
    note for converted layers, the GEMM backend that runs, and the kernels' first-call ``preparation`` (``cache``:
    "warm", "cold" or "unknown" with its ``reason``; ``seconds``, ``compiled``, ``from_cache``).

    Counts come from the ops at run time (also under torch.compile, where a site that keeps diffusers' op counts once
    per trace); calls replayed from a CUDA graph run no Python and are not counted. ``print(report)`` shows it per
    site kind: the modules it is installed on (``site_modules``), fused calls, fallbacks with their reasons.
    """
    report = FastPathReport()
    graphs = {id(getattr(t, "_orig_mod", t)): graph_report(t) for t in denoisers(pipe_or_transformer)}
    for component, model in _models(pipe_or_transformer):
        linears = [m for m in model.modules() if isinstance(m, NVFP4Linear)]
        state = _state(model)
        stats = state.stats if state else None
        entry: dict[str, Any] = {"enabled": state is not None, "nvfp4_linears": len(linears)}
        if component is not None:
            entry["component"] = component
        if linears:
            device = execution_device(model, linears[0])
            entry["gemm_backend"] = gemm_backend(device)
            padded = padded_layers(linears, device)
            if padded:
                entry["gemm_padded_layers"] = padded
        if state is not None:
            entry["fused"] = state.fused
            entry["fused_paths"] = state.fused_paths
            entry["converted"] = dict(state.converted)
            if state.gemm_warm_up:
                entry["gemm_warm_up"] = dict(state.gemm_warm_up)
            if state.preparation is not None:
                entry["preparation"] = state.preparation.report()
            if BFL_SOURCE in state.converted:
                entry["numerics"] = BFL_NUMERICS + (BFL_FP16_NUMERICS if _runs_fp16(linears) else "")
        if stats is not None:
            entry.update(stats.as_dict())
            entry["site_modules"] = {kind: list(names) for kind, names in stats.site_modules.items()}
        if graphs.get(id(model)) is not None:
            entry["cuda_graphs"] = graphs[id(model)]
        report[component if type(model).__name__ in report else type(model).__name__] = entry
    return report
