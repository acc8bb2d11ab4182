"""Qwen-Image residual-norm quantize: ``residual + gate * attn -> LayerNorm -> modulate -> quantize`` in one pass.

Reference: ``qwen_resnorm_quantize_reference``, diffusers' eager ops followed by the standalone quantize
(docs/design.md §6). Kernel: ``kernels.qwen_resnorm_quantize_triton``. The ``_decoded`` variant gives FC1's input as
its exact FP16 values, for an FC1 whose GEMM multiplies those (SM80-SM90, more than 64 rows).
"""

from __future__ import annotations

from typing import NamedTuple, cast

import torch
import torch.nn.functional as F

from .. import format as nvfp4
from .dispatch import call_op, custom_op_pair, kernels, triton_runs_on
from .quantize import empty_quantized, quantize
from .verify import run_checked

KIND = "qwen_resnorm"
FLUX2_KIND = "flux2_resnorm"  # the same fused op in FLUX.2 double-stream blocks (before ff / ff_context)


class ResNormInputs(NamedTuple):
    """One stream's tensors between the attention output and FC1 of a ``QwenImageTransformerBlock``.

    residual, x: ``[B, L, D]`` BF16 (``x`` is the attention output, without its projection bias when ``bias`` is
    given); bias: ``[D]`` or None; gate, scale, shift: per sample ``[B, D]`` / ``[B, 1, D]`` or per token ``[B, L, D]``.
    """

    residual: torch.Tensor
    x: torch.Tensor
    bias: torch.Tensor | None
    gate: torch.Tensor
    scale: torch.Tensor
    shift: torch.Tensor


def broadcast_rows(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Per-sample modulation ``[B, D]`` (or ``[B, 1, D]`` / ``[B, L, D]``) -> broadcastable against ``x [B, L, D]``."""
    return p.unsqueeze(1) if p.dim() == 2 else p


def qwen_residual_chain(inputs: ResNormInputs, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' Qwen-Image block between the attention output and FC1, op by op (each BF16 op rounds).

    Returns (residual_out ``[B, L, D]``, modulated FC1 input ``[B, L, D]``).
    """
    residual, x, bias, gate, scale, shift = inputs
    a = x if bias is None else x + bias
    r = residual + broadcast_rows(gate, a) * a
    n = F.layer_norm(r, (r.shape[-1],), eps=eps)
    m = n * (1 + broadcast_rows(scale, n)) + broadcast_rows(shift, n)
    return r, m


def qwen_resnorm_quantize_reference(
    inputs: ResNormInputs, global_scale: torch.Tensor, eps: float, fast_math: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eager chain + standalone quantize -> (residual_out ``[B, L, D]``, packed ``[B*L, D/2]``, 128x4 scales)."""
    r, m = qwen_residual_chain(inputs, eps)
    packed, scales = quantize(m.reshape(-1, m.shape[-1]), global_scale, fast_math)
    return r, packed, scales


def kernel_runs_on(x: torch.Tensor) -> bool:
    """True where the fused Triton kernel runs for ``x``."""
    return triton_runs_on(x) and hasattr(kernels, "qwen_resnorm_quantize_triton")


def _impl(residual, x, bias, gate, scale, shift, global_scale, eps, fast_math):
    """The kernel where it runs, else the reference (the custom ops below wrap it with a typed signature)."""
    if kernel_runs_on(x):
        return kernels.qwen_resnorm_quantize_triton(residual, x, bias, gate, scale, shift, global_scale, eps=eps,
                                                    fast_math=fast_math)
    return qwen_resnorm_quantize_reference(ResNormInputs(residual, x, bias, gate, scale, shift), global_scale, eps,
                                           fast_math)


def _fake(residual, x, bias, gate, scale, shift, global_scale, eps, fast_math, *_):
    d = residual.shape[-1]
    rows = residual.numel() // d
    return (torch.empty_like(residual, memory_format=torch.contiguous_format), *empty_quantized(residual, rows, d))


def _checked_impl(
    residual: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, gate: torch.Tensor, scale: torch.Tensor,
    shift: torch.Tensor, global_scale: torch.Tensor, eps: float, fast_math: bool, stats_id: int, shape_class: str,
    kind: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    inputs = ResNormInputs(residual, x, bias, gate, scale, shift)
    return cast("tuple[torch.Tensor, torch.Tensor, torch.Tensor]", run_checked(
        stats_id, kind, shape_class, ("residual_out", "packed", "scales"),
        lambda: _impl(*inputs, global_scale, eps, fast_math),
        lambda: qwen_resnorm_quantize_reference(inputs, global_scale, eps, fast_math),
    ))


def _op_impl(
    residual: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, gate: torch.Tensor, scale: torch.Tensor,
    shift: torch.Tensor, global_scale: torch.Tensor, eps: float, fast_math: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _impl(residual, x, bias, gate, scale, shift, global_scale, eps, fast_math)


_op, _checked_op = custom_op_pair("qwen_resnorm_quantize", _op_impl, _checked_impl, _fake)


def qwen_resnorm_quantize(
    inputs: ResNormInputs, global_scale: torch.Tensor, eps: float, fast_math: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (residual_out ``[B, L, D]``, packed uint8 ``[B*L, D/2]``, 128x4 scales uint8) of the modulated FC1 input."""
    return call_op(_op, _op_impl, *inputs, global_scale, eps, fast_math)


def qwen_resnorm_quantize_checked(
    inputs: ResNormInputs, global_scale: torch.Tensor, eps: float, fast_math: bool, stats_id: int, shape_class: str,
    kind: str = KIND,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``qwen_resnorm_quantize`` with first-use byte verification against the eager chain + standalone quantize,
    counted under site ``kind``."""
    return call_op(_checked_op, _checked_impl, *inputs, global_scale, eps, fast_math, stats_id, shape_class, kind)


def qwen_resnorm_quantize_decoded_reference(
    inputs: ResNormInputs, global_scale: torch.Tensor, eps: float, fast_math: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference, then the decode: (residual_out, FP16 ``[B*L, D]`` = each E2M1 value times its block scale)."""
    r, packed, scales = qwen_resnorm_quantize_reference(inputs, global_scale, eps, fast_math)
    return r, nvfp4.decode_nvfp4(packed, scales, dtype=torch.float16)


def _decoded_impl(residual, x, bias, gate, scale, shift, global_scale, eps, fast_math):
    if kernel_runs_on(x):
        return kernels.qwen_resnorm_quantize_triton(residual, x, bias, gate, scale, shift, global_scale, eps=eps,
                                                    fast_math=fast_math, decoded=True)
    return qwen_resnorm_quantize_decoded_reference(ResNormInputs(residual, x, bias, gate, scale, shift), global_scale,
                                                   eps, fast_math)


def _decoded_checked_impl(
    residual: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, gate: torch.Tensor, scale: torch.Tensor,
    shift: torch.Tensor, global_scale: torch.Tensor, eps: float, fast_math: bool, stats_id: int, shape_class: str,
    kind: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = ResNormInputs(residual, x, bias, gate, scale, shift)
    return cast("tuple[torch.Tensor, torch.Tensor]", run_checked(
        stats_id, kind, shape_class + ",decoded", ("residual_out", "decoded"),
        lambda: _decoded_impl(*inputs, global_scale, eps, fast_math),
        lambda: qwen_resnorm_quantize_decoded_reference(inputs, global_scale, eps, fast_math),
    ))


def _decoded_op_impl(
    residual: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, gate: torch.Tensor, scale: torch.Tensor,
    shift: torch.Tensor, global_scale: torch.Tensor, eps: float, fast_math: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _decoded_impl(residual, x, bias, gate, scale, shift, global_scale, eps, fast_math)


def _decoded_fake(residual, x, bias, gate, scale, shift, global_scale, eps, fast_math, *_):
    d = residual.shape[-1]
    return (torch.empty_like(residual, memory_format=torch.contiguous_format),
            residual.new_empty((residual.numel() // d, d), dtype=torch.float16))


_decoded_op, _decoded_checked_op = custom_op_pair(
    "qwen_resnorm_quantize_decoded", _decoded_op_impl, _decoded_checked_impl, _decoded_fake)


def qwen_resnorm_quantize_decoded_checked(
    inputs: ResNormInputs, global_scale: torch.Tensor, eps: float, fast_math: bool, stats_id: int, shape_class: str,
    kind: str = KIND,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (residual_out ``[B, L, D]``, FP16 ``[B*L, D]``): the decoded values of ``qwen_resnorm_quantize``'s FC1 input,
    for an FC1 whose GEMM multiplies those; first-use byte verification as ``qwen_resnorm_quantize_checked``."""
    return call_op(_decoded_checked_op, _decoded_checked_impl, *inputs, global_scale, eps, fast_math, stats_id,
                   shape_class, kind)
