"""The NVFP4 quantize epilogue shared by every kernel that emits NVFP4 activations.

A kernel loads (or computes) an FP32 tile ``x[BLOCK_R, BLOCK_K]`` of rows ``rows`` and columns ``cols`` and calls
``store_nvfp4_tile``; the epilogue computes block maxima, E4M3 block scales and E2M1 codes exactly as DESIGN.md
section 3 (and ``diffusers_nvfp4_fast.format``) define them, then writes packed bytes and 128x4-swizzled scales.

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
    """FP32 -> E2M1 code (int32 0..15): nearest, ties to the even code, saturating; sign bit kept; NaN -> 7."""
    a = tl.abs(v)
    code = (
        (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a >= 1.75).to(tl.int32)
        + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
    )
    sign = (v.to(tl.int32, bitcast=True) >> 28) & 8
    return tl.where(v != v, 7, code | sign)


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
def store_nvfp4_tile(
    x, rows, col0, g, packed_ptr, scales_ptr, M, K, padded_cols,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, FAST_MATH: tl.constexpr, HW_E2M1: tl.constexpr,
):
    """Quantize ``x`` (FP32 ``[BLOCK_R, BLOCK_K]``; out-of-range elements must be 0) and store it.

    rows: int ``[BLOCK_R]``; col0: first column of the tile (a multiple of 16). Packed bytes land in
    ``packed_ptr[M, K/2]`` for rows < M, cols < K; scales in the 128x4 layout for every row < round_up(M, 128)
    and k-block < padded_cols, so padding is written as 0 by tiles that cover it.
    """
    blocks = tl.reshape(x, [BLOCK_R, BLOCK_K // 16, 16])
    a = tl.abs(blocks)
    vec_max = tl.max(tl.where(a != a, 0.0, a), axis=2)
    sf_byte, factor = block_scale_and_factor(vec_max, g, FAST_MATH)
    scaled = tl.reshape(blocks * factor[:, :, None], [BLOCK_R, BLOCK_K // 2, 2])
    lo, hi = tl.split(scaled)  # even elements go to the low nibble
    if HW_E2M1:
        byte = e2m1x2_hw(hi, lo)
    else:
        byte = e2m1_code(lo) | (e2m1_code(hi) << 4)
    half_cols = col0 // 2 + tl.arange(0, BLOCK_K // 2)
    pmask = (rows[:, None] < M) & (half_cols[None, :] < K // 2)
    tl.store(packed_ptr + rows[:, None].to(tl.int64) * (K // 2) + half_cols[None, :], byte.to(tl.uint8), mask=pmask)
    kblocks = col0 // 16 + tl.arange(0, BLOCK_K // 16)
    smask = (rows[:, None] < ((M + 127) // 128) * 128) & (kblocks[None, :] < padded_cols)
    offs = swizzled_scale_offset(rows[:, None].to(tl.int64), kblocks[None, :], padded_cols)
    tl.store(scales_ptr + offs, sf_byte.to(tl.uint8), mask=smask)
