"""Launch helpers shared by the NVFP4-emitting kernels."""

import functools

import torch


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host code. ``triton.cdiv`` is a constexpr function whose Python-side call costs a few
    microseconds (argument unwrapping); the launch wrappers call it hundreds of times per transformer block, which
    shows in eager steps that are bound by host time."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (n >= 1), like ``triton.next_power_of_2`` but a plain host function."""
    return 1 << (n - 1).bit_length()


def padded_scale_shape(m: int, k: int) -> tuple[int, int]:
    return (cdiv(m, 128) * 128, cdiv(k // 16, 4) * 4)


def tile_grid(m: int, padded_cols: int, block_r: int, block_c: int) -> tuple[tuple[int], int]:
    """1-D grid over (row tiles x 16-block tiles) covering the padded scale area (no 65,535 grid-dimension limit)."""
    col_tiles = cdiv(padded_cols, block_c)
    row_tiles = cdiv(cdiv(m, 128) * 128, block_r)
    return (row_tiles * col_tiles,), col_tiles


def as_block_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A 2-D bf16/fp16 matrix as int64 words (four values each) and its row stride in words.

    Rows may be strided; the last dimension must be contiguous and every row start 8-byte aligned, otherwise a
    contiguous copy is made.
    """
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"NVFP4 kernels take bfloat16/float16 input, got {x.dtype}")
    if x.shape[0] and (x.stride(-1) != 1 or x.stride(0) % 4 or x.data_ptr() % 8):
        x = x.contiguous()
    words = x.view(torch.int64)
    return words, words.stride(0)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def hardware_e2m1(device: torch.device) -> bool:
    """cvt.rn.satfinite.e2m1x2.f32 exists from SM100 on (ptxas rejects it for SM90)."""
    if device.type != "cuda":
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device())[0] >= 10


def launch_options(device: torch.device, fast_math: bool, num_warps: int = 4) -> dict:
    # No FMA contraction: every rounding step must happen exactly where the spec puts it.
    return {"FAST_MATH": bool(fast_math), "HW_E2M1": hardware_e2m1(device), "enable_fp_fusion": False, "num_warps": num_warps}
