"""FLUX.2 single-stream blocks: ``to_out(cat([attn, mlp]))`` becomes ``to_out(token_cat_quantize(attn, mlp))``.

diffusers builds the concatenation in ``Flux2ParallelSelfAttnProcessor.__call__`` (and its KV-cache twin) only to
quantize it inside ``to_out``. The processors below are diffusers' code up to that point; they are installed per
attention instance (processors are looked up at call time, so cache hooks on the block do not hide them).
"""

from __future__ import annotations

from typing import NamedTuple, cast

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers import transformer_flux2 as flux2_module
from torch import nn

from ..format import fast_math_from_env
from ..linear import NVFP4Linear
from ..ops.token_cat_quantize import KIND, token_cat_quantize_checked
from ..ops.verify import failed_kind_reason, record_fallback, stats_for
from .hooks import consumer_reason, nvfp4_layer
from .swap import swap_processor


def token_cat_gate(attn: nn.Module, attn_out: torch.Tensor, mlp_out: torch.Tensor) -> str | None:
    """None when the fused path applies to this call, else the reason it does not."""
    reason = consumer_reason(cast(nn.Module, attn.to_out), "to_out")
    if reason is not None:
        return reason
    if attn_out.dtype not in (torch.bfloat16, torch.float16) or mlp_out.dtype != attn_out.dtype:
        return f"dtype {attn_out.dtype}/{mlp_out.dtype} (bf16/fp16 only)"
    a, b = attn_out.shape[-1], mlp_out.shape[-1]
    if a % 16 or b % 16:
        return f"widths {a}+{b} not multiples of 16"
    to_out_features = cast(NVFP4Linear, attn.to_out).in_features  # an NVFP4Linear: consumer_reason passed
    if a + b != to_out_features:
        return f"widths {a}+{b} != to_out.in_features {to_out_features} (sharded?)"
    if attn_out.shape[:-1] != mlp_out.shape[:-1]:
        return "attn and mlp rows differ"
    if failed_kind_reason(KIND) is not None:
        return "verification failed earlier in this process"
    return None


class TokenCatInput(NamedTuple):
    """What the fused path hands ``to_out``: the two halves of its input; the layer quantizes them itself (one kernel,
    with its own ``input_scale_inv``) once its hooks have run."""

    attn: torch.Tensor
    mlp: torch.Tensor
    stats_id: int
    shape_class: str

    def run_on(self, layer: NVFP4Linear) -> torch.Tensor:
        packed, scales = token_cat_quantize_checked(
            self.attn, self.mlp, layer.input_scale_inv, fast_math_from_env(), self.stats_id, self.shape_class
        )
        return layer.forward_prequantized(packed, scales, self.attn.dtype)


class _FusedOutputMixin:
    """The shared tail of both processors: fused token-cat quantize into ``to_out``, or diffusers' own code."""

    _stats_id: int = 0

    def _project_out(self, attn: nn.Module, attn_out: torch.Tensor, mlp_out: torch.Tensor) -> torch.Tensor:
        reason = token_cat_gate(attn, attn_out, mlp_out)
        stats = stats_for(self._stats_id)
        if reason is not None:
            if stats is not None:
                record_fallback(stats, KIND, reason)
            return cast(nn.Module, attn.to_out)(torch.cat([attn_out, mlp_out], dim=-1))
        to_out = cast(NVFP4Linear, attn.to_out)  # the gate passed: to_out is an NVFP4Linear
        shape_class = f"A={attn_out.shape[-1]},B={mlp_out.shape[-1]},{attn_out.dtype},{attn_out.device}"
        out = to_out(TokenCatInput(attn_out, mlp_out, self._stats_id, shape_class))
        return out.reshape(*attn_out.shape[:-1], to_out.out_features)


# Adapted from diffusers 0.42.1, models/transformers/transformer_flux2.py, Flux2ParallelSelfAttnProcessor.__call__.
def _qkv_mlp(attn, hidden_states, image_rotary_emb):
    # diffusers' split of the fused input projection, kept identical (including its tensor-parallel arithmetic).
    projected = attn.to_qkv_mlp_proj(hidden_states)
    qkv_dim = 3 * attn.inner_dim
    mlp_dim = attn.mlp_hidden_dim * attn.mlp_mult_factor
    local_qkv = projected.shape[-1] * qkv_dim // (qkv_dim + mlp_dim)
    qkv, mlp = torch.split(projected, [local_qkv, projected.shape[-1] - local_qkv], dim=-1)
    query, key, value = (t.unflatten(-1, (-1, attn.head_dim)) for t in qkv.chunk(3, dim=-1))
    query, key = attn.norm_q(query), attn.norm_k(key)
    if image_rotary_emb is not None:
        query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
        key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
    return query, key, value, mlp


class Flux2FusedParallelSelfAttnProcessor(_FusedOutputMixin):
    """``Flux2ParallelSelfAttnProcessor`` with the output concatenation fused into NVFP4 quantization.

    Adapted from diffusers 0.42.1, models/transformers/transformer_flux2.py, ``Flux2ParallelSelfAttnProcessor``."""

    _attention_backend = None
    _parallel_config = None

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        query, key, value, mlp = _qkv_mlp(attn, hidden_states, image_rotary_emb)
        out = dispatch_attention_fn(
            query, key, value, attn_mask=attention_mask, backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        out = out.flatten(2, 3).to(query.dtype)
        return self._project_out(attn, out, cast(nn.Module, attn.mlp_act_fn)(mlp))


class Flux2FusedKVParallelSelfAttnProcessor(_FusedOutputMixin):
    """``Flux2KVParallelSelfAttnProcessor`` (reference-image KV cache) with the same fused output.

    Adapted from diffusers 0.42.1, models/transformers/transformer_flux2.py, ``Flux2KVParallelSelfAttnProcessor``."""

    _attention_backend = None
    _parallel_config = None

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
        kv_cache=None,
        kv_cache_mode: str | None = None,
        num_txt_tokens: int = 0,
        num_ref_tokens: int = 0,
    ) -> torch.Tensor:
        query, key, value, mlp = _qkv_mlp(attn, hidden_states, image_rotary_emb)
        if kv_cache_mode == "extract" and kv_cache is not None and num_ref_tokens > 0:
            ref = slice(num_txt_tokens, num_txt_tokens + num_ref_tokens)
            kv_cache.store(key[:, ref].clone(), value[:, ref].clone())
        if kv_cache_mode == "extract" and num_ref_tokens > 0:
            out = flux2_module._flux2_kv_causal_attention(
                query, key, value, num_txt_tokens, num_ref_tokens, backend=self._attention_backend
            )
        elif kv_cache_mode == "cached" and kv_cache is not None:
            out = flux2_module._flux2_kv_causal_attention(
                query, key, value, num_txt_tokens, 0, kv_cache=kv_cache, backend=self._attention_backend
            )
        else:
            out = dispatch_attention_fn(
                query, key, value, attn_mask=attention_mask, backend=self._attention_backend,
                parallel_config=self._parallel_config,
            )
        out = out.flatten(2, 3).to(query.dtype)
        return self._project_out(attn, out, cast(nn.Module, attn.mlp_act_fn)(mlp))


_REPLACEMENTS: dict[type, type[Flux2FusedParallelSelfAttnProcessor | Flux2FusedKVParallelSelfAttnProcessor]] = {
    flux2_module.Flux2ParallelSelfAttnProcessor: Flux2FusedParallelSelfAttnProcessor,
    flux2_module.Flux2KVParallelSelfAttnProcessor: Flux2FusedKVParallelSelfAttnProcessor,
}


def patch_flux2(model: nn.Module, stats_id: int, restore: list) -> int:
    """Install fused processors on every single-stream attention whose ``to_out`` is NVFP4. Returns the count.

    Appends undo callables to ``restore``; each puts back the original processor object unless the user replaced
    the fused one meanwhile.
    """
    count = 0
    for block in getattr(model, "single_transformer_blocks", []):
        attn = block.attn
        original = attn.processor
        fused_cls = _REPLACEMENTS.get(type(original))
        if fused_cls is None or nvfp4_layer(attn.to_out) is None:
            continue
        fused = fused_cls()
        fused._stats_id = stats_id
        # Attention backend and context-parallel settings live on the processor instance or class.
        fused._attention_backend = original._attention_backend
        fused._parallel_config = original._parallel_config
        restore.append(swap_processor(attn, fused))
        count += 1
    return count
