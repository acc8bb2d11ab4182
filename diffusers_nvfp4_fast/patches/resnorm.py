"""The residual-norm site shared by Qwen-Image and FLUX.2 double-stream blocks: ``residual + gate * attn ->
LayerNorm -> x * (1 + scale) + shift`` feeding a feed-forward's first NVFP4 projection. Both models round the same
ops in the same order (docs/design.md §6), so one op (``ops.layer_norm_quantize.resnorm_quantize``) serves both;
each model reports its own site kind."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from ..linear import NVFP4Linear
from ..module_hooks import call_changed_reason
from ..ops.layer_norm_quantize import ResNormInputs, kernel_runs_on
from ..ops.site import Site, SiteKind
from ..ops.verify import COMPILED, failed_kind_reason
from .consumers import consumer_reason
from .operands import ResNormOperand


def layer_norm_reason(norm: nn.Module, label: str) -> str | None:
    """Why the norm kernels cannot stand in for ``norm`` (diffusers' ``label``) in this call, or None: it must be an
    affine-free LayerNorm, and not inside torch.compile, where inductor lowers LayerNorm to a reduction of its own
    whose bytes the kernel cannot reproduce (compiled on must equal compiled off, docs/design.md §1)."""
    if not isinstance(norm, nn.LayerNorm) or norm.elementwise_affine:
        return f"{label} is not an affine-free LayerNorm"
    if torch.compiler.is_compiling():
        return COMPILED  # inductor computes LayerNorm its own way
    return None


def resnorm_reason(
    fc1: nn.Module | None, bypassed: dict[str, nn.Module], norm: nn.Module, residual: torch.Tensor, x: torch.Tensor,
    bias: torch.Tensor | None, kind: SiteKind,
) -> str | None:
    """None when the fused residual-norm path applies to this stream's call, else the reason it does not.

    fc1: the projection that takes the quantized activation; bypassed: label -> module whose call the fused path
    replaces (no hook may sit on them); x: the attention output ``[B, L, D]`` (without ``bias`` where it is given).
    """
    reason = consumer_reason(fc1, "FC1") if fc1 is not None else "FC1 is not an NVFP4Linear"
    if reason is not None:
        return reason
    for label, module in bypassed.items():
        reason = call_changed_reason(label, module)
        if reason is not None:
            return reason
    reason = layer_norm_reason(norm, "norm2")
    if reason is not None:
        return reason
    if residual.dtype != torch.bfloat16 or x.dtype != torch.bfloat16:
        return f"dtype {residual.dtype} (bf16 only)"
    if bias is not None and bias.dtype != torch.bfloat16:
        return f"attention output bias dtype {bias.dtype} (bf16 only)"
    if residual.dim() != 3 or x.shape != residual.shape:
        return f"shapes {tuple(residual.shape)} / {tuple(x.shape)}"
    if residual.shape[-1] % 16:
        return f"hidden size {residual.shape[-1]} not a multiple of 16"
    if residual.is_cuda and not kernel_runs_on(residual):
        return "no Triton kernel for this GPU"
    if residual.is_cuda and residual.shape[-1] % 512:
        return (f"hidden size {residual.shape[-1]} not a multiple of 512 (the kernel reproduces torch's LayerNorm "
                "there only)")
    if failed_kind_reason(kind) is not None:
        return "verification failed earlier in this process"
    return None


def fused_residual_norm(
    fc1: NVFP4Linear, norm: nn.Module, inputs: ResNormInputs, site: Site
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the fused path (its gate passed) through ``fc1``'s call: (residual_out ``[B, L, D]``, FC1's output
    ``[B, L, N]``)."""
    eps = float(cast(nn.LayerNorm, norm).eps)  # layer_norm_reason passed: an affine-free nn.LayerNorm
    return fc1(ResNormOperand(inputs, eps, site))
