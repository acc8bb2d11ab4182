"""SwiGLU quantize: ``quantize(cat([attn, silu(gate) * up], -1))`` without writing the SwiGLU output.

- ``swiglu_quantize`` (FLUX.2): ``hidden`` is the feed-forward input projection's output ``[..., 2H]`` (gate first, as
  diffusers' ``Flux2SwiGLU`` splits it); ``attn`` is the single-stream attention output that diffusers concatenates in
  front, or None for a double-stream feed-forward. Reference: ``swiglu_quantize_reference``.
- ``swiglu_gate_up_quantize`` (Qwen-Image 2.1): ``quantize(silu(gate) * up)`` with gate and up two tensors, the outputs
  of ``QwenImage21SwiGLUFeedForward``'s ``gate_layer`` and ``proj``. Reference: ``swiglu_gate_up_quantize_reference``.

Both references are diffusers' own ops, then the unfused quantize (docs/design.md §6); both kernels are
``kernels/swiglu_quantize.py``'s one kernel (the up values read through a pointer of their own).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fused import AotKernel, Case, Form, FusedOp, Probe
from .quantize import empty_quantized, quantize


def swiglu_reference(hidden: torch.Tensor) -> torch.Tensor:
    """diffusers 0.42.1 ``Flux2SwiGLU.forward``: ``silu(h[..., :H]) * h[..., H:]`` in the input dtype."""
    half = hidden.shape[-1] // 2
    return F.silu(hidden[..., :half]) * hidden[..., half:]


def swiglu_quantize_reference(
    hidden: torch.Tensor, attn: torch.Tensor | None, global_scale: torch.Tensor, fast_math: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused computation: SwiGLU, the concatenation (when ``attn`` is given), then ``quantize``."""
    x = swiglu_reference(hidden)
    if attn is not None:
        x = torch.cat([attn, x], dim=-1)
    return quantize(x.reshape(-1, x.shape[-1]), global_scale, fast_math)


def _swiglu_fake(hidden, attn, *_):
    k = hidden.shape[-1] // 2 + (attn.shape[-1] if attn is not None else 0)
    return empty_quantized(hidden, hidden.numel() // hidden.shape[-1], k)


# hidden [..., 2H], optional attn [..., A] (same leading dims, BF16/FP16, H and A multiples of 16), global_scale FP32
# one-element, fast_math -> packed uint8 [R, (A+H)/2], 128x4 scales uint8 [round_up(R,128), round_up((A+H)/16,4)].
swiglu_quantize = Form(
    "swiglu_quantize", swiglu_quantize_reference,
    lambda k, hidden, attn, g, fast_math: k.swiglu_quantize_triton(hidden, g, attn, fast_math=fast_math),
    _swiglu_fake, ("packed", "scales"),
    aot=AotKernel("swiglu", "swiglu_quantize", "_swiglu_quantize_kernel", {
        "a_ptr": "*i64", "h_ptr": "*i64", "u_ptr": "*i64", "g_ptr": "*fp32", "packed_ptr": "*i64", "scales_ptr": "*u8",
        "M": "i32", "A": "i32", "H": "i32", "stride_a": "i32", "stride_h": "i32", "stride_u": "i32", "up_block": "i32",
        "padded_cols": "i32", "col_tiles": "i32"}))


def _swiglu_probe(p: Probe) -> list[Case]:
    """FLUX.2-dev: the single-stream block's attention output (6144) and MLP projection (2 x 18432) per token; the
    double-stream feed-forward without the attention output."""
    attn, hidden = p.randn(p.rows, p.pick(6144, 64)), p.randn(p.rows, 2 * p.pick(18432, 192), scale=2.0)
    g, h = p.global_scale(attn, hidden), hidden.shape[-1] // 2
    return [Case("SwiGLU + cat quantize", f"{p.rows}x({attn.shape[-1]}+{h})", (hidden, attn, g, p.fast_math)),
            Case("SwiGLU quantize", f"{p.rows}x{h}", (hidden, None, g, p.fast_math))]


SWIGLU_QUANTIZE = FusedOp(swiglu_quantize, _swiglu_probe)


def swiglu_gate_up_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """diffusers 0.42.1 ``QwenImage21SwiGLUFeedForward.forward`` between its projections:
    ``activation_fn(gate_layer(x)) * proj(x)`` with ``activation_fn = nn.SiLU()``, in the input dtype."""
    return F.silu(gate) * up


def swiglu_gate_up_quantize_reference(
    gate: torch.Tensor, up: torch.Tensor, global_scale: torch.Tensor, fast_math: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused computation: SiLU, the product, then ``quantize``."""
    x = swiglu_gate_up_reference(gate, up)
    return quantize(x.reshape(-1, x.shape[-1]), global_scale, fast_math)


# gate, up [..., H] (one shape and dtype, BF16/FP16, H a multiple of 16), global_scale FP32 one-element, fast_math ->
# packed uint8 [R, H/2], 128x4 scales uint8 [round_up(R,128), round_up(H/16,4)].
swiglu_gate_up_quantize = Form(
    "swiglu_gate_up_quantize", swiglu_gate_up_quantize_reference,
    lambda k, gate, up, g, fast_math: k.swiglu_gate_up_quantize_triton(gate, up, g, fast_math=fast_math),
    lambda gate, *_: empty_quantized(gate, gate.numel() // gate.shape[-1], gate.shape[-1]), ("packed", "scales"))


def _gate_up_probe(p: Probe) -> list[Case]:
    """Qwen-Image 2.1's feed-forward: the outputs of ``gate_layer`` and ``proj`` (12288 each) per token."""
    gate, up = p.randn(p.rows, p.pick(12288, 128), scale=2.0), p.randn(p.rows, p.pick(12288, 128), scale=2.0)
    return [Case("SwiGLU of two tensors quantize", f"{p.rows}x{gate.shape[-1]}",
                 (gate, up, p.global_scale(gate, up), p.fast_math))]


SWIGLU_GATE_UP_QUANTIZE = FusedOp(swiglu_gate_up_quantize, _gate_up_probe)
