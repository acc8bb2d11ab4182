"""Qwen-Image GELU quantize: ``quantize(gelu(h, approximate="tanh"))`` without writing the GELU output.

``hidden`` is a feed-forward's FC1 output ``[..., K]``; the result is FC2's quantized input. Reference:
``gelu_quantize_reference`` (diffusers' own op, then the unfused quantize; docs/design.md §6). Kernel:
``kernels.gelu_quantize_triton``; ``gelu_quantize_decoded`` gives the exact FP16 values of that result
instead, for an FC2 whose GEMM multiplies those (SM80-SM90, more than 64 rows). Besides the first-use verification of
each call shape, ``gelu_mismatch`` checks the kernel's GELU against torch's on all 65,536 values of the dtype, once
per process and device: GELU is elementwise, so that check covers every input the fused op can see. Under
``torch.compile`` the site runs only where ``check_compiled_gelu`` (run by ``exact_inductor``) found inductor's GELU
equal to torch's on every value too, so that compiled on equals compiled off (docs/design.md §1).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import ModuleType
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F

from .. import caches
from .. import format as nvfp4
from .dispatch import call_op, compiling_only, define_op, kernels
from .fused import AotKernel, Case, Form, FusedOp, Probe, call_class
from .linear import learn_plan, linear_fp16_x_impl, linear_impl, plan_for, plan_key, takes_decoded_activation
from .quantize import empty_quantized, quantize
from .site import Site, SiteKind
from .verify import counted_without_check

# (device, dtype) -> what differs, None if nothing
_MISMATCH: dict[tuple[str, torch.dtype], str | None] = caches.register(
    "ops.gelu_quantize.eager_mismatch", {}, "one entry per device and dtype; kept for the process")
_lock = threading.Lock()


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _every_value(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """All 65,536 bit patterns of a 16-bit ``dtype`` on ``device``."""
    return torch.arange(1 << 16, dtype=torch.int32, device=device).to(torch.int16).view(dtype)


def _differ(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Where two GELU outputs differ in their bits, NaNs of any payload counting as equal."""
    return (got.view(torch.int16) != want.view(torch.int16)) & ~(got.isnan() & want.isnan())


def gelu_mismatch(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when the Triton kernel's GELU equals ``F.gelu(x, approximate="tanh")`` for every ``dtype`` value on
    ``device`` (NaNs of any payload count as equal: the quantize encodes every NaN alike), else what differs.
    Computed once per process, device and dtype; while a CUDA graph is being captured, before that check, it cannot
    run and says so (the caller falls back)."""
    key = (str(device), dtype)
    if key not in _MISMATCH:
        if compiling_only():  # the check's kernel compiles now; the check itself runs at the next call
            cast(ModuleType, kernels).gelu_triton(_every_value(device, dtype))
            return None
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return "GELU not yet checked against torch's when captured into a CUDA graph"
        values = _every_value(device, dtype)
        differ = _differ(cast(ModuleType, kernels).gelu_triton(values), _gelu_tanh(values))
        n = int(differ.sum())
        examples = values[differ][:4].float().tolist() if n else []
        with _lock:
            _MISMATCH[key] = f"{n} of 65536 {dtype} values differ from torch's GELU, e.g. {examples}" if n else None
    return _MISMATCH[key]


# (device, dtype) -> "" where inductor's GELU agrees, else why not
_COMPILED: dict[tuple[str, torch.dtype], str] = caches.register(
    "ops.gelu_quantize.compiled_mismatch", {}, "one entry per device and dtype; kept for the process")


def check_compiled_gelu(device: torch.device) -> None:
    """Compile ``F.gelu(x, approximate="tanh")`` with the inductor settings in force and compare it, on all 65,536
    BF16 and FP16 values on ``device``, with torch's eager GELU; with ``gelu_mismatch`` (the kernel against torch)
    this is what lets the GELU site run inside compiled graphs. Once per process, device and dtype."""
    compiled = None
    for dtype in (torch.bfloat16, torch.float16):
        key = (str(device), dtype)
        if key in _COMPILED:
            continue
        try:
            compiled = compiled or torch.compile(_gelu_tanh, fullgraph=True, dynamic=False)
            with torch.no_grad():
                values = _every_value(device, dtype)
                n = int(_differ(compiled(values), _gelu_tanh(values)).sum())
            reason = (f"inductor's GELU differs from torch's on {n} of 65536 {dtype} values" if n
                      else gelu_mismatch(device, dtype) or "")
        except Exception as error:  # noqa: BLE001 - any failure keeps diffusers' GELU, which is always right
            reason = f"inductor's GELU could not be checked: {type(error).__name__}: {error}"
        with _lock:
            _COMPILED[key] = reason


@torch.compiler.assume_constant_result
def compiled_gelu_reason(device: str, bf16: bool) -> str:
    """Why a compiled graph must keep diffusers' GELU on ``device`` ("" where ``check_compiled_gelu`` passed there).
    Read while tracing; torch.compile keeps the answer as a constant of the graph."""
    key = (device, torch.bfloat16 if bf16 else torch.float16)
    reason = _COMPILED.get(key)
    if reason is None:
        return "compiled: kept diffusers' op (inductor's GELU not checked here: compile inside exact_inductor())"
    return reason


def gelu_quantize_reference(
    hidden: torch.Tensor, global_scale: torch.Tensor, fast_math: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused computation: diffusers 0.42.1 ``GELU.gelu`` (``F.gelu(h, approximate="tanh")``), then
    ``quantize``."""
    x = F.gelu(hidden, approximate="tanh")
    return quantize(x.reshape(-1, x.shape[-1]), global_scale, fast_math)


def gelu_quantize_decoded_reference(hidden: torch.Tensor, global_scale: torch.Tensor, fast_math: bool) -> torch.Tensor:
    """The unfused computation, then the decode: FP16 ``[R, K]``, each E2M1 value times its E4M3 block scale."""
    return nvfp4.decode_nvfp4(*gelu_quantize_reference(hidden, global_scale, fast_math), dtype=torch.float16)


def _rows(hidden: torch.Tensor) -> int:
    return hidden.numel() // hidden.shape[-1]


_GELU_SIGNATURE = {"h_ptr": "*i64", "g_ptr": "*fp32", "packed_ptr": "*i64", "scales_ptr": "*u8", "M": "i32", "K": "i32",
                   "row_stride": "i32", "padded_cols": "i32", "col_tiles": "i32"}
# hidden [..., K] BF16/FP16, K % 16 == 0, global_scale, fast_math -> packed uint8 [R, K/2], 128x4 scales uint8
# [round_up(R,128), round_up(K/16,4)] of gelu(hidden, approximate="tanh").
gelu_quantize = Form(
    "gelu_quantize", gelu_quantize_reference,
    lambda k, hidden, g, fast_math: k.gelu_quantize_triton(hidden, g, fast_math=fast_math),
    lambda hidden, *_: empty_quantized(hidden, _rows(hidden), hidden.shape[-1]), ("packed", "scales"),
    aot=AotKernel("gelu", "gelu_quantize", "_gelu_quantize_kernel", _GELU_SIGNATURE))
# hidden [..., K] -> FP16 [R, K]: the decoded values of gelu_quantize's result, for an FC2 whose GEMM multiplies those.
gelu_quantize_decoded = Form(
    "gelu_quantize_decoded", gelu_quantize_decoded_reference,
    lambda k, hidden, g, fast_math: k.gelu_quantize_decoded_triton(hidden, g, fast_math=fast_math),
    lambda hidden, *_: hidden.new_empty((_rows(hidden), hidden.shape[-1]), dtype=torch.float16), ("decoded",),
    aot=AotKernel("gelu_decoded", "gelu_quantize", "_gelu_quantize_decoded_kernel", {
        "h_ptr": "*i64", "g_ptr": "*fp32", "out_ptr": "*i64", "M": "i32", "K": "i32", "row_stride": "i32",
        "col_tiles": "i32"}))


def _probe(p: Probe) -> list[Case]:
    """Qwen-Image's feed-forward: FC1's output (12288) per token."""
    fc1 = p.randn(p.rows, p.pick(12288, 128), scale=2.0)
    return [Case("GELU quantize", f"{p.rows}x{fc1.shape[-1]}", (fc1, p.global_scale(fc1), p.fast_math))]


# A GPU whose kernel GELU differs from torch's keeps diffusers' GELU at every GELU site (patches/qwenimage.py).
GELU_QUANTIZE = FusedOp(gelu_quantize, _probe, gelu_quantize_decoded,
                        unused_here=lambda device: gelu_mismatch(device, torch.bfloat16))


def _gelu_plan(hidden, x16, out, n, w_packed, w_scales, alpha, bias, global_scale, fast_math) -> _VerifiedPlan | None:
    """The launch plan of FC2 on GELU (``learn_plan``'s builder: the call's tensors, then the keyed ones)."""
    k = cast(ModuleType, kernels)
    plan = k.linear_plan(hidden, x16, global_scale, fast_math, w_packed, w_scales, alpha, bias, out,
                         k.gelu_decoded_launch)
    return None if plan is None else _VerifiedPlan(
        plan, call_class(gelu_quantize_decoded.name, (hidden, global_scale, fast_math)))


class _VerifiedPlan(NamedTuple):
    """A launch plan of FC2 on GELU and the verification key of its GELU quantize: it runs only for a verified class."""

    plan: Callable[[torch.Tensor], torch.Tensor]
    call_class: str


def _gelu_linear_impl(
    hidden: torch.Tensor, global_scale: torch.Tensor, fast_math: bool, w_packed: torch.Tensor, w_scales: torch.Tensor,
    alpha: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype, w_swizzled: bool, stats_id: int, kind: str,
) -> torch.Tensor:
    site = Site(stats_id, cast(SiteKind, kind))
    if not takes_decoded_activation(hidden.shape[0], hidden.device, bias, out_dtype, w_swizzled):
        packed, scales = gelu_quantize.checked(site, hidden, global_scale, fast_math)
        return linear_impl(packed, scales, w_packed, w_scales, alpha, bias, out_dtype, w_swizzled)
    keyed = (w_packed.shape[0], w_packed, w_scales, alpha, bias, global_scale, fast_math)
    key = plan_key("gelu", hidden, out_dtype, keyed)
    verified = plan_for(key)
    if verified is not None and counted_without_check(stats_id, site.kind, verified.call_class):
        return verified.plan(hidden)  # the GELU quantize kernel and the GEMM, launched directly (ops/linear.py)
    x16 = gelu_quantize_decoded.checked(site, hidden, global_scale, fast_math)
    out = linear_fp16_x_impl(x16, w_packed, w_scales, alpha, bias, out_dtype)
    learn_plan(key, _gelu_plan, (hidden, x16, out), keyed)
    return out


def _gelu_linear_fake(hidden, global_scale, fast_math, w_packed, w_scales, alpha, bias, out_dtype, w_swizzled,
                      stats_id, kind):
    return hidden.new_empty((hidden.shape[0], w_packed.shape[0]), dtype=out_dtype)


_gelu_linear_op = define_op("gelu_linear", _gelu_linear_impl, _gelu_linear_fake)


def gelu_linear(
    site: Site, hidden: torch.Tensor, global_scale: torch.Tensor, fast_math: bool, w_packed: torch.Tensor,
    w_scales: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype, w_swizzled: bool,
) -> torch.Tensor:
    """An NVFP4 layer (FC2) on ``gelu(hidden, approximate="tanh")``: hidden ``[R, K]`` BF16/FP16 -> ``[R, N]`` in
    ``out_dtype``, the bytes of ``nvfp4_linear`` on ``gelu_quantize``'s result. The GELU quantize is verified at first
    use per call class, counted under ``site``; from a verified class's second call on, one launch plan runs the GELU
    quantize and the GEMM (one op call, as an unfused layer's)."""
    return call_op(_gelu_linear_op, _gelu_linear_impl, hidden, global_scale, fast_math, w_packed, w_scales, alpha, bias,
                   out_dtype, w_swizzled, site.stats_id, site.kind)
