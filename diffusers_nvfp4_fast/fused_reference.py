"""Torch references of the fused ops: the unfused computations the kernels must reproduce byte for byte.

They run on CPU (CI, and the CPU fast path) and on GPU as the verification oracle (DESIGN.md section 6).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import ops


def token_cat_quantize_reference(
    attn: torch.Tensor, mlp: torch.Tensor, global_scale: torch.Tensor, fast_math: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize(cat([attn, mlp], -1))``: attn ``[..., A]``, mlp ``[..., B]`` -> packed ``[R, (A+B)/2]``, 128x4 scales."""
    x = torch.cat([attn, mlp], dim=-1)
    return ops.quantize_nvfp4(x.reshape(-1, x.shape[-1]), global_scale, fast_math)


def broadcast_rows(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Per-sample modulation ``[B, D]`` (or ``[B, 1, D]`` / ``[B, L, D]``) -> broadcastable against ``x [B, L, D]``."""
    return p.unsqueeze(1) if p.dim() == 2 else p


def qwen_residual_chain(
    residual: torch.Tensor,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    gate: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' Qwen-Image block between the attention output and FC1, op by op (each bf16 op rounds).

    residual, x: ``[B, L, D]``; bias ``[D]`` or None (x already biased); gate/scale/shift ``[B, D]`` or ``[B, L, D]``.
    Returns (residual_out ``[B, L, D]``, modulated FC1 input ``[B, L, D]``).
    """
    a = x if bias is None else x + bias
    r = residual + broadcast_rows(gate, a) * a
    n = F.layer_norm(r, (r.shape[-1],), eps=eps)
    m = n * (1 + broadcast_rows(scale, n)) + broadcast_rows(shift, n)
    return r, m


def qwen_resnorm_quantize_reference(
    residual: torch.Tensor,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    gate: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    global_scale: torch.Tensor,
    eps: float,
    fast_math: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eager chain + standalone quantize -> (residual_out ``[B, L, D]``, packed ``[B*L, D/2]``, 128x4 scales)."""
    r, m = qwen_residual_chain(residual, x, bias, gate, scale, shift, eps)
    packed, scales = ops.quantize_nvfp4(m.reshape(-1, m.shape[-1]), global_scale, fast_math)
    return r, packed, scales
