"""What every loader shares: putting ``NVFP4Linear`` layers into a model, finishing it, describing the result, and
the one home of the facts several loaders need (scale-layout guess from shapes, exclude patterns, q/k/v groups)."""

from __future__ import annotations

import fnmatch
import logging

import torch
from torch import nn

from ..format import BLOCK_SIZE, ScaleLayout, padded_scale_shape
from ..linear import NVFP4Linear
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


def classify_scale_layout(shape: tuple[int, ...], out_features: int, in_features: int) -> ScaleLayout | None:
    """'linear' or '128x4' from the shape, None if neither fits. Ambiguous shapes read as 'linear' (ModelOpt's
    default export), so swizzled exports of such shapes must be declared by the caller."""
    guess = scale_layout_from_shape(shape, out_features, in_features)
    return {"linear": "linear", "ambiguous": "linear", "128x4": "128x4"}.get(guess)


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


def finish_model(model: nn.Module, source, device) -> None:
    """Refuse a model with tensors the checkpoint did not fill; eval mode; move to ``device``."""
    meta = [n for n, p in model.named_parameters() if p.is_meta] + [n for n, b in model.named_buffers() if b.is_meta]
    if meta:
        raise NVFP4CheckpointError(f"{source}: no data for {meta}")
    model.eval()
    if device is not None:
        model.to(device)


def module_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def load_summary(model: nn.Module, **facts) -> dict:
    """``model._nvfp4_load_summary``: class, layer counts and byte sizes, plus the loader's own ``facts``."""
    linears = [m for m in model.modules() if isinstance(m, NVFP4Linear)]
    return {
        "class": type(model).__name__, **facts, "nvfp4_linears": len(linears),
        "bf16_linears": sum(isinstance(m, nn.Linear) for m in model.modules()),
        "nvfp4_bytes": sum(module_bytes(m) for m in linears), "total_bytes": module_bytes(model),
    }


def log_summary(summary: dict, source) -> None:
    logger.info(
        "Loaded %s from %s: %d NVFP4 linears (%.1f MB), %d BF16 linears, %.1f MB in all",
        summary["class"], source, summary["nvfp4_linears"], summary["nvfp4_bytes"] / 1e6, summary["bf16_linears"],
        summary["total_bytes"] / 1e6,
    )


def scalar(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(()).to(torch.float32)
