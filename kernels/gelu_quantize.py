"""Fused GELU (tanh) quantize: ``quantize(gelu(h, approximate="tanh"))`` without writing the activation.

Qwen-Image's feed-forwards compute ``gelu(FC1(x))`` in BF16 only to quantize it inside FC2 (an NVFP4 projection).
Each value is computed as torch's eager CUDA kernel does (``GeluCUDAKernelImpl``, FP32 opmath, compiled by nvcc with
multiply-add contraction on): ``inner = beta * fma(kappa, x*x*x, x)``, ``y = round((0.5*x) * (1 + tanhf(inner)))``,
with ``beta = float(sqrt(2) * 2/sqrt(pi) * 0.5)`` and ``kappa = float(0.044715)``; every other operation rounds on its
own (this kernel is compiled without contraction, so the one FMA is written out). ``tanhf`` is libdevice's, the CUDA
math library's implementation. Whether these bytes equal torch's is checked on the GPU (tests) and at first use
(``verify``); the Triton interpreter has no libdevice, so there ``tanh`` is ``1 - 2 / (exp(2x) + 1)`` and the CPU
tests compare with the same arithmetic in NumPy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .grid_dependency import wait_for_prior_grids
from .launch import INTERPRETING, launch
from .nvfp4_epilogue import block_tile, decoded_blocks, load_blocks, quantize_blocks, store_blocks, unpack4
from .quantize_nvfp4 import (
    DecodedQuantizeLaunch,
    decoded_quantize_launch,
    launch_block_quantize,
    launch_decoded_quantize,
    store_words,
)
from .rounding import round_to_half

__all__ = ["gelu_decoded_launch", "gelu_quantize_decoded_triton", "gelu_quantize_triton", "gelu_triton"]

try:
    from triton.language.extra import libdevice
except ImportError:  # older Triton keeps it under the CUDA namespace
    from triton.language.extra.cuda import libdevice

# torch's constants: kBeta = M_SQRT2 * M_2_SQRTPI * 0.5 (evaluated in double, stored as float), kKappa = 0.044715f.
GELU_BETA = tl.constexpr(0.7978845834732056)
GELU_KAPPA = tl.constexpr(0.044714998453855515)
LIBDEVICE_TANH = tl.constexpr(not INTERPRETING)


@triton.jit
def gelu_tanh_value(x, IS_BF16: tl.constexpr):
    """One GELU (tanh) output from an FP32 ``x`` holding a model-dtype value, as its 16 bits (int64)."""
    x_cube = (x * x) * x
    inner = GELU_BETA * tl.fma(tl.full(x.shape, GELU_KAPPA, tl.float32), x_cube, x)
    if LIBDEVICE_TANH:
        t = libdevice.tanh(inner)
    else:
        t = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
    return round_to_half((0.5 * x) * (1.0 + t), IS_BF16)


@triton.jit
def gelu_word(q, IS_BF16: tl.constexpr):
    """An int64 word of four model-dtype values -> the word of their four GELU outputs."""
    x0, x1, x2, x3 = unpack4(q, IS_BF16)
    return (gelu_tanh_value(x0, IS_BF16) | (gelu_tanh_value(x1, IS_BF16) << 16)
            | (gelu_tanh_value(x2, IS_BF16) << 32) | (gelu_tanh_value(x3, IS_BF16) << 48))


@triton.jit
def _gelu_blocks(h_ptr, g_ptr, rows, kbs, row_stride, mask, IS_BF16: tl.constexpr, FAST_MATH: tl.constexpr,
                 HW_E2M1: tl.constexpr):
    """The tile's 16-blocks of ``gelu(h)``, quantized: (packed int64, E4M3 scale byte). Masked lanes load 0 and
    gelu(0) is +0, so padding blocks get zero scales, as the plain quantize's do."""
    q0, q1, q2, q3 = load_blocks(h_ptr, rows, kbs, row_stride, mask)
    return quantize_blocks(gelu_word(q0, IS_BF16), gelu_word(q1, IS_BF16), gelu_word(q2, IS_BF16),
                           gelu_word(q3, IS_BF16), tl.load(g_ptr), IS_BF16, FAST_MATH, HW_E2M1)


@triton.jit
def _gelu_quantize_kernel(
    h_ptr, g_ptr, packed_ptr, scales_ptr, M, K, row_stride, padded_cols, col_tiles,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, IS_BF16: tl.constexpr, FAST_MATH: tl.constexpr,
    HW_E2M1: tl.constexpr,
):
    rows, kbs, mask = block_tile(tl.program_id(0), col_tiles, M, K, BLOCK_R, BLOCK_C)
    packed, sf_byte = _gelu_blocks(h_ptr, g_ptr, rows, kbs, row_stride, mask, IS_BF16, FAST_MATH, HW_E2M1)
    store_blocks(packed, sf_byte, rows, kbs, packed_ptr, scales_ptr, M, K, padded_cols)


def gelu_quantize_triton(
    hidden: torch.Tensor, global_scale: torch.Tensor, *, fast_math: bool = True, block_r: int = 8, block_c: int = 16,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden ``[..., K]`` bf16/fp16 (rows may be strided), K % 16 == 0; global_scale fp32 one-element tensor ->
    packed uint8 ``[R, K/2]`` and 128x4 scales uint8 ``[round_up(R,128), round_up(K/16,4)]`` of
    ``gelu(hidden, approximate="tanh")``."""
    h = hidden.reshape(-1, hidden.shape[-1])
    return launch_block_quantize(_gelu_quantize_kernel, h, global_scale, fast_math, block_r, block_c, num_warps)


# One binary for row counts divisible by 16 and not (Qwen-Image's image and text streams): the hint changes
# no code of this kernel (tests/test_specialization.py; docs/performance.md, "First image").
@triton.jit(do_not_specialize_on_alignment=["M"])
def _gelu_quantize_decoded_kernel(
    h_ptr, g_ptr, out_ptr, M, K, row_stride, col_tiles,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, IS_BF16: tl.constexpr, FAST_MATH: tl.constexpr,
    HW_E2M1: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_prior_grids(PDL)
    rows, kbs, mask = block_tile(tl.program_id(0), col_tiles, M, K, BLOCK_R, BLOCK_C)
    q0, q1, q2, q3 = load_blocks(h_ptr, rows, kbs, row_stride, mask)
    w0, w1, w2, w3 = decoded_blocks(gelu_word(q0, IS_BF16), gelu_word(q1, IS_BF16), gelu_word(q2, IS_BF16),
                                    gelu_word(q3, IS_BF16), tl.load(g_ptr), IS_BF16, FAST_MATH)
    store_words(w0, w1, w2, w3, rows, kbs, out_ptr, K, mask)


GELU_DECODED_TILES = (8, 16, 4)  # rows, 16-blocks per program, warps


def gelu_quantize_decoded_triton(
    hidden: torch.Tensor, global_scale: torch.Tensor, *, fast_math: bool = True, block_r: int = GELU_DECODED_TILES[0],
    block_c: int = GELU_DECODED_TILES[1], num_warps: int = GELU_DECODED_TILES[2],
) -> torch.Tensor:
    """``gelu_quantize_triton`` straight to the exact FP16 values the large-M GEMM multiplies (``decode_nvfp4_rows``
    of its result, without the packed bytes in between): hidden ``[..., K]`` -> FP16 ``[R, K]``."""
    h = hidden.reshape(-1, hidden.shape[-1])
    return launch_decoded_quantize(_gelu_quantize_decoded_kernel, h, global_scale, fast_math, block_r, block_c,
                                   num_warps)


def gelu_decoded_launch(hidden: torch.Tensor, global_scale: torch.Tensor, out: torch.Tensor,
                        fast_math: bool) -> DecodedQuantizeLaunch | None:
    """The direct launch of a ``gelu_quantize_decoded_triton`` call (default tiles) made once with contiguous 2-D
    ``hidden`` whose result is ``out`` (for a launch plan), or None where it cannot be launched directly."""
    return decoded_quantize_launch(hidden, global_scale, out, fast_math, _gelu_quantize_decoded_kernel,
                                   GELU_DECODED_TILES)


@triton.jit
def _gelu_kernel(x_ptr, out_ptr, n_words, BLOCK: tl.constexpr, IS_BF16: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n_words
    tl.store(out_ptr + i, gelu_word(tl.load(x_ptr + i, mask=mask, other=0), IS_BF16), mask=mask)


def gelu_triton(x: torch.Tensor, block: int = 256) -> torch.Tensor:
    """The fused kernel's GELU alone, elementwise: ``x`` bf16/fp16, contiguous, ``numel % 4 == 0`` -> ``gelu(x,
    approximate="tanh")`` as the fused kernel computes it (for checking it against torch on every input value)."""
    if x.dtype not in (torch.bfloat16, torch.float16) or not x.is_contiguous() or x.numel() % 4:
        raise ValueError(f"gelu_triton: needs a contiguous bf16/fp16 tensor with numel % 4 == 0, got "
                         f"{tuple(x.shape)} {x.dtype}")
    words = x.reshape(-1).view(torch.int64)
    out = torch.empty_like(words)
    launch(_gelu_kernel, (triton.cdiv(words.numel(), block),), words, out, words.numel(), BLOCK=block,
           IS_BF16=x.dtype == torch.bfloat16, enable_fp_fusion=False, num_warps=4)
    return out.view(x.dtype).reshape(x.shape)
