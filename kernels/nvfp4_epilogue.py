"""The NVFP4 quantize epilogue shared by every kernel that emits NVFP4 activations.

A kernel calls the entry point that matches how a 16-block sits in its threads: ``quantize_blocks`` (one thread
loaded the whole block as four int64 words), ``quantize_block_halves`` (one thread computed the whole block in
registers) or ``quantize_pairs`` (the block is split across threads, so its maximum is a cross-thread reduction).
Each computes block maxima, E4M3 block scales and E2M1 codes exactly as DESIGN.md section 3 (and
``diffusers_nvfp4_fast.format``) define them; the kernel stores the packed bytes and the 128x4-swizzled scales
(``swizzled_scale_offset``, ``store_blocks``).

Everything that rounds is done in integer arithmetic or with correctly rounded FP32 operations, so the result
does not depend on the GPU's FP8 conversion and the Triton interpreter reproduces it on CPU (precise mode).
Fast-math mode uses ``rcp.approx.ftz.f32`` (inline PTX), exactly the instruction the spec names. On SM100+
``HW_E2M1`` selects ``cvt.rn.satfinite.e2m1x2.f32``; below SM100 the same rounding runs in software.

Special values: NaN is skipped by the block maximum and a NaN product encodes as 0x7; see ``format.py``.
"""

import triton
import triton.language as tl

E4M3_MAX = tl.constexpr(448.0)
MIN_E4M3_NORMAL = tl.constexpr(0.015625)  # 2^-6
TWO_POW_23 = tl.constexpr(8388608.0)


@triton.jit
def rcp_approx_ftz(x):
    return tl.inline_asm_elementwise(
        "rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def rcp_rn(x):
    return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), x)


@triton.jit
def e4m3_round(s):
    """Non-negative FP32 (already <= 448) -> E4M3 byte as int32, round to nearest even."""
    bits = s.to(tl.int32, bitcast=True)
    # Normal range: round the 23-bit mantissa to 3 bits (ties to even); a carry bumps the exponent as it should.
    rounded = bits + 0x7FFFF + ((bits >> 20) & 1)
    normal = (rounded >> 20) - (120 << 3)
    # Subnormal range: the byte is s / 2^-9 rounded to an integer; adding 2^23 rounds an FP32 to an integer (RNE).
    sub = ((s * 512.0 + TWO_POW_23) - TWO_POW_23).to(tl.int32)
    return tl.where(s >= MIN_E4M3_NORMAL, normal, sub)


@triton.jit
def e4m3_value(byte):
    """E4M3 byte (int32, 0..126) -> FP32 value."""
    e = byte >> 3
    m = byte & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    return tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)


@triton.jit
def e2m1_code(v):
    """FP32 -> E2M1 code (int32 0..15): nearest, ties to the even code, saturating; sign bit kept; NaN -> 7.

    The E2M1 grid has spacing 0.5 below 2, 1 in [2, 4) and 2 in [4, 6]. Adding ``c = 1.5 * 2^(22 + e)``, whose ulp is
    that spacing (``e`` = 0, 1, 2 for the three ranges), rounds to the grid in one correctly rounded FP32 add with
    ties to even, and ``bits(|t| + c) - bits(c)`` counts grid steps; the range's first code (0, 2, 4) is added back.
    ``c`` is built from the exponent field of ``max(|t|, 1)``, so no compare or float-to-int conversion is needed.
    """
    # minNum (PTX min.f32, np.fmin in the interpreter): a NaN becomes 6.0, i.e. code 7 with the sign bit clear.
    t = tl.maximum(tl.minimum(v, 6.0), -6.0)
    tb = t.to(tl.int32, bitcast=True)
    exp_field = tl.maximum(tb & 0x7F800000, 0x3F800000)  # 2^0, 2^1 or 2^2 as FP32 bits (the sign is masked off)
    c_bits = exp_field + (0x4AC00000 - 0x3F800000)  # 1.5 * 2^22 scaled by the same power of two
    steps = (tl.abs(t) + c_bits.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True) - c_bits
    first_code = (exp_field >> 22) - 254  # 0, 2, 4
    return (steps + first_code) | ((tb >> 28) & 8)


@triton.jit
def e2m1x2_hw(hi, lo):
    """SM100+: two FP32 -> one byte (hi nibble from ``hi``), with the hardware conversion; NaN forced to 7."""
    byte = tl.inline_asm_elementwise(
        "{ .reg .b8 t; cvt.rn.satfinite.e2m1x2.f32 t, $1, $2; cvt.u32.u8 $0, t; }",
        "=r,r,r", [hi, lo], dtype=tl.int32, is_pure=True, pack=1,
    )
    byte = tl.where(lo != lo, (byte & 0xF0) | 7, byte)
    return tl.where(hi != hi, (byte & 0x0F) | 0x70, byte)


@triton.jit
def block_scale_and_factor(vec_max, g, FAST_MATH: tl.constexpr):
    """Block maxima and global scale (FP32) -> (E4M3 scale byte int32, FP32 factor applied before E2M1)."""
    if FAST_MATH:
        sf = g * (vec_max * rcp_approx_ftz(tl.full(vec_max.shape, 6.0, tl.float32)))
        sf_byte = e4m3_round(tl.minimum(sf, E4M3_MAX))
        factor = rcp_approx_ftz(e4m3_value(sf_byte) * rcp_approx_ftz(g))
    else:
        sf = vec_max * (g * (1.0 / 6.0))
        sf_byte = e4m3_round(tl.minimum(sf, E4M3_MAX))
        factor = tl.minimum(rcp_rn(e4m3_value(sf_byte) * rcp_rn(g)), 3.4028234663852886e38)
    return sf_byte, tl.where(vec_max != 0.0, factor, 0.0)


@triton.jit
def swizzled_scale_offset(rows, kblocks, padded_cols):
    """Flat offset of scale (row, k-block) in the 128x4 layout of a matrix with ``padded_cols`` scale columns."""
    return (
        (rows // 128) * (padded_cols * 128) + (kblocks // 4) * 512 + (rows % 32) * 16 + ((rows % 128) // 32) * 4
        + kblocks % 4
    )


@triton.jit
def quantize_pairs(lo, hi, g, FAST_MATH: tl.constexpr, HW_E2M1: tl.constexpr):
    """FP32 ``lo``/``hi`` ``[R, C, 8]`` (elements 2j and 2j+1 of C 16-blocks per row) -> (bytes int32 ``[R, C, 8]``,
    E4M3 scale bytes int32 ``[R, C]``). Working on element pairs keeps the packed byte of a pair local; the block
    maximum reduces the last axis, across threads where the kernel's layout splits a block."""
    a = tl.maximum(tl.abs(lo), tl.abs(hi))  # maxNum: skips a NaN partner
    vec_max = tl.max(tl.where(a != a, 0.0, a), axis=2)
    sf_byte, factor = block_scale_and_factor(vec_max, g, FAST_MATH)
    return _pair_byte(lo, hi, factor[:, :, None], HW_E2M1), sf_byte


# ---------------------------------------------------------------------------------------------------------------
# Whole-block paths: one thread owns whole 16-blocks (loaded as int64 words, or computed in registers), so the block
# maximum, the scale and the packing need no cross-thread reductions or layout conversions.
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _unpack4(q, IS_BF16: tl.constexpr):
    """int64 holding four consecutive 16-bit values (first in the lowest bits) -> four FP32 values."""
    lo = q.to(tl.int32)
    hi = (q >> 32).to(tl.int32)
    if IS_BF16:
        return ((lo << 16).to(tl.float32, bitcast=True), (lo & -65536).to(tl.float32, bitcast=True),
                (hi << 16).to(tl.float32, bitcast=True), (hi & -65536).to(tl.float32, bitcast=True))
    else:
        return ((lo & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32),
                (lo >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32),
                (hi & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32),
                (hi >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32))


@triton.jit
def _max4(a, b, c, d):
    # tl.maximum is maxNum (PTX max.f32, np.fmax in the interpreter): NaN lanes are skipped, as the spec's block
    # maximum requires; a block of only NaNs gives NaN, which the caller maps to 0.
    return tl.maximum(tl.maximum(tl.abs(a), tl.abs(b)), tl.maximum(tl.abs(c), tl.abs(d)))


@triton.jit
def _pair_byte(lo, hi, f, HW_E2M1: tl.constexpr):
    if HW_E2M1:
        return e2m1x2_hw(hi * f, lo * f)
    else:
        return e2m1_code(lo * f) | (e2m1_code(hi * f) << 4)


@triton.jit
def _quarter_word(a, b, c, d, f, HW_E2M1: tl.constexpr):
    """Four values -> 16 bits: two packed bytes, element order kept (low nibble = earlier element)."""
    return _pair_byte(a, b, f, HW_E2M1) | (_pair_byte(c, d, f, HW_E2M1) << 8)


@triton.jit
def quantize_blocks(q0, q1, q2, q3, g, IS_BF16: tl.constexpr, FAST_MATH: tl.constexpr, HW_E2M1: tl.constexpr):
    """Four int64 tensors ``[R, C]`` (elements 4i..4i+3 of each 16-block in ``q_i``) -> (packed int64 ``[R, C]``:
    the block's 8 packed bytes, little-endian; E4M3 scale byte int32 ``[R, C]``)."""
    e0, e1, e2, e3 = _unpack4(q0, IS_BF16)
    e4, e5, e6, e7 = _unpack4(q1, IS_BF16)
    e8, e9, e10, e11 = _unpack4(q2, IS_BF16)
    e12, e13, e14, e15 = _unpack4(q3, IS_BF16)
    vec_max = tl.maximum(tl.maximum(_max4(e0, e1, e2, e3), _max4(e4, e5, e6, e7)),
                         tl.maximum(_max4(e8, e9, e10, e11), _max4(e12, e13, e14, e15)))
    vec_max = tl.where(vec_max == vec_max, vec_max, 0.0)
    sf_byte, f = block_scale_and_factor(vec_max, g, FAST_MATH)
    w0 = _quarter_word(e0, e1, e2, e3, f, HW_E2M1) | (_quarter_word(e4, e5, e6, e7, f, HW_E2M1) << 16)
    w1 = _quarter_word(e8, e9, e10, e11, f, HW_E2M1) | (_quarter_word(e12, e13, e14, e15, f, HW_E2M1) << 16)
    packed = w0.to(tl.uint32).to(tl.int64) | (w1.to(tl.int64) << 32)
    return packed, sf_byte


@triton.jit
def _pairs_word(lo, hi, f, HW_E2M1: tl.constexpr):
    """FP32 ``[R, 4]`` pairs (elements 2j, 2j+1 of 8 consecutive values) -> their 4 packed bytes as int32 ``[R]``."""
    shift = (tl.arange(0, 4) * 8)[None, :]
    return tl.sum(_pair_byte(lo, hi, f, HW_E2M1) << shift, axis=1)


@triton.jit
def quantize_block_halves(a, b, g, FAST_MATH: tl.constexpr, HW_E2M1: tl.constexpr):
    """One 16-block per row, held by one thread: FP32 ``a``, ``b`` ``[R, 8]`` are its elements 0..7 and 8..15.

    Returns (packed int32 ``[R, 2]``: the block's 8 bytes, little-endian; E4M3 scale byte int32 ``[R]``). For kernels
    that compute their values in registers and can give each thread whole blocks (no cross-thread maximum).
    """
    R: tl.constexpr = a.shape[0]
    # maxNum skips NaN lanes; only an all-NaN block leaves NaN, mapped to 0 once per block.
    vec_max = tl.maximum(tl.max(tl.abs(a), axis=1), tl.max(tl.abs(b), axis=1))
    vec_max = tl.where(vec_max == vec_max, vec_max, 0.0)
    sf_byte, factor = block_scale_and_factor(vec_max, g, FAST_MATH)
    f = factor[:, None]
    a_lo, a_hi = tl.split(tl.reshape(a, [R, 4, 2]))
    b_lo, b_hi = tl.split(tl.reshape(b, [R, 4, 2]))
    return tl.join(_pairs_word(a_lo, a_hi, f, HW_E2M1), _pairs_word(b_lo, b_hi, f, HW_E2M1)), sf_byte


@triton.jit
def load_blocks(ptr, rows, kbs, row_stride, mask):
    """The four int64 quarters of 16-blocks ``kbs`` (int ``[BLOCK_C]``) of rows ``rows``; ``ptr`` is the bf16/fp16
    matrix viewed as int64 (four values each), ``row_stride`` in int64 units, ``mask`` ``[BLOCK_R, BLOCK_C]``."""
    p = ptr + rows[:, None].to(tl.int64) * row_stride + kbs[None, :] * 4
    return (tl.load(p, mask=mask, other=0), tl.load(p + 1, mask=mask, other=0),
            tl.load(p + 2, mask=mask, other=0), tl.load(p + 3, mask=mask, other=0))


@triton.jit
def store_blocks(packed, sf_byte, rows, kbs, packed_ptr, scales_ptr, M, K, padded_cols):
    """``packed_ptr``: the packed output viewed as int64 ``[M, K/16]`` (one word per block); ``scales_ptr``: uint8
    128x4 layout, written for rows below round_up(M, 128) and blocks below ``padded_cols`` (padding gets zeros)."""
    r = rows[:, None]
    kb = kbs[None, :]
    tl.store(packed_ptr + r.to(tl.int64) * (K // 16) + kb, packed, mask=(r < M) & (kb < K // 16))
    smask = (r < ((M + 127) // 128) * 128) & (kb < padded_cols)
    tl.store(scales_ptr + swizzled_scale_offset(r, kb, padded_cols), sf_byte.to(tl.uint8), mask=smask)
