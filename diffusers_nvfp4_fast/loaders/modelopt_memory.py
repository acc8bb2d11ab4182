"""Convert a diffusers transformer quantized in memory by NVIDIA ModelOpt into ``NVFP4Linear`` layers.

``mtq.quantize`` turns each ``nn.Linear`` into ``QuantLinear`` (fake quant: BF16 weight, a weight quantizer with the
weight amax, an input quantizer with the calibrated activation amax); ``mtq.compress`` then turns it into
``RealQuantQuantLinear`` whose ``weight`` is a ``QTensorWrapper`` around packed uint8 ``[N, K/2]`` (low nibble first)
while the weight quantizer holds ``_scale`` (E4M3 ``[N, K/16]``, or a cutlass-swizzled 1-D uint8 tensor when
TensorRT-LLM did the packing on a Blackwell GPU) and ``_double_scale`` (FP32, = amax / 2688 at compress time).

``convert_modelopt_model`` produces exactly the tensors ``export_hf_checkpoint`` would write for the same model,
using ModelOpt's own functions for every number it computes, including the export's QKV fusion: q/k/v (and
add_q/k/v) of one attention share ``weight_scale_2`` = max of their weight amaxes and ``input_scale`` = max of their
input amaxes; for compressed weights, the block scales of the other members are re-rounded as
``e4m3(_scale * _double_scale / weight_scale_2)`` (ModelOpt's export does the same; the packed nibbles are kept).
The export groups q/k/v by a dummy forward (modules sharing one input, with q/k/v names); here they are grouped by
name (``is_qkv_projection`` / ``get_qkv_group_key``), which is the same grouping for FLUX.2 and Qwen-Image.

Where the export would invent a value (an input amax of 0 or NaN becomes 6.0), this raises instead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from ..format import BLOCK_SIZE, padded_scale_shape, unswizzle_scales
from ..linear import NVFP4Linear
from .common import copy_tp_annotations, layer_tensor_problems, raise_scale_problems, scale_problems
from .errors import NVFP4CheckpointError

logger = logging.getLogger("diffusers_nvfp4_fast")


def _is_modelopt_linear(module: nn.Module) -> bool:
    # Duck-typed, so no ModelOpt import is needed to answer "is there anything to convert?".
    return (
        isinstance(module, nn.Linear)
        and type(module).__module__.startswith("modelopt.")
        and hasattr(module, "weight_quantizer")
        and hasattr(module, "input_quantizer")
    )


def has_modelopt_modules(model: nn.Module) -> bool:
    """True if ``model`` holds ModelOpt quantized Linears (``QuantLinear`` / ``RealQuantQuantLinear``), enabled or not.

    Cheap (a walk over ``model.modules()`` and a class-module check); imports nothing from ModelOpt.
    """
    return any(_is_modelopt_linear(m) for m in model.modules())


@dataclass
class _Layer:
    name: str
    module: nn.Module
    compressed: bool


DYNAMIC_ADVICE = ("to accept that, pass dynamic_input_scale=True to enable_fast_paths(...) or "
                  "convert_modelopt_model(...): each call then quantizes with its own amax")


def _quantizer_problem(name: str, module: nn.Module, dynamic_input_scale: bool) -> str | None:
    from modelopt.torch.export.model_config import QUANTIZATION_NVFP4, QUANTIZATION_W4A16_NVFP4
    from modelopt.torch.export.quant_utils import get_quantization_format
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    fmt = get_quantization_format(module)
    wq: Any  # ModelOpt TensorQuantizers: their attributes are not typed
    iq: Any
    wq, iq = module.weight_quantizer, module.input_quantizer
    # Weight-only NVFP4 (input quantizer off) has the same weight tensors; it only lacks the activation scale.
    if fmt == QUANTIZATION_W4A16_NVFP4 and not iq.is_enabled and not dynamic_input_scale:
        return f"{name}: weight-only NVFP4 (input quantizer disabled), so there is no input_scale ({DYNAMIC_ADVICE})"
    if fmt not in (QUANTIZATION_NVFP4, QUANTIZATION_W4A16_NVFP4):
        return (f"{name}: ModelOpt format {fmt!r}; only NVFP4 W4A4 (the diffusers 'nvfp4' preset) "
                "converts to NVFP4Linear")
    block_sizes = wq.block_sizes or {}
    if block_sizes.get(-1) != BLOCK_SIZE or block_sizes.get("four_over_six", False):
        return f"{name}: weight block sizes {block_sizes}; only 16-element blocks without 4/6 search are supported"
    if NVFP4QTensor._is_static_quantizer(wq):
        return f"{name}: static NVFP4 weight quantizer (global_amax); only dynamic block quantizers are supported"
    if getattr(wq, "_amax", None) is None:
        return f"{name}: the weight quantizer has no amax (not calibrated)"
    if not iq.is_enabled or iq.amax is None:
        if dynamic_input_scale:
            return None
        state = "disabled" if not iq.is_enabled else "not calibrated (no amax)"
        return (f"{name}: input quantizer {state}, so there is no input_scale "
                f"({DYNAMIC_ADVICE})")
    if iq.amax.numel() != 1:
        return f"{name}: per-channel input amax {list(iq.amax.shape)}; NVFP4Linear takes one input_scale"
    if getattr(iq, "pre_quant_scale", None) is not None:
        return f"{name}: input pre_quant_scale (AWQ/SmoothQuant) is not supported"
    return None


def _qkv_groups(names: list[str]) -> dict[str, list[str]]:
    """name -> the names of its fusion group (itself alone when it has no q/k/v siblings)."""
    from modelopt.torch.export.diffusers_utils import get_qkv_group_key, is_qkv_projection

    groups: dict[str, list[str]] = {}
    for name in names:
        if is_qkv_projection(name):
            groups.setdefault(get_qkv_group_key(name), []).append(name)
    out = {n: [n] for n in names}
    for members in groups.values():
        if len(members) > 1:
            for n in members:
                out[n] = members
    return out


def _compressed_block_scale(layer: _Layer, n: int, k: int) -> torch.Tensor:
    scale: torch.Tensor = cast(Any, layer.module.weight_quantizer)._scale
    if scale.dtype == torch.uint8 and scale.dim() == 1:
        # Packed by TensorRT-LLM: the cutlass 128x4 layout, which is the 128x4 layout of docs/design.md §3.
        rp, cp = padded_scale_shape(n, k)
        if scale.numel() != rp * cp:
            raise NVFP4CheckpointError(
                f"{layer.name}: 1-D block scale of {scale.numel()} bytes, expected {rp}x{cp} (128x4)"
            )
        scale = unswizzle_scales(scale.view(rp, cp), n, k // BLOCK_SIZE).view(torch.float8_e4m3fn)
    if tuple(scale.shape) != (n, k // BLOCK_SIZE):
        raise NVFP4CheckpointError(
            f"{layer.name}: block scale shape {list(scale.shape)}, expected {[n, k // BLOCK_SIZE]}"
        )
    return scale


def _collect(model: nn.Module, dynamic_input_scale: bool, problems: list[str]) -> tuple[list[_Layer], list]:
    """ModelOpt Linears of ``model``: (NVFP4 layers to convert, (name, module) of Linears with quantizers off)."""
    from modelopt.torch.quantization.qtensor.base_qtensor import QTensorWrapper

    quantized: list[_Layer] = []
    plain: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not _is_modelopt_linear(module):
            continue
        if not module.weight_quantizer.is_enabled:
            if module.input_quantizer.is_enabled:
                problems.append(f"{name}: input quantizer enabled without a weight quantizer; not an NVFP4 W4A4 layer")
            plain.append((name, module))
            continue
        problem = _quantizer_problem(name, module, dynamic_input_scale)
        if problem:
            problems.append(problem)
            continue
        quantized.append(_Layer(name, module, isinstance(module.weight, QTensorWrapper)))
    return quantized, plain


def _group_scales(layer: _Layer, members: list[_Layer], problems: list[str]):
    """(weight_scale_2, input_scale or None) as the export computes them over the layer's q/k/v group."""
    from modelopt.torch.quantization.utils.numeric_utils import E2M1_MAX, fp8_max_for_normalization

    wq: Any  # ModelOpt TensorQuantizers: their attributes are not typed
    iq: Any
    wq, iq = layer.module.weight_quantizer, layer.module.input_quantizer
    # ModelOpt export: preprocess_linear_fusion -> amax = max over the group; then amax.float() / (6 * 448).
    weight_amax = torch.max(torch.stack([cast(Any, m.module.weight_quantizer)._amax for m in members]))
    weight_scale_2 = (weight_amax.float() / (E2M1_MAX * fp8_max_for_normalization(wq))).reshape(())
    if not iq.is_enabled or iq.amax is None:
        return weight_scale_2, None
    calibrated: list[Any] = [m.module.input_quantizer for m in members]
    input_amax = torch.max(torch.stack([q.amax for q in calibrated if q.is_enabled and q.amax is not None]))
    if not bool(torch.isfinite(input_amax)) or float(input_amax) <= 0:
        problems.append(f"{layer.name}: input amax {float(input_amax)} (calibration never reached this layer?)")
    return weight_scale_2, (input_amax.float() / (iq.maxbound * 448.0)).reshape(())


def _packed_weight(layer: _Layer, weight_scale_2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """(packed ``[N, K/2]``, linear E4M3 block scales ``[N, K/16]``, original weight dtype), as the export writes
    them."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    module: Any = layer.module  # a ModelOpt QuantLinear: its quantizers and QTensorWrapper weight are not typed
    n, k = module.out_features, module.in_features
    if layer.compressed:
        packed = module.weight.data
        if tuple(packed.shape) != (n, k // 2) or packed.dtype != torch.uint8:
            raise NVFP4CheckpointError(
                f"{layer.name}: packed weight {packed.dtype} {list(packed.shape)}, expected uint8 {[n, k // 2]}"
            )
        block_scale = _compressed_block_scale(layer, n, k)
        double_scale = module.weight_quantizer._double_scale.to(block_scale.device)
        # unified_export_hf._export_quantized_weight, compressed branch: rescale to the fused weight_scale_2.
        weight_scale = NVFP4QTensor._cast_per_block_scale_to_fp8(
            block_scale.float() * double_scale.float() / weight_scale_2.to(block_scale.device)
        )
        return packed, weight_scale, module.weight.metadata.get("dtype", torch.bfloat16)
    from modelopt.torch.export.model_config import QUANTIZATION_NVFP4
    from modelopt.torch.export.quant_utils import to_quantized_weight

    weight = module.weight.detach()
    weight_scale = NVFP4QTensor.get_weights_scaling_factor(weight, BLOCK_SIZE, weight_scale_2.to(weight.device))[0]
    packed = to_quantized_weight(weight, weight_scale, QUANTIZATION_NVFP4, weight_scale_2, BLOCK_SIZE)
    return packed, weight_scale, weight.dtype


def _build_layer(layer: _Layer, weight_scale_2: torch.Tensor, input_scale: torch.Tensor | None,
                 problems: list[str]) -> NVFP4Linear | None:
    """The ``NVFP4Linear`` that replaces ``layer``: the export's tensors, block scales in the 128x4 layout; None
    (with ``problems`` added) where a tensor does not fit the layer."""
    module: Any = layer.module  # a ModelOpt QuantLinear (see _packed_weight)
    packed, weight_scale, dtype = _packed_weight(layer, weight_scale_2)
    bias = module.bias.detach() if module.bias is not None else None
    found = layer_tensor_problems(layer.name, module.out_features, module.in_features, packed, weight_scale,
                                  weight_scale_2, input_scale, bias)
    if found:
        problems += found
        return None
    new = NVFP4Linear(module.in_features, module.out_features, bias=bias is not None,
                      dtype=bias.dtype if bias is not None else dtype, device=packed.device)
    new.load_nvfp4(
        packed, weight_scale, weight_scale_2,
        input_scale if input_scale is not None else torch.tensor(float("nan")),  # NaN: never used, loud if it were
        bias, scale_layout="linear",
    )
    new.swizzle_weight_scales_()
    new.dynamic_input_scale = input_scale is None
    new.input_scale_source = "dynamic" if input_scale is None else "modelopt"
    copy_tp_annotations(module, new)
    return new


def _plain_linear(module: nn.Linear) -> nn.Linear:
    # A Linear whose quantizers are all off computes F.linear(x, weight, bias): the same module, minus ModelOpt.
    linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
    linear.weight = module.weight
    linear.bias = module.bias
    copy_tp_annotations(module, linear)
    return linear


def _replace(model: nn.Module, name: str, new: nn.Module, restore: list | None) -> None:
    """Put ``new`` at ``name``; with ``restore``, append the undo that puts the ModelOpt module back (unless the
    user replaced ``new`` since)."""
    old = model.get_submodule(name)
    model.set_submodule(name, new)
    if restore is not None:
        def undo() -> None:
            if model.get_submodule(name) is new:
                model.set_submodule(name, old)

        restore.append(undo)


@torch.no_grad()
def convert_modelopt_model(model: nn.Module, *, dynamic_input_scale: bool = False,
                           restore: list | None = None) -> nn.Module:
    """Replace ModelOpt quantized Linears in ``model`` (in place) and return it.

    NVFP4 layers (compressed by ``mtq.compress`` or still fake-quantized) become ``NVFP4Linear`` with the weight,
    block scales (128x4 after conversion), ``weight_scale_2`` and ``input_scale`` that ``export_hf_checkpoint`` would
    write; Linears whose quantizers are disabled become plain ``nn.Linear`` sharing the same parameters. Every layer
    is checked before anything is changed, and all problems are raised together.

    Args:
        dynamic_input_scale: layers whose input quantizer has no amax (disabled or never calibrated) get
            ``NVFP4Linear.dynamic_input_scale`` instead of an error. Not the calibrated recipe.
        restore: where given, one undo per replaced module is appended, which puts the ModelOpt module back (its
            quantizers untouched): ``disable_fast_paths`` runs them.

    Raises:
        NVFP4CheckpointError: unsupported formats (non-NVFP4, static, 4/6, AWQ pre-scales), uncalibrated layers,
            or an input amax of 0/NaN (the exporter would silently substitute 6.0).
    """
    problems: list[str] = []
    quantized, plain = _collect(model, dynamic_input_scale, problems)
    groups = _qkv_groups([q.name for q in quantized])
    by_name = {q.name: q for q in quantized}
    plans = [(layer, *_group_scales(layer, [by_name[n] for n in groups[layer.name]], problems)) for layer in quantized]
    if problems:
        raise NVFP4CheckpointError(
            f"{type(model).__name__}: {len(problems)} ModelOpt layer(s) cannot be converted to NVFP4Linear:\n  "
            + "\n  ".join(problems)
        )
    built: list[tuple[_Layer, NVFP4Linear]] = []
    for layer, weight_scale_2, input_scale in plans:
        new = _build_layer(layer, weight_scale_2, input_scale, problems)
        if new is not None:
            built.append((layer, new))
    if problems:
        raise NVFP4CheckpointError(f"{type(model).__name__}: {len(problems)} problem(s) in ModelOpt layer tensors; "
                                   "nothing was converted:\n  " + "\n  ".join(problems))
    raise_scale_problems(type(model).__name__, [
        p for layer, new in built
        for p in scale_problems(layer.name, new.weight_scale, new.weight_scale_2,
                                None if new.dynamic_input_scale else new.input_scale)
    ])
    for layer, new in built:
        _replace(model, layer.name, new, restore)
    for name, module in plain:
        _replace(model, name, _plain_linear(cast(nn.Linear, module)), restore)
    leftover = sorted({type(m).__name__ for m in model.modules() if type(m).__module__.startswith("modelopt.")
                       and any(getattr(q, "is_enabled", False) for q in m.children())})
    if leftover:
        logger.warning("ModelOpt modules with enabled quantizers remain (not Linears, left as they are): %s", leftover)
    logger.info(
        "Converted ModelOpt model %s: %d NVFP4Linear (%d compressed, %d dynamic input scale), %d plain Linear",
        type(model).__name__, len(plans), sum(p[0].compressed for p in plans), sum(p[2] is None for p in plans),
        len(plain),
    )
    return model
