"""Rotary position embedding on query / key, in one pass, with the bytes of diffusers' ``apply_rotary_emb``.

diffusers (``use_real=True``, pairs interleaved as FLUX uses them) computes, for each pair ``(x0, x1)`` of a head's
vector and the FP32 ``cos`` / ``sin`` of its position, with one rounding per torch op:
``out0 = bf16(fl(fl(x0 * cos0) + fl(-x1 * sin0)))``, ``out1 = bf16(fl(fl(x1 * cos1) + fl(x0 * sin1)))``. Those ops
run as separate kernels (no FMA between them), materializing an FP32 copy, the rotated copy and three FP32
intermediates; this kernel reads ``x`` and the tables once and writes the result (FMA contraction off).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import cdiv, launch
from .rounding import negate, round_to_half

__all__ = ["rotary_triton"]


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, rows, S, H,
    D: tl.constexpr, BLOCK_R: tl.constexpr, IS_BF16: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # row = (batch, position, head)
    pos = (r // H) % S
    cols = tl.arange(0, D)
    ok = (r < rows)[:, None]
    x = tl.load(x_ptr + r[:, None].to(tl.int64) * D + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + pos[:, None].to(tl.int64) * D + cols[None, :], mask=ok, other=0.0)
    s = tl.load(sin_ptr + pos[:, None].to(tl.int64) * D + cols[None, :], mask=ok, other=0.0)
    x0, x1 = tl.split(tl.reshape(x, [BLOCK_R, D // 2, 2]))
    c0, c1 = tl.split(tl.reshape(c, [BLOCK_R, D // 2, 2]))
    s0, s1 = tl.split(tl.reshape(s, [BLOCK_R, D // 2, 2]))
    out0 = round_to_half(x0 * c0 + negate(x1) * s0, IS_BF16)
    out1 = round_to_half(x1 * c1 + x0 * s1, IS_BF16)
    bits = tl.reshape(tl.join(out0, out1), [BLOCK_R, D]).to(tl.int16)
    tl.store(out_ptr + r[:, None].to(tl.int64) * D + cols[None, :], bits, mask=ok)


def rotary_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, block_r: int = 16,
                  num_warps: int = 4) -> torch.Tensor:
    """x ``[B, S, H, D]`` bf16/fp16 (D a power of two), cos / sin FP32 ``[S, D]`` -> ``[B, S, H, D]`` in x's dtype,
    the bytes of ``diffusers.models.embeddings.apply_rotary_emb(x, (cos, sin), sequence_dim=1)``."""
    if x.dim() != 4 or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"rotary_triton: x must be [B, S, H, D] bf16/fp16, got {tuple(x.shape)} {x.dtype}")
    b, seq, heads, d = x.shape
    if d & (d - 1) or d < 2:
        raise ValueError(f"rotary_triton: head dim {d} must be a power of two")
    if cos.shape != (seq, d) or sin.shape != (seq, d) or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"rotary_triton: cos/sin must be FP32 [{seq}, {d}], got {tuple(cos.shape)} {cos.dtype} / "
                         f"{tuple(sin.shape)} {sin.dtype}")
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    out = torch.empty_like(x)
    rows = b * seq * heads
    launch(
        _rotary_kernel, (cdiv(rows, block_r),),
        x, cos, sin, out.view(torch.int16), rows, seq, heads,
        D=d, BLOCK_R=block_r, IS_BF16=x.dtype == torch.bfloat16, num_warps=num_warps, enable_fp_fusion=False,
    )
    return out
