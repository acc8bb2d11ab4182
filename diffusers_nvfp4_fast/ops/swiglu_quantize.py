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

from types import ModuleType
from typing import cast

import torch
import torch.nn.functional as F

from .dispatch import kernels, triton_runs_on
from .fused import FusedOp
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


def _swiglu_impl(
    hidden: torch.Tensor, attn: torch.Tensor | None, global_scale: torch.Tensor, fast_math: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if triton_runs_on(hidden):
        return cast(ModuleType, kernels).swiglu_quantize_triton(hidden, global_scale, attn, fast_math=fast_math)
    return swiglu_quantize_reference(hidden, attn, global_scale, fast_math)


def _swiglu_fake(hidden, attn, global_scale, fast_math):
    k = hidden.shape[-1] // 2 + (attn.shape[-1] if attn is not None else 0)
    return empty_quantized(hidden, hidden.numel() // hidden.shape[-1], k)


# hidden [..., 2H], optional attn [..., A] (same leading dims, BF16/FP16, H and A multiples of 16), global_scale FP32
# one-element, fast_math -> packed uint8 [R, (A+H)/2], 128x4 scales uint8 [round_up(R,128), round_up((A+H)/16,4)].
swiglu_quantize = FusedOp("swiglu_quantize", _swiglu_impl, swiglu_quantize_reference, _swiglu_fake,
                          ("packed", "scales"))


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


def _swiglu_gate_up_impl(
    gate: torch.Tensor, up: torch.Tensor, global_scale: torch.Tensor, fast_math: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if triton_runs_on(gate):
        return cast(ModuleType, kernels).swiglu_gate_up_quantize_triton(gate, up, global_scale, fast_math=fast_math)
    return swiglu_gate_up_quantize_reference(gate, up, global_scale, fast_math)


def _swiglu_gate_up_fake(gate, up, global_scale, fast_math):
    return empty_quantized(gate, gate.numel() // gate.shape[-1], gate.shape[-1])


# gate, up [..., H] (one shape and dtype, BF16/FP16, H a multiple of 16), global_scale FP32 one-element, fast_math ->
# packed uint8 [R, H/2], 128x4 scales uint8 [round_up(R,128), round_up(H/16,4)].
swiglu_gate_up_quantize = FusedOp("swiglu_gate_up_quantize", _swiglu_gate_up_impl, swiglu_gate_up_quantize_reference,
                                  _swiglu_gate_up_fake, ("packed", "scales"))
