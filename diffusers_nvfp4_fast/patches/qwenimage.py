"""Qwen-Image blocks: ``residual + gate*attn -> LayerNorm -> modulate -> quantize`` fused into one kernel.

``fused_block_forward`` is diffusers' ``QwenImageTransformerBlock.forward`` with the norm2 section of each stream
replaced by ``_mlp_stream``: the kernel returns the new residual and FC1's quantized input, and FC1 runs
``forward_prequantized``; then GELU and FC2's quantize run as one kernel (``qwen_gelu``) where FC2 is NVFP4, and the
gate2 residual stays diffusers' code. It is installed per block instance with ``swap_forward`` so cache hooks keep
wrapping it. Under ``torch.compile`` the block runs diffusers' forward (compiled on must equal compiled off), and
only GELU stays fused, in the feed-forward's own forward, where inductor's GELU was found equal to torch's.

Where both attention output projections are ``NVFP4Linear`` with a bias, their bias add moves into the kernel
(one pass over ``[B, L, D]`` less per stream): the block's attention processor is wrapped so that it sees the
projections' ``forward_without_bias``, and the kernel computes ``bf16(x + bias)`` exactly as the projection's own
bias add would. Only a block whose forward is the fused one consumes those unbiased outputs.
"""

from __future__ import annotations

import types
from typing import Any, cast

import torch
from diffusers.models.activations import GELU
from diffusers.models.transformers import transformer_qwenimage as qwen_module
from torch import nn

from ..linear import NVFP4Linear
from ..module_hooks import call_changed_reason
from ..ops.dispatch import triton_runs_on
from ..ops.gelu_quantize import compiled_gelu_reason, gelu_mismatch
from ..ops.layer_norm_quantize import ResNormInputs
from ..ops.site import Site, SiteKind, sites_for
from ..ops.verify import COMPILED, count_fallback, failed_kind_reason, site_counter
from ..swaps import current_inner_forward, swap_forward, swap_processor
from .adaln import SharedInputConsumers, fused_norm1_input
from .consumers import consumer_reason, nvfp4_layer
from .operands import AdaLNOperand, GeluOperand
from .qwen_attention import QwenFusedAttnProcessor
from .resnorm import fused_residual_norm, resnorm_reason
from .state import BlockState, block_state, install_state, remove_state


def _fc1(ff: nn.Module) -> nn.Module | None:
    net = getattr(ff, "net", None)
    return getattr(net[0], "proj", None) if net is not None and len(net) > 0 else None


class _DeferredBiasView:
    """What the attention processor gets in place of ``attn``: every attribute is the attention's own, except that
    ``to_out[0]`` and ``to_add_out`` skip their bias (the fused kernel adds it)."""

    def __init__(self, attn: nn.Module):
        self._attn = attn

    @property
    def to_out(self) -> list:
        # list(...)[1:], not to_out[1:]: slicing a ModuleList builds a new ModuleList (an nn.Module) on every access
        modules = list(cast(nn.ModuleList, self._attn.to_out))
        return [modules[0].forward_without_bias, *modules[1:]]

    @property
    def to_add_out(self):
        return self._attn.to_add_out.forward_without_bias

    def __getattr__(self, name: str):
        return getattr(self._attn, name)


class QwenDeferredBiasAttnProcessor:
    """Runs the attention's own processor (whatever its class) with the output projections' bias deferred.

    The signature repeats diffusers' ``QwenDoubleStreamAttnProcessor2_0.__call__``: ``Attention.forward`` passes
    only the keyword arguments the processor's signature names. Attention backend and parallel config are read and
    set on the wrapped processor, so ``set_attention_backend`` keeps working while the fast paths are on.
    """

    def __init__(self, processor, attn: nn.Module, state: BlockState):
        self.processor = processor
        self._view = _DeferredBiasView(attn)
        self._state = state  # the block forward decides per call whether the bias is deferred

    _attention_backend = property(lambda self: self.processor._attention_backend,
                                  lambda self, v: setattr(self.processor, "_attention_backend", v))
    _parallel_config = property(lambda self: self.processor._parallel_config,
                                lambda self, v: setattr(self.processor, "_parallel_config", v))

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.processor(
            self._view if self._state.defer_bias else attn, hidden_states, encoder_hidden_states,
            encoder_hidden_states_mask, attention_mask, image_rotary_emb,
        )


def bias_deferral_reason(attn: nn.Module) -> str | None:
    """Why ``attn`` must return its projections with their bias (the unfused way), or None when the bias can move
    into the fused kernel: its processor is the wrapper, both projections are biased ``NVFP4Linear``, no hook
    observes the attention or its projections (a cache hook would see unbiased outputs), and no training-mode
    dropout sits between ``to_out[0]`` and its bias. Checked per call, so later changes to the model are safe."""
    if not isinstance(attn.processor, QwenDeferredBiasAttnProcessor):
        return "attention processor replaced"
    if torch.compiler.is_compiling():
        return COMPILED  # the block runs diffusers' forward, which adds the bias itself
    to_out = list(cast(nn.ModuleList, attn.to_out))
    for label, module in (
        ("attention", attn), ("to_out.0", to_out[0]), ("to_add_out", cast(nn.Module, attn.to_add_out)),
    ):
        reason = call_changed_reason(label, module)
        if reason is not None:
            return reason
    if not _bias_can_be_deferred(attn):
        return "output projections are not both biased NVFP4Linear"
    if any(isinstance(m, nn.Dropout) and m.training and m.p > 0 for m in to_out[1:]):
        return "dropout in training mode"
    return None


def _bias_can_be_deferred(attn: nn.Module) -> bool:
    to_out = getattr(attn, "to_out", None)
    projections = (to_out[0] if to_out is not None and len(to_out) > 0 else None, getattr(attn, "to_add_out", None))
    return all(isinstance(p, NVFP4Linear) and p.bias is not None for p in projections)


def _mod_params(mod: torch.Tensor, index: torch.Tensor | None):
    """(shift, scale, gate2) for the kernel, and gate2 shaped as ``QwenImageTransformerBlock._modulate`` returns it.

    Per-sample rows stay ``[B, D]`` views (the kernel reads them with a zero token stride): building ``[B, L, D]``
    views would cost host time on every call, and the eager step is bound by host time. With ``index`` (edit
    models) each token picks the first or second half of the batch's parameters, as ``_modulate`` does.
    """
    shift, scale, gate = mod.chunk(3, dim=-1)
    if index is None:
        return shift, scale, gate.unsqueeze(1)
    half = shift.size(0) // 2
    pick = index.unsqueeze(-1) == 0
    return tuple(torch.where(pick, p[:half].unsqueeze(1), p[half:].unsqueeze(1)) for p in (shift, scale, gate))


def _mlp_stream(
    block: nn.Module, ff: nn.Module, norm: nn.Module, residual: torch.Tensor, attn_out: torch.Tensor,
    attn_bias: torch.Tensor | None, gate1: torch.Tensor, mod2: torch.Tensor, index: torch.Tensor | None,
) -> torch.Tensor:
    """``residual + gate1*(attn_out + attn_bias)``, then norm2 + modulate + MLP + gate2 residual, fused where the
    gate allows. ``attn_bias`` is the projection bias the attention deferred (None if ``attn_out`` has it)."""
    fc1 = _fc1(ff)
    bypassed = {"norm2": norm, "feed-forward": ff, "feed-forward GELU": cast(nn.ModuleList, ff.net)[0]}
    sites = block_state(block).sites
    reason = resnorm_reason(fc1, bypassed, norm, residual, attn_out, attn_bias, "qwen_resnorm")
    if reason is not None:
        count_fallback(sites["qwen_resnorm"], reason)
        if attn_bias is not None:
            attn_out = attn_out + attn_bias  # the projection's own bias add, deferred to here
        hidden = residual + gate1 * attn_out
        modulated, gate2 = cast(Any, block)._modulate(norm(hidden), mod2, index)
        return hidden + gate2 * ff(modulated)
    shift, scale, gate2 = _mod_params(mod2, index)
    # gate1 is _modulate's [B, 1, D] (or per-token [B, L, D]): the kernel takes either as it is.
    inputs = ResNormInputs(residual, attn_out, attn_bias, gate1, scale, shift)
    hidden, y = fused_residual_norm(cast(NVFP4Linear, fc1), norm, inputs, sites["qwen_resnorm"])
    return hidden + gate2 * _gelu_fc2(ff, y, sites["qwen_gelu"])


_NOT_GELU_FEED_FORWARD = "feed-forward is not GELU, Dropout, FC2"


def gelu_fc2_reason(ff: nn.Module, y: torch.Tensor) -> str | None:
    """None when GELU and FC2's quantize can run as one kernel on FC1's output ``y``, else the reason they cannot.
    (``resnorm_reason`` already checked the feed-forward and its GELU module for hooks.)"""
    net = list(cast(nn.ModuleList, ff.net))  # not ff.net[...] slices (see _DeferredBiasView.to_out)
    if len(net) < 3 or type(net[0]) is not GELU or not isinstance(net[1], nn.Dropout):
        return _NOT_GELU_FEED_FORWARD
    if net[0].approximate != "tanh":
        return f"GELU approximate={net[0].approximate!r} (tanh only)"
    if net[1].training and net[1].p > 0:
        return "dropout in training mode"
    reason = call_changed_reason("feed-forward dropout", net[1]) or consumer_reason(net[2], "FC2")
    if reason is not None:
        return reason
    if y.dtype not in (torch.bfloat16, torch.float16) or y.shape[-1] % 16:
        return f"FC1 output {y.dtype} width {y.shape[-1]} (bf16/fp16, a multiple of 16)"
    if torch.compiler.is_compiling():  # compiled off computes inductor's GELU: fused only where it is torch's
        if not triton_runs_on(y):
            return COMPILED
        return compiled_gelu_reason(str(y.device), y.dtype == torch.bfloat16) or None
    if failed_kind_reason("qwen_gelu") is not None:
        return "verification failed earlier in this process"
    return gelu_mismatch(y.device, y.dtype) if triton_runs_on(y) else None


def _gelu_fc2(ff: nn.Module, y: torch.Tensor, site: Site) -> torch.Tensor:
    """diffusers' ``ff.net[0].gelu`` and the rest of ``ff.net`` on FC1's output, with GELU folded into FC2's
    quantize where ``gelu_fc2_reason`` allows."""
    net = list(cast(nn.ModuleList, ff.net))
    reason = gelu_fc2_reason(ff, y)
    if reason is not None:
        count_fallback(site, reason)
        y = cast(Any, net[0]).gelu(y)
        for module in net[1:]:
            y = module(y)
        return y
    y = net[2](GeluOperand(y, site))  # the gate passed: FC2 is an NVFP4Linear, net[1] an inactive dropout
    for module in net[3:]:
        y = module(y)
    return y


def compiled_feed_forward(ff: nn.Module, site: Site):
    """The feed-forward's own forward, except under ``torch.compile`` (where the block runs diffusers' forward): there
    GELU and FC2's quantize run as one kernel (``_gelu_fc2``) where the gate allows. Eager calls of the fused block
    forward fuse them in ``_mlp_stream`` and do not call this."""
    original = current_inner_forward(ff)

    def forward(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if not torch.compiler.is_compiling() or args or kwargs:
            return original(hidden_states, *args, **kwargs)
        gelu = cast(nn.ModuleList, ff.net)[0]
        reason = (_NOT_GELU_FEED_FORWARD if type(gelu) is not GELU
                  else call_changed_reason("feed-forward GELU", gelu))
        if reason is not None:
            count_fallback(site, reason)
            return original(hidden_states)
        return _gelu_fc2(ff, cast(nn.Module, gelu.proj)(hidden_states), site)

    return forward


def _processor_reason(attn: nn.Module) -> str | None:
    """None when the attention's processor is diffusers' own Qwen-Image processor (directly or in the bias wrapper):
    its code reads the image and text inputs only through the projections' calls and their ``shape`` / ``device``,
    which an ``AdaLNOperand`` provides. Another processor could read the values, so it gets the modulated tensors."""
    processor = attn.processor
    if isinstance(processor, QwenDeferredBiasAttnProcessor):
        processor = processor.processor
    if type(processor) not in (qwen_module.QwenDoubleStreamAttnProcessor2_0, QwenFusedAttnProcessor):
        return f"attention processor is {type(processor).__name__}"
    return None


def _attention_input(block: nn.Module, stream: str, norm: nn.Module, x: torch.Tensor, mod: torch.Tensor,
                     index: torch.Tensor | None) -> tuple[torch.Tensor | AdaLNOperand, torch.Tensor]:
    """(the attention's input for this stream, gate1): diffusers' ``_modulate(norm1(x), mod, index)``, or an
    ``AdaLNOperand`` that the query/key/value projections quantize in one kernel (site ``qwen_adaln``)."""
    state = block_state(block)
    consumers = state.adaln.get(stream)
    if consumers is not None:
        shift, scale, gate = _mod_params(mod, index)
        reason = _processor_reason(cast(nn.Module, block.attn))
        fused = fused_norm1_input(state.sites["qwen_adaln"], consumers, norm, x, scale, shift, reason)
        if fused is not None:
            return fused, gate
    return cast(tuple[torch.Tensor, torch.Tensor], cast(Any, block)._modulate(norm(x), mod, index))


def _decide_bias_deferral(block: nn.Module, state: BlockState) -> bool:
    """Whether this call's attention returns its projections without bias (decided once per call, before the
    attention runs, and read by ``QwenDeferredBiasAttnProcessor``); a deferral site that cannot defer counts why."""
    if not state.bias_site:
        return False
    reason = bias_deferral_reason(cast(nn.Module, block.attn))
    if reason is not None:
        count_fallback(state.sites["qwen_bias_deferral"], reason)
    return reason is None


def _count_compiled_sites(block: nn.Module) -> None:
    """Under torch.compile the block runs diffusers' forward: each of its sites keeps diffusers' ops (counted once
    per trace), except GELU, which the feed-forward's own forward decides (``compiled_feed_forward``)."""
    state = block_state(block)
    for ff in (cast(nn.Module, block.img_mlp), cast(nn.Module, block.txt_mlp)):
        if nvfp4_layer(_fc1(ff)) is not None:
            count_fallback(state.sites["qwen_resnorm"], COMPILED)
    for _ in state.adaln:
        count_fallback(state.sites["qwen_adaln"], COMPILED)
    if state.bias_site:
        count_fallback(state.sites["qwen_bias_deferral"], COMPILED)


_DIFFUSERS_BLOCK_FORWARD = qwen_module.QwenImageTransformerBlock.forward  # a plain function: dynamo inlines it


# Adapted from diffusers 0.42.1, models/transformers/transformer_qwenimage.py, QwenImageTransformerBlock.forward:
# the same code, with each stream's norm1 section handed to _attention_input and its norm2 section to _mlp_stream.
def fused_block_forward(
    self,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    encoder_hidden_states_mask: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
    modulate_index: torch.Tensor | None = None,  # diffusers annotates list[int] but passes a tensor (or None)
) -> tuple[torch.Tensor, torch.Tensor]:
    if torch.compiler.is_compiling():  # diffusers' forward, op for op: inductor sees off's graph (design.md §1)
        _count_compiled_sites(self)
        return _DIFFUSERS_BLOCK_FORWARD(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb,
                                        image_rotary_emb, joint_attention_kwargs, cast(Any, modulate_index))
    img_mod1, img_mod2 = self.img_mod(temb).chunk(2, dim=-1)
    if self.zero_cond_t:
        temb = torch.chunk(temb, 2, dim=0)[0]
    txt_mod1, txt_mod2 = self.txt_mod(temb).chunk(2, dim=-1)

    img_modulated, img_gate1 = _attention_input(self, "img", self.img_norm1, hidden_states, img_mod1, modulate_index)
    txt_modulated, txt_gate1 = _attention_input(self, "txt", self.txt_norm1, encoder_hidden_states, txt_mod1, None)
    state = block_state(self)
    deferred = state.defer_bias = _decide_bias_deferral(self, state)
    try:
        img_attn_output, txt_attn_output = self.attn(
            hidden_states=img_modulated,
            encoder_hidden_states=txt_modulated,
            encoder_hidden_states_mask=encoder_hidden_states_mask,
            image_rotary_emb=image_rotary_emb,
            **(joint_attention_kwargs or {}),
        )
    finally:
        state.defer_bias = False  # any other call of the attention gets its projections with their bias
    img_bias = self.attn.to_out[0].bias if deferred else None
    txt_bias = self.attn.to_add_out.bias if deferred else None
    hidden_states = _mlp_stream(
        self, self.img_mlp, self.img_norm2, hidden_states, img_attn_output, img_bias, img_gate1, img_mod2,
        modulate_index,
    )
    encoder_hidden_states = _mlp_stream(
        self, self.txt_mlp, self.txt_norm2, encoder_hidden_states, txt_attn_output, txt_bias, txt_gate1, txt_mod2, None
    )
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


def patch_qwenimage(model: nn.Module, stats_id: int, restore: list) -> dict[SiteKind, int]:
    """Swap the forward of every block whose image or text FC1 is NVFP4 (and diffusers' attention processor for
    the fused query/key norm and rotary embedding). Returns ``{site kind: count}``."""
    sites = sites_for(stats_id)
    count: dict[SiteKind, int] = dict.fromkeys(("qwen_resnorm", "qwen_gelu", "qwen_adaln", "qwen_qk_rotary"), 0)
    note = site_counter(stats_id)

    def add(kind: SiteKind, name: str) -> None:
        count[kind] += 1
        note(kind, name)

    for i, block in enumerate(getattr(model, "transformer_blocks", [])):
        name = f"transformer_blocks.{i}"
        if not isinstance(block, qwen_module.QwenImageTransformerBlock):
            continue
        img_fc1, txt_fc1 = nvfp4_layer(_fc1(block.img_mlp)), nvfp4_layer(_fc1(block.txt_mlp))
        if img_fc1 is None and txt_fc1 is None:
            continue
        attn = block.attn
        state = BlockState(sites)
        install_state(block, state)
        undo = swap_forward(block, types.MethodType(fused_block_forward, block))
        undo_qk = undo_processor = None
        if type(attn.processor) is qwen_module.QwenDoubleStreamAttnProcessor2_0:
            undo_qk = swap_processor(attn, QwenFusedAttnProcessor(attn.processor, sites["qwen_qk_rotary"]))
            add("qwen_qk_rotary", f"{name}.attn")
        # Both streams' FC1 must be fused to consume both unbiased outputs without an extra pass.
        if _bias_can_be_deferred(attn) and img_fc1 is not None and txt_fc1 is not None:
            undo_processor = swap_processor(attn, QwenDeferredBiasAttnProcessor(attn.processor, attn, state))
        state.bias_site = undo_processor is not None
        found = {"img": SharedInputConsumers(attn, ("to_q", "to_k", "to_v")),
                 "txt": SharedInputConsumers(attn, ("add_q_proj", "add_k_proj", "add_v_proj"))}
        state.adaln = {stream: consumers for stream, consumers in found.items() if consumers.reason is None}
        for stream in state.adaln:
            add("qwen_adaln", f"{name}.attn ({stream})")

        def restore_block(block=block, undo=undo, undo_processor=undo_processor, undo_qk=undo_qk):
            for undo_swap in (undo_processor, undo_qk):  # the wrapper first: it holds the fused processor
                if undo_swap is not None:
                    undo_swap()
            undo()
            remove_state(block)

        restore.append(restore_block)
        add("qwen_resnorm", name)
        for fc1, ff_name in ((img_fc1, "img_mlp"), (txt_fc1, "txt_mlp")):
            net = getattr(block, ff_name).net
            if fc1 is not None and len(net) > 2 and nvfp4_layer(net[2]) is not None:
                add("qwen_gelu", f"{name}.{ff_name}")
                restore.append(swap_forward(getattr(block, ff_name), compiled_feed_forward(
                    getattr(block, ff_name), sites["qwen_gelu"])))
    return {kind: n for kind, n in count.items() if n or kind == "qwen_resnorm"}
