"""LayerNorm + modulate + NVFP4 quantize in one pass, the modulated tensor never written (docs/design.md §6):

- ``resnorm_quantize``: ``residual + gate * (x + bias) -> LayerNorm -> * (1 + scale) + shift -> quantize``, between
  an attention and its feed-forward's first projection (Qwen-Image's FC1, FLUX.2's double-stream ``linear_in``,
  Qwen-Image 2.1's ``gate_layer`` and ``proj``); also returns the new residual.
- ``adaln_quantize``: ``LayerNorm(x) -> * (1 + scale) + shift -> quantize``, a block's norm1 before the attention's
  input projections (Qwen-Image's, Qwen-Image 2.1's and FLUX.2's query/key/value, FLUX.2's fused single-stream input).

``shift`` may be None in both: Qwen-Image 2.1 modulates with ``x * (1 + scale)`` alone, and the chain then has no add
at all (adding a zero is not the identity for both zeros' signs).

References: diffusers' eager ops followed by the standalone quantize. Kernels: ``kernels.resnorm_quantize_triton``
and ``kernels.adaln_quantize_triton`` (one kernel, with or without the residual add). The ``_decoded`` variants give
the exact FP16 values instead of packed bytes, for consumers whose GEMM multiplies those (SM80-SM90, > 64 rows).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .. import format as nvfp4
from .dispatch import kernels, triton_runs_on
from .fused import Case, Form, FusedOp, Probe
from .quantize import empty_quantized, quantize

EPS = 1e-6  # the LayerNorms' eps in Qwen-Image's and FLUX.2's blocks (the probes' value)


class ResNormInputs(NamedTuple):
    """One stream's tensors between the attention output and the feed-forward's first projection.

    residual, x: ``[B, L, D]`` BF16 (``x`` is the attention output, without its projection bias when ``bias`` is
    given); bias: ``[D]`` or None; gate, scale, shift: per sample ``[B, D]`` / ``[B, 1, D]`` or per token ``[B, L, D]``
    (shift None: no shift, Qwen-Image 2.1).
    """

    residual: torch.Tensor
    x: torch.Tensor
    bias: torch.Tensor | None
    gate: torch.Tensor
    scale: torch.Tensor
    shift: torch.Tensor | None


class AdaLNInputs(NamedTuple):
    """x: the LayerNorm's input ``[B, L, D]`` BF16; scale, shift: per sample ``[B, D]`` / ``[B, 1, D]`` or per token
    ``[B, L, D]`` (shift None: no shift, Qwen-Image 2.1)."""

    x: torch.Tensor
    scale: torch.Tensor
    shift: torch.Tensor | None


def broadcast_rows(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Per-sample modulation ``[B, D]`` (or ``[B, 1, D]`` / ``[B, L, D]``) -> broadcastable against ``x [B, L, D]``."""
    return p.unsqueeze(1) if p.dim() == 2 else p


def modulate(n: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None) -> torch.Tensor:
    """``n * (1 + scale) + shift`` as diffusers' blocks write it (three BF16 ops, each rounding), or ``n * (1 + scale)``
    (two) without a shift: Qwen-Image 2.1's ``QwenImage21TransformerBlock._modulate``."""
    m = n * (1 + broadcast_rows(scale, n))
    return m if shift is None else m + broadcast_rows(shift, n)


def residual_norm_chain(inputs: ResNormInputs, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' block section between the attention output and the feed-forward, op by op (each BF16 op rounds).

    Returns (residual_out ``[B, L, D]``, modulated feed-forward input ``[B, L, D]``).
    """
    residual, x, bias, gate, scale, shift = inputs
    a = x if bias is None else x + bias
    r = residual + broadcast_rows(gate, a) * a
    return r, modulate(F.layer_norm(r, (r.shape[-1],), eps=eps), scale, shift)


def adaln_chain(inputs: AdaLNInputs, eps: float) -> torch.Tensor:
    """diffusers' norm1 section, op by op (each BF16 op rounds): ``LayerNorm(x) * (1 + scale) + shift``. FLUX.2
    writes ``(1 + scale) * n``: the same product, IEEE multiplication commutes."""
    x, scale, shift = inputs
    return modulate(F.layer_norm(x, (x.shape[-1],), eps=eps), scale, shift)


def kernel_runs_on(x: torch.Tensor) -> bool:
    """True where the fused Triton kernel runs for ``x``."""
    return triton_runs_on(x) and hasattr(kernels, "resnorm_quantize_triton")


def _decode(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return nvfp4.decode_nvfp4(packed, scales, dtype=torch.float16)


# ---------------------------------------------------------------------------------------------------------------
# resnorm_quantize(residual, x, bias, gate, scale, shift, global_scale, eps, fast_math)
# ---------------------------------------------------------------------------------------------------------------

def resnorm_quantize_reference(
    residual: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, gate: torch.Tensor, scale: torch.Tensor,
    shift: torch.Tensor | None, global_scale: torch.Tensor, eps: float, fast_math: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eager chain + standalone quantize -> (residual_out ``[B, L, D]``, packed ``[B*L, D/2]``, 128x4 scales)."""
    r, m = residual_norm_chain(ResNormInputs(residual, x, bias, gate, scale, shift), eps)
    packed, scales = quantize(m.reshape(-1, m.shape[-1]), global_scale, fast_math)
    return r, packed, scales


def resnorm_quantize_decoded_reference(
    residual: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, gate: torch.Tensor, scale: torch.Tensor,
    shift: torch.Tensor | None, global_scale: torch.Tensor, eps: float, fast_math: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference, then the decode: (residual_out, FP16 ``[B*L, D]`` = each E2M1 value times its block scale)."""
    r, packed, scales = resnorm_quantize_reference(residual, x, bias, gate, scale, shift, global_scale, eps, fast_math)
    return r, _decode(packed, scales)


def _residual_out(residual: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(residual, memory_format=torch.contiguous_format)


def _resnorm_fake(residual, *_):
    d = residual.shape[-1]
    return (_residual_out(residual), *empty_quantized(residual, residual.numel() // d, d))


def _resnorm_decoded_fake(residual, *_):
    d = residual.shape[-1]
    return _residual_out(residual), residual.new_empty((residual.numel() // d, d), dtype=torch.float16)


resnorm_quantize = Form(
    "resnorm_quantize", resnorm_quantize_reference,
    lambda k, residual, x, bias, gate, scale, shift, g, eps, fast_math: k.resnorm_quantize_triton(
        residual, x, bias, gate, scale, shift, g, eps=eps, fast_math=fast_math),
    _resnorm_fake, ("residual_out", "packed", "scales"))
resnorm_quantize_decoded = Form(
    "resnorm_quantize_decoded", resnorm_quantize_decoded_reference,
    lambda k, residual, x, bias, gate, scale, shift, g, eps, fast_math: k.resnorm_quantize_triton(
        residual, x, bias, gate, scale, shift, g, eps=eps, fast_math=fast_math, decoded=True),
    _resnorm_decoded_fake, ("residual_out", "decoded"))


def probe_modulation(p: Probe) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Qwen-Image's (shift, scale, gate) of one stream: diffusers' strided views of ``img_mod``'s output
    ``[1, 6 * D]`` (D = 3072)."""
    d = p.pick(3072, 512)
    mod = p.randn(1, 6 * d, scale=0.3)
    shift, scale, gate = mod.chunk(2, dim=-1)[1].chunk(3, dim=-1)
    return shift, scale, gate


def _resnorm_probe(p: Probe) -> list[Case]:
    """Qwen-Image's block between the attention and FC1 (width 3072), per-sample modulation."""
    shift, scale, gate = probe_modulation(p)
    d = shift.shape[-1]
    res = ResNormInputs(p.randn(1, p.rows, d, scale=4.0), p.randn(1, p.rows, d), p.randn(d, scale=0.1), gate, scale,
                        shift)
    return [Case("residual-norm quantize", f"{p.rows}x{d}", (*res, p.global_scale(res.x), EPS, p.fast_math))]


RESNORM_QUANTIZE = FusedOp(resnorm_quantize, _resnorm_probe, resnorm_quantize_decoded)


# ---------------------------------------------------------------------------------------------------------------
# adaln_quantize(x, scale, shift, global_scale, eps, fast_math)
# ---------------------------------------------------------------------------------------------------------------

def adaln_quantize_reference(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None, global_scale: torch.Tensor, eps: float,
    fast_math: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager chain + standalone quantize -> (packed ``[B*L, D/2]``, 128x4 scales)."""
    m = adaln_chain(AdaLNInputs(x, scale, shift), eps)
    return quantize(m.reshape(-1, m.shape[-1]), global_scale, fast_math)


def adaln_quantize_decoded_reference(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None, global_scale: torch.Tensor, eps: float,
    fast_math: bool,
) -> torch.Tensor:
    """The reference, then the decode: FP16 ``[B*L, D]``, each E2M1 value times its E4M3 block scale."""
    return _decode(*adaln_quantize_reference(x, scale, shift, global_scale, eps, fast_math))


adaln_quantize = Form(
    "adaln_quantize", adaln_quantize_reference,
    lambda k, x, scale, shift, g, eps, fast_math: k.adaln_quantize_triton(x, scale, shift, g, eps=eps,
                                                                         fast_math=fast_math),
    lambda x, *_: empty_quantized(x, x.numel() // x.shape[-1], x.shape[-1]), ("packed", "scales"))
adaln_quantize_decoded = Form(
    "adaln_quantize_decoded", adaln_quantize_decoded_reference,
    lambda k, x, scale, shift, g, eps, fast_math: k.adaln_quantize_triton(x, scale, shift, g, eps=eps,
                                                                         fast_math=fast_math, decoded=True)[0],
    lambda x, *_: x.new_empty((x.numel() // x.shape[-1], x.shape[-1]), dtype=torch.float16), ("decoded",))


def _adaln_probe(p: Probe) -> list[Case]:
    """Qwen-Image's norm1 (width 3072), per-sample modulation."""
    shift, scale, _ = probe_modulation(p)
    x = p.randn(1, p.rows, shift.shape[-1], scale=3.0)
    return [Case("adaptive-LayerNorm quantize", f"{p.rows}x{x.shape[-1]}",
                 (x, scale, shift, p.global_scale(x), EPS, p.fast_math))]


ADALN_QUANTIZE = FusedOp(adaln_quantize, _adaln_probe, adaln_quantize_decoded)
