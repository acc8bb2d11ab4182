"""Qwen-Image 2.1 (``QwenImage21Transformer2DModel``): the tensors its single-stream blocks build only to quantize them
inside the next NVFP4 projection are never written.

``fused_block_forward`` is diffusers' ``QwenImage21TransformerBlock.forward`` with three sections replaced, each where
its gate allows (else diffusers' code runs, the reason counted):
- norm1 (``qwen21_adaln``): ``img_norm1(x) * (1 + scale)`` and the input quantize of ``to_q``/``to_k``/``to_v`` as
  one kernel, the adaptive-LayerNorm kernel of ``adaln.py`` without its shift add (``HAS_SHIFT=False``: not an add
  of zero, which would turn -0 into +0); the attention gets an ``AdaLNOperand``;
- norm2 (``qwen21_resnorm``): ``h + tanh(gate1) * attn``, ``img_norm2``, ``* (1 + scale)`` and the input quantize of
  the feed-forward's ``gate_layer`` and ``proj`` as one kernel, the residual-norm kernel of ``resnorm.py`` without bias
  and shift; ``tanh(gate1)`` is diffusers' own op on diffusers' own tensor, run first and passed as the gate. Both
  projections read one ``SharedResNormOperand`` (one quantized input: their input scales must be equal, checked like
  query/key/value's);
- the feed-forward (``qwen21_swiglu``): ``silu(gate_layer(x)) * proj(x)`` folded into ``out``'s quantize
  (``ops.swiglu_quantize.swiglu_gate_up_quantize``, FLUX.2's SwiGLU kernel reading gate and up from two tensors).
The query/key norm and rotary embedding run in the attention processor (``qwen21_attention.py``,
``qwen21_qk_rotary``), which keeps diffusers' KV-cache bookkeeping; ``kv_cache_mode``, ``segments`` and the other
arguments reach it unchanged. Installed per block instance with ``swap_forward`` (cache hooks keep wrapping it).

Modulation: diffusers' ``_select_modulation_rows`` gives per-sample ``[B, 1, D]`` views without ``causal_condition``,
and per-token ``[B, L, D]`` rows (the real rows for target tokens, the ``t = 0`` row for the rest) with it; the norm
kernels read either as it is (a zero or a real token stride). Under ``torch.compile`` the block runs diffusers'
forward (inductor computes LayerNorm, SiLU and RMSNorm its own way, and compiled on must equal compiled off; each
site counts ``compiled: kept diffusers' op`` once per trace); the NVFP4 GEMMs stay.
"""

from __future__ import annotations

import types
from typing import Any, cast

import torch
from diffusers.models.transformers import transformer_qwenimage21 as qwen21_module
from torch import nn

from ..linear import NVFP4Linear
from ..module_hooks import call_changed_reason
from ..ops.layer_norm_quantize import ResNormInputs
from ..ops.site import SiteKind, sites_for
from ..ops.verify import COMPILED, count_fallback, failed_kind_reason, site_counter
from ..swaps import swap_forward, swap_processor
from .adaln import SharedInputConsumers, fused_norm1_input, modulation_reason
from .consumers import consumer_reason, nvfp4_layer
from .operands import SharedResNormOperand, SwiGLUGateUpOperand
from .qwen21_attention import QwenImage21FusedAttnProcessor
from .resnorm import resnorm_reason
from .state import BlockState, block_state, install_state, remove_state

KINDS: tuple[SiteKind, ...] = ("qwen21_adaln", "qwen21_resnorm", "qwen21_swiglu", "qwen21_qk_rotary")
_HALF_DTYPES = (torch.bfloat16, torch.float16)
# Processors whose code reads the attention's input only through to_q/to_k/to_v's calls (an AdaLNOperand serves them).
_OPERAND_READERS = (qwen21_module.QwenImage21AttnProcessor, qwen21_module.QwenImage21FlexAttnProcessor,
                    QwenImage21FusedAttnProcessor)


def _selected(mod: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, gate) of one ``[B(+1), 2D]`` modulation half, rows selected per token as diffusers'
    ``QwenImage21TransformerBlock._modulate`` does (its own function, so the same tensors)."""
    scale, gate = mod.chunk(2, dim=-1)
    return (qwen21_module._select_modulation_rows(scale, mask), qwen21_module._select_modulation_rows(gate, mask))


def _processor_reason(attn: nn.Module) -> str | None:
    """None when the attention's processor reads its input only through the projections' calls (diffusers' two 2.1
    processors and the fused one); another processor could read the values, so it gets the modulated tensor."""
    if type(attn.processor) not in _OPERAND_READERS:
        return f"attention processor is {type(attn.processor).__name__}"
    return None


def _attention_input(block: nn.Module, x: torch.Tensor, mod: torch.Tensor,
                     mask: torch.Tensor | None) -> tuple[Any, torch.Tensor]:
    """(the attention's input, gate1): diffusers' ``_modulate(img_norm1(x), mod, mask)``, or an ``AdaLNOperand`` that
    the query/key/value projections quantize in one kernel (site ``qwen21_adaln``)."""
    state = block_state(block)
    consumers = state.adaln.get("img")
    if consumers is not None:
        scale, gate = _selected(mod, mask)
        attn = cast(nn.Module, block.attn)
        reason = _processor_reason(attn) or (None if consumers.owner is attn else "attention replaced after enabling")
        fused = fused_norm1_input(state.sites["qwen21_adaln"], consumers, cast(nn.Module, block.img_norm1), x, scale,
                                  None, reason)
        if fused is not None:
            return fused, gate
    modulated = cast(Any, block)._modulate(cast(nn.Module, block.img_norm1)(x), mod, mask)
    return cast(tuple[torch.Tensor, torch.Tensor], modulated)


def _count_processor_fallback(block: nn.Module, state: BlockState) -> None:
    """A block whose attention runs another processor than the fused one (e.g. ``QwenImage21FlexAttnProcessor``, set
    before or after enabling) keeps diffusers' query/key norm and rotary: counted per call."""
    processor = cast(nn.Module, block.attn).processor
    if not isinstance(processor, QwenImage21FusedAttnProcessor):
        count_fallback(state.sites["qwen21_qk_rotary"], f"attention processor is {type(processor).__name__}")


def swiglu_reason(ff: nn.Module, gate: torch.Tensor) -> str | None:
    """None when ``out(activation_fn(gate) * up)`` can take ``silu(gate) * up`` as one kernel inside ``out``'s
    quantize (site ``qwen21_swiglu``), else the reason. ``gate``: ``gate_layer``'s output."""
    out, act = cast(nn.Module, ff.out), cast(nn.Module, ff.activation_fn)
    reason = consumer_reason(out, "out")
    if reason is not None:
        return reason
    if type(act) is not nn.SiLU:
        return f"activation is {type(act).__name__}, not SiLU"
    reason = call_changed_reason("activation_fn", act)
    if reason is not None:
        return reason
    if torch.compiler.is_compiling():
        return COMPILED  # inductor computes SiLU as x * sigmoid(x), which rounds differently
    if gate.dtype not in _HALF_DTYPES or gate.shape[-1] % 16:
        return f"gate_layer output {gate.dtype} width {gate.shape[-1]} (bf16/fp16, a multiple of 16)"
    if gate.shape[-1] != cast(NVFP4Linear, out).in_features:
        return f"width {gate.shape[-1]} != out.in_features {cast(NVFP4Linear, out).in_features} (sharded?)"
    if failed_kind_reason("qwen21_swiglu") is not None:
        return "verification failed earlier in this process"
    return None


def _gated_mlp(block: nn.Module, x: Any) -> torch.Tensor:
    """``QwenImage21SwiGLUFeedForward``'s body on ``x`` (a tensor, or the ``qwen21_resnorm`` site's operand): its
    projections in diffusers' order, with SiLU and the product folded into ``out``'s quantize where the site allows."""
    ff: Any = block.img_mlp  # a QwenImage21SwiGLUFeedForward (checked by the callers)
    state = block_state(block)
    site = state.sites["qwen21_swiglu"]
    gate = ff.gate_layer(x)
    reason = swiglu_reason(ff, gate) if "qwen21_swiglu" in state.installed else "not installed"
    if reason is None:
        up = ff.proj(x)
        if up.shape == gate.shape and up.dtype == gate.dtype:
            return ff.out(SwiGLUGateUpOperand(gate, up, site))
        count_fallback(site, f"proj output {tuple(up.shape)} {up.dtype} is not gate_layer's")
        return ff.out(ff.activation_fn(gate) * up)
    if reason != "not installed":
        count_fallback(site, reason)
    return ff.out(ff.activation_fn(gate) * ff.proj(x))


def _feed_forward(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``img_mlp(x)``: its module call where a hook observes it (or no SwiGLU site is installed), else its body."""
    ff = cast(nn.Module, block.img_mlp)
    state = block_state(block)
    if "qwen21_swiglu" not in state.installed:
        return ff(x)
    reason = (f"feed-forward is {type(ff).__name__}" if type(ff) is not qwen21_module.QwenImage21SwiGLUFeedForward
              else call_changed_reason("feed-forward", ff))
    if reason is not None:
        count_fallback(state.sites["qwen21_swiglu"], reason)
        return ff(x)
    return _gated_mlp(block, x)


def _resnorm_reason(block: nn.Module, consumers: SharedInputConsumers, residual: torch.Tensor,
                    attn_out: torch.Tensor, params: tuple[torch.Tensor, ...]) -> str | None:
    """Why the norm2 section of this call cannot run as the residual-norm kernel feeding ``gate_layer`` and ``proj``
    (site ``qwen21_resnorm``), or None."""
    ff = cast(nn.Module, block.img_mlp)
    if consumers.owner is not ff:
        return "feed-forward replaced after enabling"
    reason = consumers.call_reason()
    if reason is not None:
        return reason
    norm = cast(nn.Module, block.img_norm2)
    bypassed = {"norm2": norm, "feed-forward": ff}
    reason = resnorm_reason(cast(nn.Module, ff.gate_layer), bypassed, norm, residual, attn_out, None,
                            "qwen21_resnorm")
    return reason or modulation_reason(params, residual) or consumers.forms_reason(residual)


def _mlp_section(block: nn.Module, residual: torch.Tensor, attn_out: torch.Tensor, gate1: torch.Tensor,
                 mod2: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``h = residual + tanh(gate1) * attn_out``, then norm2, modulate, the feed-forward and the gate2 residual; the
    first part and the projections' input quantize in one kernel where the gate allows."""
    state = block_state(block)
    tanh1 = gate1.tanh()  # diffusers' op on diffusers' tensor (not correctly rounded: computed exactly as there)
    scale2, gate2 = _selected(mod2, mask)
    consumers = state.ff_inputs
    reason = None if consumers is None else _resnorm_reason(block, consumers, residual, attn_out, (tanh1, scale2))
    if consumers is None or reason is not None:
        if reason is not None:
            count_fallback(state.sites["qwen21_resnorm"], reason)
        hidden = residual + tanh1 * attn_out
        modulated = cast(nn.Module, block.img_norm2)(hidden) * (1 + scale2)  # diffusers' _modulate
        return hidden + gate2.tanh() * _feed_forward(block, modulated)
    eps = float(cast(nn.LayerNorm, block.img_norm2).eps)  # resnorm_reason passed: an affine-free nn.LayerNorm
    operand = SharedResNormOperand(ResNormInputs(residual, attn_out, None, tanh1, scale2, None), eps,
                                   state.sites["qwen21_resnorm"])
    mlp_out = _gated_mlp(block, operand)
    return operand.residual_out + gate2.tanh() * mlp_out


def _count_compiled_sites(block: nn.Module) -> None:
    """Under torch.compile the block runs diffusers' forward: each of its sites keeps diffusers' ops (counted once
    per trace; the fused attention processor counts its own)."""
    state = block_state(block)
    for kind in state.installed:
        if kind != "qwen21_qk_rotary":
            count_fallback(state.sites[kind], COMPILED)


_DIFFUSERS_BLOCK_FORWARD = qwen21_module.QwenImage21TransformerBlock.forward  # a plain function: dynamo inlines it


# Adapted from diffusers 0.42.1, models/transformers/transformer_qwenimage21.py, QwenImage21TransformerBlock.forward:
# the same code, with the norm1 section handed to _attention_input and the rest after the attention to _mlp_section.
def fused_block_forward(
    self,
    hidden_states: torch.Tensor,
    modulation: torch.Tensor,
    rotary_emb: torch.Tensor | None = None,
    attention_mask: Any | None = None,
    target_token_mask: torch.Tensor | None = None,
    layer_cache: Any = None,
    kv_cache_mode: str | None = None,
    cache_write_slice: slice | None = None,
    segments: list[tuple[int, int, bool]] | None = None,
    key_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    if torch.compiler.is_compiling():  # diffusers' forward, op for op: inductor sees off's graph (design.md §1)
        _count_compiled_sites(self)
        return _DIFFUSERS_BLOCK_FORWARD(self, hidden_states, modulation, rotary_emb, attention_mask, target_token_mask,
                                        layer_cache, kv_cache_mode, cache_write_slice, segments, key_valid)
    mod1, mod2 = modulation.chunk(2, dim=-1)

    img_modulated, img_gate1 = _attention_input(self, hidden_states, mod1, target_token_mask)
    _count_processor_fallback(self, block_state(self))
    attn_output = self.attn(
        hidden_states=img_modulated,
        attention_mask=attention_mask,
        rotary_emb=rotary_emb,
        layer_cache=layer_cache,
        kv_cache_mode=kv_cache_mode,
        cache_write_slice=cache_write_slice,
        segments=segments,
        key_valid=key_valid,
    )
    hidden_states = _mlp_section(self, hidden_states, attn_output, img_gate1, mod2, target_token_mask)

    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)

    return hidden_states


def _block_sites(block: nn.Module) -> tuple[list[SiteKind], SharedInputConsumers | None, SharedInputConsumers | None]:
    """(the site kinds that can be installed on ``block``, its query/key/value consumers, its feed-forward's)."""
    attn, ff = cast(nn.Module, block.attn), cast(nn.Module, block.img_mlp)
    kinds: list[SiteKind] = []
    qkv = SharedInputConsumers(attn, ("to_q", "to_k", "to_v"))
    if qkv.reason is None:
        kinds.append("qwen21_adaln")
    ff_inputs = None
    if type(ff) is qwen21_module.QwenImage21SwiGLUFeedForward:
        ff_inputs = SharedInputConsumers(ff, ("gate_layer", "proj"), "the feed-forward's gate_layer and proj")
        if ff_inputs.reason is None:
            kinds.append("qwen21_resnorm")
        if nvfp4_layer(cast(nn.Module, ff.out)) is not None:
            kinds.append("qwen21_swiglu")
    if type(attn.processor) is qwen21_module.QwenImage21AttnProcessor:
        kinds.append("qwen21_qk_rotary")
    return kinds, (qkv if qkv.reason is None else None), (ff_inputs if "qwen21_resnorm" in kinds else None)


def patch_qwenimage21(model: nn.Module, stats_id: int, restore: list) -> dict[SiteKind, int]:
    """Swap the forward of every ``QwenImage21TransformerBlock`` with an NVFP4 layer (and diffusers' default attention
    processor for the fused query/key norm and rotary embedding). Returns ``{site kind: count}``."""
    sites = sites_for(stats_id)
    count: dict[SiteKind, int] = dict.fromkeys(KINDS, 0)
    note = site_counter(stats_id)
    for i, block in enumerate(getattr(model, "transformer_blocks", [])):
        name = f"transformer_blocks.{i}"
        if not isinstance(block, qwen21_module.QwenImage21TransformerBlock):
            continue
        if not any(isinstance(m, NVFP4Linear) for m in block.modules()):
            continue  # a BF16 block (the exclusion rule keeps the first two and last two): diffusers' code
        kinds, qkv, ff_inputs = _block_sites(block)
        if not kinds:
            continue
        attn = cast(nn.Module, block.attn)
        state = BlockState(sites, adaln={"img": qkv} if qkv is not None else {}, ff_inputs=ff_inputs, installed=kinds)
        install_state(block, state)
        undo = swap_forward(block, types.MethodType(fused_block_forward, block))
        undo_qk = None
        if "qwen21_qk_rotary" in kinds:
            undo_qk = swap_processor(attn, QwenImage21FusedAttnProcessor(attn.processor, sites["qwen21_qk_rotary"]))

        def restore_block(block=block, undo=undo, undo_qk=undo_qk):
            if undo_qk is not None:
                undo_qk()
            undo()
            remove_state(block)

        restore.append(restore_block)
        where = {"qwen21_adaln": f"{name}.attn", "qwen21_resnorm": f"{name}.img_mlp",
                 "qwen21_swiglu": f"{name}.img_mlp.out", "qwen21_qk_rotary": f"{name}.attn"}
        for kind in kinds:
            count[kind] += 1
            note(kind, where[kind])
    return {kind: n for kind, n in count.items() if n}
