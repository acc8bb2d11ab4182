"""FP32 -> BF16 / FP16 rounding as torch's eager CUDA kernels round, for kernels that reproduce a chain of torch ops
in registers. On the GPU it is the instruction torch uses from SM80 on (``cvt.rn.bf16.f32`` / ``cvt.rn.f16.f32``:
nearest, ties to even, NaN to the canonical 0x7FFF). Under the interpreter BF16 is rounded in integer arithmetic
(same values; NaN becomes 0x7FC0, as torch's CPU and pre-SM80 code make it)."""

import triton
import triton.language as tl

from .launch import INTERPRETING

SOFT_CONVERT = tl.constexpr(INTERPRETING)  # integer rounding where the interpreter's casts are wrong


@triton.jit
def widen_bf16(v, SOFT_BF16: tl.constexpr):
    """BF16 -> FP32 (exact). The interpreter's conversion mangles BF16 subnormals, so SOFT_BF16 shifts the bits."""
    if SOFT_BF16:
        return (v.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return v.to(tl.float32)


@triton.jit
def narrow_bf16(x, SOFT_BF16: tl.constexpr):
    """FP32 -> BF16, round to nearest even (``cvt.rn.bf16.f32`` on the GPU). The interpreter's cast truncates, so
    SOFT_BF16 rounds in integer arithmetic (same result for every non-NaN input; NaN becomes the quiet NaN 0x7FC0)."""
    if SOFT_BF16:
        bits = x.to(tl.int32, bitcast=True)
        rounded = tl.where(x != x, 0x7FC00000, bits + 0x7FFF + ((bits >> 16) & 1))
        return (rounded >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def round_to_half(x, IS_BF16: tl.constexpr):
    """FP32 -> the nearest (ties to even) BF16 / FP16 value, as its 16 bits in an int64."""
    if IS_BF16:
        return narrow_bf16(x, SOFT_CONVERT).to(tl.int16, bitcast=True).to(tl.int64) & 0xFFFF
    else:
        return x.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int64) & 0xFFFF


@triton.jit
def half_value(bits, IS_BF16: tl.constexpr):
    """16 bits (int64, as ``round_to_half`` returns them) -> their FP32 value."""
    if IS_BF16:
        return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
