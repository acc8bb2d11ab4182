"""What every loader shares: putting ``NVFP4Linear`` layers into a model, finishing it, describing the result, and
the one home of the facts several loaders need (scale-layout guess from shapes, exclude patterns, q/k/v groups)."""

from __future__ import annotations

import fnmatch
import logging
import math
from typing import Any, cast

import torch
from torch import nn

from ..format import BLOCK_SIZE, padded_scale_shape
from ..linear import NVFP4Linear
from ..utils import tensor_bytes
from .errors import NVFP4CheckpointError

logger = logging.getLogger("diffusers_nvfp4_fast")

NVFP4_SUFFIXES = ("weight", "weight_scale", "weight_scale_2", "input_scale")
# diffusers' tensor-parallel annotations of fused projections; a replacement layer keeps them.
_TP_ATTRS = ("_tp_packed_row_blocks", "_tp_packed_col_blocks")
# q/k/v projections fed by the same input share one weight_scale_2 and input_scale in ModelOpt exports.
QKV_GROUPS = (("to_q", "to_k", "to_v"), ("add_q_proj", "add_k_proj", "add_v_proj"))


def scale_layout_from_shape(shape: tuple[int, ...], out_features: int, in_features: int) -> str:
    """'linear' ``[N, K/16]``, '128x4' (padded swizzled shape), '128x4 (flat)' (1-D), 'ambiguous' (both layouts
    have this shape: N % 128 == 0 and K/16 % 4 == 0) or 'neither'."""
    linear, swizzled = (out_features, in_features // BLOCK_SIZE), padded_scale_shape(out_features, in_features)
    shape = tuple(shape)
    if shape == linear:
        return "ambiguous" if shape == swizzled else "linear"
    if shape == swizzled:
        return "128x4"
    if len(shape) == 1 and shape[0] == swizzled[0] * swizzled[1]:
        return "128x4 (flat)"
    return "neither"


def is_excluded(module_name: str, patterns: list[str]) -> bool:
    """True if the module or any parent module matches an exclude pattern.

    ModelOpt writes patterns for the module it quantized (``img_mod``) while the Linear inside serializes as
    ``img_mod.1``; matching every dotted prefix covers both spellings.
    """
    parts = module_name.split(".")
    prefixes = [".".join(parts[: i + 1]) for i in range(len(parts))]
    return any(fnmatch.fnmatchcase(p, pat) for p in prefixes for pat in patterns)


def qkv_group(name: str) -> list[str]:
    """The names of the q/k/v group ``name`` belongs to (``[name]`` alone when it is not a q/k/v projection)."""
    parent, leaf = name.rsplit(".", 1) if "." in name else ("", name)
    for group in QKV_GROUPS:
        if leaf in group:
            return [f"{parent}.{g}" if parent else g for g in group]
    return [name]


def copy_tp_annotations(old: nn.Module, new: nn.Module) -> None:
    for attr in _TP_ATTRS:
        if hasattr(old, attr):
            setattr(new, attr, getattr(old, attr))


def replace_linear(model: nn.Module, name: str, linear: nn.Module, new: nn.Module) -> None:
    """Put ``new`` where ``linear`` was, keeping diffusers' tensor-parallel block annotations."""
    copy_tp_annotations(linear, new)
    model.set_submodule(name, new)


_SUMMARY = "_nvfp4_load_summary"  # where a loader keeps its summary on the model it returns


def record_load_summary(model: nn.Module, source, **facts) -> dict:
    """Keep (for ``load_summary``) and log what was loaded: class, layer counts and byte sizes, plus the loader's own
    ``facts``."""
    linears = [m for m in model.modules() if isinstance(m, NVFP4Linear)]
    summary = {
        "class": type(model).__name__, **facts, "nvfp4_linears": len(linears),
        "bf16_linears": sum(isinstance(m, nn.Linear) for m in model.modules()),
        "nvfp4_bytes": sum(tensor_bytes(m) for m in linears), "total_bytes": tensor_bytes(model),
    }
    model.__dict__[_SUMMARY] = summary
    _log_summary(summary, source)
    return summary


def load_summary(model: nn.Module) -> dict:
    """What ``load_nvfp4_transformer`` loaded into ``model``: ``class``, ``format``, ``nvfp4_linears``,
    ``bf16_linears``, ``nvfp4_bytes``, ``total_bytes`` and the loader's own facts (scale layout, input-scale sources,
    scales swizzled on load). A JSON-able dict; a copy. Raises ``ValueError`` for a model this package did not load."""
    summary = model.__dict__.get(_SUMMARY)
    if summary is None:
        raise ValueError(f"{type(model).__name__} was not loaded by load_nvfp4_transformer, so it has no load summary")
    return dict(summary)


def _log_summary(summary: dict, source) -> None:
    logger.info(
        "Loaded %s from %s: %d NVFP4 linears (%.1f MB), %d BF16 linears, %.1f MB in all",
        summary["class"], source, summary["nvfp4_linears"], summary["nvfp4_bytes"] / 1e6, summary["bf16_linears"],
        summary["total_bytes"] / 1e6,
    )


def scalar(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(()).to(torch.float32)


def scale_problems(name: str, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                   input_scale: torch.Tensor | None) -> list[str]:
    """What is wrong with one layer's NVFP4 scales (docs/checkpoints.md, "Scales that are refused"), each naming the
    key and the bad value; empty when they are usable.

    Refused: a NaN or +-Inf ``weight_scale_2``; a negative one; a zero one unless every block scale is zero (an all-zero
    weight, which is legal); a NaN, +-Inf, zero or negative ``input_scale`` (``None`` skips the check: a layer that
    computes its scale per call); E4M3 NaN bytes (0x7F, 0xFF) and negative nonzero bytes in ``weight_scale``.
    """
    problems = []
    ws2 = float(weight_scale_2.reshape(()).float())
    scale_bytes = weight_scale.reshape(-1).view(torch.uint8)
    if not math.isfinite(ws2) or ws2 < 0:
        problems.append(f"{name}.weight_scale_2 is {ws2}: it must be a finite number >= 0")
    elif ws2 == 0 and bool(scale_bytes.any()):
        problems.append(f"{name}.weight_scale_2 is 0 but some block scales are not: the weight would be wrong")
    if input_scale is not None:
        value = float(input_scale.reshape(()).float())
        if not math.isfinite(value) or value <= 0:
            problems.append(f"{name}.input_scale is {value}: it must be a finite number > 0")
    nan_bytes = int(((scale_bytes & 0x7F) == 0x7F).sum())
    if nan_bytes:
        problems.append(f"{name}.weight_scale holds {nan_bytes} E4M3 NaN byte(s) (0x7F/0xFF)")
    negative = int((scale_bytes > 0x80).sum()) - int((scale_bytes == 0xFF).sum())
    if negative:
        problems.append(f"{name}.weight_scale holds {negative} negative block scale(s) (sign bit set)")
    return problems


def _scalar_problem(name: str, t: torch.Tensor | None) -> str | None:
    if t is None or (t.dtype == torch.float32 and t.numel() == 1):
        return None
    return f"{name}: {t.dtype} {list(t.shape)}, expected a float32 scalar"


def layer_tensor_problems(name: str, out_features: int, in_features: int, weight: torch.Tensor,
                          weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                          input_scale: torch.Tensor | None, bias: torch.Tensor | None) -> list[str]:
    """What keeps one NVFP4 layer's tensors from being read as ``NVFP4Linear`` takes them (each naming the tensor,
    its dtype and shape, and the expected ones); empty when they fit. Expected, for an ``[N, K]`` layer: packed uint8
    ``[N, K/2]``, linear E4M3 (or uint8) block scales ``[N, K/16]``, float32 scalars, a bias ``[N]``."""
    n, k = out_features, in_features
    problems = []
    if k % BLOCK_SIZE:
        return [f"{name}: in_features {k} is not a multiple of {BLOCK_SIZE}, so it cannot be NVFP4"]
    if weight.dtype != torch.uint8 or tuple(weight.shape) != (n, k // 2):
        problems.append(f"{name}.weight: {weight.dtype} {list(weight.shape)}, expected packed uint8 {[n, k // 2]}")
    if weight_scale.dtype not in (torch.float8_e4m3fn, torch.uint8) or \
            tuple(weight_scale.shape) != (n, k // BLOCK_SIZE):
        problems.append(f"{name}.weight_scale: {weight_scale.dtype} {list(weight_scale.shape)}, expected "
                        f"float8_e4m3fn {[n, k // BLOCK_SIZE]} (linear block scales of a [{n}, {k}] layer)")
    problems += [p for p in (_scalar_problem(f"{name}.weight_scale_2", weight_scale_2),
                             _scalar_problem(f"{name}.input_scale", input_scale)) if p]
    if bias is not None and tuple(bias.shape) != (n,):
        problems.append(f"{name}.bias: {list(bias.shape)}, expected {[n]}")
    return problems


def raise_scale_problems(source, problems: list[str]) -> None:
    if problems:
        raise NVFP4CheckpointError(f"{source}: {len(problems)} problem(s) in NVFP4 scales:\n  " + "\n  ".join(problems))


PRODUCER = "diffusers-nvfp4-fast"


def checkpoint_config(model: nn.Module) -> dict | None:
    """The ``quantization_config`` that describes ``model``'s NVFP4 layers as ``save_pretrained`` writes them: the
    ModelOpt keys plus the facts a loader must not guess (block-scale layout, nibble order, layers that compute their
    activation scale per call). None when the model has no NVFP4 layer or its layers mix scale layouts."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    layouts = {m.scale_layout for m in layers.values()}
    if not layers or len(layouts) != 1:
        return None
    return quantization_config([name for name, m in model.named_modules() if isinstance(m, nn.Linear)],
                               layouts.pop(), [name for name, m in layers.items() if m.dynamic_input_scale])


def producer() -> dict[str, str]:
    """The ``producer`` entry of every checkpoint config this package writes."""
    from .. import __version__  # the package's version, read at call time (the package imports its loaders)

    return {"name": PRODUCER, "version": __version__}


def quantization_config(bf16_linears: list[str], scale_layout: str, dynamic_layers: list[str]) -> dict:
    """The ``quantization_config`` of a checkpoint this package writes: ModelOpt's keys, the Linears kept BF16
    (``ignore``), the block-scale layout, the nibble order, the layers that compute their activation scale per call."""
    group = {"num_bits": 4, "type": "float", "group_size": BLOCK_SIZE}
    return {
        "quant_method": PRODUCER, "quant_algo": "NVFP4", "producer": producer(),
        "config_groups": {"group_0": {"weights": group, "input_activations": group, "targets": ["Linear"]}},
        "ignore": sorted(bf16_linears), "weight_scale_layout": scale_layout, "nibble_order": "lo_first",
        "dynamic_input_scale": sorted(dynamic_layers),
    }


def record_checkpoint_config(model: nn.Module) -> None:
    """Put ``checkpoint_config(model)`` into the diffusers config, so ``model.save_pretrained(dir)`` writes a
    checkpoint that ``load_nvfp4_transformer(dir)`` reads back byte for byte."""
    config = checkpoint_config(model)
    if config is not None and hasattr(model, "register_to_config"):
        cast(Any, model).register_to_config(quantization_config=config)  # a diffusers ModelMixin
