"""Launch plans: an NVFP4 linear call's kernels launched without their Python wrappers (eager host time).

An eager step launches each layer's kernels through wrappers that check arguments, compute Triton's specialization
key and encode the weight's TMA descriptors on every call; a Qwen-Image step makes 784 such calls and waits for the
host (docs/performance.md, "Host time per call"). A plan is built after a call has run the normal way, from the
binaries that call recorded (``launch.launch_by_site``): it keeps the launch arguments that do not change between
calls of the same class (the layer's tensors, M, dtypes, recipe) and takes only the activation and fresh outputs per
call. Same binaries, same arguments: same bytes (GPU-tested against the wrappers, tests/test_launch.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import triton_compat as compat
from .nvfp4_gemm import sm90_kernel_module
from .nvfp4_gemv import GemvLaunch, gemv_launch
from .quantize_nvfp4 import DecodedQuantizeLaunch, decoded_quantize_launch

__all__ = ["LinearPlan", "RowPlan", "linear_plan", "row_plan"]

if TYPE_CHECKING:  # the Gluon module is imported where this Triton has it (nvfp4_gemm.sm90_kernel_module)
    from .nvfp4_gemm_sm90 import Sm90Launch


class LinearPlan:
    """One NVFP4 linear call class on SM90 with more than 64 rows: ``quantize`` (BF16/FP16 activation -> its exact
    FP16 decode; None for a plan that takes that decode from a fused producer) then the GEMM into a fresh output."""

    __slots__ = ("quantize", "gemm", "k", "device", "device_index")

    def __init__(self, quantize: DecodedQuantizeLaunch | None, gemm: Sm90Launch, k: int, device: torch.device):
        self.quantize, self.gemm, self.k, self.device = quantize, gemm, k, device
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``[m, k]`` contiguous, 16-byte aligned, on the plan's device: BF16/FP16 for a quantizing plan, the FP16
        decode otherwise. Returns the fresh ``[m, n]`` output."""
        gemm = self.gemm
        stream = compat.current_raw_stream(self.device_index)
        out = torch.empty((gemm.m, gemm.n), dtype=gemm.out_dtype, device=self.device)
        if self.quantize is None:
            return gemm.run(x.data_ptr(), out, stream)
        x16 = torch.empty((gemm.m, self.k), dtype=torch.float16, device=self.device)
        address = x16.data_ptr()
        self.quantize.run(x.data_ptr(), address, stream)
        return gemm.run(address, out, stream)


def linear_plan(x: torch.Tensor | None, x16: torch.Tensor, global_scale: torch.Tensor | None, fast_math: bool,
                w_packed: torch.Tensor, w_scales: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor | None,
                out: torch.Tensor, producer=decoded_quantize_launch) -> LinearPlan | None:
    """The plan of a call that just ran the normal way on SM90 (decoded quantize, then ``nvfp4_gemm_sm90``): ``x``
    its contiguous BF16/FP16 activation (None when a fused producer wrote the decode), ``x16`` the FP16 decode
    ``[M, K]`` its GEMM read, ``out`` its result. ``producer`` gives the launch that wrote ``x16`` from ``x``
    (``decoded_quantize_launch``'s arguments; ``gelu_decoded_launch`` for FC2 after GELU). None where the GEMM is not
    the SM90 kernel or a kernel cannot be launched directly."""
    k = x16.shape[1]
    sm90 = sm90_kernel_module()
    if sm90 is None or not sm90.sm90_supported(k, w_packed, w_scales):
        return None
    if out.dtype not in (torch.bfloat16, torch.float16) or (bias is not None and not bias.is_contiguous()):
        return None  # the GEMM wrapper would add that bias outside the kernel
    gemm = sm90.sm90_launch(x16, w_packed, w_scales, alpha, out, bias)
    if gemm is None:
        return None
    if x is None:
        return LinearPlan(None, gemm, k, out.device)
    assert global_scale is not None  # a quantizing plan quantizes with the layer's input scale
    quantize = producer(x, global_scale, x16, fast_math)
    return None if quantize is None else LinearPlan(quantize, gemm, k, out.device)


class RowPlan:
    """One NVFP4 linear call class with one activation row: ``quantize_nvfp4_decoded`` (the row's exact FP16 values)
    then ``nvfp4_gemv``, both launched directly, into a fresh ``[1, N]`` output."""

    __slots__ = ("quantize", "gemv", "k", "device_index")

    def __init__(self, quantize: DecodedQuantizeLaunch, gemv: GemvLaunch, k: int):
        self.quantize, self.gemv, self.k = quantize, gemv, k
        device = gemv.device
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``[1, k]`` contiguous, 16-byte aligned BF16/FP16 on the plan's device. Returns the fresh ``[1, n]``."""
        gemv = self.gemv
        stream = compat.current_raw_stream(self.device_index)
        x16 = torch.empty((1, self.k), dtype=torch.float16, device=gemv.device)
        out = torch.empty((1, gemv.n), dtype=gemv.out_dtype, device=gemv.device)
        address = x16.data_ptr()
        self.quantize.run(x.data_ptr(), address, stream)
        return gemv.run(address, out, stream)


def row_plan(x: torch.Tensor, x16: torch.Tensor, global_scale: torch.Tensor, fast_math: bool, w_packed: torch.Tensor,
             w_scales: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor | None,
             out: torch.Tensor) -> RowPlan | None:
    """The plan of a one-row call that just ran the normal way: ``x16 = quantize_nvfp4_decoded(x, global_scale,
    fast_math=fast_math)`` (``x`` contiguous), then ``out = nvfp4_gemv(x16, ..., bias=bias)``; None where the product
    split K or a kernel cannot be launched directly."""
    if bias is not None and not bias.is_contiguous():
        return None
    gemv = gemv_launch(x16, w_packed, w_scales, alpha, out, bias)
    quantize = None if gemv is None else decoded_quantize_launch(x, global_scale, x16, fast_math)
    return None if quantize is None or gemv is None else RowPlan(quantize, gemv, x16.shape[1])
