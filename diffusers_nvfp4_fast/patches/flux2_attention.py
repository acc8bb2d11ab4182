"""FLUX.2 attention, for the single-stream processors in ``flux2.py`` and the double-stream processor here: each
query's and key's RMSNorm and rotary embedding in one kernel (``flux2_qk_rotary``) where the attention has torch
RMSNorms over heads of 128, otherwise the rotary embedding alone in one kernel (``flux2_rotary``).

In a double-stream block diffusers normalizes each stream, joins text and image and rotates the joint sequence;
both ops act on each row alone, so each stream is normalized and rotated with its rows of the rotary tables and then
joined (the same bytes). Under ``torch.compile`` diffusers' ops are kept: inductor computes RMSNorm's reduction and
contracts the rotary's FP32 multiply-adds its own way, and compiled on must equal compiled off.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers import transformer_flux2 as flux2_module
from torch import nn

from ..module_hooks import call_changed_reason
from ..ops.dispatch import triton_runs_on
from ..ops.qk_norm_rotary import flux2_qk_norm_rotary
from ..ops.rotary import rotary
from ..ops.site import Site, SiteKind
from ..ops.verify import COMPILED, count_fallback, failed_kind_reason
from ..swaps import on_original

HALF_DTYPES = (torch.bfloat16, torch.float16)  # what the fused kernels take
Sites = dict[SiteKind, Site]
QK_HEAD_DIM = 128  # the kernel's row width


def rotary_reason(x: torch.Tensor, rotary_emb) -> str | None:
    """None when the rotary kernel reproduces ``apply_rotary_emb(x, rotary_emb, sequence_dim=1)`` for this call."""
    if torch.compiler.is_compiling():
        return COMPILED  # inductor contracts the FP32 multiply-adds
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
    if failed_kind_reason("flux2_rotary") is not None:
        return "verification failed earlier in this process"
    return None


def rotate(x: torch.Tensor, rotary_emb, sites: Sites) -> torch.Tensor:
    """``apply_rotary_emb(x, rotary_emb, sequence_dim=1)``, as one kernel where the gate allows."""
    reason = rotary_reason(x, rotary_emb)
    if reason is not None:
        count_fallback(sites["flux2_rotary"], reason)
        return cast(torch.Tensor, apply_rotary_emb(x, rotary_emb, sequence_dim=1))  # (diffusers annotates a tuple)
    cos, sin = rotary_emb
    return rotary.checked(sites["flux2_rotary"], x, cos, sin)


def qk_site(norms: tuple[Any, ...], head_dim: int) -> bool:
    """Whether an attention's query/key norms (structure only; each call checks the rest) are torch RMSNorms over
    heads of 128 with a weight and an explicit eps: then norm and rotary run as one kernel (``flux2_qk_rotary``)."""
    return head_dim == QK_HEAD_DIM and all(
        type(n) is nn.RMSNorm and n.elementwise_affine and tuple(n.normalized_shape) == (QK_HEAD_DIM,)
        and n.eps is not None for n in norms)


def qk_norm_rotary_reason(norm: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """None when ``apply_rotary_emb(norm(x), (cos, sin), sequence_dim=1)`` can run as one kernel, else the reason."""
    if torch.compiler.is_compiling():
        return COMPILED  # inductor computes RMSNorm and the rotary products its own way
    if not qk_site((norm,), QK_HEAD_DIM):  # the module was replaced after enabling
        return f"query/key norm is {type(norm).__name__}, not an RMSNorm over 128 values with a weight and an eps"
    reason = call_changed_reason("query/key norm", norm)
    if reason is not None:
        return reason
    weight = norm.weight
    if weight.dtype != torch.bfloat16 or weight.device != x.device:
        return f"RMSNorm weight {weight.dtype} on {weight.device} (bf16, on the query's device)"
    if x.dim() != 4 or x.shape[-1] != QK_HEAD_DIM or x.dtype != torch.bfloat16:
        return f"query/key {tuple(x.shape)} {x.dtype} (bf16 [B, S, H, 128])"
    if cos.dtype != torch.float32 or cos.shape != (x.shape[1], QK_HEAD_DIM) or sin.shape != cos.shape \
            or sin.dtype != cos.dtype or cos.device != x.device:
        return f"cos/sin {tuple(cos.shape)} {cos.dtype} (FP32 [S, 128] on the query's device)"
    # torch's vectorized RMSNorm (the arithmetic the kernel reproduces) needs 8-byte aligned rows and weight; a
    # non-contiguous query is copied first (aligned), as torch does.
    if (x.is_contiguous() and x.data_ptr() % 8) or weight.data_ptr() % 8:
        return "query/key rows or RMSNorm weight not 8-byte aligned (torch takes another RMSNorm kernel)"
    if x.is_cuda and not triton_runs_on(x):
        return "no Triton kernel for this GPU"
    if failed_kind_reason("flux2_qk_rotary") is not None:
        return "verification failed earlier in this process"
    return None


def fused_qk(tensors: list[tuple[Any, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]], sites: Sites
             ) -> list[torch.Tensor] | None:
    """``apply_rotary_emb(norm(x), (cos, sin), sequence_dim=1)`` for each ``(norm, x, (cos, sin))``, one kernel each;
    None (one fallback counted) when a gate refuses any of them, so that the caller runs diffusers' ops for all."""
    for norm, x, (cos, sin) in tensors:
        reason = qk_norm_rotary_reason(norm, x, cos, sin)
        if reason is not None:
            count_fallback(sites["flux2_qk_rotary"], reason)
            return None
    # the key holds contiguity: a strided query (single-stream) takes another path into torch's RMSNorm
    return [flux2_qk_norm_rotary.checked(sites["flux2_qk_rotary"], x, norm.weight, cos, sin, norm.eps)
            for norm, x, (cos, sin) in tensors]


def _rotary_pair(rotary_emb: Any, sites: Sites) -> tuple[torch.Tensor, torch.Tensor] | None:
    if isinstance(rotary_emb, tuple) and len(rotary_emb) == 2 and all(isinstance(t, torch.Tensor) for t in rotary_emb):
        return rotary_emb
    count_fallback(sites["flux2_qk_rotary"], "rotary embedding is not a (cos, sin) pair")
    return None


def single_stream_qk(attn: Any, query: torch.Tensor, key: torch.Tensor, rotary_emb: Any, sites: Sites
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(query, key) normalized and rotated, one kernel each, or None where a gate refuses."""
    pair = _rotary_pair(rotary_emb, sites)
    if pair is None:
        return None
    out = fused_qk([(attn.norm_q, query, pair), (attn.norm_k, key, pair)], sites)
    return None if out is None else (out[0], out[1])


def joint_qk(attn: Any, query: torch.Tensor, key: torch.Tensor, encoder_query: torch.Tensor, encoder_key: torch.Tensor,
             rotary_emb: Any, sites: Sites) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The double-stream block's joint (query, key) (text rows, then image rows), each stream's tensors normalized
    and rotated with their rows of the joint tables, one kernel each; None where a gate refuses."""
    pair = _rotary_pair(rotary_emb, sites)
    if pair is None:
        return None
    cos, sin = pair
    text = encoder_query.shape[1]
    txt, img = (cos[:text], sin[:text]), (cos[text:], sin[text:])
    out = fused_qk([(attn.norm_added_q, encoder_query, txt), (attn.norm_q, query, img),
                    (attn.norm_added_k, encoder_key, txt), (attn.norm_k, key, img)], sites)
    return None if out is None else (torch.cat(out[:2], dim=1), torch.cat(out[2:], dim=1))


class Flux2FusedAttnProcessor:
    """``Flux2AttnProcessor`` (double-stream blocks) with the rotary embedding in one kernel per tensor.

    Adapted from diffusers 0.42.1, models/transformers/transformer_flux2.py, ``Flux2AttnProcessor``."""

    _attention_backend = on_original("_attention_backend")
    _parallel_config = on_original("_parallel_config")

    def __init__(self, original, sites: Sites, qk: bool):
        self._original = original  # attention backend and context-parallel settings stay on it
        self._sites = sites
        self._qk = qk  # qk_site holds: norm and rotary in one kernel per tensor where each call's gate allows

    def __call__(
        self,
        attn: Any,  # diffusers' Flux2Attention
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb=None,
    ):
        query, key, value = self._joint_qkv(attn, hidden_states, encoder_hidden_states, image_rotary_emb)
        hidden_states = dispatch_attention_fn(
            query, key, value, attn_mask=attention_mask, backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        return self._out(attn, hidden_states, query.dtype, encoder_hidden_states)

    def _joint_qkv(self, attn: Any, hidden_states, encoder_hidden_states, image_rotary_emb):
        """Query, key, value ``[B, S_txt + S_img, H, D]``: projected, normed, joined and rotated as diffusers does."""
        query, key, value, encoder_query, encoder_key, encoder_value = flux2_module._get_qkv_projections(
            attn, hidden_states, encoder_hidden_states
        )
        query, key, value = (t.unflatten(-1, (-1, attn.head_dim)) for t in (query, key, value))
        joint = attn.added_kv_proj_dim is not None
        if joint:
            encoder_query, encoder_key, encoder_value = (
                t.unflatten(-1, (-1, attn.head_dim)) for t in (encoder_query, encoder_key, encoder_value))
        fused = None
        if self._qk and joint and image_rotary_emb is not None:
            fused = joint_qk(attn, query, key, encoder_query, encoder_key, image_rotary_emb, self._sites)
        if fused is not None:
            query, key = fused
            value = torch.cat([encoder_value, value], dim=1)
        else:  # diffusers' order: norms, join, rotate (the rotary alone in one kernel where allowed)
            query, key = attn.norm_q(query), attn.norm_k(key)
            if joint:
                encoder_query, encoder_key = attn.norm_added_q(encoder_query), attn.norm_added_k(encoder_key)
                query = torch.cat([encoder_query, query], dim=1)
                key = torch.cat([encoder_key, key], dim=1)
                value = torch.cat([encoder_value, value], dim=1)
            if image_rotary_emb is not None:
                query = rotate(query, image_rotary_emb, self._sites)
                key = rotate(key, image_rotary_emb, self._sites)
        return query, key, value

    @staticmethod
    def _out(attn: Any, hidden_states: torch.Tensor, dtype: torch.dtype, encoder_hidden_states):
        """The attention output ``[B, S, H, D]`` split per stream and projected, as diffusers does."""
        hidden_states = hidden_states.flatten(2, 3).to(dtype)
        if encoder_hidden_states is None:
            return attn.to_out[1](attn.to_out[0](hidden_states))
        text = encoder_hidden_states.shape[1]
        encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
            [text, hidden_states.shape[1] - text], dim=1)
        encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        return hidden_states, encoder_hidden_states


class Flux2FusedKVAttnProcessor(Flux2FusedAttnProcessor):
    """``Flux2KVAttnProcessor`` (FLUX.2-klein KV: reference-image keys and values cached after the rotary) with the
    same fused rotary and norm inputs.

    Adapted from diffusers 0.42.1, models/transformers/transformer_flux2.py, ``Flux2KVAttnProcessor``."""

    def __call__(  # diffusers' KV processor takes the cache arguments too
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb=None,
        kv_cache=None,
        kv_cache_mode: str | None = None,
        num_ref_tokens: int = 0,
    ):
        query, key, value = self._joint_qkv(attn, hidden_states, encoder_hidden_states, image_rotary_emb)
        text = encoder_hidden_states.shape[1] if encoder_hidden_states is not None else 0
        if kv_cache_mode == "extract" and kv_cache is not None and num_ref_tokens > 0:
            kv_cache.store(key[:, text:text + num_ref_tokens].clone(), value[:, text:text + num_ref_tokens].clone())
        if kv_cache_mode == "extract" and num_ref_tokens > 0:
            hidden_states = flux2_module._flux2_kv_causal_attention(
                query, key, value, text, num_ref_tokens, backend=self._attention_backend)
        elif kv_cache_mode == "cached" and kv_cache is not None:
            hidden_states = flux2_module._flux2_kv_causal_attention(
                query, key, value, text, 0, kv_cache=kv_cache, backend=self._attention_backend)
        else:
            hidden_states = dispatch_attention_fn(
                query, key, value, attn_mask=attention_mask, backend=self._attention_backend,
                parallel_config=self._parallel_config,
            )
        return self._out(attn, hidden_states, query.dtype, encoder_hidden_states)
