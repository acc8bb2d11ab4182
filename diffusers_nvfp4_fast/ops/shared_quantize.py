"""Several NVFP4 linears on one activation, quantized once: ``[quantized_linear(x, s_i, ..., w_i, ...) for i]`` with
the activation quantized once where every ``s_i`` holds the same value (docs/design.md §1, "compiled graphs").

Reference: the list of ``quantized_linear`` calls. There is no kernel of its own: one quantize (packed, or straight to
the FP16 values the SM90 GEMM multiplies) and each layer's GEMM, the two halves ``quantized_linear`` runs per layer,
so the bytes are those of the separate calls. Compiled graphs get it from ``inductor.ShareActivationQuantize``,
which rewrites the ``quantized_linear`` nodes that read one tensor (a block's query, key and value projections).
Eager fused sites share their quantize their own way (``patches/adaln.py``).
"""

from __future__ import annotations

import torch

from .. import caches
from .dispatch import call_op, define_op, kernels
from .linear import linear_fp16_x_impl, linear_impl, quantized_linear_impl, takes_decoded_activation
from .quantize import quantize

# Whether the global scales at these (address, version) pairs hold one value: asked once per key (a device sync),
# outside CUDA-graph capture; an in-place update of a scale bumps its version and so asks again.
_EQUAL_SCALES: dict[tuple, bool] = caches.register("ops.shared_quantize.equal_scales", {},
                                                   "emptied when it grows past _EQUAL_SCALES_LIMIT entries")
_EQUAL_SCALES_LIMIT = 4096


def _scales_equal(scales: list[torch.Tensor]) -> bool:
    """Whether every one-element global scale holds the first's value; False where that cannot be known without a
    device sync that is not allowed now (CUDA-graph capture) or a version counter (inference tensors)."""
    try:
        key = tuple((s.data_ptr(), s._version) for s in scales)
    except RuntimeError:  # inference tensors have no version counter
        return False
    known = _EQUAL_SCALES.get(key)
    if known is not None:
        return known
    if len({p for p, _ in key}) == 1:
        return True
    if scales[0].is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    if len(_EQUAL_SCALES) >= _EQUAL_SCALES_LIMIT:
        _EQUAL_SCALES.clear()
    _EQUAL_SCALES[key] = equal = all(torch.equal(scales[0], s) for s in scales[1:])
    return equal


def quantized_linears_reference(
    x: torch.Tensor, global_scales: list[torch.Tensor], fast_math: bool, w_packed: list[torch.Tensor],
    w_scales: list[torch.Tensor], alphas: list[torch.Tensor], biases: list[torch.Tensor | None],
    out_dtype: torch.dtype, w_swizzled: list[bool],
) -> list[torch.Tensor]:
    """One ``quantized_linear`` per layer: what the op must equal byte for byte."""
    return [quantized_linear_impl(x, s, fast_math, w, ws, a, b, out_dtype, sw) for s, w, ws, a, b, sw in
            zip(global_scales, w_packed, w_scales, alphas, biases, w_swizzled)]


def _quantized_linears_impl(
    x: torch.Tensor, global_scales: list[torch.Tensor], fast_math: bool, w_packed: list[torch.Tensor],
    w_scales: list[torch.Tensor], alphas: list[torch.Tensor], biases: list[torch.Tensor | None],
    out_dtype: torch.dtype, w_swizzled: list[bool],
) -> list[torch.Tensor]:
    forms = {takes_decoded_activation(x.shape[0], x.device, b, out_dtype, s) for b, s in zip(biases, w_swizzled)}
    if len(forms) > 1 or not _scales_equal(global_scales):
        return quantized_linears_reference(x, global_scales, fast_math, w_packed, w_scales, alphas, biases,
                                           out_dtype, w_swizzled)
    if forms == {True}:  # the SM90 GEMM multiplies the activation's FP16 values: quantize straight to them, once
        assert kernels is not None  # takes_decoded_activation holds only where the kernels imported
        x16 = kernels.quantize_nvfp4_decoded(x, global_scales[0], fast_math=fast_math)
        return [linear_fp16_x_impl(x16, w, ws, a, b, out_dtype) for w, ws, a, b in
                zip(w_packed, w_scales, alphas, biases)]
    x_packed, x_scales = quantize(x, global_scales[0], fast_math)
    return [linear_impl(x_packed, x_scales, w, ws, a, b, out_dtype, s) for w, ws, a, b, s in
            zip(w_packed, w_scales, alphas, biases, w_swizzled)]


def _quantized_linears_fake(x, global_scales, fast_math, w_packed, w_scales, alphas, biases, out_dtype, w_swizzled):
    return [x.new_empty((x.shape[0], w.shape[0]), dtype=out_dtype) for w in w_packed]


_quantized_linears_op = define_op("quantized_linears", _quantized_linears_impl, _quantized_linears_fake)


def quantized_linears(
    x: torch.Tensor, global_scales: list[torch.Tensor], fast_math: bool, w_packed: list[torch.Tensor],
    w_scales: list[torch.Tensor], alphas: list[torch.Tensor], biases: list[torch.Tensor | None],
    out_dtype: torch.dtype, w_swizzled: list[bool],
) -> list[torch.Tensor]:
    """x ``[M, K]`` BF16/FP16 and per layer i its global scale, packed weight ``[N_i, K/2]``, scales, alpha, bias and
    layout -> ``[M, N_i]`` per layer in ``out_dtype``: the bytes of one ``quantized_linear`` per layer."""
    return call_op(_quantized_linears_op, _quantized_linears_impl, x.contiguous(), global_scales, fast_math, w_packed,
                   w_scales, alphas, biases, out_dtype, w_swizzled)
