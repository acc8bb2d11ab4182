"""Fused (residual +) LayerNorm + modulate + NVFP4 quantize (docs/design.md §6), one kernel for every LayerNorm site:
Qwen-Image's and FLUX.2's residual norm before the feed-forward, and their adaptive norm1 before the attention
(``adaln_quantize_triton``: the same kernel without the residual add).

Between the attention output and FC1 a ``QwenImageTransformerBlock`` runs, op by op in BF16 (FLUX.2's double-stream
block the same ops without the bias)::

    a = bf16(x + bias)                          # the biased attention output projection
    r = bf16(residual + bf16(gate * a))         # residual_out (kept by the block)
    n = F.layer_norm(r, (D,), eps=eps)          # torch's CUDA LayerNorm, no affine
    m = bf16(bf16(n * bf16(1 + scale)) + shift) # _modulate
    packed, scales = quantize(m, g)             # FC1's input quantization

Qwen-Image 2.1 modulates without a shift (``m = bf16(n * bf16(1 + scale))``) and feeds ``m`` to two projections
(``gate_layer`` and ``proj``); ``HAS_SHIFT=False`` leaves the add out rather than adding a zero (``-0 + +0`` is
``+0``, and E2M1 keeps the sign of zero).

``resnorm_quantize_triton`` does all of it in one pass and never writes ``m``. Byte identity with the eager ops
needs two things:

* every BF16 rounding happens exactly where torch rounds (explicit FP32 -> BF16 -> FP32, no FMA contraction:
  launched with ``enable_fp_fusion=False``). For BF16 operands FP32-then-BF16 equals the correctly rounded BF16
  result (the FP32 product is exact, and double rounding of a sum is innocuous since 24 >= 2*8 + 2), which is also
  why LLVM may, and does, turn these sequences into native ``add/mul.rn.bf16x2``: same bits, fewer instructions;
* the LayerNorm reproduces torch's ``vectorized_layer_norm_kernel`` (aten/src/ATen/native/cuda/layer_norm_kernel.cu)
  operation for operation: one block of 128 threads per row, thread ``t`` walks the 4-element vectors
  ``t, t+128, ...`` and runs Welford per element (``mean = fma(delta, 1/count, mean)``,
  ``m2 = fma(delta, v - mean, m2)``, ``1/count`` correctly rounded), then ``cuWelfordCombine`` over a shuffle-down
  tree (offsets 16, 8, 4, 2, 1 inside each warp, then warps 2,3 into 0,1 and 1 into 0), ``var = m2 / N`` (IEEE),
  ``rstd = rsqrt.approx.f32(var + eps)`` and ``y = bf16(rstd * (x - mean))``. The Triton tensors below are indexed
  so that element ``t`` of a ``[128]`` vector is what torch's thread ``t`` holds; which hardware thread computes it
  does not matter, only the order of the floating-point operations does.

Limits (checked by the wrappers): BF16 tensors, ``D`` a multiple of 512 (every one of torch's 128 threads then holds
the same number of elements, so all combine steps merge equal counts) and ``nA = nB = 0.5`` exactly at every combine
level (true for every such ``D`` below 20,992). With ``nA = nB = 0.5`` the two products of the combined mean are
exact, so whether nvcc contracted ``nA*mean_A + nB*mean_B`` into an FMA cannot change the result, except when a
partial mean is subnormal (rows of subnormal values). ``TORCH_MEAN_FMA`` selects the variant; the GPU test
``test_layer_norm_subnormal_means`` checks it against the installed torch and names the right one if it differs.

Interpreter (``TRITON_INTERPRET=1``, CPU smoke tests only): inline PTX cannot run, so ``approx_rsqrt=False`` computes
``rsqrt`` correctly rounded (in FP64) instead of with ``rsqrt.approx.f32``; the two differ in the last bit for some
inputs, so there the result can differ from torch's CUDA LayerNorm in rare elements (the CPU test compares against
an FP32 emulation of the CUDA algorithm with the same correctly rounded rsqrt). The interpreter's BF16 casts are
also wrong (FP32 -> BF16 truncates, BF16 subnormals -> FP32 are mangled), so ``SOFT_BF16`` does both conversions
in integer arithmetic there. GPU launches use ``rsqrt.approx.f32`` and the hardware conversions (the wrappers pick
both whenever the interpreter is off).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from .launch import INTERPRETING, launch, launch_options, padded_scale_shape
from .nvfp4_epilogue import (
    INLINE_PTX,
    block_scale_and_factor,
    e2m1_half_words,
    e2m1_words,
    e4m3_value,
    quantize_block_halves,
    swizzled_scale_offset,
)
from .quantize_nvfp4 import decoded_nibbles, fp16x4_word
from .rounding import fma_rn, narrow_bf16, rsqrt_like_torch, sum_of_products, widen_bf16

__all__ = ["adaln_quantize_triton", "resnorm_quantize_triton"]

THREADS = tl.constexpr(128)  # torch's LayerNorm block: 32 x 4 threads
VEC = tl.constexpr(4)  # torch's vec_size: each thread reads 4 consecutive elements at a time
CHUNK = tl.constexpr(512)  # one vector per thread: 512 consecutive elements of the row
_THREADS, _CHUNK = 128, 512  # the same, for host code
# How the combined mean is rounded (see _welford_combine); only subnormal means can tell the variants apart.
TORCH_MEAN_FMA = 1  # torch 2.11's (docs/design.md §6); test_layer_norm_subnormal_means checks the installed torch
# 40 registers fit 12 programs per SM on Hopper without spilling, the fastest cap measured (docs/history.md, "Kernel
# tuning constants").
MAX_REGISTERS = 40


# ---------------------------------------------------------------------------------------------------------------
# LayerNorm statistics, operation for operation as torch's vectorized_layer_norm_kernel.
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _widen_for_fp32(v, SOFT_BF16: tl.constexpr):
    """``widen_bf16`` for values that feed FP32 arithmetic: two values per 32-bit register, one shift or mask each (the
    default conversion extracts the upper half with a byte permute first). Where the result only feeds BF16 ops
    use ``widen_bf16``: the compiler turns those widen-op-round sequences into native BF16x2 instructions."""
    if SOFT_BF16:
        return widen_bf16(v, SOFT_BF16)
    else:
        return tl.inline_asm_elementwise(
            "{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xFFFF0000; }", "=r,=r,r", [v], dtype=tl.float32, is_pure=True,
            pack=2,
        )


@triton.jit
def _bf16(x, SOFT_BF16: tl.constexpr):
    """Round FP32 to BF16 and widen back: the rounding torch applies at each BF16 op's output."""
    return widen_bf16(narrow_bf16(x, SOFT_BF16), SOFT_BF16)


@triton.jit
def _welford_step(mean, m2, v, COUNT):
    """cuWelfordOnlineSum for the COUNT-th element of every thread; ``1/COUNT`` is a correctly rounded FP32 constant
    (the Python double 1/COUNT rounded to FP32: double rounding is innocuous for a quotient)."""
    delta = v - mean
    new_mean = fma_rn(delta, tl.math.div_rn(tl.full(v.shape, 1.0, tl.float32), tl.full(v.shape, COUNT, tl.float32)),
                      mean)
    new_m2 = fma_rn(delta, v - new_mean, m2)
    return new_mean, new_m2


@triton.jit
def _welford_vector(mean, m2, v, SEEN):
    """Feed one 4-element vector per thread: ``v`` is ``[128, 4]``, row ``t`` = thread t's vector, in element order.

    ``SEEN`` = elements each thread has already consumed. The splits only regroup registers (no arithmetic).
    """
    even, odd = tl.split(tl.reshape(v, [THREADS, 2, 2]))  # even: elements 0, 2; odd: elements 1, 3
    v0, v2 = tl.split(even)
    v1, v3 = tl.split(odd)
    mean, m2 = _welford_step(mean, m2, v0, SEEN + 1)
    mean, m2 = _welford_step(mean, m2, v1, SEEN + 2)
    mean, m2 = _welford_step(mean, m2, v2, SEEN + 3)
    mean, m2 = _welford_step(mean, m2, v3, SEEN + 4)
    return mean, m2


@triton.jit
def _welford_combine(own_m, own_s, other_m, other_s, COUNT: tl.constexpr, MEAN_FMA: tl.constexpr):
    """cuWelfordCombine(dataB=own, dataA=other) where both sides hold COUNT elements (FP32 counts, as in torch).

    ``mean = nA*mean_A + nB*mean_B``: MEAN_FMA selects how nvcc may have contracted it (0: no FMA,
    1: fma(nA, mean_A, nB*mean_B), 2: fma(nB, mean_B, nA*mean_A)). With nA = nB = 0.5 all three agree unless a mean
    is subnormal; the GPU test of subnormal rows tells which one torch's binary uses.
    """
    cnt = tl.full(own_m.shape, COUNT, tl.float32)
    coef = tl.math.div_rn(tl.full(own_m.shape, 1.0, tl.float32), cnt + cnt)  # 1.f / count: IEEE division
    n_other = cnt * coef
    n_own = cnt * coef
    delta = own_m - other_m
    mean = sum_of_products(n_other, other_m, n_own, own_m, MEAN_FMA)
    m2 = fma_rn((delta * delta) * cnt, n_own, other_s + own_s)  # nvcc contracts the last multiply-add
    return mean, m2


@triton.jit
def _shuffle_down_combine(m, s, lane, OFFSET: tl.constexpr, COUNT: tl.constexpr, MEAN_FMA: tl.constexpr):
    """One WARP_SHFL_DOWN level of torch's compute_stats on ``[4, 32]`` (warp, lane) states: every lane merges the
    state of lane + OFFSET, or its own where that is past lane 31 (the clamp of ``shfl.down``). A gather, not inline
    ``shfl.sync.down``: which hardware lane holds which element is the compiler's choice (it has differed between two
    kernels: docs/performance.md, "Measurements behind the kernels' design"), and the gather is correct for every
    layout."""
    src = tl.where(lane + OFFSET < 32, lane + OFFSET, lane)
    return _welford_combine(m, s, tl.gather(m, src, 1), tl.gather(s, src, 1), COUNT, MEAN_FMA)


@triton.jit
def _pack2(hi, lo):
    """Two FP32 tensors -> one int64 per position (bits only)."""
    return ((hi.to(tl.int32, bitcast=True).to(tl.int64) << 32)
            | (lo.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF))


@triton.jit
def _unpack2(p):
    return (p >> 32).to(tl.int32).to(tl.float32, bitcast=True), p.to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _row_mean_rstd(mean, m2, eps, D: tl.constexpr, APPROX_RSQRT: tl.constexpr, MEAN_FMA: tl.constexpr):
    """Per-thread Welford state ``[128]`` -> (mean, rstd) as ``[128, 1]`` FP32 (every entry equal), reduced in
    torch's order. The gathers only move values: position (w, l) computes what torch's thread 32*w + l computes."""
    PER_THREAD: tl.constexpr = D // THREADS
    m = tl.reshape(mean, [4, 32])  # thread t = (warp t // 32, lane t % 32)
    s = tl.reshape(m2, [4, 32])
    lane = tl.broadcast_to(tl.arange(0, 32)[None, :], [4, 32])
    # Intra-warp shuffle-down tree: offsets 16, 8, 4, 2, 1; lane l merges lane l + offset (itself when past 31).
    m, s = _shuffle_down_combine(m, s, lane, 16, PER_THREAD, MEAN_FMA)
    m, s = _shuffle_down_combine(m, s, lane, 8, PER_THREAD * 2, MEAN_FMA)
    m, s = _shuffle_down_combine(m, s, lane, 4, PER_THREAD * 4, MEAN_FMA)
    m, s = _shuffle_down_combine(m, s, lane, 2, PER_THREAD * 8, MEAN_FMA)
    m, s = _shuffle_down_combine(m, s, lane, 1, PER_THREAD * 16, MEAN_FMA)
    # Inter-warp (shared memory in torch): warps 0,1 merge warps 2,3, then warp 0 merges warp 1. Every thread runs
    # these two levels itself on copies of the four warp states (lane 0 of each warp holds its warp's), so the result
    # needs no broadcast: one cross-warp exchange (a shared-memory round trip; mean and m2 travel as one 64-bit word)
    # gives lane l the state of warp l % 4, and four in-warp gathers give every lane all four. Only data moves, so
    # -0.0 and every bit survive; the operations and their operand order are torch's.
    zeros = tl.zeros([4, 32], tl.int32)
    spread = tl.gather(tl.gather(_pack2(m, s), zeros, 1), lane % 4, 0)
    w0 = _unpack2(tl.gather(spread, zeros, 1))
    w1 = _unpack2(tl.gather(spread, zeros + 1, 1))
    w2 = _unpack2(tl.gather(spread, zeros + 2, 1))
    w3 = _unpack2(tl.gather(spread, zeros + 3, 1))
    m02, s02 = _welford_combine(w0[0], w0[1], w2[0], w2[1], PER_THREAD * 32, MEAN_FMA)
    m13, s13 = _welford_combine(w1[0], w1[1], w3[0], w3[1], PER_THREAD * 32, MEAN_FMA)
    m, s = _welford_combine(m02, s02, m13, s13, PER_THREAD * 64, MEAN_FMA)
    var = tl.math.div_rn(s, tl.full([4, 32], D, tl.float32))  # sigma2 / float(N): IEEE division
    rstd = rsqrt_like_torch(var + eps, APPROX_RSQRT)
    return tl.reshape(m, [THREADS, 1]), tl.reshape(rstd, [THREADS, 1])


@triton.jit
def _load_pass1(x_row, res_row, bias_ptr, gate_row, offs, start, HAS_BIAS: tl.constexpr):
    """x, residual, bias and gate of one pass-1 chunk (bias is a placeholder, x again, without HAS_BIAS)."""
    o = start + offs
    # x and residual are read once: evict-first keeps L1 for what every row reads again (docs/history.md).
    x = tl.load(x_row + o, eviction_policy="evict_first")
    bias = tl.load(bias_ptr + o) if HAS_BIAS else x
    return x, tl.load(res_row + o, eviction_policy="evict_first"), bias, tl.load(gate_row + o)


@triton.jit
def _load_pass2(out_row, scale_row, shift_row, offs2, start, HAS_SHIFT: tl.constexpr):
    """residual_out, scale and shift at ``start + offs2`` (pass 2); without HAS_SHIFT the shift is a placeholder (the
    scale again: a cache hit, never used)."""
    o = start + offs2
    sc = tl.load(scale_row + o)
    return tl.load(out_row + o), sc, tl.load(shift_row + o) if HAS_SHIFT else sc


@triton.jit
def _vector_offsets():
    """``[128, 4]`` element offsets of one 512-element chunk: row t = torch thread t's vector of 4."""
    return tl.arange(0, THREADS)[:, None] * VEC + tl.arange(0, VEC)[None, :]


@triton.jit
def _modulate(r, scale, shift, row_mean, rstd, SOFT_BF16: tl.constexpr, HAS_SHIFT: tl.constexpr):
    """residual_out -> the FC1 input ``m`` (widened to FP32, exact): normalize, ``* bf16(1 + scale)``, ``+ shift``
    (without HAS_SHIFT no add at all: ``m = bf16(n * bf16(1 + scale))``, Qwen-Image 2.1's ``x * (1 + scale)``; adding
    +0.0 instead would turn a -0 product into +0, which the quantizer encodes differently)."""
    n = _bf16(rstd * (_widen_for_fp32(r, SOFT_BF16) - row_mean), SOFT_BF16)
    scale1 = _bf16(1.0 + widen_bf16(scale, SOFT_BF16), SOFT_BF16)
    if HAS_SHIFT:
        m = narrow_bf16(_bf16(n * scale1, SOFT_BF16) + widen_bf16(shift, SOFT_BF16), SOFT_BF16)
    else:
        m = narrow_bf16(n * scale1, SOFT_BF16)
    return _widen_for_fp32(m, SOFT_BF16)


@triton.jit
def _split_block_step(out_row, scale_row, shift_row, row_mean, rstd, r64, col, g, packed_ptr, scales_ptr,
                      D: tl.constexpr, padded_cols, VEC2: tl.constexpr, SOFT_BF16: tl.constexpr,
                      FAST_MATH: tl.constexpr, HW_E2M1: tl.constexpr, DECODED: tl.constexpr, HAS_SHIFT: tl.constexpr):
    """Pass 2 for the ``128 * VEC2`` columns from ``col``, thread t taking ``VEC2`` consecutive ones, so 16 / VEC2
    threads share a 16-block: the block maximum crosses threads, and every holder of a block has its scale byte.
    With ``DECODED`` each thread stores its elements' exact FP16 values instead (``packed_ptr``: FP16 as int64).

    Storing a scale tensor in that replicated layout makes Triton exchange it through shared memory (barriers
    included); on the GPU each holder stores the byte itself with ``st.global.b8`` instead (the same byte, twice or
    four times: harmless). Inline PTX cannot run in the interpreter, which takes a plain store.
    """
    NB: tl.constexpr = THREADS * VEC2 // 16
    r, sc, sh = _load_pass2(out_row, scale_row, shift_row, tl.arange(0, THREADS)[:, None] * VEC2
                            + tl.arange(0, VEC2)[None, :], col, HAS_SHIFT)
    m = tl.reshape(_modulate(r, sc, sh, row_mean, rstd, SOFT_BF16, HAS_SHIFT), [NB, 16 // VEC2, VEC2])
    vec_max = tl.max(tl.max(tl.abs(m), axis=2), axis=1)  # maxNum: NaN lanes skipped
    sf_byte, factor = block_scale_and_factor(vec_max, g, FAST_MATH)
    x = m * factor[:, None, None]
    t = tl.reshape(tl.arange(0, THREADS), [NB, 16 // VEC2])  # the thread's share: VEC2 / 2 packed bytes
    if DECODED:  # the exact FP16 values, no scale bytes (the output is FP16 [M, D], passed viewed as int64)
        block_scale = e4m3_value(sf_byte)[:, None]
        if VEC2 == 8:  # the thread's eight values as one FP16 [8] store
            values16 = packed_ptr.to(tl.pointer_type(tl.float16)) + r64 * D + col + t * 8
            tl.store(values16[:, :, None] + tl.arange(0, 8), decoded_nibbles(e2m1_words(x, HW_E2M1), block_scale))
        else:
            codes = e2m1_half_words(x, HW_E2M1).to(tl.int64)
            tl.store(packed_ptr + r64 * (D // 4) + col // 4 + t, fp16x4_word(codes, block_scale))
    else:
        if VEC2 == 8:
            tl.store(packed_ptr + r64 * (D // 8) + col // 8 + t, e2m1_words(x, HW_E2M1))
        else:
            half_words = packed_ptr.to(tl.pointer_type(tl.int16)) + r64 * (D // 4) + col // 4 + t
            tl.store(half_words, e2m1_half_words(x, HW_E2M1).to(tl.int16))
        offs_sf = scales_ptr + swizzled_scale_offset(r64, col // 16 + tl.arange(0, NB), padded_cols)
        if INLINE_PTX:
            tl.inline_asm_elementwise(
                "{ st.global.b8 [$1], $2; mov.b32 $0, 0; }", "=r,l,r", [offs_sf, sf_byte], dtype=tl.int32,
                is_pure=False, pack=1,
            )
        else:
            tl.store(offs_sf, sf_byte.to(tl.uint8))


# ---------------------------------------------------------------------------------------------------------------
# Kernels.
# ---------------------------------------------------------------------------------------------------------------


# One binary for row counts divisible by 16 and not (Qwen-Image's image and text streams): the hint changes
# no code of this kernel (tests/test_specialization.py; docs/performance.md, "First image").
@triton.jit(do_not_specialize_on_alignment=["M", "L"])
def _resnorm_quantize_kernel(
    res_ptr, x_ptr, bias_ptr, gate_ptr, scale_ptr, shift_ptr, g_ptr, rout_ptr, packed_ptr, scales_ptr,
    M, L, eps,
    s_res_b, s_res_l, s_x_b, s_x_l, s_gate_b, s_gate_l, s_scale_b, s_scale_l, s_shift_b, s_shift_l,
    padded_cols,
    D: tl.constexpr, HAS_BIAS: tl.constexpr, APPROX_RSQRT: tl.constexpr, SOFT_BF16: tl.constexpr,
    MEAN_FMA: tl.constexpr, FAST_MATH: tl.constexpr, HW_E2M1: tl.constexpr, ONE_SAMPLE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, DECODED: tl.constexpr, HAS_SHIFT: tl.constexpr,
):
    # One program per row of the padded scale matrix: rows >= M only write their zero scale bytes. Without
    # HAS_RESIDUAL the LayerNorm reads x itself (no residual add, no residual_out); with DECODED the FC1 input is
    # stored as its exact FP16 values (packed_ptr: FP16 [M, D] as int64) and no scales are written (grid: M rows).
    row = tl.program_id(0)
    if row < M:
        offs = _vector_offsets()
        g = tl.load(g_ptr)
        if ONE_SAMPLE:  # the common case (CFG runs the two branches as separate calls): no division
            b = 0
            l_idx = row.to(tl.int64)
        else:
            b32 = row // L  # 32-bit division (a 64-bit one is a slow software routine); M < 2^31
            b = b32.to(tl.int64)
            l_idx = (row - b32 * L).to(tl.int64)
        res_row = res_ptr + b * s_res_b + l_idx * s_res_l
        x_row = x_ptr + b * s_x_b + l_idx * s_x_l
        gate_row = gate_ptr + b * s_gate_b + l_idx * s_gate_l
        scale_row = scale_ptr + b * s_scale_b + l_idx * s_scale_l
        shift_row = shift_ptr + b * s_shift_b + l_idx * s_shift_l
        r64 = row.to(tl.int64)
        out_row = rout_ptr + r64 * D

        # Pass 1: residual_out and the per-thread Welford state, chunk by chunk in torch's element order. A load that
        # follows a store to memory that may alias cannot be moved above it, so the loads run three chunks ahead in
        # program order (a rotation of registers; past the last chunk the last one is loaded again, a cache hit):
        # loading per chunk exposed one memory round trip per chunk.
        NCHUNK: tl.constexpr = D // CHUNK
        mean = tl.zeros([THREADS], tl.float32)
        m2 = tl.zeros([THREADS], tl.float32)
        if HAS_RESIDUAL:
            x0 = tl.load(x_row + min(0, NCHUNK - 1) * CHUNK + offs, eviction_policy="evict_first")
            res0 = tl.load(res_row + min(0, NCHUNK - 1) * CHUNK + offs, eviction_policy="evict_first")
            x1 = tl.load(x_row + min(1, NCHUNK - 1) * CHUNK + offs, eviction_policy="evict_first")
            res1 = tl.load(res_row + min(1, NCHUNK - 1) * CHUNK + offs, eviction_policy="evict_first")
            x2 = tl.load(x_row + min(2, NCHUNK - 1) * CHUNK + offs, eviction_policy="evict_first")
            res2 = tl.load(res_row + min(2, NCHUNK - 1) * CHUNK + offs, eviction_policy="evict_first")
            for j in tl.range(NCHUNK):
                o = j * CHUNK + offs
                gt0 = tl.load(gate_row + o)
                a = widen_bf16(x0, SOFT_BF16)
                if HAS_BIAS:
                    a = _bf16(a + widen_bf16(tl.load(bias_ptr + o), SOFT_BF16), SOFT_BF16)
                r = narrow_bf16(widen_bf16(res0, SOFT_BF16) + _bf16(widen_bf16(gt0, SOFT_BF16) * a, SOFT_BF16),
                                SOFT_BF16)
                x0, res0 = x1, res1
                x1, res1 = x2, res2
                ahead = tl.minimum(j + 3, NCHUNK - 1) * CHUNK + offs
                x2 = tl.load(x_row + ahead, eviction_policy="evict_first")
                res2 = tl.load(res_row + ahead, eviction_policy="evict_first")
                tl.store(out_row + o, r)
                mean, m2 = _welford_vector(mean, m2, _widen_for_fp32(r, SOFT_BF16), j * VEC)
            src_row = out_row
        else:  # nothing is stored in this pass, so the compiler may hoist the loads itself
            for j in tl.static_range(NCHUNK):
                v = tl.load(x_row + j * CHUNK + offs)
                mean, m2 = _welford_vector(mean, m2, _widen_for_fp32(v, SOFT_BF16), j * VEC)
            src_row = x_row
        row_mean, rstd = _row_mean_rstd(mean, m2, eps, D, APPROX_RSQRT, MEAN_FMA)

        # Pass 2 reads residual_out back (cache-resident, written by this program) instead of recomputing it, or x
        # again without HAS_RESIDUAL; the barrier makes every thread's pass-1 stores visible to the whole program.
        # Pass 2 is elementwise up to the quantizer, so it need not follow torch's thread order. While 128 whole
        # 16-blocks remain, each thread takes one (2048 elements per step): its maximum, scale byte and packed words
        # stay in the thread. The rest (1024 or 512 elements) is split: 8 or 4 consecutive elements per thread.
        tl.debug_barrier()
        NFULL: tl.constexpr = D // 2048
        REST: tl.constexpr = D - NFULL * 2048
        t = tl.arange(0, THREADS)
        half = t[:, None] * 16 + tl.arange(0, 8)[None, :]  # [128, 8]: first half of thread t's block
        for j in tl.range(NFULL):
            col = j * 2048
            r_a, sc_a, sh_a = _load_pass2(src_row, scale_row, shift_row, half, col, HAS_SHIFT)
            r_b, sc_b, sh_b = _load_pass2(src_row, scale_row, shift_row, half, col + 8, HAS_SHIFT)
            m_a = _modulate(r_a, sc_a, sh_a, row_mean, rstd, SOFT_BF16, HAS_SHIFT)
            m_b = _modulate(r_b, sc_b, sh_b, row_mean, rstd, SOFT_BF16, HAS_SHIFT)
            words, sf_byte = quantize_block_halves(m_a, m_b, g, FAST_MATH, HW_E2M1)
            kb = col // 16 + t
            if DECODED:  # the block's 16 FP16 values, eight per packed word, stored as two FP16 [8] rows
                lo, hi = tl.split(words)
                block_scale = e4m3_value(sf_byte)
                values16 = packed_ptr.to(tl.pointer_type(tl.float16)) + r64 * D + kb[:, None] * 16 + tl.arange(0, 8)
                tl.store(values16, decoded_nibbles(lo, block_scale))
                tl.store(values16 + 8, decoded_nibbles(hi, block_scale))
            else:
                tl.store(packed_ptr + r64 * (D // 8) + kb[:, None] * 2 + tl.arange(0, 2)[None, :], words)
                tl.store(scales_ptr + swizzled_scale_offset(r64, kb, padded_cols), sf_byte.to(tl.uint8))
        if REST >= 1024:
            _split_block_step(src_row, scale_row, shift_row, row_mean, rstd, r64, NFULL * 2048, g, packed_ptr,
                              scales_ptr, D, padded_cols, 8, SOFT_BF16, FAST_MATH, HW_E2M1, DECODED, HAS_SHIFT)
        if REST % 1024 == 512:
            _split_block_step(src_row, scale_row, shift_row, row_mean, rstd, r64, D - 512, g, packed_ptr,
                              scales_ptr, D, padded_cols, 4, SOFT_BF16, FAST_MATH, HW_E2M1, DECODED, HAS_SHIFT)
    elif not DECODED:
        # Padding row of the 128x4 scale layout: its scale bytes are 0 (D % 512 == 0, so D/16 == padded_cols and
        # every k-block is covered by the chunks).
        # One store for the whole row (each store costs the compile's coalescing pass a walk of the whole kernel).
        kblocks = tl.arange(0, triton.next_power_of_2(D // CHUNK))[:, None] * (CHUNK // 16) + tl.arange(0, CHUNK // 16)
        offs_sf = swizzled_scale_offset(row.to(tl.int64), kblocks, padded_cols)
        tl.store(scales_ptr + offs_sf, tl.zeros(kblocks.shape, tl.uint8), mask=kblocks < D // 16)


@triton.jit
def _layer_norm_kernel(
    x_ptr, y_ptr, mean_ptr, rstd_ptr, stride_x, eps,
    D: tl.constexpr, WRITE_STATS: tl.constexpr, APPROX_RSQRT: tl.constexpr, SOFT_BF16: tl.constexpr,
    MEAN_FMA: tl.constexpr,
):
    """LayerNorm alone (no affine): the statistics path of the fused kernel, for testing it against F.layer_norm.
    With WRITE_STATS it also stores the FP32 mean and rstd (what torch.native_layer_norm returns)."""
    row = tl.program_id(0).to(tl.int64)
    offs = _vector_offsets()
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * D
    mean = tl.zeros([THREADS], tl.float32)
    m2 = tl.zeros([THREADS], tl.float32)
    for j in tl.static_range(D // CHUNK):
        v = widen_bf16(tl.load(x_row + j * CHUNK + offs), SOFT_BF16)
        mean, m2 = _welford_vector(mean, m2, v, j * VEC)
    row_mean, rstd = _row_mean_rstd(mean, m2, eps, D, APPROX_RSQRT, MEAN_FMA)
    if WRITE_STATS:  # row_mean/rstd are [128, 1] copies of one value: the first one stores it
        first = tl.arange(0, THREADS)[:, None] == 0
        tl.store(mean_ptr + row + tl.zeros([THREADS, 1], tl.int64), row_mean, mask=first)
        tl.store(rstd_ptr + row + tl.zeros([THREADS, 1], tl.int64), rstd, mask=first)
    for j in tl.static_range(D // CHUNK):
        o = j * CHUNK + offs
        v = widen_bf16(tl.load(x_row + o), SOFT_BF16)
        tl.store(y_row + o, narrow_bf16(rstd * (v - row_mean), SOFT_BF16))


# ---------------------------------------------------------------------------------------------------------------
# Wrappers.
# ---------------------------------------------------------------------------------------------------------------


@functools.cache
def unsupported_hidden_size(d: int) -> str | None:
    """None when the kernel reproduces torch's LayerNorm for rows of ``d`` elements, else the reason it cannot."""
    if d <= 0 or d % _CHUNK:
        return f"hidden size {d} is not a positive multiple of {_CHUNK} (torch's 128 threads x 4-element vectors)"
    count = np.float32(d // _THREADS)
    for _ in range(7):  # 5 shuffle levels + 2 inter-warp levels, each merging two equal counts
        half = count * (np.float32(1.0) / (count + count))
        if half != np.float32(0.5):
            return (f"hidden size {d}: torch's combine weight is {half!r}, not 0.5 "
                    "(FMA contraction of the mean unverified)")
        count = count + count
    return None


def _check_hidden_size(d: int) -> None:
    reason = unsupported_hidden_size(d)
    if reason is not None:
        raise ValueError(reason)


def _row_strides(t: torch.Tensor, name: str, b: int, l_len: int, d: int) -> tuple[int, int]:
    """(stride_b, stride_l) of a per-sample ``[B, D]`` / ``[B, 1, D]`` or per-token ``[B, L, D]`` parameter."""
    if t.dtype != torch.bfloat16:
        raise TypeError(f"{name} must be bfloat16, got {t.dtype}")
    if t.shape[-1] != d or t.stride(-1) != 1:
        raise ValueError(f"{name}: last dim must be {d} and contiguous, got shape {tuple(t.shape)} "
                         f"strides {t.stride()}")
    if t.dim() == 2 and t.shape[0] == b:
        return t.stride(0), 0
    if t.dim() == 3 and t.shape[0] == b and t.shape[1] in (1, l_len):
        return t.stride(0), (t.stride(1) if t.shape[1] == l_len and l_len > 1 else 0)
    raise ValueError(f"{name} must be [B, D], [B, 1, D] or [B, L, D] with B={b}, L={l_len}, D={d}; "
                     f"got {tuple(t.shape)}")


def resnorm_quantize_triton(
    residual: torch.Tensor,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    gate: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor | None,
    global_scale: torch.Tensor,
    *,
    eps: float,
    fast_math: bool = True,
    approx_rsqrt: bool | None = None,
    decoded: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Fused ``residual + gate * (x + bias) -> LayerNorm -> * (1 + scale) + shift -> NVFP4`` (``+ shift`` only where
    ``shift`` is given: Qwen-Image 2.1 modulates with ``x * (1 + scale)`` alone).

    Args:
        residual, x: ``[B, L, D]`` bfloat16; the last dim contiguous, the B and L dims may be strided.
        bias: ``[D]`` bfloat16 contiguous, or None when ``x`` already includes the bias.
        gate, scale, shift: bfloat16, per sample ``[B, D]`` (or ``[B, 1, D]``) or per token ``[B, L, D]``; any strides
            in the leading dims (chunks of ``mod_params`` are fine), last dim contiguous. ``shift`` None: no add.
        global_scale: FP32 1-element tensor ``g`` (FC1's ``1 / input_scale``) on the same device.
        eps: the LayerNorm's eps (used as FP32, like torch).
        fast_math: the NVFP4 quantize recipe (docs/design.md §3).
        approx_rsqrt: None = ``rsqrt.approx.f32`` unless running under ``TRITON_INTERPRET=1`` (see module docstring).
        decoded: return the quantized FC1 input as its exact FP16 values ``[B*L, D]`` (what the large-M GEMM
            multiplies) instead of packed bytes and scales.

    Returns:
        residual_out ``[B, L, D]`` bfloat16 contiguous, then packed uint8 ``[B*L, D/2]`` and 128x4 scales uint8
        ``[round_up(B*L, 128), round_up(D/16, 4)]`` (padding written as 0), or with ``decoded`` the FP16 values.
    """
    if residual.dim() != 3 or x.shape != residual.shape:
        raise ValueError(f"residual and x must both be [B, L, D], got {tuple(residual.shape)} and {tuple(x.shape)}")
    if residual.dtype != torch.bfloat16 or residual.stride(-1) != 1:
        raise TypeError(f"residual must be bfloat16 with a contiguous last dim, got {residual.dtype} "
                        f"strides {residual.stride()}")
    d = residual.shape[-1]
    if bias is not None and (bias.dtype != torch.bfloat16 or tuple(bias.shape) != (d,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous bfloat16 [{d}] tensor, got {tuple(bias.shape)} {bias.dtype}")
    out = torch.empty(residual.shape, dtype=torch.bfloat16, device=residual.device)
    return (out, *_launch(x, (residual, bias, gate, out), scale, shift, global_scale, eps, fast_math, approx_rsqrt,
                          decoded))


def adaln_quantize_triton(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor | None,
    global_scale: torch.Tensor,
    *,
    eps: float,
    fast_math: bool = True,
    approx_rsqrt: bool | None = None,
    decoded: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Fused ``LayerNorm(x) -> * (1 + scale) + shift -> NVFP4`` (adaptive LayerNorm before a projection): the kernel
    of ``resnorm_quantize_triton`` without the residual add. Arguments as there (``x`` is the LayerNorm's
    input; ``shift`` None: ``LayerNorm(x) * (1 + scale)``). Returns packed uint8 ``[B*L, D/2]`` and 128x4 scales,
    or with ``decoded`` the FP16 values ``[B*L, D]``.
    """
    return _launch(x, None, scale, shift, global_scale, eps, fast_math, approx_rsqrt, decoded)


def _launch(x, residual_args, scale, shift, global_scale, eps, fast_math, approx_rsqrt, decoded):
    """Check the common arguments, allocate the FC1 input and launch the kernel; ``residual_args`` is
    ``(residual, bias, gate, residual_out)`` or None (no residual add)."""
    if x.dim() != 3 or x.dtype != torch.bfloat16 or x.stride(-1) != 1:
        raise TypeError(f"x must be a bfloat16 [B, L, D] tensor with a contiguous last dim, got {tuple(x.shape)} "
                        f"{x.dtype} strides {x.stride()}")
    b, l_len, d = x.shape
    _check_hidden_size(d)
    if global_scale.numel() != 1 or global_scale.dtype != torch.float32:
        raise ValueError(f"global_scale must be a 1-element float32 tensor, got {tuple(global_scale.shape)} "
                         f"{global_scale.dtype}")
    residual, bias, gate, out = residual_args if residual_args is not None else (x, None, scale, x)
    has_shift = shift is not None
    shift = shift if has_shift else scale  # a placeholder the kernel never reads
    params = ((gate, "gate"), (scale, "scale"), (shift, "shift"))
    strides = [s for p, name in params for s in _row_strides(p, name, b, l_len, d)]
    m = b * l_len
    if decoded:
        x16 = torch.empty((m, d), dtype=torch.float16, device=x.device)
        outputs, packed, scales, rows = (x16,), x16.view(torch.int64), x16, m
    else:
        packed_bytes = torch.empty((m, d // 2), dtype=torch.uint8, device=x.device)
        scales = torch.empty(padded_scale_shape(m, d), dtype=torch.uint8, device=x.device)
        outputs, packed, rows = (packed_bytes, scales), packed_bytes.view(torch.int32), scales.shape[0]
    if m == 0:
        return outputs
    if approx_rsqrt is None:
        approx_rsqrt = not INTERPRETING
    launch(
        _resnorm_quantize_kernel, (rows,),
        residual, x, x if bias is None else bias, gate, scale, shift, global_scale, out, packed, scales,
        m, l_len, float(eps),
        residual.stride(0), residual.stride(1), x.stride(0), x.stride(1), *strides,
        scales.shape[1] if not decoded else 0,
        D=d, HAS_BIAS=bias is not None, APPROX_RSQRT=bool(approx_rsqrt), SOFT_BF16=INTERPRETING,
        MEAN_FMA=TORCH_MEAN_FMA, ONE_SAMPLE=b == 1, HAS_RESIDUAL=residual_args is not None, DECODED=decoded,
        HAS_SHIFT=has_shift,
        maxnreg=MAX_REGISTERS, **launch_options(x.device, fast_math),
    )
    return outputs


def layer_norm_torch_exact(
    x: torch.Tensor, eps: float, *, approx_rsqrt: bool | None = None, return_stats: bool = False,
    mean_fma: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``F.layer_norm(x, (D,), eps=eps)`` without affine, as torch's CUDA kernel computes it (the fused kernel's
    statistics path alone). x: ``[..., D]`` bfloat16, last dim contiguous, D as for ``resnorm_quantize_triton``.

    Returns bfloat16 of x's shape (contiguous); with ``return_stats`` also the FP32 per-row mean and rstd ``[rows]``,
    comparable bit for bit with ``torch.native_layer_norm(x, (D,), None, None, eps)[1:]``. ``mean_fma`` overrides
    the contraction variant of the combined mean (diagnosis only; see ``_welford_combine``).
    """
    if x.dtype != torch.bfloat16:
        raise TypeError(f"layer_norm_torch_exact takes bfloat16, got {x.dtype}")
    d = x.shape[-1]
    _check_hidden_size(d)
    rows = x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty(rows.shape, dtype=torch.bfloat16, device=x.device)
    mean = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    rstd = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        if approx_rsqrt is None:
            approx_rsqrt = not INTERPRETING
        launch(
            _layer_norm_kernel, (rows.shape[0],), rows, y, mean, rstd, rows.stride(0), float(eps),
            D=d, WRITE_STATS=return_stats, APPROX_RSQRT=bool(approx_rsqrt), SOFT_BF16=INTERPRETING,
            MEAN_FMA=TORCH_MEAN_FMA if mean_fma is None else int(mean_fma), enable_fp_fusion=False, num_warps=4,
        )
    y = y.reshape(x.shape)
    return (y, mean, rstd) if return_stats else y
