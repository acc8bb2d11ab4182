"""Qwen-Image attention: each query's and key's RMSNorm and rotary embedding in one kernel (site ``qwen_qk_rotary``).

``QwenFusedAttnProcessor`` stands in for diffusers' ``QwenDoubleStreamAttnProcessor2_0`` (inside the bias-deferral
wrapper where that is installed). Under ``torch.compile`` diffusers' norm runs (inductor computes RMSNorm's reduction
its own way, and compiled on must equal compiled off) and only the rotary embedding is the kernel's
(``ops.qk_norm_rotary.qwen_rotary``): inductor leaves diffusers' complex product to an eager kernel over FP32 copies.
On a GPU the site first checks once which of the kernel's reduction trees is torch's there, if any
(``ops.qk_norm_rotary.tree_match``).
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.normalization import RMSNorm
from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

from ..module_hooks import call_changed_reason
from ..ops.dispatch import triton_runs_on
from ..ops.qk_norm_rotary import qk_norm_rotary, qwen_rotary, tree_match
from ..ops.site import Site, SiteKind
from ..ops.verify import count_fallback, failed_kind_reason
from ..swaps import on_original


def qk_rotary_reason(norm: Any, x: torch.Tensor, freqs: Any, kind: SiteKind = "qwen_qk_rotary") -> str | None:
    """None when ``apply_rotary_emb_qwen(norm(x), freqs, use_real=False)`` can run as one kernel, else the reason
    (``kind``: the site kind whose failed verification turns it off; Qwen-Image 2.1's processor shares the gate).
    Never asked under torch.compile: the processor hands those calls to diffusers' processor."""
    if type(norm) is not RMSNorm:
        return f"query/key norm is {type(norm).__name__}, not RMSNorm"
    reason = call_changed_reason("query/key norm", norm)
    if reason is not None:
        return reason
    weight = norm.weight
    if weight is None or weight.dtype != torch.bfloat16 or getattr(norm, "bias", None) is not None:
        return "RMSNorm without a BF16 weight, or with a bias"
    if x.dim() != 4 or x.shape[-1] != 128 or x.dtype != torch.bfloat16:
        return f"query/key {tuple(x.shape)} {x.dtype} (bf16 [B, S, H, 128])"
    if not isinstance(freqs, torch.Tensor) or freqs.dtype != torch.complex64 or freqs.shape != (x.shape[1], 64):
        return "rotary factors are not complex64 [S, 64]"
    if freqs.device != x.device or weight.device != x.device:
        return "rotary factors or norm weight on another device"
    if x.is_cuda and not triton_runs_on(x):
        return "no Triton kernel for this GPU"
    if failed_kind_reason(kind) is not None:
        return "verification failed earlier in this process"
    return tree_match(x.device).reason if x.is_cuda else None


def norm_and_rotate(norm: Any, x: torch.Tensor, freqs: Any, site: Site) -> torch.Tensor:
    """``apply_rotary_emb_qwen(norm(x), freqs, use_real=False)``, as one kernel where ``qk_rotary_reason`` allows."""
    reason = qk_rotary_reason(norm, x, freqs)
    if reason is not None:
        count_fallback(site, reason)
        return apply_rotary_emb_qwen(norm(x), freqs, use_real=False)  # type: ignore[return-value]  # (one tensor)
    return qk_norm_rotary.checked(site, x, norm.weight, freqs, norm.eps)


def rotate_compiled(x: torch.Tensor, freqs: Any, site: Site) -> torch.Tensor:
    """``apply_rotary_emb_qwen(x, freqs, use_real=False)`` in a compiled graph: the checked kernel for BF16 rows of
    128 and complex64 ``[S, 64]`` factors, diffusers' op otherwise (tensor properties only: nothing to guard)."""
    if (x.dim() == 4 and x.shape[-1] == 128 and x.dtype == torch.bfloat16 and isinstance(freqs, torch.Tensor)
            and freqs.dtype == torch.complex64 and freqs.shape == (x.shape[1], 64)):
        return qwen_rotary.checked(site, x, freqs)
    return apply_rotary_emb_qwen(x, freqs, use_real=False)  # type: ignore[return-value]  # (one tensor)


class QwenFusedAttnProcessor:
    """``QwenDoubleStreamAttnProcessor2_0`` with each query's and key's RMSNorm + rotary embedding in one kernel.

    Adapted from diffusers 0.42.1, models/transformers/transformer_qwenimage.py, ``QwenDoubleStreamAttnProcessor2_0``:
    the same code, with the four norm calls and the four rotary calls paired per tensor (each pair reads only its
    own tensor, so the order between tensors does not matter)."""

    _attention_backend = on_original("_attention_backend")
    _parallel_config = on_original("_parallel_config")

    def __init__(self, original, site: Site):
        self._original = original  # attention backend and context-parallel settings stay on it
        self._site = site

    def _qk(self, norm: Any, x: torch.Tensor, freqs: Any) -> torch.Tensor:
        if freqs is None:
            return x if norm is None else norm(x)
        if torch.compiler.is_compiling():
            return rotate_compiled(x if norm is None else norm(x), freqs, self._site)
        if norm is None:
            return apply_rotary_emb_qwen(x, freqs, use_real=False)  # type: ignore[return-value]  # (one tensor)
        return norm_and_rotate(norm, x, freqs, self._site)

    def __call__(
        self,
        attn: Any,  # diffusers' Attention (or the bias-deferral view of it)
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if encoder_hidden_states is None:
            raise ValueError("QwenDoubleStreamAttnProcessor2_0 requires encoder_hidden_states (text stream)")
        if attention_mask is not None:
            raise ValueError(
                "QwenDoubleStreamAttnProcessor2_0 does not accept an external attention_mask. "
                "Pass encoder_hidden_states_mask to let the processor build the joint mask."
            )
        if encoder_hidden_states_mask is not None:
            seq_img = hidden_states.shape[1]
            image_mask = torch.ones((hidden_states.shape[0], seq_img), dtype=torch.bool, device=hidden_states.device)
            attention_mask = torch.cat([encoder_hidden_states_mask, image_mask], dim=1)[:, None, None, :]
        seq_txt = encoder_hidden_states.shape[1]

        head_dim = attn.inner_dim // attn.heads
        img_query = attn.to_q(hidden_states).unflatten(-1, (-1, head_dim))
        img_key = attn.to_k(hidden_states).unflatten(-1, (-1, head_dim))
        img_value = attn.to_v(hidden_states).unflatten(-1, (-1, head_dim))
        txt_query = attn.add_q_proj(encoder_hidden_states).unflatten(-1, (-1, head_dim))
        txt_key = attn.add_k_proj(encoder_hidden_states).unflatten(-1, (-1, head_dim))
        txt_value = attn.add_v_proj(encoder_hidden_states).unflatten(-1, (-1, head_dim))

        img_freqs, txt_freqs = image_rotary_emb if image_rotary_emb is not None else (None, None)
        img_query = self._qk(attn.norm_q, img_query, img_freqs)
        img_key = self._qk(attn.norm_k, img_key, img_freqs)
        txt_query = self._qk(attn.norm_added_q, txt_query, txt_freqs)
        txt_key = self._qk(attn.norm_added_k, txt_key, txt_freqs)

        joint_query = torch.cat([txt_query, img_query], dim=1)  # order: text, image
        joint_key = torch.cat([txt_key, img_key], dim=1)
        joint_value = torch.cat([txt_value, img_value], dim=1)
        joint_hidden_states = dispatch_attention_fn(
            joint_query, joint_key, joint_value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
            backend=self._attention_backend, parallel_config=self._parallel_config,
        )
        joint_hidden_states = joint_hidden_states.flatten(2, 3).to(joint_query.dtype)
        txt_attn_output = joint_hidden_states[:, :seq_txt, :]
        img_attn_output = joint_hidden_states[:, seq_txt:, :]

        img_attn_output = attn.to_out[0](img_attn_output.contiguous())
        if len(attn.to_out) > 1:
            img_attn_output = attn.to_out[1](img_attn_output)  # dropout
        txt_attn_output = attn.to_add_out(txt_attn_output.contiguous())
        return img_attn_output, txt_attn_output
