"""The NVFP4 quantize epilogue shared by every kernel that emits NVFP4 activations.

A kernel calls the entry point that matches how a 16-block sits in its threads: ``quantize_blocks`` (one thread
loaded the whole block as four int64 words) or ``quantize_block_halves`` (one thread computed the whole block in
registers); a kernel that splits a block across threads reduces the maximum itself, then calls
``block_scale_and_factor`` and ``e2m1_words`` / ``e2m1_half_words`` on its share. ``decoded_blocks`` gives
``quantize_blocks``' result as the exact FP16 values the large-M GEMM multiplies, without codes (``e2m1_value``).
Each computes block maxima, E4M3 block scales and E2M1 codes exactly as docs/design.md §3 (and
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

from .launch import INTERPRETING

E4M3_MAX = tl.constexpr(448.0)
MIN_E4M3_NORMAL = tl.constexpr(0.015625)  # 2^-6
TWO_POW_23 = tl.constexpr(8388608.0)
INLINE_PTX = tl.constexpr(not INTERPRETING)  # inline PTX where it can run (GPU builds), Triton ops in the interpreter


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
def _e2m1_parts(v):
    """FP32 ``v`` -> (``u``, ``s``) uint32: the low nibble of ``u`` is the E2M1 magnitude code of ``v`` (nearest, ties
    to the even code, saturating at 6; NaN -> 7) and bits 3..21 of ``u`` are zero; the top bit of ``s`` is the sign.
    ``v`` must be the result of an FP32 multiply (the scaled value): on the GPU a NaN ``v`` then has its sign clear.

    The E2M1 grid has spacing 0.5 below 2, 1 in [2, 4) and 2 in [4, 6]. Adding ``c = 1.5 * 2^(22 + e)``, whose ulp is
    that spacing (``e`` = 0, 1, 2 for the three ranges), rounds to the grid in one correctly rounded FP32 add with
    ties to even. ``c`` is built with its mantissa already holding the range's first code (0, 2 or 4 grid steps,
    even, so the tie parity is unchanged), hence ``bits(a + c)`` with ``a = min(|v|, 6)`` ends in the code itself.
    ``e`` comes from the exponent field of ``max(a, 1)``; one multiply-add turns it into ``c``'s bits.
    """
    a, c, sign = _e2m1_grid(v)
    return (a + c).to(tl.uint32, bitcast=True), sign.to(tl.uint32, bitcast=True)


@triton.jit
def _e2m1_grid(v):
    """``_e2m1_parts``' operands: (``a = min(|v|, 6)``, the rounding constant ``c`` of ``a``'s range, a value carrying
    ``v``'s sign as the code's sign bit)."""
    # minNum (PTX min.f32, np.fmin in the interpreter) saturates at 6 and turns a NaN into 6.0, i.e. code 7.
    if INLINE_PTX:
        # The sign comes from v itself: every caller passes an FP32 product (value * factor), and a GPU multiply
        # returns the canonical NaN 0x7FFFFFFF, sign clear, whatever the sign of a NaN operand.
        a = tl.minimum(tl.abs(v), 6.0)
        sign = v
    else:
        # NumPy keeps a NaN operand's sign through the product: the clamped value carries the sign instead.
        sign = tl.maximum(tl.minimum(v, 6.0), -6.0)
        a = tl.abs(sign)
    e8 = tl.maximum(a, 1.0).to(tl.int32, bitcast=True) >> 23  # 127, 128 or 129
    # bits(c) = (e8 << 23) + (22 << 23) + 2^22 (the 1.5) + 2 * (e8 - 127) (the first code)
    c_bits = e8 * 0x800002 + (0x4AC00000 - 127 * 0x800002)
    return a, c_bits.to(tl.float32, bitcast=True), sign


@triton.jit
def _low_bytes(b0, b1, b2, b3):
    """The low bytes of four uint32 -> one uint32 (``b0``'s in the lowest byte): three byte permutes on the GPU (the
    compiler builds it from shifts and masks, two instructions per byte, otherwise)."""
    if INLINE_PTX:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t0, t1; prmt.b32 t0, $1, $2, 0x40; prmt.b32 t1, $3, $4, 0x40; prmt.b32 $0, t0, t1, 0x5410; }",
            "=r,r,r,r,r", [b0, b1, b2, b3], dtype=tl.uint32, is_pure=True, pack=1,
        )
    else:
        return (b0 & 0xFF) | ((b1 & 0xFF) << 8) | ((b2 & 0xFF) << 16) | (b3 << 24)


@triton.jit
def _sign_nibbles(s7, s6, s5, s4, s3, s2, s1, s0):
    """Top nibbles of eight uint32, ``s0``'s lowest: one funnel shift each. Only bit 3 of each nibble (the sign) is kept
    by the caller."""
    acc = s7 >> 28
    acc = (acc << 4) | (s6 >> 28)
    acc = (acc << 4) | (s5 >> 28)
    acc = (acc << 4) | (s4 >> 28)
    acc = (acc << 4) | (s3 >> 28)
    acc = (acc << 4) | (s2 >> 28)
    acc = (acc << 4) | (s1 >> 28)
    return (acc << 4) | (s0 >> 28)


@triton.jit
def e2m1_word(x0, x1, x2, x3, x4, x5, x6, x7, HW_E2M1: tl.constexpr):
    """Eight scaled FP32 values (same shape; products, see ``_e2m1_parts``) -> their eight E2M1 codes as one int32,
    ``x0`` in the lowest nibble."""
    if HW_E2M1:
        return (e2m1x2_hw(x1, x0) | (e2m1x2_hw(x3, x2) << 8) | (e2m1x2_hw(x5, x4) << 16)
                | (e2m1x2_hw(x7, x6) << 24))
    else:
        u0, s0 = _e2m1_parts(x0)
        u1, s1 = _e2m1_parts(x1)
        u2, s2 = _e2m1_parts(x2)
        u3, s3 = _e2m1_parts(x3)
        u4, s4 = _e2m1_parts(x4)
        u5, s5 = _e2m1_parts(x5)
        u6, s6 = _e2m1_parts(x6)
        u7, s7 = _e2m1_parts(x7)
        return _packed_codes(u0, u1, u2, u3, u4, u5, u6, u7, s0, s1, s2, s3, s4, s5, s6, s7)


@triton.jit
def _packed_codes(u0, u1, u2, u3, u4, u5, u6, u7, s0, s1, s2, s3, s4, s5, s6, s7):
    """Eight ``_e2m1_parts`` results -> one int32 of their codes, ``u0``/``s0``'s in the lowest nibble."""
    # (u_hi << 4) + u_lo: the pair's byte in the low 8 bits (u's bits 3..21 are zero, so nothing carries in).
    mags = _low_bytes((u1 << 4) + u0, (u3 << 4) + u2, (u5 << 4) + u4, (u7 << 4) + u6)
    word = (_sign_nibbles(s7, s6, s5, s4, s3, s2, s1, s0) & 0x88888888) | mags
    return word.to(tl.int32, bitcast=True)


@triton.jit
def e2m1_half_word(x0, x1, x2, x3, HW_E2M1: tl.constexpr):
    """Four scaled FP32 values -> their E2M1 codes in the low 16 bits of an int32 (``x0`` in the lowest nibble)."""
    if HW_E2M1:
        return e2m1x2_hw(x1, x0) | (e2m1x2_hw(x3, x2) << 8)
    else:
        u0, s0 = _e2m1_parts(x0)
        u1, s1 = _e2m1_parts(x1)
        u2, s2 = _e2m1_parts(x2)
        u3, s3 = _e2m1_parts(x3)
        mags = (((u1 << 4) + u0) & 0xFF) | ((((u3 << 4) + u2) & 0xFF) << 8)
        signs = ((s3 >> 28) << 12) | ((s2 >> 28) << 8) | ((s1 >> 28) << 4) | (s0 >> 28)
        return ((signs & 0x8888) | mags).to(tl.int32, bitcast=True)


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
    """Block maxima and global scale (FP32) -> (E4M3 scale byte int32, FP32 factor applied before E2M1).

    ``vec_max`` is the NaN-skipping (maxNum) maximum of the block's magnitudes: NaN only for a block of only NaNs,
    which is mapped to 0 here."""
    vec_max = tl.where(vec_max == vec_max, vec_max, 0.0)
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
def split8(x):
    """``[R, 8]`` or ``[R, C, 8]`` -> its eight ``[R]`` / ``[R, C]`` slices in element order (register renaming only:
    the 8 elements sit in one thread)."""
    if len(x.shape) == 2:
        even, odd = tl.split(tl.reshape(x, [x.shape[0], 2, 2, 2]))
    else:
        even, odd = tl.split(tl.reshape(x, [x.shape[0], x.shape[1], 2, 2, 2]))
    e_lo, e_hi = tl.split(even)
    o_lo, o_hi = tl.split(odd)
    x0, x4 = tl.split(e_lo)
    x2, x6 = tl.split(e_hi)
    x1, x5 = tl.split(o_lo)
    x3, x7 = tl.split(o_hi)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def split4(x):
    """``[R, 4]`` or ``[R, C, 4]`` -> its four slices in element order."""
    if len(x.shape) == 2:
        even, odd = tl.split(tl.reshape(x, [x.shape[0], 2, 2]))
    else:
        even, odd = tl.split(tl.reshape(x, [x.shape[0], x.shape[1], 2, 2]))
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    return x0, x1, x2, x3


@triton.jit
def e2m1_words(x, HW_E2M1: tl.constexpr):
    """Scaled FP32 ``[..., 8]`` -> int32 ``[...]``: each row of eight values as four packed bytes."""
    # The codes are computed on the whole tensor, split only to pack: the same per-element arithmetic in an eighth of
    # the IR ops, which Triton's coalescing pass costs quadratically (docs/performance.md, "First image").
    if HW_E2M1:
        x0, x1, x2, x3, x4, x5, x6, x7 = split8(x)
        return e2m1_word(x0, x1, x2, x3, x4, x5, x6, x7, HW_E2M1)
    else:
        u, s = _e2m1_parts(x)
        u0, u1, u2, u3, u4, u5, u6, u7 = split8(u)
        s0, s1, s2, s3, s4, s5, s6, s7 = split8(s)
        return _packed_codes(u0, u1, u2, u3, u4, u5, u6, u7, s0, s1, s2, s3, s4, s5, s6, s7)


@triton.jit
def e2m1_half_words(x, HW_E2M1: tl.constexpr):
    """Scaled FP32 ``[..., 4]`` -> int32 ``[...]`` holding each row's two packed bytes in its low 16 bits."""
    x0, x1, x2, x3 = split4(x)
    return e2m1_half_word(x0, x1, x2, x3, HW_E2M1)


# ---------------------------------------------------------------------------------------------------------------
# Whole-block paths: one thread owns whole 16-blocks (loaded as int64 words, or computed in registers), so the block
# maximum, the scale and the packing need no cross-thread reductions or layout conversions.
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def unpack4(q, IS_BF16: tl.constexpr):
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
    # maximum requires; a block of only NaNs gives NaN, which block_scale_and_factor maps to 0.
    return tl.maximum(tl.maximum(tl.abs(a), tl.abs(b)), tl.maximum(tl.abs(c), tl.abs(d)))


@triton.jit
def e2m1_value(v):
    """A scaled FP32 value (a product, as for ``_e2m1_parts``) -> the E2M1 value its code stands for, as FP32 with
    the code's sign (-0 for a small negative value, +6 for NaN), without building the code: ``(a + c) - c`` is
    ``a`` on the E2M1 grid (the same correctly rounded add as ``_e2m1_parts``; the subtraction is exact)."""
    a, c, sign = _e2m1_grid(v)
    magnitude = ((a + c) - c).to(tl.uint32, bitcast=True)
    return (magnitude | (sign.to(tl.uint32, bitcast=True) & 0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def _fp16_pair(lo, hi):
    """Two FP32 values exact in FP16 -> uint32 holding their FP16 bits, ``lo`` in the low half."""
    return (lo.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
            | (hi.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32) << 16))


@triton.jit
def _decoded_word(x0, x1, x2, x3, f, s):
    """Four values, their block's factor and FP32 scale -> int64 of the four exact FP16 products ``e2m1 * s``."""
    lo = _fp16_pair(e2m1_value(x0 * f) * s, e2m1_value(x1 * f) * s)
    hi = _fp16_pair(e2m1_value(x2 * f) * s, e2m1_value(x3 * f) * s)
    return lo.to(tl.int64) | (hi.to(tl.int64) << 32)


@triton.jit
def _block_values(q0, q1, q2, q3, g, IS_BF16: tl.constexpr, FAST_MATH: tl.constexpr):
    """Four int64 tensors ``[R, C]`` of 16-blocks -> (the 16 FP32 values, E4M3 scale byte int32, FP32 factor)."""
    e0, e1, e2, e3 = unpack4(q0, IS_BF16)
    e4, e5, e6, e7 = unpack4(q1, IS_BF16)
    e8, e9, e10, e11 = unpack4(q2, IS_BF16)
    e12, e13, e14, e15 = unpack4(q3, IS_BF16)
    vec_max = tl.maximum(tl.maximum(_max4(e0, e1, e2, e3), _max4(e4, e5, e6, e7)),
                         tl.maximum(_max4(e8, e9, e10, e11), _max4(e12, e13, e14, e15)))
    sf_byte, f = block_scale_and_factor(vec_max, g, FAST_MATH)
    return (e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11, e12, e13, e14, e15), sf_byte, f


@triton.jit
def decoded_blocks(q0, q1, q2, q3, g, IS_BF16: tl.constexpr, FAST_MATH: tl.constexpr):
    """``quantize_blocks``'s 16-blocks straight to their exact FP16 values (code value times E4M3 scale, the bytes
    of decoding the packed result): four int64 ``[R, C]``, element ``4j + i`` of a block in bits ``16i`` of word
    ``j``. Rounds each value to the E2M1 grid as a float instead of building and decoding codes (docs/design.md
    §7)."""
    e, sf_byte, f = _block_values(q0, q1, q2, q3, g, IS_BF16, FAST_MATH)
    s = e4m3_value(sf_byte)
    return (_decoded_word(e[0], e[1], e[2], e[3], f, s), _decoded_word(e[4], e[5], e[6], e[7], f, s),
            _decoded_word(e[8], e[9], e[10], e[11], f, s), _decoded_word(e[12], e[13], e[14], e[15], f, s))


@triton.jit
def quantize_blocks(q0, q1, q2, q3, g, IS_BF16: tl.constexpr, FAST_MATH: tl.constexpr, HW_E2M1: tl.constexpr):
    """Four int64 tensors ``[R, C]`` (elements 4i..4i+3 of each 16-block in ``q_i``) -> (packed int64 ``[R, C]``:
    the block's 8 packed bytes, little-endian; E4M3 scale byte int32 ``[R, C]``)."""
    e, sf_byte, f = _block_values(q0, q1, q2, q3, g, IS_BF16, FAST_MATH)
    e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11, e12, e13, e14, e15 = e
    w0 = e2m1_word(e0 * f, e1 * f, e2 * f, e3 * f, e4 * f, e5 * f, e6 * f, e7 * f, HW_E2M1)
    w1 = e2m1_word(e8 * f, e9 * f, e10 * f, e11 * f, e12 * f, e13 * f, e14 * f, e15 * f, HW_E2M1)
    packed = w0.to(tl.uint32).to(tl.int64) | (w1.to(tl.int64) << 32)
    return packed, sf_byte


@triton.jit
def quantize_block_halves(a, b, g, FAST_MATH: tl.constexpr, HW_E2M1: tl.constexpr):
    """One 16-block per row, held by one thread: FP32 ``a``, ``b`` ``[R, 8]`` are its elements 0..7 and 8..15.

    Returns (packed int32 ``[R, 2]``: the block's 8 bytes, little-endian; E4M3 scale byte int32 ``[R]``). For kernels
    that compute their values in registers and can give each thread whole blocks (no cross-thread maximum).
    """
    # maxNum skips NaN lanes; only an all-NaN block leaves NaN (mapped to 0 by block_scale_and_factor).
    vec_max = tl.maximum(tl.max(tl.abs(a), axis=1), tl.max(tl.abs(b), axis=1))
    sf_byte, factor = block_scale_and_factor(vec_max, g, FAST_MATH)
    f = factor[:, None]
    return tl.join(e2m1_words(a * f, HW_E2M1), e2m1_words(b * f, HW_E2M1)), sf_byte


@triton.jit
def block_tile(pid, col_tiles, M, K, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program ``pid``'s rows and 16-block columns in a grid over an ``[M, K]`` matrix, and the mask of its blocks
    that lie inside the matrix."""
    rows = (pid // col_tiles) * BLOCK_R + tl.arange(0, BLOCK_R)
    kbs = (pid % col_tiles) * BLOCK_C + tl.arange(0, BLOCK_C)
    return rows, kbs, (rows[:, None] < M) & (kbs[None, :] < K // 16)


@triton.jit
def cat_tile(pid, col_tiles, M, A, B, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program ``pid``'s rows and 16-block columns in a grid over ``cat([a, b], -1)`` (A and B columns), and the
    masks of the blocks taken from ``a`` and from ``b`` (padding blocks are in neither)."""
    rows = (pid // col_tiles) * BLOCK_R + tl.arange(0, BLOCK_R)
    kbs = (pid % col_tiles) * BLOCK_C + tl.arange(0, BLOCK_C)
    a_blocks = A // 16
    row_ok = rows[:, None] < M
    in_a = row_ok & (kbs[None, :] < a_blocks)
    in_b = row_ok & (kbs[None, :] >= a_blocks) & (kbs[None, :] < a_blocks + B // 16)
    return rows, kbs, in_a, in_b


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
