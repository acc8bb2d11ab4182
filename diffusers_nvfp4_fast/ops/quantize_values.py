"""The activation quantize to its exact FP16 values, spelled in torch ops so that inductor fuses it into the kernel
that produces the activation (docs/design.md §1, "compiled graphs", and §7).

Reference: ``format.decode_nvfp4(*format.quantize_nvfp4(x, g))`` in FP16, the values the SM80-SM90 GEMM multiplies
(``kernels.quantize_nvfp4_decoded`` computes them in one kernel). ``quantize_values`` follows that kernel's
rounding (``kernels/nvfp4_epilogue.py``, ``decoded_blocks``) step by step: the NaN-skipping block maximum, the
E4M3 block scale, the factor, each value rounded onto the E2M1 grid by ``(a + c) - c``, times the scale. Every step
is a correctly rounded FP32 operation or an exact one, so inductor's code computes the kernel's bytes, except the
reciprocals: the fast-math recipe names ``rcp.approx.ftz.f32``, which no torch op computes. They go through the
custom op ``nvfp4_fast::reciprocal``, which inductor lowers to that one PTX instruction (``rcp.rn.f32`` in the
precise recipe) inside the fused kernel (``register_reciprocal_lowering``).
"""

from __future__ import annotations

import functools

import torch

from .. import format as nvfp4
from .dispatch import kernels

# fl(1/6) in FP32: rcp.approx.ftz.f32(6.0) gives it too (docs/design.md §3)
_RCP_6 = 0.1666666716337204
_FLT_MAX = 3.4028234663852886e38
# (a + c) - c rounds a = min(|v|, 6) onto the E2M1 grid with ties to the even code: c = 1.5 * 2^(22 + e) for the
# ranges [0, 2), [2, 4), [4, 6] (spacing 0.5, 1, 2), its mantissa holding the range's first code (0, 2, 4), as
# nvfp4_epilogue._e2m1_grid builds it from bits.
_E2M1_C = (6291456.0, 12582914.0, 25165832.0)


def _reciprocal_impl(x: torch.Tensor, approx: bool) -> torch.Tensor:
    if not approx:
        return 1.0 / x  # IEEE division on every device torch runs on
    if x.is_cuda and kernels is not None:
        return kernels.rcp_approx.rcp_approx_cuda(x)
    return nvfp4._rcp_approx(x)  # the CPU stand-in of the reference quantizer (docs/design.md §3)


_reciprocal_op = torch.library.custom_op("nvfp4_fast::reciprocal", mutates_args=())(_reciprocal_impl)


@_reciprocal_op.register_fake
def _(x, approx):
    return torch.empty_like(x)


def reciprocal(x: torch.Tensor, approx: bool) -> torch.Tensor:
    """FP32 ``1 / x`` elementwise: ``rcp.approx.ftz.f32`` when ``approx`` (on a CPU the reference's stand-in), else
    correctly rounded. Under ``torch.compile`` on a CUDA device inductor computes it inside its fused kernels."""
    return _reciprocal_op(x, approx)


@functools.cache
def register_reciprocal_lowering() -> bool:
    """Teach inductor ``nvfp4_fast::reciprocal`` as one PTX instruction per element on CUDA devices (other devices
    call the op). False where this torch's inductor lacks the pieces (then compiled graphs keep the opaque quantize:
    ``inductor.ActivationQuantizePass`` asks first)."""
    try:
        from torch._inductor.lowering import fallback_handler, make_pointwise, register_lowering
        from torch._inductor.virtualized import ops
    except ImportError:
        return False
    if torch.version.hip is not None or not hasattr(ops, "inline_asm_elementwise"):
        return False
    op = torch.ops.nvfp4_fast.reciprocal.default
    call_op = fallback_handler(op, add_to_fallback_set=False)

    @register_lowering(op, type_promotion_kind=None)
    def _lower(x, approx):
        if x.get_device() is None or x.get_device().type != "cuda":
            return call_op(x, approx)
        asm = "rcp.approx.ftz.f32 $0, $1;" if approx else "rcp.rn.f32 $0, $1;"
        return make_pointwise(functools.partial(ops.inline_asm_elementwise, asm=asm, constraints="=r,r",
                                                dtype=torch.float32, is_pure=True, pack=1))(x)

    return True


def quantize_values(x: torch.Tensor, global_scale: torch.Tensor, fast_math: bool) -> torch.Tensor:
    """x ``[M, K]`` BF16/FP16 (K % 16 == 0), global_scale FP32 one-element -> FP16 ``[M, K]``: each value's E2M1 code
    value times its block's E4M3 scale, the bytes of ``decode_nvfp4(*quantize_nvfp4(x, global_scale))``.

    Torch ops only (and ``reciprocal``), written for inductor: ``x`` is read twice, for the block maximum and for
    the rounding, so that a producer inductor inlines is computed twice instead of stored."""
    m, k = x.shape
    g = global_scale.reshape(()).to(torch.float32)
    magnitude = x.reshape(m, k // 16, 16).to(torch.float32).abs()
    vec_max = torch.where(torch.isnan(magnitude), 0.0, magnitude).amax(-1, keepdim=True)
    if fast_math:
        sf = g * (vec_max * _RCP_6)
    else:
        sf = vec_max * (g * _RCP_6)
    scale = torch.where(sf < 448.0, sf, 448.0).to(torch.float8_e4m3fn).to(torch.float32)  # minNum: NaN -> 448
    factor = reciprocal(scale * reciprocal(g, fast_math), fast_math)
    if not fast_math:
        factor = torch.where(factor < _FLT_MAX, factor, _FLT_MAX)
    factor = torch.where(vec_max != 0.0, factor, 0.0)
    value = e2m1_values(x.reshape(m, k // 16, 16).to(torch.float32) * factor)
    return (value * scale).to(torch.float16).reshape(m, k)


def e2m1_values(v: torch.Tensor) -> torch.Tensor:
    """FP32 -> the value of its E2M1 code (``format.e2m1_round``) as FP32: nearest, ties to the even code, saturating
    at 6, the sign kept (-0 for a small negative value), +6 for NaN."""
    a = torch.clamp(v.abs(), max=6.0)
    c = torch.where(a < 2.0, _E2M1_C[0], torch.where(a < 4.0, _E2M1_C[1], _E2M1_C[2]))
    return torch.where(torch.isnan(v), 6.0, torch.copysign((a + c) - c, v))
