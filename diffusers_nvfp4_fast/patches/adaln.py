"""Adaptive LayerNorm sites shared by Qwen-Image and FLUX.2 (``qwen_adaln``, ``flux2_adaln``): a block's
``LayerNorm(x) * (1 + scale) + shift`` before its attention, and the input quantize of the projections that read it,
as one kernel (``ops.layer_norm_quantize.adaln_quantize``); the modulated BF16 tensor is never written.

The block forward hands the attention an ``AdaLNOperand`` in place of the modulated tensor. The attention processor
(diffusers' own Qwen-Image processor, or this package's FLUX.2 processors) passes it to each projection's call, where
``NVFP4Linear.forward`` runs it: the first projection runs the kernel with its own ``input_scale_inv`` (after
its offloading hooks ran), the others reuse the result. That sharing is exact only while every projection has the
same input scale: ``AdaLNConsumers`` checks that when the fast paths are enabled (ModelOpt calibrates the three
projections on the same tensor, so their scales agree), and checks it again at the first call after a projection was
replaced or its scales were reloaded (``NVFP4Linear.scale_version``).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from ..hooks import call_changed_reason, consumer_reason, nvfp4_layer
from ..linear import NVFP4Linear
from ..ops.layer_norm_quantize import AdaLNInputs, kernel_runs_on
from ..ops.site import Site
from ..ops.verify import count_fallback, failed_kind_reason
from .operands import AdaLNOperand
from .resnorm import layer_norm_reason


class AdaLNConsumers:
    """The projections of one stream that read the norm1 output (an ``AdaLNOperand`` serves them all).

    ``consumers``: attribute name -> module on ``owner`` (the attention) as last checked; ``reason``: why the site
    cannot be fused at all (projections not NVFP4, input scales differ or not loaded when enabled), else None. A
    projection replaced later (a LoRA wrapping it, then unloaded) or whose scales were reloaded since (a LoRA load
    runs ``load_state_dict`` on the whole model) is checked again at its next call: the site follows the model.
    """

    def __init__(self, owner: nn.Module, names: tuple[str, ...]):
        self.owner = owner
        self.consumers = {name: getattr(owner, name, None) for name in names}
        self.versions = _scale_versions(self.consumers)
        self.reason = _shared_scale_reason(self.consumers)

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
            reason = _shared_scale_reason(consumers)  # one quantized input must still serve every projection
            if reason is not None:
                return f"{reason} (changed after enable_fast_paths)"
            self.consumers, self.versions = consumers, versions
        return None


def _scale_versions(consumers: dict[str, nn.Module | None]) -> tuple[int, ...]:
    return tuple(getattr(nvfp4_layer(m), "scale_version", -1) for m in consumers.values())


def _shared_scale_reason(consumers: dict[str, nn.Module | None]) -> str | None:
    layers = [nvfp4_layer(m) for m in consumers.values()]
    if any(layer is None for layer in layers):
        return "the projections after norm1 are not all NVFP4Linear"
    scales = [cast(NVFP4Linear, layer).input_scale for layer in layers]
    if any(s.is_meta for s in scales):
        return "input scales not loaded yet (meta device) when the fast paths were enabled"
    first = scales[0].detach().float().cpu()
    if any(not torch.equal(first, s.detach().float().cpu()) for s in scales[1:]):
        return f"the input scales of {', '.join(consumers)} differ (one quantized input cannot serve all)"
    return None


def adaln_reason(consumers: AdaLNConsumers, norm: nn.Module, x: torch.Tensor, params: tuple[torch.Tensor, ...],
                 counted: Site) -> str | None:
    """None when ``norm(x)`` modulated by ``params`` (scale, shift) can be handed to the site's projections as one
    fused kernel's output, else the reason."""
    reason = (consumers.call_reason() or call_changed_reason("attention", consumers.owner)
              or call_changed_reason("norm1", norm) or layer_norm_reason(norm, "norm1"))
    if reason is not None:
        return reason
    if x.dtype != torch.bfloat16 or x.dim() != 3 or x.shape[-1] % 16:
        return f"input {tuple(x.shape)} {x.dtype} (bf16 [B, L, D], D a multiple of 16)"
    b, l_len, d = x.shape
    for p in params:
        if p.dtype != torch.bfloat16 or p.shape[-1] != d or p.shape[0] != b or p.dim() not in (2, 3) or (
                p.dim() == 3 and p.shape[1] not in (1, l_len)):
            return f"modulation parameter {tuple(p.shape)} {p.dtype} (bf16 [B, D], [B, 1, D] or [B, L, D])"
    rows = x.numel() // d
    forms = {cast(NVFP4Linear, m).takes_decoded_rows(rows, x.device, x.dtype) for m in consumers.consumers.values()}
    if len(forms) > 1:
        return "the projections after norm1 take different activation forms (bias dtypes differ?)"
    if x.is_cuda and not kernel_runs_on(x):
        return "no Triton kernel for this GPU"
    if x.is_cuda and d % 512:
        return f"hidden size {d} not a multiple of 512 (the kernel reproduces torch's LayerNorm there only)"
    if failed_kind_reason(counted.kind) is not None:
        return "verification failed earlier in this process"
    return None


def fused_norm1_input(counted: Site, consumers: AdaLNConsumers, norm: nn.Module, x: torch.Tensor, scale: torch.Tensor,
                     shift: torch.Tensor, processor_reason: str | None) -> AdaLNOperand | None:
    """The ``AdaLNOperand`` for this call of a block's norm1 site, or None after counting (under ``counted``) why it
    stays unfused. ``processor_reason``: the model's check of the attention processor (None: its code reads the
    input only through the projections' calls and ``shape``/``device``)."""
    reason = processor_reason or adaln_reason(consumers, norm, x, (scale, shift), counted)
    if reason is not None:
        count_fallback(counted, reason)
        return None
    return AdaLNOperand(AdaLNInputs(x, scale, shift), float(cast(nn.LayerNorm, norm).eps), counted)
