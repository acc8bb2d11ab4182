"""Standalone NVFP4 quantize: BF16/FP16 ``[M, K]`` -> packed ``[M, K/2]`` + 128x4 scales (the unfused GPU path), or
straight to the exact FP16 values the large-M GEMM multiplies (``quantize_nvfp4_decoded``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .grid_dependency import wait_for_prior_grids
from .launch import (
    DirectLaunch,
    as_block_rows,
    cdiv,
    launch_by_site,
    launch_options,
    padded_scale_shape,
    pdl_options,
    site_binary,
    tile_grid,
)
from .nvfp4_epilogue import block_tile, decoded_blocks, load_blocks, quantize_blocks, store_blocks

__all__ = ["quantize_nvfp4_decoded", "quantize_nvfp4_triton"]


@triton.jit
def _quantize_nvfp4_kernel(
    x_ptr, g_ptr, packed_ptr, scales_ptr, M, K, row_stride, padded_cols, col_tiles,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, IS_BF16: tl.constexpr, FAST_MATH: tl.constexpr,
    HW_E2M1: tl.constexpr,
):
    rows, kbs, mask = block_tile(tl.program_id(0), col_tiles, M, K, BLOCK_R, BLOCK_C)
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
    return launch_block_quantize(_quantize_nvfp4_kernel, x, global_scale, fast_math, block_r, block_c, num_warps)


def launch_block_quantize(
    kernel, x: torch.Tensor, global_scale: torch.Tensor, fast_math: bool, block_r: int, block_c: int, num_warps: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate the packed output and scales of a 2-D ``x`` and launch ``kernel``, which takes the plain quantize
    kernel's arguments (x as int64 words, g, packed, scales, M, K, row stride, padded scale columns, column tiles)."""
    m, k = x.shape
    if k % 16:
        raise ValueError(f"K={k} must be a multiple of 16")
    blocks, row_stride = as_block_rows(x)
    packed = torch.empty((m, k // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty(padded_scale_shape(m, k), dtype=torch.uint8, device=x.device)
    grid, col_tiles = tile_grid(m, scales.shape[1], block_r, block_c)
    words = packed.view(torch.int64)
    launch_by_site(
        kernel, grid, blocks, global_scale, words, scales, m, k, row_stride, scales.shape[1], col_tiles,
        BLOCK_R=block_r, BLOCK_C=block_c, IS_BF16=x.dtype == torch.bfloat16, **launch_options(x.device, fast_math,
                                                                                               num_warps),
    )
    return packed, scales


@triton.jit
def _e2m1_times(code, scale):
    """E2M1 nibble codes (int64, ``s eem``) times FP32 E4M3 scale values -> FP32, exact (<= 6 significant bits)."""
    mag = code & 7
    # 0, 0.5, then (1 + m/2) * 2^(e-1) for the normal codes: the FP32 bits built directly.
    bits = tl.where(mag >= 2, ((126 + (mag >> 1)) << 23) | ((mag & 1) << 22), tl.where(mag == 1, 126 << 23, 0))
    bits = bits | ((code & 8) << 28)
    return bits.to(tl.int32).to(tl.float32, bitcast=True) * scale


@triton.jit
def fp16x4_word(codes, scale):
    """Four E2M1 codes (bits 0..15 of an int64, element i in bits 4i; higher bits ignored) times FP32 ``scale`` ->
    int64 holding their four FP16 values, element i in bits 16i."""
    w = tl.zeros_like(codes)
    for i in tl.static_range(4):
        v = _e2m1_times((codes >> (4 * i)) & 0xF, scale).to(tl.float16)
        w |= (v.to(tl.int16, bitcast=True).to(tl.int64) & 0xFFFF) << (16 * i)
    return w


@triton.jit
def decoded_nibbles(word, scale):
    """int32 words of eight E2M1 codes (element i in bits 4i) and their FP32 block scale (broadcastable to the words)
    -> FP16 ``[..., 8]``: the eight exact values per word. One decode over a new last axis of 8, where the thread
    holds its word: the compiler walks one chain of ops instead of eight (docs/performance.md, "First image")."""
    codes = (tl.expand_dims(word, -1) >> (4 * tl.arange(0, 8))) & 15
    return _e2m1_times(codes.to(tl.int64), tl.expand_dims(scale, -1)).to(tl.float16)


@triton.jit
def decoded_words(packed, scale):
    """A block's packed int64 (16 nibbles, element i in bits 4i..4i+3) and its FP32 scale -> four int64 words of
    four FP16 values each, element 4j + i in bits 16i of word j (the layout ``load_blocks`` reads)."""
    return (fp16x4_word(packed, scale), fp16x4_word(packed >> 16, scale), fp16x4_word(packed >> 32, scale),
            fp16x4_word(packed >> 48, scale))


@triton.jit
def store_words(w0, w1, w2, w3, rows, kbs, out_ptr, K, mask):
    """Store 16-blocks given as four int64 words of four FP16 values each (``decoded_blocks``' layout) into the FP16
    ``[M, K]`` output viewed as int64."""
    p = out_ptr + rows[:, None].to(tl.int64) * (K // 4) + kbs[None, :] * 4
    tl.store(p, w0, mask=mask)
    tl.store(p + 1, w1, mask=mask)
    tl.store(p + 2, w2, mask=mask)
    tl.store(p + 3, w3, mask=mask)


# One binary for row counts divisible by 16 and not (Qwen-Image's image and text streams): the hint changes
# no code of this kernel (tests/test_specialization.py; docs/performance.md, "First image").
@triton.jit(do_not_specialize_on_alignment=["M"])
def _quantize_nvfp4_decoded_kernel(
    x_ptr, g_ptr, out_ptr, M, K, row_stride, col_tiles,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, IS_BF16: tl.constexpr, FAST_MATH: tl.constexpr,
    HW_E2M1: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_prior_grids(PDL)
    rows, kbs, mask = block_tile(tl.program_id(0), col_tiles, M, K, BLOCK_R, BLOCK_C)
    q0, q1, q2, q3 = load_blocks(x_ptr, rows, kbs, row_stride, mask)
    w0, w1, w2, w3 = decoded_blocks(q0, q1, q2, q3, tl.load(g_ptr), IS_BF16, FAST_MATH)
    store_words(w0, w1, w2, w3, rows, kbs, out_ptr, K, mask)


# quantize_nvfp4_decoded's default tiles (rows, 16-blocks) and warps; decoded_quantize_launch finds its binary by them.
# Wide and short tiles: the row count, not the instruction count, limited the taller ones (docs/performance.md,
# "Measurements behind the kernels' design").
DECODED_TILES = (4, 32, 4)


def quantize_nvfp4_decoded(
    x: torch.Tensor, global_scale: torch.Tensor, *, fast_math: bool = True, block_r: int = DECODED_TILES[0],
    block_c: int = DECODED_TILES[1], num_warps: int = DECODED_TILES[2],
) -> torch.Tensor:
    """The exact FP16 values of ``quantize_nvfp4_triton(x, global_scale)`` (each E2M1 value times its E4M3 block
    scale, the global scale not applied), in one pass: what the large-M GEMM decodes its activation to, without
    writing the packed bytes and scales in between. ``decode_nvfp4_rows(*quantize_nvfp4_triton(x, g))`` has the same
    bytes.

    Args:
        x: ``[M, K]`` bf16/fp16 (rows may be strided), K % 16 == 0.
        global_scale: fp32 one-element tensor on x's device.
    Returns:
        FP16 ``[M, K]``, contiguous.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_nvfp4_decoded wants a 2-D input, got shape {tuple(x.shape)}")
    return launch_decoded_quantize(_quantize_nvfp4_decoded_kernel, x, global_scale, fast_math, block_r, block_c,
                                   num_warps)


def launch_decoded_quantize(
    kernel, x: torch.Tensor, global_scale: torch.Tensor, fast_math: bool, block_r: int, block_c: int, num_warps: int,
) -> torch.Tensor:
    """Allocate the FP16 output of a 2-D ``x`` and launch ``kernel``, which takes the arguments of
    ``_quantize_nvfp4_decoded_kernel`` (x as int64 words, g, out as int64 words, M, K, row stride, column tiles) and
    starts with ``wait_for_prior_grids`` (``pdl_options``)."""
    m, k = x.shape
    if k % 16:
        raise ValueError(f"K={k} must be a multiple of 16")
    blocks, row_stride = as_block_rows(x)
    out = torch.empty((m, k), dtype=torch.float16, device=x.device)
    if m:
        grid, args, options = _decoded_arguments(x, blocks, row_stride, global_scale, out, fast_math, block_r, block_c,
                                                 num_warps)
        launch_by_site(kernel, grid, *args, **options)
    return out


def _decoded_arguments(x: torch.Tensor, blocks: torch.Tensor, row_stride: int, global_scale: torch.Tensor,
                       out: torch.Tensor, fast_math: bool, block_r: int, block_c: int, num_warps: int) -> tuple:
    """(grid, positional arguments, keyword arguments) of a decoded-quantize launch of ``x`` (``blocks``, its rows as
    int64 words with ``row_stride``) into the FP16 ``out``."""
    m, k = x.shape
    col_tiles = cdiv(k // 16, block_c)
    args = (blocks, global_scale, out.view(torch.int64), m, k, row_stride, col_tiles)
    options = dict(BLOCK_R=block_r, BLOCK_C=block_c, IS_BF16=x.dtype == torch.bfloat16,
                   **launch_options(x.device, fast_math, num_warps), **pdl_options(x.device))
    return (cdiv(m, block_r) * col_tiles,), args, options


class DecodedQuantizeLaunch:
    """``quantize_nvfp4_decoded`` for one class of calls (M, K, dtype, recipe, global scale tensor), launched without
    its wrapper (``launch.DirectLaunch``): ``run`` gives its bytes for ``m`` contiguous, 16-byte aligned rows."""

    __slots__ = ("direct", "grid", "scale_address", "after_out")

    def __init__(self, direct: DirectLaunch, tail: tuple, m: int, k: int, global_scale: torch.Tensor,
                 block_r: int, block_c: int) -> None:
        col_tiles = cdiv(k // 16, block_c)
        self.direct, self.grid = direct, (cdiv(m, block_r) * col_tiles,)
        self.scale_address = global_scale.data_ptr()
        self.after_out = (m, k, k // 4, col_tiles, *tail)

    def run(self, x_address: int, out_address: int, stream: int) -> None:
        """FP16 ``[m, k]`` at ``out_address`` = the decoded quantize of the rows at ``x_address``, on ``stream``."""
        self.direct.run(self.grid, stream, x_address, self.scale_address, out_address, *self.after_out)


def decoded_quantize_launch(x: torch.Tensor, global_scale: torch.Tensor, out: torch.Tensor, fast_math: bool,
                            kernel=None, tiles: tuple[int, int, int] = DECODED_TILES) -> DecodedQuantizeLaunch | None:
    """The ``DecodedQuantizeLaunch`` of a call ``quantize_nvfp4_decoded(x, global_scale)`` (default tiles) made once
    with contiguous ``x`` whose result is ``out``, or None where it cannot be launched directly. ``kernel`` and
    ``tiles``: another kernel with its arguments, launched by ``launch_decoded_quantize`` with those tiles."""
    block_r, block_c, num_warps = tiles
    blocks, row_stride = as_block_rows(x)
    _, args, options = _decoded_arguments(x, blocks, row_stride, global_scale, out, fast_math, block_r, block_c,
                                          num_warps)
    recorded = site_binary(_quantize_nvfp4_decoded_kernel if kernel is None else kernel, args, options)
    if recorded is None or recorded[0].descriptor_meta is not None:
        return None
    return DecodedQuantizeLaunch(recorded[0], recorded[1], x.shape[0], x.shape[1], global_scale, block_r, block_c)
