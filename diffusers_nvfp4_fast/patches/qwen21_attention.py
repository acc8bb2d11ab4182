"""Qwen-Image 2.1 attention: each query's and key's RMSNorm and rotary embedding in one kernel (site
``qwen21_qk_rotary``), diffusers' KV-cache bookkeeping and block-causal prefill unchanged.

``QwenImage21FusedAttnProcessor`` stands in for diffusers' ``QwenImage21AttnProcessor`` (the default processor, no
flex_attention). It is diffusers' code (the processor's ``__call__`` and ``_qwenimage21_prepare_qkv``) with
``apply_rotary_emb_qwen(norm(x).to(value.dtype), freqs, use_real=False)`` computed per tensor by the Qwen-Image QK
kernel (``ops.qk_norm_rotary``, docs/design.md §6): diffusers' 2.1 module uses the same ``RMSNorm`` class and a copy
of Qwen-Image's ``apply_rotary_emb_qwen`` (``tests/test_qwenimage21.py`` checks the two sources are equal), and the
``.to(value.dtype)`` is the identity wherever the gate lets the kernel run (query, key, value and the norm weight all
BF16). The cache stores and concatenates the keys after the rotary, as diffusers does, so a cache filled with fast
paths on serves a step with them off and the other way round.

Under ``torch.compile`` diffusers' processor runs the call (inductor computes RMSNorm and the complex product its own
way, and compiled on must equal compiled off). ``QwenImage21FlexAttnProcessor`` is not replaced: its prefill is one
flex_attention call that only a compiled model runs at useful speed, where the kernel would not run anyway; blocks
with it count a ``qwen21_qk_rotary`` fallback per call (``qwenimage21.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_qwenimage21 import apply_rotary_emb_qwen

from ..ops.qk_norm_rotary import qk_norm_rotary
from ..ops.site import Site
from ..ops.verify import COMPILED, count_fallback
from ..swaps import on_original
from .qwen_attention import qk_rotary_reason


class QwenImage21FusedAttnProcessor:
    """``QwenImage21AttnProcessor`` with each query's and key's RMSNorm + rotary embedding in one kernel.

    Adapted from diffusers 0.42.1, models/transformers/transformer_qwenimage21.py, ``QwenImage21AttnProcessor`` and
    ``_qwenimage21_prepare_qkv``: the same code, with the two norm calls and the two rotary calls paired per tensor
    (each pair reads only its own tensor, so the order between tensors does not matter)."""

    _attention_backend = on_original("_attention_backend")
    _parallel_config = on_original("_parallel_config")

    def __init__(self, original, site: Site):
        self._original = original  # attention backend and context-parallel settings stay on it
        self._site = site

    def _norm_rotate(self, norm: Any, x: torch.Tensor, freqs: Any, dtype: torch.dtype) -> torch.Tensor:
        """``apply_rotary_emb_qwen(norm(x).to(dtype), freqs, use_real=False)``, one kernel where the gate allows."""
        reason = (f"query/key {x.dtype} and value {dtype} differ" if x.dtype != dtype
                  else qk_rotary_reason(norm, x, freqs, self._site.kind))
        if reason is None:
            return qk_norm_rotary.checked(self._site, x, norm.weight, freqs, norm.eps)
        count_fallback(self._site, reason)
        return apply_rotary_emb_qwen(norm(x).to(dtype), freqs, use_real=False)  # type: ignore[return-value]

    def _prepare_qkv(self, attn: Any, hidden_states: Any, rotary_emb: Any, layer_cache: Any,
                     kv_cache_mode: str | None, cache_write_slice: slice | None):
        # hidden_states: the modulated tensor, or the qwen21_adaln site's AdaLNOperand (read only by the projections).
        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)

        head_dim = attn.inner_dim // attn.heads
        query = query.unflatten(-1, (-1, head_dim))
        key = key.unflatten(-1, (-1, head_dim))
        value = value.unflatten(-1, (-1, head_dim))

        if rotary_emb is not None:
            query = self._norm_rotate(attn.norm_q, query, rotary_emb, value.dtype)
            key = self._norm_rotate(attn.norm_k, key, rotary_emb, value.dtype)
        else:
            query = attn.norm_q(query).to(value.dtype)
            key = attn.norm_k(key).to(value.dtype)

        if layer_cache is not None:
            if kv_cache_mode == "extract" and cache_write_slice is not None:
                # clone(), as diffusers: the cache must not pin the whole prefill K/V
                layer_cache.store(key[:, cache_write_slice].clone(), value[:, cache_write_slice].clone())
            elif kv_cache_mode == "cached":
                cached_k, cached_v = layer_cache.get()
                key = torch.cat([cached_k, key], dim=1)
                value = torch.cat([cached_v, value], dim=1)
        return query, key, value, query.shape[1]

    def __call__(
        self,
        attn: Any,  # diffusers' QwenImage21Attention
        hidden_states: Any,
        attention_mask: Any | None = None,
        rotary_emb: torch.Tensor | None = None,
        layer_cache: Any = None,
        kv_cache_mode: str | None = None,
        cache_write_slice: slice | None = None,
        segments: list[tuple[int, int, bool]] | None = None,
        key_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if torch.compiler.is_compiling():  # diffusers' processor, op for op: inductor then sees off's graph
            count_fallback(self._site, COMPILED)
            return self._original(attn, hidden_states, attention_mask, rotary_emb, layer_cache, kv_cache_mode,
                                  cache_write_slice, segments, key_valid)
        query, key, value, seq_len_q = self._prepare_qkv(
            attn, hidden_states, rotary_emb, layer_cache, kv_cache_mode, cache_write_slice
        )

        if segments is None:
            # decode: full attention over [cached prefix, target]
            hidden_states = dispatch_attention_fn(
                query, key, value, attn_mask=attention_mask, dropout_p=0.0, backend=self._attention_backend,
                parallel_config=self._parallel_config,
            )
        else:
            # prefill: every segment attends to the keys [0, end); text segments also get a causal triangle over their
            # own keys; padded text keys are dropped (diffusers' decomposition of the block-causal mask).
            prefix_len = segments[-1][1] if segments else 0
            outputs = []
            for start, end, is_text in segments:
                seg_mask = None
                if is_text:
                    seg_len = end - start
                    seg_mask = torch.cat(
                        [
                            torch.ones(seg_len, start, dtype=torch.bool, device=query.device),
                            torch.tril(torch.ones(seg_len, seg_len, dtype=torch.bool, device=query.device)),
                        ],
                        dim=1,
                    )[None, None]
                if key_valid is not None:
                    seg_key_valid = key_valid[:, None, None, :end]
                    seg_mask = seg_key_valid if seg_mask is None else (seg_mask & seg_key_valid)
                outputs.append(
                    dispatch_attention_fn(
                        query[:, start:end], key[:, :end], value[:, :end], attn_mask=seg_mask, dropout_p=0.0,
                        backend=None, parallel_config=self._parallel_config,
                    )
                )
            outputs.append(
                dispatch_attention_fn(
                    query[:, prefix_len:], key, value,
                    attn_mask=None if key_valid is None else key_valid[:, None, None, :], dropout_p=0.0,
                    backend=None, parallel_config=self._parallel_config,
                )
            )
            hidden_states = torch.cat(outputs, dim=1)
        hidden_states = hidden_states[:, :seq_len_q]
        hidden_states = hidden_states.flatten(2, 3).type_as(query)

        hidden_states = attn.to_out[0](hidden_states)
        return attn.to_out[1](hidden_states)
