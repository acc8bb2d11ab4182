"""Fused token-cat quantize: ``quantize(cat([attn, mlp], -1))`` without materializing the concatenation.

FLUX.2's single-stream blocks concatenate the attention output ``[..., A]`` and the SwiGLU output ``[..., B]`` only
to feed ``to_out``; with A and B multiples of 16 no 16-value block straddles the two, so quantizing each block from
its own source gives exactly the bytes of quantizing the concatenation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import as_block_rows, launch, launch_options, padded_scale_shape, tile_grid
from .nvfp4_epilogue import cat_tile, load_blocks, quantize_blocks, store_blocks

__all__ = ["token_cat_quantize_triton"]


@triton.jit
def _token_cat_quantize_kernel(
    a_ptr, b_ptr, g_ptr, packed_ptr, scales_ptr, M, A, B, stride_a, stride_b, padded_cols, col_tiles,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, IS_BF16: tl.constexpr, FAST_MATH: tl.constexpr,
    HW_E2M1: tl.constexpr,
):
    rows, kbs, in_a, in_b = cat_tile(tl.program_id(0), col_tiles, M, A, B, BLOCK_R, BLOCK_C)
    a0, a1, a2, a3 = load_blocks(a_ptr, rows, kbs, stride_a, in_a)
    b0, b1, b2, b3 = load_blocks(b_ptr, rows, kbs - A // 16, stride_b, in_b)
    # Masked lanes loaded 0, so OR-ing the two sources picks whichever one the block belongs to.
    packed, sf_byte = quantize_blocks(a0 | b0, a1 | b1, a2 | b2, a3 | b3, tl.load(g_ptr), IS_BF16, FAST_MATH, HW_E2M1)
    store_blocks(packed, sf_byte, rows, kbs, packed_ptr, scales_ptr, M, A + B, padded_cols)


def token_cat_quantize_triton(
    attn: torch.Tensor, mlp: torch.Tensor, global_scale: torch.Tensor, *, fast_math: bool = True,
    block_r: int = 8, block_c: int = 32, num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """attn ``[..., A]``, mlp ``[..., B]`` (same leading dims, bf16/fp16; rows may be strided) ->
    packed uint8 ``[R, (A+B)/2]`` and 128x4 scales uint8 ``[round_up(R,128), round_up((A+B)/16,4)]``."""
    if attn.dtype != mlp.dtype:
        raise TypeError(f"token_cat_quantize_triton: attn is {attn.dtype} but mlp is {mlp.dtype}")
    a = attn.reshape(-1, attn.shape[-1])
    b = mlp.reshape(-1, mlp.shape[-1])
    (m, width_a), (mb, width_b) = a.shape, b.shape
    if m != mb or width_a % 16 or width_b % 16:
        raise ValueError(
            f"token_cat_quantize_triton: attn {tuple(attn.shape)} and mlp {tuple(mlp.shape)} need equal rows and "
            "widths % 16 == 0"
        )
    (a_blocks, stride_a), (b_blocks, stride_b) = as_block_rows(a), as_block_rows(b)
    k = width_a + width_b
    packed = torch.empty((m, k // 2), dtype=torch.uint8, device=a.device)
    scales = torch.empty(padded_scale_shape(m, k), dtype=torch.uint8, device=a.device)
    grid, col_tiles = tile_grid(m, scales.shape[1], block_r, block_c)
    launch(
        _token_cat_quantize_kernel, grid,
        a_blocks, b_blocks, global_scale, packed.view(torch.int64), scales, m, width_a, width_b, stride_a, stride_b,
        scales.shape[1], col_tiles,
        BLOCK_R=block_r, BLOCK_C=block_c, IS_BF16=a.dtype == torch.bfloat16,
        **launch_options(a.device, fast_math, num_warps),
    )
    return packed, scales
