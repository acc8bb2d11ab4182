"""NVFP4 activation quantize, the unfused path: BF16/FP16 ``[M, K]`` -> packed ``[M, K/2]`` + 128x4 scales.

Reference: ``format.quantize_nvfp4`` (docs/design.md §3). Kernel: ``kernels.quantize_nvfp4_triton``.
"""

from __future__ import annotations

from types import ModuleType
from typing import cast

import torch

from .. import format as nvfp4
from .dispatch import call_op, define_op, kernels, triton_runs_on
from .fused import AotKernel


def quantize_reference(
    x: torch.Tensor, global_scale: torch.Tensor, fast_math: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference: ``format.quantize_nvfp4`` with 128x4 scales."""
    return nvfp4.quantize_nvfp4(x, global_scale, fast_math=fast_math)


def _quantize_impl(x: torch.Tensor, global_scale: torch.Tensor, fast_math: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if triton_runs_on(x):
        return cast(ModuleType, kernels).quantize_nvfp4_triton(x, global_scale, fast_math=fast_math)
    return quantize_reference(x, global_scale, fast_math)


def empty_quantized(like: torch.Tensor, rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised (packed uint8 ``[rows, k/2]``, 128x4 scales) on ``like``'s device: the fake ops' outputs."""
    return (like.new_empty((rows, k // 2), dtype=torch.uint8),
            like.new_empty(nvfp4.padded_scale_shape(rows, k), dtype=torch.uint8))


def _quantize_fake(x, global_scale, fast_math):
    return empty_quantized(x, *x.shape)


_quantize_op = define_op("quantize", _quantize_impl, _quantize_fake)


def quantize(x: torch.Tensor, global_scale: torch.Tensor, fast_math: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[M, K]`` BF16/FP16, global_scale FP32 one-element -> (packed uint8 ``[M, K/2]``, 128x4 scales uint8
    ``[round_up(M,128), round_up(K/16,4)]``)."""
    return call_op(_quantize_op, _quantize_impl, x.contiguous(), global_scale, fast_math)


_QUANTIZE_DECODED_SIGNATURE = {"x_ptr": "*i64", "g_ptr": "*fp32", "out_ptr": "*i64", "M": "i32", "K": "i32",
                               "row_stride": "i32", "col_tiles": "i32"}
# The standalone quantize kernels' ahead-of-time builds (ops/registry.py lists them with the fused ops').
AOT_KERNELS = (
    AotKernel("quantize", "quantize_nvfp4", "_quantize_nvfp4_kernel", {
        "x_ptr": "*i64", "g_ptr": "*fp32", "packed_ptr": "*i64", "scales_ptr": "*u8", "M": "i32", "K": "i32",
        "row_stride": "i32", "padded_cols": "i32", "col_tiles": "i32"}),
    AotKernel("decoded", "quantize_nvfp4", "_quantize_nvfp4_decoded_kernel", _QUANTIZE_DECODED_SIGNATURE),
)
