"""FLUX.2 attention: the rotary embedding on query and key in one kernel (``flux2_rotary``), for the single-stream
processors in ``flux2.py`` and the double-stream processor here.

Under ``torch.compile`` diffusers' ``apply_rotary_emb`` is kept: inductor contracts its FP32 multiply-adds, which
rounds differently from the eager ops the kernel reproduces, and compiled on must equal compiled off.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers import transformer_flux2 as flux2_module

from ..ops.rotary import KIND as KIND_ROTARY
from ..ops.rotary import rotary_checked
from ..ops.verify import count_fallback, failed_kind_reason

HALF_DTYPES = (torch.bfloat16, torch.float16)  # what the fused kernels take


def rotary_reason(x: torch.Tensor, rotary_emb) -> str | None:
    """None when the rotary kernel reproduces ``apply_rotary_emb(x, rotary_emb, sequence_dim=1)`` for this call."""
    if torch.compiler.is_compiling():
        return "torch.compile (inductor contracts the FP32 multiply-adds; its own ops are kept)"
    if not isinstance(rotary_emb, tuple) or len(rotary_emb) != 2:
        return "rotary embedding is not a (cos, sin) pair"
    cos, sin = rotary_emb
    d = x.shape[-1]
    if x.dim() != 4 or x.dtype not in HALF_DTYPES or d & (d - 1):
        return f"query/key {tuple(x.shape)} {x.dtype} (bf16/fp16 [B, S, H, D], D a power of two)"
    if cos.dtype != torch.float32 or cos.shape != (x.shape[1], d) or sin.shape != cos.shape or sin.dtype != cos.dtype:
        return f"cos/sin {tuple(cos.shape)} {cos.dtype} (FP32 [S, D])"
    if cos.device != x.device:
        return "cos/sin on another device"
    if failed_kind_reason(KIND_ROTARY) is not None:
        return "verification failed earlier in this process"
    return None


def rotate(x: torch.Tensor, rotary_emb, stats_id: int) -> torch.Tensor:
    """``apply_rotary_emb(x, rotary_emb, sequence_dim=1)``, as one kernel where the gate allows."""
    reason = rotary_reason(x, rotary_emb)
    if reason is not None:
        count_fallback(stats_id, KIND_ROTARY, reason)
        return cast(torch.Tensor, apply_rotary_emb(x, rotary_emb, sequence_dim=1))  # (diffusers annotates a tuple)
    cos, sin = rotary_emb
    return rotary_checked(x, cos, sin, stats_id, f"D={x.shape[-1]},{x.dtype},{x.device}")


def on_original(name: str) -> property:
    """An attribute read from and written to diffusers' processor that the fused one stands in for, so that
    ``set_attention_backend`` / ``enable_parallelism`` while the fast paths are on outlive ``disable_fast_paths``."""
    return property(lambda self: getattr(self._original, name, None),
                    lambda self, value: setattr(self._original, name, value))


class Flux2FusedAttnProcessor:
    """``Flux2AttnProcessor`` (double-stream blocks) with the rotary embedding in one kernel per tensor.

    Adapted from diffusers 0.42.1, models/transformers/transformer_flux2.py, ``Flux2AttnProcessor``."""

    _attention_backend = on_original("_attention_backend")
    _parallel_config = on_original("_parallel_config")

    def __init__(self, original, stats_id: int):
        self._original = original  # attention backend and context-parallel settings stay on it
        self._stats_id = stats_id

    def __call__(
        self,
        attn: Any,  # diffusers' Flux2Attention
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb=None,
    ):
        query, key, value, encoder_query, encoder_key, encoder_value = flux2_module._get_qkv_projections(
            attn, hidden_states, encoder_hidden_states
        )
        query, key, value = (t.unflatten(-1, (-1, attn.head_dim)) for t in (query, key, value))
        query, key = attn.norm_q(query), attn.norm_k(key)
        if attn.added_kv_proj_dim is not None:
            encoder_query, encoder_key, encoder_value = (
                t.unflatten(-1, (-1, attn.head_dim)) for t in (encoder_query, encoder_key, encoder_value))
            encoder_query, encoder_key = attn.norm_added_q(encoder_query), attn.norm_added_k(encoder_key)
            query = torch.cat([encoder_query, query], dim=1)
            key = torch.cat([encoder_key, key], dim=1)
            value = torch.cat([encoder_value, value], dim=1)
        if image_rotary_emb is not None:
            query = rotate(query, image_rotary_emb, self._stats_id)
            key = rotate(key, image_rotary_emb, self._stats_id)
        hidden_states = dispatch_attention_fn(
            query, key, value, attn_mask=attention_mask, backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        hidden_states = hidden_states.flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return attn.to_out[1](attn.to_out[0](hidden_states))
        text = encoder_hidden_states.shape[1]
        encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
            [text, hidden_states.shape[1] - text], dim=1)
        encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        return hidden_states, encoder_hidden_states
