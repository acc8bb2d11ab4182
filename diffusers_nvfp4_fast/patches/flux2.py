"""FLUX.2: the tensors diffusers builds only to quantize them inside the next NVFP4 projection are never written.

- Single-stream blocks: ``to_out(cat([attn, swiglu(h)]))`` becomes one kernel that reads the attention output and the
  feed-forward projection ``h`` and quantizes the concatenation (``flux2_token_cat_swiglu``); where SwiGLU cannot be
  folded in (another activation, a hook on it, ``torch.compile``), ``to_out(token_cat_quantize(attn, mlp))``
  (``flux2_token_cat``). diffusers builds the concatenation in ``Flux2ParallelSelfAttnProcessor.__call__`` (and its
  KV-cache twin); the processors below are diffusers' code up to that point, installed per attention instance
  (processors are looked up at call time, so cache hooks on the block do not hide them).
  The same processors, and the double-stream attention processors (``flux2_attention.py``, with its KV-cache twin),
  run each query's and key's RMSNorm and rotary embedding as one kernel (``flux2_qk_rotary``) where the heads are
  128 wide, and otherwise the rotary embedding alone as one kernel (``flux2_rotary``).
- Double-stream feed-forwards: ``linear_out(swiglu(linear_in(x)))`` quantizes ``linear_in``'s output through
  SwiGLU in one kernel (``flux2_swiglu``), installed per feed-forward with ``swap_forward``.
- Double-stream blocks: ``residual + gate * attn -> norm2 -> modulate`` and ``linear_in``'s quantize run as one
  kernel (``flux2_resnorm``), the one Qwen-Image uses (``resnorm.py``): both models round the same ops in the same
  order. ``fused_double_block_forward`` is diffusers' block forward with that section replaced, installed per block.
- Every block's ``norm1 -> modulate`` before its attention and the input quantize of the projections that read it
  (query/key/value, or the single-stream fused input projection) run as one kernel (``flux2_adaln``, ``adaln.py``);
  ``fused_single_block_forward`` is diffusers' single-stream block forward with that section replaced.

SwiGLU and the rotary embedding stay diffusers' ops under ``torch.compile``: inductor computes SiLU as
``x * sigmoid(x)`` and contracts the rotary multiply-adds, which round differently from the eager ops the kernels
reproduce, and compiled on must equal compiled off.
"""

from __future__ import annotations

import types
from typing import Any, cast

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers import transformer_flux2 as flux2_module
from torch import nn

from ..linear import NVFP4Linear
from ..module_hooks import call_changed_reason
from ..ops.layer_norm_quantize import ResNormInputs
from ..ops.site import SiteKind, sites_for
from ..ops.verify import COMPILED, count_fallback, failed_kind_reason, site_counter
from ..swaps import current_inner_forward, on_original, swap_forward, swap_processor
from .adaln import SharedInputConsumers, fused_norm1_input
from .consumers import consumer_reason, nvfp4_layer
from .flux2_attention import (
    HALF_DTYPES,
    Flux2FusedAttnProcessor,
    Flux2FusedKVAttnProcessor,
    Sites,
    qk_site,
    rotate,
    single_stream_qk,
)
from .operands import AdaLNOperand, SwiGLUOperand, TokenCatOperand
from .resnorm import fused_residual_norm, resnorm_reason
from .state import BlockState, block_state, install_state, remove_state


def token_cat_reason(attn: nn.Module, attn_out: torch.Tensor, mlp_out: torch.Tensor) -> str | None:
    """None when the fused path applies to this call, else the reason it does not. ``mlp_out`` is the SwiGLU output,
    or anything of its shape and dtype (the gate reads only those)."""
    reason = consumer_reason(cast(nn.Module, attn.to_out), "to_out")
    if reason is not None:
        return reason
    if attn_out.dtype not in HALF_DTYPES or mlp_out.dtype != attn_out.dtype:
        return f"dtype {attn_out.dtype}/{mlp_out.dtype} (bf16/fp16 only)"
    a, b = attn_out.shape[-1], mlp_out.shape[-1]
    if a % 16 or b % 16:
        return f"widths {a}+{b} not multiples of 16"
    to_out_features = cast(NVFP4Linear, attn.to_out).in_features  # an NVFP4Linear: consumer_reason passed
    if a + b != to_out_features:
        return f"widths {a}+{b} != to_out.in_features {to_out_features} (sharded?)"
    if attn_out.shape[:-1] != mlp_out.shape[:-1]:
        return "attn and mlp rows differ"
    if failed_kind_reason("flux2_token_cat") is not None:
        return "verification failed earlier in this process"
    return None


def swiglu_fold_reason(act_fn: nn.Module, hidden: torch.Tensor, kind: SiteKind) -> str | None:
    """None when ``act_fn(hidden)`` can be computed inside the quantize kernel of site ``kind``, else the reason it
    cannot."""
    if type(act_fn) is not flux2_module.Flux2SwiGLU:
        return f"activation is {type(act_fn).__name__}, not Flux2SwiGLU"
    reason = call_changed_reason("act_fn", act_fn)
    if reason is not None:
        return reason
    if torch.compiler.is_compiling():
        return COMPILED  # inductor rounds SiLU differently
    if hidden.dtype not in HALF_DTYPES or hidden.shape[-1] % 32:
        return f"hidden {hidden.dtype} width {hidden.shape[-1]} (bf16/fp16, a multiple of 32)"
    if failed_kind_reason(kind) is not None:
        return "verification failed earlier in this process"
    return None


class _FusedOutputMixin:
    """The shared tail of both processors: SwiGLU, the concatenation and ``to_out``, fused as far as the gates
    allow (SwiGLU and token-cat quantize in one kernel; token-cat quantize; diffusers' own code)."""

    _attention_backend = on_original("_attention_backend")
    _parallel_config = on_original("_parallel_config")

    def __init__(self, original, sites: Sites, qk: bool):
        self._original = original  # diffusers' processor: attention backend and context-parallel settings stay on it
        self._sites = sites
        self._qk = qk  # flux2_attention.qk_site holds

    def _project_out(self, attn: nn.Module, attn_out: torch.Tensor, mlp_hidden: torch.Tensor) -> torch.Tensor:
        act_fn = cast(nn.Module, attn.mlp_act_fn)
        fold = swiglu_fold_reason(act_fn, mlp_hidden, "flux2_token_cat_swiglu")
        if fold is None:
            half = mlp_hidden[..., : mlp_hidden.shape[-1] // 2]  # a view: the gate reads its shape and dtype
            if token_cat_reason(attn, attn_out, half) is None:
                fused = SwiGLUOperand(mlp_hidden, attn_out, self._sites["flux2_token_cat_swiglu"])
                return cast(nn.Module, attn.to_out)(fused)
        else:
            count_fallback(self._sites["flux2_token_cat_swiglu"], fold)
        return self._project_cat(attn, attn_out, act_fn(mlp_hidden))

    def _project_cat(self, attn: nn.Module, attn_out: torch.Tensor, mlp_out: torch.Tensor) -> torch.Tensor:
        reason = token_cat_reason(attn, attn_out, mlp_out)
        if reason is not None:
            count_fallback(self._sites["flux2_token_cat"], reason)
            return cast(nn.Module, attn.to_out)(torch.cat([attn_out, mlp_out], dim=-1))
        return cast(nn.Module, attn.to_out)(TokenCatOperand(attn_out, mlp_out, self._sites["flux2_token_cat"]))


# Adapted from diffusers 0.42.1, models/transformers/transformer_flux2.py, Flux2ParallelSelfAttnProcessor.__call__.
def _qkv_mlp(attn, hidden_states, image_rotary_emb, sites: Sites, qk: bool):
    # diffusers' split of the fused input projection, kept identical (including its tensor-parallel arithmetic).
    projected = attn.to_qkv_mlp_proj(hidden_states)
    qkv_dim = 3 * attn.inner_dim
    mlp_dim = attn.mlp_hidden_dim * attn.mlp_mult_factor
    local_qkv = projected.shape[-1] * qkv_dim // (qkv_dim + mlp_dim)
    qkv, mlp = torch.split(projected, [local_qkv, projected.shape[-1] - local_qkv], dim=-1)
    query, key, value = (t.unflatten(-1, (-1, attn.head_dim)) for t in qkv.chunk(3, dim=-1))
    fused = single_stream_qk(attn, query, key, image_rotary_emb, sites) if qk and image_rotary_emb is not None \
        else None
    if fused is not None:
        return *fused, value, mlp
    query, key = attn.norm_q(query), attn.norm_k(key)
    if image_rotary_emb is not None:
        query = rotate(query, image_rotary_emb, sites)
        key = rotate(key, image_rotary_emb, sites)
    return query, key, value, mlp


def swiglu_out(ff: nn.Module, hidden: torch.Tensor, sites: Sites) -> torch.Tensor:
    """``linear_out(act_fn(hidden))`` of a ``Flux2FeedForward`` on ``linear_in``'s output, with SwiGLU folded into
    ``linear_out``'s quantize where the gates allow (site ``flux2_swiglu``)."""
    linear_out, act_fn = cast(nn.Module, ff.linear_out), cast(nn.Module, ff.act_fn)
    reason = consumer_reason(linear_out, "linear_out") or swiglu_fold_reason(act_fn, hidden, "flux2_swiglu")
    if reason is not None:
        count_fallback(sites["flux2_swiglu"], reason)
        return linear_out(act_fn(hidden))
    return linear_out(SwiGLUOperand(hidden, None, sites["flux2_swiglu"]))


def fused_feed_forward(ff: nn.Module, sites: Sites):
    """``Flux2FeedForward.forward`` with SwiGLU and the quantize of ``linear_out``'s input in one kernel."""
    original = current_inner_forward(ff)

    def forward(x: torch.Tensor) -> torch.Tensor:
        reason = consumer_reason(cast(nn.Module, ff.linear_out), "linear_out")
        if reason is not None:
            count_fallback(sites["flux2_swiglu"], reason)
            return original(x)
        return swiglu_out(ff, cast(nn.Module, ff.linear_in)(x), sites)

    return forward


def _ff_stream_reason(ff: nn.Module, norm: nn.Module, residual: torch.Tensor, attn_out: torch.Tensor,
                      params: tuple[torch.Tensor, ...]) -> str | None:
    """Why this stream's norm2 section cannot run as the residual-norm kernel (``flux2_resnorm``), or None."""
    if not isinstance(ff, flux2_module.Flux2FeedForward):
        return f"feed-forward is {type(ff).__name__}, not Flux2FeedForward"
    if any(p.dtype != torch.bfloat16 or p.dim() != 3 or p.shape[:2] != (residual.shape[0], 1) for p in params):
        return "modulation parameters are not per sample [B, 1, D] bf16"
    bypassed = {"norm2": norm, "feed-forward": ff}
    return resnorm_reason(cast(nn.Module, ff.linear_in), bypassed, norm, residual, attn_out, None, "flux2_resnorm")


def _ff_stream(block: nn.Module, ff: nn.Module, norm: nn.Module, residual: torch.Tensor, attn_out: torch.Tensor,
               gate_msa: torch.Tensor, shift_mlp: torch.Tensor, scale_mlp: torch.Tensor,
               gate_mlp: torch.Tensor) -> torch.Tensor:
    """``residual + gate_msa*attn_out``, then norm2 + modulate + feed-forward + gate_mlp residual, with the first
    part and ``linear_in``'s quantize in one kernel where the gate allows."""
    sites = block_state(block).sites
    reason = _ff_stream_reason(ff, norm, residual, attn_out, (gate_msa, scale_mlp, shift_mlp))
    if reason is not None:
        if nvfp4_layer(getattr(ff, "linear_in", None)) is not None:  # a site that could not fuse this call
            count_fallback(sites["flux2_resnorm"], reason)
        hidden = residual + gate_msa * attn_out
        norm_hidden = norm(hidden) * (1 + scale_mlp) + shift_mlp
        return hidden + gate_mlp * ff(norm_hidden)
    inputs = ResNormInputs(residual, attn_out, None, gate_msa, scale_mlp, shift_mlp)
    hidden, y = fused_residual_norm(cast(NVFP4Linear, ff.linear_in), norm, inputs, sites["flux2_resnorm"])
    return hidden + gate_mlp * swiglu_out(ff, y, sites)


def _attention_input(block: nn.Module, stream: str, norm: nn.Module, x: torch.Tensor, scale: torch.Tensor,
                     shift: torch.Tensor) -> torch.Tensor | AdaLNOperand:
    """The attention's input for this stream: diffusers' ``(1 + scale) * norm(x) + shift``, or an ``AdaLNOperand``
    that the projections after it quantize in one kernel (site ``flux2_adaln``)."""
    state = block_state(block)
    consumers = state.adaln.get(stream)
    if consumers is not None:
        reason = _processor_reason(cast(nn.Module, block.attn), consumers)
        fused = fused_norm1_input(state.sites["flux2_adaln"], consumers, norm, x, scale, shift, reason)
        if fused is not None:
            return fused
    return (1 + scale) * norm(x) + shift


def _processor_reason(attn: nn.Module, consumers: SharedInputConsumers) -> str | None:
    """None when the attention's processor is one of this package's (their code reads the inputs only through the
    projections' calls and ``shape``) and calls the projections the site recorded."""
    if type(attn.processor) not in _ADALN_PROCESSORS:
        return f"attention processor is {type(attn.processor).__name__}"
    if getattr(attn, "fused_projections", False) != ("to_qkv" in consumers.consumers):
        return "query/key/value projections fused or unfused after enable_fast_paths"
    return None


# Adapted from diffusers 0.42.1, models/transformers/transformer_flux2.py, Flux2TransformerBlock.forward: the same
# code, with each stream's norm1 section handed to _attention_input and its norm2 section to _ff_stream.
def fused_double_block_forward(
    self,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb_mod_img: torch.Tensor,
    temb_mod_txt: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    joint_attention_kwargs = joint_attention_kwargs or {}
    split = flux2_module.Flux2Modulation.split
    (shift_msa, scale_msa, gate_msa), (shift_mlp, scale_mlp, gate_mlp) = split(temb_mod_img, 2)
    (c_shift_msa, c_scale_msa, c_gate_msa), (c_shift_mlp, c_scale_mlp, c_gate_mlp) = split(temb_mod_txt, 2)

    norm_hidden_states = _attention_input(self, "img", self.norm1, hidden_states, scale_msa, shift_msa)
    norm_encoder_hidden_states = _attention_input(self, "txt", self.norm1_context, encoder_hidden_states, c_scale_msa,
                                                  c_shift_msa)
    attn_output, context_attn_output = self.attn(
        hidden_states=norm_hidden_states,
        encoder_hidden_states=norm_encoder_hidden_states,
        image_rotary_emb=image_rotary_emb,
        **joint_attention_kwargs,
    )
    hidden_states = _ff_stream(self, self.ff, self.norm2, hidden_states, attn_output, gate_msa, shift_mlp, scale_mlp,
                               gate_mlp)
    encoder_hidden_states = _ff_stream(self, self.ff_context, self.norm2_context, encoder_hidden_states,
                                       context_attn_output, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp)
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


# Adapted from diffusers 0.42.1, models/transformers/transformer_flux2.py, Flux2SingleTransformerBlock.forward: the
# same code, with the norm section handed to _attention_input.
def fused_single_block_forward(
    self,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor | None,
    temb_mod: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
    split_hidden_states: bool = False,
    text_seq_len: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if encoder_hidden_states is not None:
        text_seq_len = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    mod_shift, mod_scale, mod_gate = flux2_module.Flux2Modulation.split(temb_mod, 1)[0]
    norm_hidden_states = _attention_input(self, "joint", self.norm, hidden_states, mod_scale, mod_shift)
    joint_attention_kwargs = joint_attention_kwargs or {}
    attn_output = self.attn(hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb,
                            **joint_attention_kwargs)
    hidden_states = hidden_states + mod_gate * attn_output
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    if split_hidden_states:
        return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
    return hidden_states


class Flux2FusedParallelSelfAttnProcessor(_FusedOutputMixin):
    """``Flux2ParallelSelfAttnProcessor`` with the output concatenation fused into NVFP4 quantization.

    Adapted from diffusers 0.42.1, models/transformers/transformer_flux2.py, ``Flux2ParallelSelfAttnProcessor``."""

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        query, key, value, mlp = _qkv_mlp(attn, hidden_states, image_rotary_emb, self._sites, self._qk)
        out = dispatch_attention_fn(
            query, key, value, attn_mask=attention_mask, backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        out = out.flatten(2, 3).to(query.dtype)
        return self._project_out(attn, out, mlp)


class Flux2FusedKVParallelSelfAttnProcessor(_FusedOutputMixin):
    """``Flux2KVParallelSelfAttnProcessor`` (reference-image KV cache) with the same fused output.

    Adapted from diffusers 0.42.1, models/transformers/transformer_flux2.py, ``Flux2KVParallelSelfAttnProcessor``."""

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
        query, key, value, mlp = _qkv_mlp(attn, hidden_states, image_rotary_emb, self._sites, self._qk)
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
        return self._project_out(attn, out, mlp)


_REPLACEMENTS: dict[type, type[Flux2FusedParallelSelfAttnProcessor | Flux2FusedKVParallelSelfAttnProcessor]] = {
    flux2_module.Flux2ParallelSelfAttnProcessor: Flux2FusedParallelSelfAttnProcessor,
    flux2_module.Flux2KVParallelSelfAttnProcessor: Flux2FusedKVParallelSelfAttnProcessor,
}


_DOUBLE_REPLACEMENTS: dict[type, type[Flux2FusedAttnProcessor]] = {
    flux2_module.Flux2AttnProcessor: Flux2FusedAttnProcessor,
    flux2_module.Flux2KVAttnProcessor: Flux2FusedKVAttnProcessor,
}
_ADALN_PROCESSORS = (*_DOUBLE_REPLACEMENTS.values(), *_REPLACEMENTS.values())


def _adaln_consumers(attn: nn.Module, streams: dict[str, tuple[str, ...]]) -> dict[str, SharedInputConsumers]:
    """stream -> its norm1 site's projections, for the streams whose projections can share one quantized input."""
    found = {stream: SharedInputConsumers(attn, names) for stream, names in streams.items()}
    return {stream: consumers for stream, consumers in found.items() if consumers.reason is None}


def _double_block_consumers(attn: nn.Module) -> dict[str, SharedInputConsumers]:
    if getattr(attn, "fused_projections", False):
        return _adaln_consumers(attn, {"img": ("to_qkv",), "txt": ("to_added_qkv",)})
    return _adaln_consumers(attn, {"img": ("to_q", "to_k", "to_v"),
                                   "txt": ("add_q_proj", "add_k_proj", "add_v_proj")})


def _swap_block_forward(block: nn.Module, forward, state: BlockState):
    """Install ``forward`` (a fused block forward) and its ``state`` on ``block``; returns the undo callable."""
    install_state(block, state)
    undo = swap_forward(block, types.MethodType(forward, block))

    def restore_block():
        undo()
        remove_state(block)

    return restore_block


def patch_flux2(model: nn.Module, stats_id: int, restore: list) -> dict[SiteKind, int]:
    """Install fused processors on every single-stream attention whose ``to_out`` is NVFP4 and on every double-stream
    attention (its query/key norm and rotary embedding), fused forwards on every double-stream feed-forward whose
    ``linear_out`` is NVFP4, and the fused block forward on every double-stream block with an NVFP4 ``linear_in``.
    Returns ``{site kind: count}`` (a single-stream site runs ``flux2_token_cat_swiglu`` or, where SwiGLU cannot be
    folded in, ``flux2_token_cat``).

    Appends undo callables to ``restore``; each puts back the original object unless the user replaced the fused one
    meanwhile.
    """
    sites = sites_for(stats_id)
    count: dict[SiteKind, int] = dict.fromkeys(
        ("flux2_token_cat", "flux2_rotary", "flux2_qk_rotary", "flux2_swiglu", "flux2_resnorm", "flux2_adaln"), 0)
    note = site_counter(stats_id)

    def add(kind: SiteKind, name: str) -> None:
        count[kind] += 1
        note(kind, name)

    for i, block in enumerate(getattr(model, "transformer_blocks", [])):
        resnorm_sites = []
        for ff_name in ("ff", "ff_context"):
            ff = getattr(block, ff_name, None)
            if not isinstance(ff, flux2_module.Flux2FeedForward):
                continue
            if nvfp4_layer(ff.linear_out) is not None:
                restore.append(swap_forward(ff, fused_feed_forward(ff, sites)))
                add("flux2_swiglu", f"transformer_blocks.{i}.{ff_name}")
            if nvfp4_layer(ff.linear_in) is not None:
                resnorm_sites.append(f"transformer_blocks.{i}.{ff_name}")
        attn = getattr(block, "attn", None)
        adaln = {}
        fused_processor = None if attn is None else _DOUBLE_REPLACEMENTS.get(type(attn.processor))
        if attn is not None and fused_processor is not None:
            norms = (attn.norm_q, attn.norm_k, getattr(attn, "norm_added_q", None), getattr(attn, "norm_added_k", None))
            qk = qk_site(norms, attn.head_dim)
            restore.append(swap_processor(attn, fused_processor(attn.processor, sites, qk)))
            add("flux2_rotary", f"transformer_blocks.{i}.attn")
            if qk:
                add("flux2_qk_rotary", f"transformer_blocks.{i}.attn")
            adaln = _double_block_consumers(attn)
        if isinstance(block, flux2_module.Flux2TransformerBlock) and (resnorm_sites or adaln):
            restore.append(_swap_block_forward(block, fused_double_block_forward, BlockState(sites, adaln)))
            for name in resnorm_sites:
                add("flux2_resnorm", name)
            for stream in adaln:
                add("flux2_adaln", f"transformer_blocks.{i}.attn ({stream})")
    for i, block in enumerate(getattr(model, "single_transformer_blocks", [])):
        attn = block.attn
        original = attn.processor
        fused_cls = _REPLACEMENTS.get(type(original))
        if fused_cls is None or nvfp4_layer(attn.to_out) is None:
            continue
        fused = fused_cls(original, sites, qk_site((attn.norm_q, attn.norm_k), attn.head_dim))
        restore.append(swap_processor(attn, fused))
        name = f"single_transformer_blocks.{i}.attn"
        add("flux2_token_cat", name)
        add("flux2_rotary", name)
        if fused._qk:
            add("flux2_qk_rotary", name)
        adaln = _adaln_consumers(attn, {"joint": ("to_qkv_mlp_proj",)})
        if isinstance(block, flux2_module.Flux2SingleTransformerBlock) and adaln:
            restore.append(_swap_block_forward(block, fused_single_block_forward, BlockState(sites, adaln)))
            add("flux2_adaln", name)
    return {kind: n for kind, n in count.items() if n}
