"""Rotary position embedding on FLUX.2 query / key: diffusers' ``apply_rotary_emb`` (``use_real=True``, interleaved
pairs, ``sequence_dim=1``) in one kernel instead of seven torch ops over FP32 copies.

Reference: ``rotary_reference`` (diffusers' function itself). Kernel: ``kernels.rotary_triton``.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from diffusers.models.embeddings import apply_rotary_emb

from .fused import AotKernel, Case, Form, FusedOp, Probe


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers 0.42.1 ``apply_rotary_emb(x, (cos, sin), sequence_dim=1)``: x ``[B, S, H, D]``, cos/sin ``[S, D]``."""
    # cast: diffusers annotates the pair as tuple[Tensor] and the result as a tuple; it returns one tensor.
    return cast(torch.Tensor, apply_rotary_emb(x, cast(Any, (cos, sin)), sequence_dim=1))


def contiguous_like_x(x: torch.Tensor, *_: Any) -> torch.Tensor:
    """The rotary ops' shape function: their kernels write a contiguous tensor shaped like x."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# x [B, S, H, D] BF16/FP16 (D a power of two), cos / sin FP32 [S, D] -> [B, S, H, D] in x's dtype.
rotary = Form(
    "rotary", rotary_reference, lambda k, x, cos, sin: k.rotary_triton(x, cos, sin), contiguous_like_x, ("out",),
    aot=AotKernel("rotary", "rotary", "_rotary_kernel", {
        "x_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "out_ptr": "*i16", "rows": "i32", "S": "i32",
        "H": "i32"}))


def probe_inputs(batch: int, seq: int, heads: int, device: torch.device | str = "cpu", seed: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query-like BF16 ``[batch, seq, heads, 128]`` with row magnitudes from 2^-20 to 2^20, one all-zero row and some
    subnormals, a BF16 RMSNorm weight near 1 and Qwen-like rotary factors (complex64 ``[seq, 64]``, positions up to
    4096): with a few thousand rows, a wrong summation tree or FMA form changes some output bytes."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(batch, seq, heads, 128, device=device, generator=gen)
    x = x * torch.exp2(torch.randint(-20, 20, (batch, seq, heads, 1), device=device, generator=gen).float())
    x.view(-1, 128)[0] = 0.0
    x.view(-1)[7::97] = 1e-39
    weight = (1 + 0.2 * torch.randn(128, device=device, generator=gen)).to(torch.bfloat16)
    pos = torch.randint(0, 4096, (seq, 1), device=device, generator=gen).float()
    angles = pos / (10000 ** (torch.arange(0, 128, 2, device=device).float() / 128))
    return x.to(torch.bfloat16), weight, torch.polar(torch.ones_like(angles), angles)


def flux2_tables(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FLUX.2's FP32 ``(cos, sin)`` ``[S, 2 * F]`` (each angle repeated for its pair) for the angles of complex
    ``freqs`` ``[S, F]``, e.g. those of ``probe_inputs``."""
    angles = freqs.angle().repeat_interleave(2, dim=1)
    return angles.cos(), angles.sin()


def _probe(p: Probe) -> list[Case]:
    """FLUX.2-dev's query: 24 heads of 128 per token, with rotary tables of Qwen-like angles."""
    q, _, freqs = probe_inputs(1, p.rows, p.pick(24, 2), device=p.device)
    return [Case("FLUX.2 rotary", f"{p.rows}x{q.shape[2]}x128", (q, *flux2_tables(freqs)))]


ROTARY = FusedOp(rotary, _probe)
