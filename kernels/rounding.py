"""Arithmetic as torch's eager CUDA kernels do it, for kernels that reproduce a chain of torch ops in registers:
FP32 -> BF16 / FP16 rounding, ``rsqrtf`` and a single-rounding FMA.

Rounding: On the GPU it is the instruction torch uses from SM80 on (``cvt.rn.bf16.f32`` / ``cvt.rn.f16.f32``:
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


@triton.jit
def rsqrt_like_torch(x, APPROX_RSQRT: tl.constexpr):
    """FP32 ``1/sqrt(x)`` as torch's CUDA kernels compute it (LayerNorm's ``rstd``, ``torch.rsqrt``)."""
    if APPROX_RSQRT:
        # c10::cuda::compat::rsqrt -> rsqrtf -> rsqrt.approx.f32 (torch is built without -ftz): the same instruction.
        return tl.inline_asm_elementwise("rsqrt.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        # Interpreter stand-in (inline PTX cannot run there): correctly rounded 1/sqrt (FP64, then one rounding to
        # FP32). Not always equal to the approximate instruction in the last bit.
        return (1.0 / tl.sqrt(x.to(tl.float64))).to(tl.float32)


@triton.jit
def negate(x):
    """FP32 ``-x`` as torch's ``neg`` computes it: the sign bit flipped, so ``-(+0) = -0``. Triton 3.6 compiles unary
    minus as ``0 - x``, which gives ``+0`` there and changes the sign of zero results downstream (docs/design.md §6)."""
    return (x.to(tl.int32, bitcast=True) ^ -2147483648).to(tl.float32, bitcast=True)


@triton.jit
def fma_rn(a, b, c):
    """``fma.rn.f32``: one rounding. Some Triton interpreters evaluate ``tl.fma`` as ``a*b + c`` in FP32 (two roundings;
    Triton 3.8), so there the single rounding is emulated: the FP64 product is exact, the FP64 sum is rounded to odd
    (TwoSum tells whether it was exact), and rounding that to FP32 gives the correctly rounded result."""
    if not SOFT_CONVERT:
        return tl.fma(a, b, c)
    else:
        p = a.to(tl.float64) * b.to(tl.float64)
        c64 = c.to(tl.float64)
        s = p + c64
        bb = s - p
        err = (p - (s - bb)) + (c64 - bb)
        bits = s.to(tl.int64, bitcast=True)
        toward = tl.where((s > 0) == (err > 0), 1, -1).to(tl.int64)  # one ulp towards the exact sum
        odd = tl.where((err != 0) & ((bits & 1) == 0), bits + toward, bits)
        return odd.to(tl.float64, bitcast=True).to(tl.float32)


@triton.jit
def sum_of_products(x, y, z, w, FORM: tl.constexpr):
    """``x*y + z*w`` as nvcc may have compiled it: FORM 0 = no contraction, 1 = ``fma(x, y, z*w)``, 2 = ``fma(z, w,
    x*y)`` (which product the compiler fused is read off torch's results, docs/design.md §6)."""
    if FORM == 1:
        return fma_rn(x, y, z * w)
    elif FORM == 2:
        return fma_rn(z, w, x * y)
    else:
        return x * y + z * w
