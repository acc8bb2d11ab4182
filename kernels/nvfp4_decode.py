"""Decoding NVFP4 operands in Triton, and the epilogue, shared by the tensor-core GEMM (``nvfp4_gemm``) and the one-row
product (``nvfp4_gemv``). The decode arithmetic and why it is exact: ``nvfp4_gemm``'s module docstring and
docs/design.md §7."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .launch import INTERPRETING, cdiv, launch
from .rounding import SOFT_CONVERT, narrow_bf16, widen_bf16

__all__ = ["decode_tile", "e4m3_to_f16_x128", "linear_epilogue", "load_decode", "scale_bytes", "scale_words",
           "split_reduce", "split_reduce_kernel", "swizzled_word_row", "to_out", "use_asm_split", "widen"]


# The package declares it in diffusers_nvfp4_fast/switches.py (TRITON_NO_ASM); tests/test_switches.py ties the two.
NO_ASM_VAR = "DIFFUSERS_NVFP4_TRITON_NO_ASM"


def use_asm_split(t: torch.Tensor) -> bool:
    """Whether to use the one-instruction PTX register split (CUDA only; the interpreter runs the shift version).

    DIFFUSERS_NVFP4_TRITON_NO_ASM=1 forces the pure-Triton version on the GPU too (same values, slower).
    """
    return t.is_cuda and not INTERPRETING and os.environ.get(NO_ASM_VAR, "") in ("", "0")


def scale_words(scales: torch.Tensor) -> torch.Tensor:
    """uint8 128x4 scales -> the same bytes viewed as int32 words (copied only if the storage is misaligned)."""
    s = scales if scales.dtype == torch.uint8 else scales.view(torch.uint8)
    if s.data_ptr() % 4:
        s = s.clone()
    return s.view(torch.int32)


@triton.jit
def scale_bytes(words, ROWS: tl.constexpr, NB: tl.constexpr):
    """int32 words ``[ROWS, NB/4]`` (4 consecutive scale columns each, little endian) -> int32 bytes ``[ROWS, NB]``."""
    shifts = tl.arange(0, 4) * 8
    return tl.reshape((words[:, :, None] >> shifts[None, None, :]) & 0xFF, (ROWS, NB))


@triton.jit
def e4m3_to_f16_x128(b):
    """E4M3 bytes (int32, any shape) -> FP16 ``scale * 2^7`` (exact: in [2^-2, 57344]; NaN bytes -> NaN)."""
    bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)  # FP16 bits of scale * 2^-8 (E4M3 bias 7 -> FP16 bias 15)
    s = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 32768.0
    return tl.where((b & 0x7F) == 0x7F, float("nan"), s).to(tl.float16)


@triton.jit
def decode_tile(packed, s16, ROWS: tl.constexpr, NB: tl.constexpr, USE_ASM: tl.constexpr):
    """packed uint8 ``[ROWS, NB*8]`` + FP16 ``scale * 2^7`` ``[ROWS, NB]`` -> FP16 ``[ROWS, NB*16]`` = value*scale*2^-7.

    Element 2j of a row is the low nibble of byte j and 2j+1 the high nibble; ``join(lo, hi)`` + reshape puts them
    side by side, which is also how a 16-bit MMA operand holds K pairs in one register.
    """
    b = tl.reshape(packed, (ROWS, NB, 8)).to(tl.int32)
    # r = FP16 bits of (low nibble) | (high nibble) << 16, each value * 2^-14 (see the module docstring).
    r = ((b * 0x00200200) & 0x0E000E00) | ((b * 0x01001000) & -0x7FFF8000)  # -0x7FFF8000 == 0x80008000 (int32)
    if USE_ASM:
        # Reinterpret the word as its two FP16 halves; written with shifts, the compiler splits the word and
        # re-packs the pair with extra PRMTs (docs/performance.md, "Measurements behind the kernels' design").
        lo, hi = tl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [r], dtype=(tl.float16, tl.float16),
                                           is_pure=True, pack=1)
    else:
        lo = r.to(tl.int16).to(tl.float16, bitcast=True)
        hi = (r >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    # Multiply after the join so that one FP16x2 multiply scales the (2j, 2j+1) pair of a byte.
    v = tl.join(lo, hi) * s16[:, :, None, None]  # [ROWS, NB, 8, 2]
    return tl.reshape(v, (ROWS, NB * 16))


@triton.jit
def swizzled_word_row(rows, Cp):
    """Row part of the int32-word offset into a 128x4 scale matrix with Cp columns.

    Byte (r, kb) lives at (r//128)*(Cp*128) + (kb//4)*512 + (r%32)*16 + ((r%128)//32)*4 + kb%4, so the four
    columns kb = 4q..4q+3 of a row form one aligned int32 word at (r//128)*(Cp*32) + q*128 + (r%32)*4 + (r%128)//32.
    Loading words rather than bytes lets the pipeliner prefetch scales with async copies.
    """
    r = rows.to(tl.int64)
    return (r // 128) * (Cp * 32) + (r % 32) * 4 + (r % 128) // 32


@triton.jit
def load_decode(p_ptrs, s_ptrs, k0, K, Cp, ROWS: tl.constexpr, NB: tl.constexpr, EVEN_K: tl.constexpr,
                 USE_ASM: tl.constexpr):
    """Load one K step of a packed operand and decode it -> FP16 ``[ROWS, NB*16]`` = value * scale * 2^-7.

    p_ptrs: uint8 pointers ``[ROWS, NB*8]`` (rows already clamped into the matrix); s_ptrs: int32 word pointers
    ``[ROWS, NB/4]`` into the 128x4 scales. K past the data reads as zero bytes with scale 0 (exact zeros), so the
    padding columns of the scale matrix never reach the result.
    """
    if EVEN_K:
        q = tl.load(p_ptrs)
        sb = scale_bytes(tl.load(s_ptrs), ROWS, NB)
    else:
        kbyte = k0 // 2 + tl.arange(0, NB * 8)
        q = tl.load(p_ptrs, mask=(kbyte < K // 2)[None, :], other=0)
        wq = k0 // 64 + tl.arange(0, NB // 4)
        words = tl.load(s_ptrs, mask=(wq < Cp // 4)[None, :], other=0)
        kb = k0 // 16 + tl.arange(0, NB)
        sb = tl.where((kb < K // 16)[None, :], scale_bytes(words, ROWS, NB), 0)
    return decode_tile(q, e4m3_to_f16_x128(sb), ROWS, NB, USE_ASM)


@triton.jit
def to_out(v, OUT_TY: tl.constexpr):
    """FP32 -> the output dtype, round to nearest even (the interpreter's BF16 cast truncates: rounding.py)."""
    if OUT_TY == tl.bfloat16:
        return narrow_bf16(v, SOFT_CONVERT)
    else:
        return v.to(OUT_TY)


@triton.jit
def widen(v):
    """The output dtype -> FP32 (exact)."""
    if v.dtype == tl.bfloat16:
        return widen_bf16(v, SOFT_CONVERT)
    else:
        return v.to(tl.float32)


@triton.jit
def linear_epilogue(sums, alpha_ptr, bias_ptr, offs_n, N, OUT_TY: tl.constexpr, HAS_BIAS: tl.constexpr):
    """FP32 sums ``[.., BN]`` (columns ``offs_n``) -> ``OUT_TY(sums * alpha)``, then, with a bias, torch's eager
    ``out + bias``: the FP32 sum of the two rounded values, rounded once more (docs/design.md §7)."""
    out = to_out(sums * tl.load(alpha_ptr), OUT_TY)
    if HAS_BIAS:
        b = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
        out = to_out(widen(out) + widen(b)[None, :], OUT_TY)
    return out


@triton.jit
def split_reduce_kernel(part_ptr, alpha_ptr, bias_ptr, out_ptr, M, N, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                         HAS_BIAS: tl.constexpr):
    """out = out_dtype((part[0] + part[1] + ... + part[SPLITS-1]) * alpha) (+ bias), summed in split order."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0)
    out = linear_epilogue(acc[None, :], alpha_ptr, bias_ptr, offs % N, N, out_ptr.dtype.element_ty, HAS_BIAS)
    tl.store(out_ptr + offs[None, :], out, mask=mask[None, :])


def split_reduce(part: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor, out: torch.Tensor, m: int, n: int,
                 splits: int, has_bias: bool) -> None:
    """``out`` (``[m, n]``, contiguous) = ``split_reduce_kernel`` of the FP32 partial sums ``part``
    (``[splits, m, n]``); ``bias`` is read only with ``has_bias``. Compiled without FMA contraction: with FP32
    output and a bias, ``sum * alpha + bias`` would otherwise round once instead of twice."""
    block = 1024
    launch(split_reduce_kernel, (cdiv(m * n, block),), part, alpha, bias, out, m, n, SPLITS=splits, BLOCK=block,
           HAS_BIAS=has_bias, num_warps=4, enable_fp_fusion=False)
