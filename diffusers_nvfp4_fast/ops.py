"""Custom ops: the one place that decides which implementation (Triton kernel, FlashInfer, torch) runs.

Every op is a ``torch.library`` custom op with a fake (meta) implementation, so ``torch.compile(fullgraph=True)``
traces through it and CUDA graphs capture it. On CPU, and on GPUs without a kernel for the op, the torch
reference runs; it is byte-identical to the kernels by construction and by test.
"""

from __future__ import annotations

import functools
import os

import torch

from . import format as nvfp4
from .format import round_up
from .gates import run_checked

_GEMM_BACKEND_VAR = "DIFFUSERS_NVFP4_GEMM_BACKEND"


@functools.cache
def _kernels():
    """The Triton kernels package, or None where Triton is missing."""
    try:
        from . import kernels
    except ImportError:
        return None
    return kernels


@functools.cache
def _reference():
    """``fused_reference`` (imported on first use: it imports this module)."""
    from . import fused_reference

    return fused_reference


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cuda_capability(device: torch.device) -> tuple[int, int]:
    # Cached: every NVFP4 call asks, and the eager step is bound by host overhead (README, "Measured").
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def _call(op, impl, *args):
    """Run custom op ``op`` whose implementation is ``impl``.

    Eager calls run ``impl`` directly: going through the custom-op dispatcher costs a few microseconds per call, and
    an eager NVFP4 step makes thousands of these calls while its wall time is bound by host overhead. Under
    ``torch.compile`` (and export) the op itself is called, so the graph holds one opaque op with its fake
    implementation. Both run the same code, so the bytes are the same.
    """
    if torch.compiler.is_compiling():
        return op(*args)
    return impl(*args)


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and _kernels() is not None and cuda_capability(x.device) >= (8, 0)


def _scale_shape(rows, k: int) -> tuple:
    return (round_up(rows, 128), round_up(k // nvfp4.BLOCK_SIZE, 4))


# ---------------------------------------------------------------------------------------------------------------
# Standalone quantize: the unfused path.
# ---------------------------------------------------------------------------------------------------------------


def _quantize_impl(x: torch.Tensor, global_scale: torch.Tensor, fast_math: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if _use_triton(x):
        return _kernels().quantize_nvfp4(x, global_scale, fast_math=fast_math)
    return nvfp4.quantize_nvfp4(x, global_scale, fast_math=fast_math)


_quantize = torch.library.custom_op("nvfp4_fast::quantize", mutates_args=())(_quantize_impl)


@_quantize.register_fake
def _(x, global_scale, fast_math):
    rows, k = x.shape
    return x.new_empty((rows, k // 2), dtype=torch.uint8), x.new_empty(_scale_shape(rows, k), dtype=torch.uint8)


def quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor, fast_math: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x: ``[M, K]`` BF16/FP16 -> (packed uint8 ``[M, K/2]``, 128x4 scales uint8)."""
    return _call(_quantize, _quantize_impl, x.contiguous(), global_scale, fast_math)


# ---------------------------------------------------------------------------------------------------------------
# NVFP4 linear: FP4 x FP4 GEMM, times alpha, plus bias.
# ---------------------------------------------------------------------------------------------------------------


def gemm_backend(device: torch.device) -> str:
    """'flashinfer' (SM100+ with FlashInfer), 'triton' (SM80-SM90 with the Triton GEMM) or 'emulated' (torch)."""
    forced = os.environ.get(_GEMM_BACKEND_VAR, "").strip().lower()
    if forced:
        if forced not in ("flashinfer", "triton", "emulated"):
            raise ValueError(f"{_GEMM_BACKEND_VAR}={forced!r}: expected 'flashinfer', 'triton' or 'emulated'")
        return forced
    if device.type != "cuda":
        return "emulated"
    major, _ = cuda_capability(device)
    if major >= 10 and _flashinfer() is not None:
        return "flashinfer"
    if 8 <= major < 10 and _kernels() is not None and hasattr(_kernels(), "nvfp4_gemm"):
        return "triton"
    return "emulated"


@functools.cache
def _flashinfer():
    try:
        import flashinfer
    except ImportError:
        return None
    return flashinfer


def emulated_nvfp4_gemm(
    x_packed: torch.Tensor,
    x_scales: torch.Tensor,
    w_packed: torch.Tensor,
    w_scales: torch.Tensor,
    w_swizzled: bool = True,
) -> torch.Tensor:
    """Exact W4A4 emulation: decode both operands (exact in FP32), FP32 matmul. Returns FP32 ``[M, N]``."""
    x = nvfp4.decode_nvfp4(x_packed, x_scales, scale_layout="128x4", dtype=torch.float32)
    w = nvfp4.decode_nvfp4(w_packed, w_scales, scale_layout="128x4" if w_swizzled else "linear", dtype=torch.float32)
    return x @ w.t()


def _linear_impl(
    x_packed: torch.Tensor,
    x_scales: torch.Tensor,
    w_packed: torch.Tensor,
    w_scales: torch.Tensor,
    alpha: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    w_swizzled: bool,
) -> torch.Tensor:
    backend = gemm_backend(x_packed.device)
    if backend != "emulated" and not w_swizzled:
        raise RuntimeError(
            "NVFP4Linear holds linear-layout weight scales; the FP4 GEMM needs 128x4. Call "
            "module.swizzle_weight_scales_() or enable_fast_paths(...) first."
        )
    if backend == "flashinfer":
        fi = _flashinfer()
        out = fi.mm_fp4(
            x_packed, w_packed.t(), x_scales.view(torch.float8_e4m3fn), w_scales.view(torch.float8_e4m3fn).t(),
            alpha, out_dtype, backend="cutlass",
        )
    elif backend == "triton":
        out = _kernels().nvfp4_gemm(x_packed, x_scales, w_packed, w_scales, alpha, out_dtype)
    else:
        out = (emulated_nvfp4_gemm(x_packed, x_scales, w_packed, w_scales, w_swizzled) * alpha).to(out_dtype)
    if bias is not None:
        out = out + bias
    return out


_linear = torch.library.custom_op("nvfp4_fast::linear", mutates_args=())(_linear_impl)


@_linear.register_fake
def _(x_packed, x_scales, w_packed, w_scales, alpha, bias, out_dtype, w_swizzled):
    return x_packed.new_empty((x_packed.shape[0], w_packed.shape[0]), dtype=out_dtype)


def nvfp4_linear(
    x_packed: torch.Tensor,
    x_scales: torch.Tensor,
    w_packed: torch.Tensor,
    w_scales: torch.Tensor,
    alpha: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    w_swizzled: bool = True,
) -> torch.Tensor:
    """``bf16(gemm(x, w) * alpha) (+ bias)``; x_packed ``[M, K/2]``, w_packed ``[N, K/2]`` -> ``[M, N]``."""
    return _call(_linear, _linear_impl, x_packed, x_scales, w_packed, w_scales, alpha, bias, out_dtype, w_swizzled)


# ---------------------------------------------------------------------------------------------------------------
# FLUX.2: fused token-cat quantize.
# ---------------------------------------------------------------------------------------------------------------


def _token_cat_impl(attn, mlp, global_scale, fast_math):
    if _use_triton(attn):
        return _kernels().token_cat_quantize(attn, mlp, global_scale, fast_math=fast_math)
    return _reference().token_cat_quantize_reference(attn, mlp, global_scale, fast_math)


def _token_cat_fake(attn, mlp, global_scale, fast_math, *_):
    rows = attn.numel() // attn.shape[-1]
    k = attn.shape[-1] + mlp.shape[-1]
    return attn.new_empty((rows, k // 2), dtype=torch.uint8), attn.new_empty(_scale_shape(rows, k), dtype=torch.uint8)


@torch.library.custom_op("nvfp4_fast::token_cat_quantize", mutates_args=())
def token_cat_quantize(
    attn: torch.Tensor, mlp: torch.Tensor, global_scale: torch.Tensor, fast_math: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize(cat([attn, mlp], -1))`` without the concatenation: attn ``[..., A]``, mlp ``[..., B]`` ->
    packed uint8 ``[R, (A+B)/2]``, 128x4 scales uint8 ``[round_up(R,128), round_up((A+B)/16,4)]``."""
    return _token_cat_impl(attn, mlp, global_scale, fast_math)


token_cat_quantize.register_fake(_token_cat_fake)


def _token_cat_checked_impl(
    attn: torch.Tensor, mlp: torch.Tensor, global_scale: torch.Tensor, fast_math: bool, stats_id: int, shape_class: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return run_checked(
        stats_id, "flux2_token_cat", shape_class, ("packed", "scales"),
        lambda: _token_cat_impl(attn, mlp, global_scale, fast_math),
        lambda: _reference().token_cat_quantize_reference(attn, mlp, global_scale, fast_math),
    )


_token_cat_checked = torch.library.custom_op("nvfp4_fast::token_cat_quantize_checked", mutates_args=())(
    _token_cat_checked_impl)
_token_cat_checked.register_fake(_token_cat_fake)


def token_cat_quantize_checked(
    attn: torch.Tensor, mlp: torch.Tensor, global_scale: torch.Tensor, fast_math: bool, stats_id: int, shape_class: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_cat_quantize`` with first-use byte verification against ``quantize(cat)`` (gates.run_checked)."""
    return _call(_token_cat_checked, _token_cat_checked_impl, attn, mlp, global_scale, fast_math, stats_id, shape_class)


# ---------------------------------------------------------------------------------------------------------------
# Qwen-Image: residual + gate * attn -> LayerNorm -> modulate -> quantize.
# ---------------------------------------------------------------------------------------------------------------


def qwen_kernel_available(x: torch.Tensor) -> bool:
    return _use_triton(x) and hasattr(_kernels(), "qwen_resnorm_quantize")


def _qwen_impl(residual, x, bias, gate, scale, shift, global_scale, eps, fast_math):
    if qwen_kernel_available(x):
        return _kernels().qwen_resnorm_quantize(residual, x, bias, gate, scale, shift, global_scale, eps=eps, fast_math=fast_math)
    return _reference().qwen_resnorm_quantize_reference(residual, x, bias, gate, scale, shift, global_scale, eps, fast_math)


def _qwen_fake(residual, x, bias, gate, scale, shift, global_scale, eps, fast_math, *_):
    d = residual.shape[-1]
    rows = residual.numel() // d
    return (
        torch.empty_like(residual, memory_format=torch.contiguous_format),
        residual.new_empty((rows, d // 2), dtype=torch.uint8),
        residual.new_empty(_scale_shape(rows, d), dtype=torch.uint8),
    )


@torch.library.custom_op("nvfp4_fast::qwen_resnorm_quantize", mutates_args=())
def qwen_resnorm_quantize(
    residual: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, gate: torch.Tensor, scale: torch.Tensor,
    shift: torch.Tensor, global_scale: torch.Tensor, eps: float, fast_math: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """residual, x ``[B, L, D]``; bias ``[D]``/None; gate/scale/shift ``[B, L, D]`` views (stride 0 over L for
    per-sample rows) -> (residual_out ``[B, L, D]``, packed ``[B*L, D/2]``, 128x4 scales of the modulated FC1 input)."""
    return _qwen_impl(residual, x, bias, gate, scale, shift, global_scale, eps, fast_math)


qwen_resnorm_quantize.register_fake(_qwen_fake)


def _qwen_checked_impl(
    residual: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, gate: torch.Tensor, scale: torch.Tensor,
    shift: torch.Tensor, global_scale: torch.Tensor, eps: float, fast_math: bool, stats_id: int, shape_class: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return run_checked(
        stats_id, "qwen_resnorm", shape_class, ("residual_out", "packed", "scales"),
        lambda: _qwen_impl(residual, x, bias, gate, scale, shift, global_scale, eps, fast_math),
        lambda: _reference().qwen_resnorm_quantize_reference(residual, x, bias, gate, scale, shift, global_scale, eps,
                                                             fast_math),
    )


_qwen_checked = torch.library.custom_op("nvfp4_fast::qwen_resnorm_quantize_checked", mutates_args=())(_qwen_checked_impl)
_qwen_checked.register_fake(_qwen_fake)


def qwen_resnorm_quantize_checked(
    residual: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, gate: torch.Tensor, scale: torch.Tensor,
    shift: torch.Tensor, global_scale: torch.Tensor, eps: float, fast_math: bool, stats_id: int, shape_class: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``qwen_resnorm_quantize`` with first-use byte verification against the eager chain + standalone quantize."""
    return _call(_qwen_checked, _qwen_checked_impl, residual, x, bias, gate, scale, shift, global_scale, eps, fast_math,
                 stats_id, shape_class)
