"""Launch helpers shared by the NVFP4-emitting kernels."""

import functools

import torch
import triton


def padded_scale_shape(m: int, k: int) -> tuple[int, int]:
    return (triton.cdiv(m, 128) * 128, triton.cdiv(k // 16, 4) * 4)


def tile_grid(m: int, padded_k: int, block_r: int, block_k: int) -> tuple[tuple[int], int]:
    """1-D grid over (row tiles x column tiles) covering the padded scale area (no 65,535 grid-dimension limit)."""
    col_tiles = triton.cdiv(padded_k, block_k)
    row_tiles = triton.cdiv(triton.cdiv(m, 128) * 128, block_r)
    return (row_tiles * col_tiles,), col_tiles


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def hardware_e2m1(device: torch.device) -> bool:
    """cvt.rn.satfinite.e2m1x2.f32 exists from SM100 on (ptxas rejects it for SM90)."""
    return device.type == "cuda" and _capability(device.index if device.index is not None else torch.cuda.current_device())[0] >= 10


def launch_options(device: torch.device, fast_math: bool) -> dict:
    # No FMA contraction: every rounding step must happen exactly where the spec puts it.
    return {"FAST_MATH": bool(fast_math), "HW_E2M1": hardware_e2m1(device), "enable_fp_fusion": False, "num_warps": 4}
