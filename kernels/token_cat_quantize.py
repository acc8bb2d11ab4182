"""Fused token-cat quantize: ``quantize(cat([attn, mlp], -1))`` without materializing the concatenation.

FLUX.2's single-stream blocks concatenate the attention output ``[..., A]`` and the SwiGLU output ``[..., B]`` only
to feed ``to_out``; with A and B multiples of 16 no 16-value block straddles the two, so quantizing each column
range from its own source gives exactly the bytes of quantizing the concatenation.
"""

import torch
import triton
import triton.language as tl

from .launch import launch_options, padded_scale_shape, tile_grid
from .nvfp4_epilogue import store_nvfp4_tile


@triton.jit
def _token_cat_quantize_kernel(
    a_ptr, b_ptr, g_ptr, packed_ptr, scales_ptr, M, A, B, stride_a, stride_b, padded_cols, col_tiles,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, FAST_MATH: tl.constexpr, HW_E2M1: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = (pid // col_tiles) * BLOCK_R + tl.arange(0, BLOCK_R)
    col0 = (pid % col_tiles) * BLOCK_K
    cols = col0 + tl.arange(0, BLOCK_K)
    row_ok = rows[:, None] < M
    r64 = rows[:, None].to(tl.int64)
    in_a = cols[None, :] < A
    in_b = (cols[None, :] >= A) & (cols[None, :] < A + B)
    xa = tl.load(a_ptr + r64 * stride_a + cols[None, :], mask=row_ok & in_a, other=0.0)
    xb = tl.load(b_ptr + r64 * stride_b + (cols[None, :] - A), mask=row_ok & in_b, other=0.0)
    x = tl.where(in_a, xa.to(tl.float32), xb.to(tl.float32))
    g = tl.load(g_ptr)
    store_nvfp4_tile(x, rows, col0, g, packed_ptr, scales_ptr, M, A + B, padded_cols, BLOCK_R, BLOCK_K, FAST_MATH, HW_E2M1)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    return t if t.stride(-1) == 1 else t.contiguous()


def token_cat_quantize(
    attn: torch.Tensor, mlp: torch.Tensor, global_scale: torch.Tensor, *, fast_math: bool = True,
    block_r: int = 32, block_k: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """attn ``[..., A]``, mlp ``[..., B]`` (same leading dims, bf16/fp16; rows may be strided) ->
    packed uint8 ``[R, (A+B)/2]`` and 128x4 scales uint8 ``[round_up(R,128), round_up((A+B)/16,4)]``."""
    a, b = _rows(attn), _rows(mlp)
    (m, width_a), (mb, width_b) = a.shape, b.shape
    if m != mb or width_a % 16 or width_b % 16:
        raise ValueError(f"token_cat_quantize: attn {tuple(attn.shape)} and mlp {tuple(mlp.shape)} need equal rows and widths % 16 == 0")
    k = width_a + width_b
    packed = torch.empty((m, k // 2), dtype=torch.uint8, device=a.device)
    scales = torch.empty(padded_scale_shape(m, k), dtype=torch.uint8, device=a.device)
    grid, col_tiles = tile_grid(m, scales.shape[1] * 16, block_r, block_k)
    _token_cat_quantize_kernel[grid](
        a, b, global_scale, packed, scales, m, width_a, width_b, a.stride(0), b.stride(0), scales.shape[1], col_tiles,
        BLOCK_R=block_r, BLOCK_K=block_k, **launch_options(a.device, fast_math),
    )
    return packed, scales
