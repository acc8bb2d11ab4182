"""Adaptive LayerNorm sites shared by Qwen-Image, Qwen-Image 2.1 and FLUX.2 (``qwen_adaln``, ``qwen21_adaln``,
``flux2_adaln``): a block's ``LayerNorm(x) * (1 + scale) + shift`` (Qwen-Image 2.1: no shift) before its attention,
and the input quantize of the projections that read it, as one kernel (``ops.layer_norm_quantize.adaln_quantize``);
the modulated BF16 tensor is never written.

The block forward hands the attention an ``AdaLNOperand`` in place of the modulated tensor. The attention processor
(diffusers' own Qwen-Image processor, or this package's FLUX.2 processors) passes it to each projection's call, where
``NVFP4Linear.forward`` runs it: the first projection runs the kernel with its own ``input_scale_inv`` (after
its offloading hooks ran), the others reuse the result. That sharing is exact only while every projection has the
same input scale: ``SharedInputConsumers`` checks that when the fast paths are enabled (ModelOpt calibrates the three
projections on the same tensor, so their scales agree), and checks it again at the first call after a projection was
replaced or its scales were reloaded (``NVFP4Linear.scale_version``). Qwen-Image 2.1's residual-norm site shares one
input between ``gate_layer`` and ``proj`` the same way (``qwenimage21.py``).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from ..linear import NVFP4Linear
from ..module_hooks import call_changed_reason
from ..ops.layer_norm_quantize import AdaLNInputs, kernel_runs_on
from ..ops.site import Site
from ..ops.verify import count_fallback, failed_kind_reason
from .consumers import consumer_reason, nvfp4_layer
from .operands import AdaLNOperand
from .resnorm import layer_norm_reason


class SharedInputConsumers:
    """The projections of one stream that read one fused input (an ``AdaLNOperand``, or Qwen-Image 2.1's
    ``SharedResNormOperand``, serves them all): the query/key/value after a norm1, or a feed-forward's parallel first
    projections.

    ``consumers``: attribute name -> module on ``owner`` (the attention or feed-forward) as last checked; ``reason``:
    why the site cannot be fused at all (projections not NVFP4, input scales differ or not loaded when enabled), else
    None. A projection replaced later (a LoRA wrapping it, then unloaded) or whose scales were reloaded since (a LoRA
    load runs ``load_state_dict`` on the whole model) is checked again at its next call: the site follows the model.
    ``label`` names the projections in reasons.
    """

    def __init__(self, owner: nn.Module, names: tuple[str, ...], label: str = "the projections after norm1"):
        self.owner = owner
        self.label = label
        self.consumers = {name: getattr(owner, name, None) for name in names}
        self.versions = _scale_versions(self.consumers)
        self.reason = _shared_scale_reason(self.consumers, label)

    def call_reason(self) -> str | None:
        """Why this call cannot take the fused path (checked per call: the model may have changed since)."""
        if self.reason is not None:
            return self.reason
        consumers = {name: getattr(self.owner, name, None) for name in self.consumers}
        for name, module in consumers.items():
            reason = consumer_reason(module, name) if module is not None else f"{name} was removed"
            if reason is not None:
                return reason
        versions = _scale_versions(consumers)
        if consumers != self.consumers or versions != self.versions:
            reason = _shared_scale_reason(consumers, self.label)  # one quantized input must still serve every one
            if reason is not None:
                return f"{reason} (changed after enable_fast_paths)"
            self.consumers, self.versions = consumers, versions
        return None

    def forms_reason(self, x: torch.Tensor) -> str | None:
        """Why one fused input ``[..., D]`` like ``x`` cannot serve every projection in one form (packed or decoded:
        ``NVFP4Linear.takes_decoded_rows``), or None. Asked after ``call_reason`` passed."""
        rows = x.numel() // x.shape[-1]
        forms = {cast(NVFP4Linear, m).takes_decoded_rows(rows, x.device, x.dtype) for m in self.consumers.values()}
        if len(forms) > 1:
            return f"{self.label} take different activation forms (bias dtypes differ?)"
        return None


def _scale_versions(consumers: dict[str, nn.Module | None]) -> tuple[int, ...]:
    return tuple(getattr(nvfp4_layer(m), "scale_version", -1) for m in consumers.values())


def _shared_scale_reason(consumers: dict[str, nn.Module | None], label: str) -> str | None:
    layers = [nvfp4_layer(m) for m in consumers.values()]
    if any(layer is None for layer in layers):
        return f"{label} are not all NVFP4Linear"
    scales = [cast(NVFP4Linear, layer).input_scale for layer in layers]
    if any(s.is_meta for s in scales):
        return "input scales not loaded yet (meta device) when the fast paths were enabled"
    first = scales[0].detach().float().cpu()
    if any(not torch.equal(first, s.detach().float().cpu()) for s in scales[1:]):
        return f"the input scales of {', '.join(consumers)} differ (one quantized input cannot serve all)"
    return None


def modulation_reason(params: tuple[torch.Tensor | None, ...], x: torch.Tensor) -> str | None:
    """Why the modulation parameters (None: absent, e.g. Qwen-Image 2.1's shift) cannot be read by the norm kernels
    for rows of ``x`` ``[B, L, D]``, or None: each must be BF16 per sample ``[B, D]`` / ``[B, 1, D]`` or per token
    ``[B, L, D]``."""
    b, l_len, d = x.shape
    for p in params:
        if p is not None and (p.dtype != torch.bfloat16 or p.shape[-1] != d or p.shape[0] != b
                              or p.dim() not in (2, 3) or (p.dim() == 3 and p.shape[1] not in (1, l_len))):
            return f"modulation parameter {tuple(p.shape)} {p.dtype} (bf16 [B, D], [B, 1, D] or [B, L, D])"
    return None


def adaln_reason(consumers: SharedInputConsumers, norm: nn.Module, x: torch.Tensor,
                 params: tuple[torch.Tensor | None, ...], counted: Site) -> str | None:
    """None when ``norm(x)`` modulated by ``params`` (scale, shift; shift None: none) can be handed to the site's
    projections as one fused kernel's output, else the reason."""
    reason = (consumers.call_reason() or call_changed_reason("attention", consumers.owner)
              or call_changed_reason("norm1", norm) or layer_norm_reason(norm, "norm1"))
    if reason is not None:
        return reason
    if x.dtype != torch.bfloat16 or x.dim() != 3 or x.shape[-1] % 16:
        return f"input {tuple(x.shape)} {x.dtype} (bf16 [B, L, D], D a multiple of 16)"
    d = x.shape[-1]
    reason = modulation_reason(params, x) or consumers.forms_reason(x)
    if reason is not None:
        return reason
    if x.is_cuda and not kernel_runs_on(x):
        return "no Triton kernel for this GPU"
    if x.is_cuda and d % 512:
        return f"hidden size {d} not a multiple of 512 (the kernel reproduces torch's LayerNorm there only)"
    if failed_kind_reason(counted.kind) is not None:
        return "verification failed earlier in this process"
    return None


def fused_norm1_input(counted: Site, consumers: SharedInputConsumers, norm: nn.Module, x: torch.Tensor,
                      scale: torch.Tensor, shift: torch.Tensor | None, processor_reason: str | None
                      ) -> AdaLNOperand | None:
    """The ``AdaLNOperand`` for this call of a block's norm1 site, or None after counting (under ``counted``) why it
    stays unfused. ``processor_reason``: the model's check of the attention processor (None: its code reads the
    input only through the projections' calls and ``shape``/``device``). ``shift`` None: no shift (Qwen-Image 2.1)."""
    reason = processor_reason or adaln_reason(consumers, norm, x, (scale, shift), counted)
    if reason is not None:
        count_fallback(counted, reason)
        return None
    return AdaLNOperand(AdaLNInputs(x, scale, shift), float(cast(nn.LayerNorm, norm).eps), counted)
