"""Standalone NVFP4 quantize: BF16/FP16 ``[M, K]`` -> packed ``[M, K/2]`` + 128x4 scales (the unfused GPU path)."""

import torch
import triton
import triton.language as tl

from .launch import launch_options, padded_scale_shape, tile_grid
from .nvfp4_epilogue import store_nvfp4_tile


@triton.jit
def _quantize_nvfp4_kernel(
    x_ptr, g_ptr, packed_ptr, scales_ptr, M, K, stride_x, padded_cols, col_tiles,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, FAST_MATH: tl.constexpr, HW_E2M1: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = (pid // col_tiles) * BLOCK_R + tl.arange(0, BLOCK_R)
    col0 = (pid % col_tiles) * BLOCK_K
    cols = col0 + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr)
    store_nvfp4_tile(x, rows, col0, g, packed_ptr, scales_ptr, M, K, padded_cols, BLOCK_R, BLOCK_K, FAST_MATH, HW_E2M1)


def quantize_nvfp4(
    x: torch.Tensor, global_scale: torch.Tensor, *, fast_math: bool = True, block_r: int = 32, block_k: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: ``[M, K]`` bf16/fp16 (last dim contiguous), global_scale: fp32 1-element tensor on x's device.

    Returns packed uint8 ``[M, K/2]`` and scales uint8 ``[round_up(M,128), round_up(K/16,4)]`` (128x4 layout).
    """
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"quantize_nvfp4 kernel wants a 2-D row-major input, got shape {tuple(x.shape)} strides {x.stride()}")
    m, k = x.shape
    if k % 16:
        raise ValueError(f"K={k} must be a multiple of 16")
    packed = torch.empty((m, k // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty(padded_scale_shape(m, k), dtype=torch.uint8, device=x.device)
    grid, col_tiles = tile_grid(m, scales.shape[1] * 16, block_r, block_k)
    _quantize_nvfp4_kernel[grid](
        x, global_scale, packed, scales, m, k, x.stride(0), scales.shape[1], col_tiles,
        BLOCK_R=block_r, BLOCK_K=block_k, **launch_options(x.device, fast_math),
    )
    return packed, scales
