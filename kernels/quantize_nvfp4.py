"""Standalone NVFP4 quantize: BF16/FP16 ``[M, K]`` -> packed ``[M, K/2]`` + 128x4 scales (the unfused GPU path)."""

import torch
import triton
import triton.language as tl

from .launch import as_block_rows, launch, launch_options, padded_scale_shape, tile_grid
from .nvfp4_epilogue import load_blocks, quantize_blocks, store_blocks


@triton.jit
def _quantize_nvfp4_kernel(
    x_ptr, g_ptr, packed_ptr, scales_ptr, M, K, row_stride, padded_cols, col_tiles,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, IS_BF16: tl.constexpr, FAST_MATH: tl.constexpr,
    HW_E2M1: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = (pid // col_tiles) * BLOCK_R + tl.arange(0, BLOCK_R)
    kbs = (pid % col_tiles) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < M) & (kbs[None, :] < K // 16)
    q0, q1, q2, q3 = load_blocks(x_ptr, rows, kbs, row_stride, mask)
    packed, sf_byte = quantize_blocks(q0, q1, q2, q3, tl.load(g_ptr), IS_BF16, FAST_MATH, HW_E2M1)
    store_blocks(packed, sf_byte, rows, kbs, packed_ptr, scales_ptr, M, K, padded_cols)


def quantize_nvfp4_triton(
    x: torch.Tensor, global_scale: torch.Tensor, *, fast_math: bool = True, block_r: int = 8, block_c: int = 32,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: ``[M, K]`` bf16/fp16 (rows may be strided), global_scale: fp32 1-element tensor on x's device.

    Returns packed uint8 ``[M, K/2]`` and scales uint8 ``[round_up(M,128), round_up(K/16,4)]`` (128x4 layout).
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_nvfp4_triton wants a 2-D input, got shape {tuple(x.shape)}")
    m, k = x.shape
    if k % 16:
        raise ValueError(f"K={k} must be a multiple of 16")
    blocks, row_stride = as_block_rows(x)
    packed = torch.empty((m, k // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty(padded_scale_shape(m, k), dtype=torch.uint8, device=x.device)
    grid, col_tiles = tile_grid(m, scales.shape[1], block_r, block_c)
    launch(
        _quantize_nvfp4_kernel, grid,
        blocks, global_scale, packed.view(torch.int64), scales, m, k, row_stride, scales.shape[1], col_tiles,
        BLOCK_R=block_r, BLOCK_C=block_c, IS_BF16=x.dtype == torch.bfloat16,
        **launch_options(x.device, fast_math, num_warps),
    )
    return packed, scales
