"""NVFP4 linear: ``bf16(fp4_gemm(x, w) * alpha)``, then ``bf16(+ bias)`` (docs/design.md §3, §7).

Reference: ``linear_reference`` (exact W4A4 emulation in torch). Kernels: cuBLASLt (or FlashInfer) on SM100+,
``kernels.nvfp4_gemm`` (Triton / Gluon) on SM80-SM90; ``dispatch.gemm_backend`` picks. On SM80-SM90 the bias is
added in the GEMM's epilogue (same bytes as ``out + bias``), and ``quantized_linear`` quantizes a large-M activation
straight to the FP16 values the GEMM multiplies (as it does a one-row activation for the one-row kernel,
``kernels.nvfp4_gemv``): the same bytes as ``quantize`` then ``nvfp4_linear``.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import cast

import torch

from .. import caches
from .. import format as nvfp4
from .blackwell import TENSOR_CORE_BACKENDS, tensor_core_gemm
from .dispatch import call_op, compiling_only, define_op, gemm_backend, kernels
from .quantize import quantize


def emulated_gemm(
    x_packed: torch.Tensor, x_scales: torch.Tensor, w_packed: torch.Tensor, w_scales: torch.Tensor,
    w_swizzled: bool = True,
) -> torch.Tensor:
    """Exact W4A4 emulation: both operands decoded (exact in FP32), FP32 matmul. ``[M, K/2]``, ``[N, K/2]`` -> FP32
    ``[M, N]``."""
    x = nvfp4.decode_nvfp4(x_packed, x_scales, scale_layout="128x4", dtype=torch.float32)
    w = nvfp4.decode_nvfp4(w_packed, w_scales, scale_layout="128x4" if w_swizzled else "linear", dtype=torch.float32)
    return x @ w.t()


def linear_reference(
    x_packed: torch.Tensor, x_scales: torch.Tensor, w_packed: torch.Tensor, w_scales: torch.Tensor, alpha: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype, w_swizzled: bool = True,
) -> torch.Tensor:
    """The torch reference of ``nvfp4_linear``."""
    out = (emulated_gemm(x_packed, x_scales, w_packed, w_scales, w_swizzled) * alpha).to(out_dtype)
    return out if bias is None else out + bias


def linear_impl(
    x_packed: torch.Tensor, x_scales: torch.Tensor, w_packed: torch.Tensor, w_scales: torch.Tensor, alpha: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype, w_swizzled: bool,
) -> torch.Tensor:
    backend = gemm_backend(x_packed.device)
    if backend == "emulated":
        return linear_reference(x_packed, x_scales, w_packed, w_scales, alpha, bias, out_dtype, w_swizzled)
    if not w_swizzled:
        raise RuntimeError(
            "NVFP4Linear holds linear-layout weight scales; the FP4 GEMM needs 128x4. Call "
            "module.swizzle_weight_scales_() or enable_fast_paths(...) first."
        )
    if backend in TENSOR_CORE_BACKENDS:
        out = tensor_core_output(backend, x_packed, x_scales, w_packed, w_scales, alpha, out_dtype)
    elif _kernel_takes_bias(bias, out_dtype):
        return cast(ModuleType, kernels).nvfp4_gemm(x_packed, x_scales, w_packed, w_scales, alpha, out_dtype,
                                                    bias=bias)
    else:
        out = cast(ModuleType, kernels).nvfp4_gemm(x_packed, x_scales, w_packed, w_scales, alpha, out_dtype)
    return out if bias is None else out + bias


def tensor_core_output(
    backend: str, x_packed: torch.Tensor, x_scales: torch.Tensor, w_packed: torch.Tensor, w_scales: torch.Tensor,
    alpha: torch.Tensor, out_dtype: torch.dtype,
) -> torch.Tensor:
    """The Blackwell GEMM (``ops/blackwell.py``) without the bias; an output dtype it cannot write (FP32) is computed
    by the reference GEMM, whose bytes it would have to match anyway."""
    if out_dtype not in (torch.bfloat16, torch.float16):
        return linear_reference(x_packed, x_scales, w_packed, w_scales, alpha, None, out_dtype)
    return tensor_core_gemm(backend, x_packed, x_scales, w_packed, w_scales, alpha, out_dtype)


def _kernel_takes_bias(bias: torch.Tensor | None, out_dtype: torch.dtype) -> bool:
    # The epilogue adds a bias of the output's dtype; any other (torch promotes the sum's dtype) is added by torch.
    return bias is None or (bias.dtype == out_dtype and bias.dim() == 1)


def _linear_fake(x_packed, x_scales, w_packed, w_scales, alpha, bias, out_dtype, w_swizzled):
    return x_packed.new_empty((x_packed.shape[0], w_packed.shape[0]), dtype=out_dtype)


_linear_op = define_op("linear", linear_impl, _linear_fake)


def nvfp4_linear(
    x_packed: torch.Tensor, x_scales: torch.Tensor, w_packed: torch.Tensor, w_scales: torch.Tensor, alpha: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype, w_swizzled: bool = True,
) -> torch.Tensor:
    """x_packed uint8 ``[M, K/2]`` + 128x4 scales, w_packed uint8 ``[N, K/2]`` + scales, alpha FP32 one-element ->
    ``[M, N]`` in ``out_dtype``: ``bf16(gemm * alpha)`` then ``+ bias``."""
    return call_op(_linear_op, linear_impl, x_packed, x_scales, w_packed, w_scales, alpha, bias, out_dtype, w_swizzled)


def takes_decoded_activation(
    rows: int, device: torch.device, bias: torch.Tensor | None, out_dtype: torch.dtype, w_swizzled: bool
) -> bool:
    """Whether the GEMM for ``rows`` activation rows on ``device`` multiplies the activation's decoded FP16 values
    (SM80-SM90 with more than 64 rows), so that a producer may hand it those (``linear_fp16_x``) instead of packed
    bytes."""
    # The cheap tests first: small-M calls then go on to linear_impl without asking for the backend twice.
    return (device.type == "cuda" and w_swizzled and kernels is not None and rows > kernels.PREDECODE_MAX_M
            and _kernel_takes_bias(bias, out_dtype) and gemm_backend(device) == "triton")


def takes_one_row(
    rows: int, device: torch.device, bias: torch.Tensor | None, out_dtype: torch.dtype, w_swizzled: bool
) -> bool:
    """Whether a ``quantized_linear`` call with ``rows`` rows runs ``kernels.nvfp4_gemv`` (one row on SM80-SM90) on
    its row quantized straight to FP16 values: the bytes of ``nvfp4_linear`` on the packed row, which runs the same
    kernel."""
    return (rows == 1 and device.type == "cuda" and w_swizzled and kernels is not None
            and _kernel_takes_bias(bias, out_dtype) and gemm_backend(device) == "triton")


def linear_fp16_x_impl(
    x16: torch.Tensor, w_packed: torch.Tensor, w_scales: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    keyed = (w_packed.shape[0], w_packed, w_scales, alpha, bias)
    key = plan_key("decoded", x16, out_dtype, keyed)
    plan = plan_for(key)
    if plan is not None:
        return plan(x16)
    out = cast(ModuleType, kernels).nvfp4_gemm_fp16_x(x16, w_packed, w_scales, alpha, out_dtype, bias)
    learn_plan(key, _decoded_plan, (x16, out), keyed)
    return out


# Launch plans (kernels/linear_plan.py) by call class. A key holds the addresses of the keyed tensors (every tensor
# the call reads but the activation) with the shapes and dtypes that fix the binaries: a plan is right for any call with
# its key. The rule is structural: a plan's builder is a plain function (no closure) called with the call's own tensors
# (activation, decode, output: fresh per call, planned by shape) and exactly the keyed values the key was made of.
# A class gets its plan from its second call on (a layer that offloading moves on every call never does); a kernel's
# binary is recorded at its third launch in a process (kernels/launch.py), so the first class of a kernel builds at
# its third call; None marks a class that still has none after _PLAN_TRIES calls. Both tables are emptied when they
# grow past _PLAN_LIMIT.
_PLANS: dict[tuple, object] = caches.register("ops.linear.plans", {}, "emptied past _PLAN_LIMIT entries")
_SEEN: dict[tuple, int] = caches.register("ops.linear.calls_seen", {}, "emptied past _PLAN_LIMIT entries")
_PLAN_TRIES = 4
_PLAN_LIMIT = 8192


def plan_key(kind: str, x: torch.Tensor, out_dtype: torch.dtype, keyed: tuple) -> tuple | None:
    """The plan key of a large-M call on SM90 (contiguous 16-byte aligned ``x`` ``[M, K]``; ``keyed``: N, the layer's
    tensors, whose addresses are taken, and plain flags), or None where the call cannot have a plan (another device,
    plans switched off)."""
    if not (x.is_cuda and kernels is not None and kernels.launch.DIRECT_LAUNCH and x.is_contiguous()
            and x.data_ptr() % 16 == 0):
        return None
    # One flat tuple built in one expression: every layer call builds one (docs/performance.md, host time per call).
    return (kind, *x.shape, x.dtype, x.get_device(), out_dtype,
            *[t.data_ptr() if isinstance(t, torch.Tensor) else t for t in keyed])


def plan_for(key: tuple | None):
    """The plan for ``key``, or None where the call must take the wrappers' path (no plan, a launch hook)."""
    if key is None:
        return None
    plan = _PLANS.get(key)
    return None if plan is None or cast(ModuleType, kernels).launch.hooks_installed() else plan


def learn_plan(key: tuple | None, build: Callable[..., object], call: tuple, keyed: tuple) -> None:
    """After a call of class ``key`` took the wrappers' path: its plan is built from its second such call on, as
    ``build(*call, *keyed)``. ``keyed`` must be what ``key`` was made of (checked), and ``build`` a plain function
    (no closure), so a plan reads no tensor whose address is not in its key."""
    if key is None or key in _PLANS or compiling_only():
        return
    calls = _SEEN.get(key, 0) + 1
    if calls == 1 and len(_SEEN) >= _PLAN_LIMIT:
        _SEEN.clear()
    _SEEN[key] = calls
    if calls < 2:
        return
    _check_keyed(key, build, keyed)
    plan = build(*call, *keyed)
    if plan is None and calls < _PLAN_TRIES:
        return
    if len(_PLANS) >= _PLAN_LIMIT:
        _PLANS.clear()
    _PLANS[key] = plan


def _check_keyed(key: tuple, build: Callable[..., object], keyed: tuple) -> None:
    tail = tuple(t.data_ptr() if isinstance(t, torch.Tensor) else t for t in keyed)
    if key[len(key) - len(tail):] != tail:
        raise ValueError(f"learn_plan: the keyed values {tail} are not the ones key {key} was made of")
    if getattr(build, "__closure__", None):
        raise ValueError(f"learn_plan: the builder {build!r} is a closure; a plan reads only its call's tensors and "
                         "the keyed ones it is given")


def forget_plans() -> None:
    """Drop every launch plan (a plan is otherwise right for as long as its key's tensors stay in place)."""
    caches.reset("ops.linear.plans")
    caches.reset("ops.linear.calls_seen")


def planned() -> list:
    """Every launch plan built so far (tests, benchmarks)."""
    return [plan for plan in _PLANS.values() if plan is not None]


def _decoded_plan(x16, out, n, w_packed, w_scales, alpha, bias):
    return cast(ModuleType, kernels).linear_plan(None, x16, None, False, w_packed, w_scales, alpha, bias, out)


def _quantize_plan(x, x16, out, n, w_packed, w_scales, alpha, bias, global_scale, fast_math):
    return cast(ModuleType, kernels).linear_plan(x, x16, global_scale, fast_math, w_packed, w_scales, alpha, bias, out)


def _row_plan(x, x16, out, n, w_packed, w_scales, alpha, bias, global_scale, fast_math):
    return cast(ModuleType, kernels).row_plan(x, x16, global_scale, fast_math, w_packed, w_scales, alpha, bias, out)


def _linear_fp16_x_fake(x16, w_packed, w_scales, alpha, bias, out_dtype):
    return x16.new_empty((x16.shape[0], w_packed.shape[0]), dtype=out_dtype)


_linear_fp16_x_op = define_op("linear_fp16_x", linear_fp16_x_impl, _linear_fp16_x_fake)


def linear_fp16_x(
    x16: torch.Tensor, w_packed: torch.Tensor, w_scales: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``nvfp4_linear`` on an activation already decoded to its exact FP16 values ``[M, K]`` (where
    ``takes_decoded_activation`` holds): the same bytes as passing its packed form."""
    return call_op(_linear_fp16_x_op, linear_fp16_x_impl, x16, w_packed, w_scales, alpha, bias, out_dtype)


def quantized_linear_impl(
    x: torch.Tensor, global_scale: torch.Tensor, fast_math: bool, w_packed: torch.Tensor, w_scales: torch.Tensor,
    alpha: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype, w_swizzled: bool,
) -> torch.Tensor:
    decoded = takes_decoded_activation(x.shape[0], x.device, bias, out_dtype, w_swizzled)
    if decoded or takes_one_row(x.shape[0], x.device, bias, out_dtype, w_swizzled):
        keyed = (w_packed.shape[0], w_packed, w_scales, alpha, bias, global_scale, fast_math)
        key = plan_key("quantize" if decoded else "row", x, out_dtype, keyed)
        plan = plan_for(key)
        if plan is not None:
            return plan(x)
        # The large-M GEMM and the one-row product multiply the activation's exact FP16 values: quantize straight to
        # them (one pass, no packed bytes in between); decode(quantize(x)) has the same bytes (GPU-tested).
        k = cast(ModuleType, kernels)
        x16 = k.quantize_nvfp4_decoded(x, global_scale, fast_math=fast_math)
        gemm, build = (k.nvfp4_gemm_fp16_x, _quantize_plan) if decoded else (k.nvfp4_gemv, _row_plan)
        out = gemm(x16, w_packed, w_scales, alpha, out_dtype, bias=bias)
        learn_plan(key, build, (x, x16, out), keyed)
        return out
    x_packed, x_scales = quantize(x, global_scale, fast_math)
    return linear_impl(x_packed, x_scales, w_packed, w_scales, alpha, bias, out_dtype, w_swizzled)


def _quantized_linear_fake(x, global_scale, fast_math, w_packed, w_scales, alpha, bias, out_dtype, w_swizzled):
    return x.new_empty((x.shape[0], w_packed.shape[0]), dtype=out_dtype)


_quantized_linear_op = define_op("quantized_linear", quantized_linear_impl, _quantized_linear_fake)


def quantized_linear(
    x: torch.Tensor, global_scale: torch.Tensor, fast_math: bool, w_packed: torch.Tensor, w_scales: torch.Tensor,
    alpha: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype, w_swizzled: bool = True,
) -> torch.Tensor:
    """``nvfp4_linear(*quantize(x, global_scale, fast_math), ...)``: x ``[M, K]`` BF16/FP16 -> ``[M, N]`` in
    ``out_dtype``, the same bytes; on SM80-SM90 with M > 64 the activation goes straight to its decoded FP16 values.
    """
    return call_op(_quantized_linear_op, quantized_linear_impl, x.contiguous(), global_scale, fast_math, w_packed,
                   w_scales, alpha, bias, out_dtype, w_swizzled)
