"""Adaptive LayerNorm quantize: ``LayerNorm(x) -> * (1 + scale) + shift -> quantize`` in one pass, the input of the
projections after a block's norm1 (Qwen-Image's and FLUX.2's query/key/value, FLUX.2's fused single-stream input).

Reference: ``adaln_quantize_reference``, diffusers' eager ops followed by the standalone quantize (docs/design.md
§6). Kernel: ``kernels.adaln_quantize_triton`` (the residual-norm kernel without its residual add). The ``_decoded``
variant gives the exact FP16 values, for consumers whose GEMM multiplies those (SM80-SM90, more than 64 rows).
"""

from __future__ import annotations

from typing import NamedTuple, cast

import torch
import torch.nn.functional as F

from .. import format as nvfp4
from .dispatch import call_op, custom_op_pair, kernels
from .quantize import empty_quantized, quantize
from .qwen_resnorm_quantize import broadcast_rows, kernel_runs_on
from .verify import run_checked

QWEN_KIND = "qwen_adaln"  # Qwen-Image norm1 + modulate into the attention's query/key/value
FLUX2_KIND = "flux2_adaln"  # FLUX.2 norm1 / single-stream norm + modulate into the attention's input projections


class AdaLNInputs(NamedTuple):
    """x: the LayerNorm's input ``[B, L, D]`` BF16; scale, shift: per sample ``[B, D]`` / ``[B, 1, D]`` or per token
    ``[B, L, D]``."""

    x: torch.Tensor
    scale: torch.Tensor
    shift: torch.Tensor


def adaln_chain(inputs: AdaLNInputs, eps: float) -> torch.Tensor:
    """diffusers' norm1 section, op by op (each BF16 op rounds): ``LayerNorm(x) * (1 + scale) + shift``. FLUX.2
    writes ``(1 + scale) * n``: the same product, IEEE multiplication commutes."""
    x, scale, shift = inputs
    n = F.layer_norm(x, (x.shape[-1],), eps=eps)
    return n * (1 + broadcast_rows(scale, n)) + broadcast_rows(shift, n)


def adaln_quantize_reference(
    inputs: AdaLNInputs, global_scale: torch.Tensor, eps: float, fast_math: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager chain + standalone quantize -> (packed ``[B*L, D/2]``, 128x4 scales)."""
    m = adaln_chain(inputs, eps)
    return quantize(m.reshape(-1, m.shape[-1]), global_scale, fast_math)


def adaln_quantize_decoded_reference(
    inputs: AdaLNInputs, global_scale: torch.Tensor, eps: float, fast_math: bool
) -> torch.Tensor:
    """The reference, then the decode: FP16 ``[B*L, D]``, each E2M1 value times its E4M3 block scale."""
    return nvfp4.decode_nvfp4(*adaln_quantize_reference(inputs, global_scale, eps, fast_math), dtype=torch.float16)


def _impl(x, scale, shift, global_scale, eps, fast_math):
    if kernel_runs_on(x):
        return kernels.adaln_quantize_triton(x, scale, shift, global_scale, eps=eps, fast_math=fast_math)
    return adaln_quantize_reference(AdaLNInputs(x, scale, shift), global_scale, eps, fast_math)


def _decoded_impl(x, scale, shift, global_scale, eps, fast_math):
    if kernel_runs_on(x):
        return kernels.adaln_quantize_triton(x, scale, shift, global_scale, eps=eps, fast_math=fast_math,
                                             decoded=True)[0]
    return adaln_quantize_decoded_reference(AdaLNInputs(x, scale, shift), global_scale, eps, fast_math)


def _op_impl(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, global_scale: torch.Tensor, eps: float, fast_math: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl(x, scale, shift, global_scale, eps, fast_math)


def _checked_impl(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, global_scale: torch.Tensor, eps: float, fast_math: bool,
    stats_id: int, shape_class: str, kind: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = AdaLNInputs(x, scale, shift)
    return cast("tuple[torch.Tensor, torch.Tensor]", run_checked(
        stats_id, kind, shape_class, ("packed", "scales"),
        lambda: _impl(*inputs, global_scale, eps, fast_math),
        lambda: adaln_quantize_reference(inputs, global_scale, eps, fast_math),
    ))


def _fake(x, scale, shift, global_scale, eps, fast_math, *_):
    return empty_quantized(x, x.numel() // x.shape[-1], x.shape[-1])


def _decoded_op_impl(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, global_scale: torch.Tensor, eps: float, fast_math: bool,
) -> torch.Tensor:
    return _decoded_impl(x, scale, shift, global_scale, eps, fast_math)


def _decoded_checked_impl(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, global_scale: torch.Tensor, eps: float, fast_math: bool,
    stats_id: int, shape_class: str, kind: str,
) -> torch.Tensor:
    inputs = AdaLNInputs(x, scale, shift)
    return run_checked(
        stats_id, kind, shape_class + ",decoded", ("decoded",),
        lambda: (_decoded_impl(*inputs, global_scale, eps, fast_math),),
        lambda: (adaln_quantize_decoded_reference(inputs, global_scale, eps, fast_math),),
    )[0]


def _decoded_fake(x, scale, shift, global_scale, eps, fast_math, *_):
    return x.new_empty((x.numel() // x.shape[-1], x.shape[-1]), dtype=torch.float16)


_op, _checked_op = custom_op_pair("adaln_quantize", _op_impl, _checked_impl, _fake)
_decoded_op, _decoded_checked_op = custom_op_pair(
    "adaln_quantize_decoded", _decoded_op_impl, _decoded_checked_impl, _decoded_fake)


def adaln_quantize(
    inputs: AdaLNInputs, global_scale: torch.Tensor, eps: float, fast_math: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (packed uint8 ``[B*L, D/2]``, 128x4 scales uint8) of ``LayerNorm(x) * (1 + scale) + shift``."""
    return call_op(_op, _op_impl, *inputs, global_scale, eps, fast_math)


def adaln_quantize_checked(
    inputs: AdaLNInputs, global_scale: torch.Tensor, eps: float, fast_math: bool, stats_id: int, shape_class: str,
    kind: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``adaln_quantize`` with first-use byte verification against the reference, counted under site ``kind``."""
    return call_op(_checked_op, _checked_impl, *inputs, global_scale, eps, fast_math, stats_id, shape_class, kind)


def adaln_quantize_decoded_checked(
    inputs: AdaLNInputs, global_scale: torch.Tensor, eps: float, fast_math: bool, stats_id: int, shape_class: str,
    kind: str,
) -> torch.Tensor:
    """-> FP16 ``[B*L, D]``: the decoded values of ``adaln_quantize``'s result, with first-use byte verification."""
    return call_op(_decoded_checked_op, _decoded_checked_impl, *inputs, global_scale, eps, fast_math, stats_id,
                   shape_class, kind)
