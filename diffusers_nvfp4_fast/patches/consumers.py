"""The NVFP4 side of a fused site's consumer checks: which ``NVFP4Linear`` a module is (through a LoRA wrapper), and
why one cannot take a pre-quantized activation through its call (docs/design.md §5). The generic hook checks are in
``module_hooks.py``."""

from __future__ import annotations

from typing import cast

from torch import nn

from ..linear import NVFP4Linear
from ..module_hooks import is_lora_layer


def nvfp4_layer(module: nn.Module | None) -> NVFP4Linear | None:
    """The ``NVFP4Linear`` that ``module`` is, or that a LoRA layer wraps; None otherwise."""
    if module is not None and is_lora_layer(module):
        module = cast(nn.Module, module.base_layer)
    return module if isinstance(module, NVFP4Linear) else None


def consumer_reason(consumer: nn.Module, label: str) -> str | None:
    """Why an NVFP4 layer cannot take a pre-quantized activation through its call, or None: it is not an
    ``NVFP4Linear``, a LoRA wraps it, it computes its activation scale per call, or a torch forward hook would
    see the packed input instead of the BF16 one. Offloading hooks are fine: they run on the call."""
    if is_lora_layer(consumer) and isinstance(consumer.base_layer, NVFP4Linear):
        return "lora"
    if not isinstance(consumer, NVFP4Linear):
        return f"{label} is not an NVFP4Linear"
    if consumer.dynamic_input_scale:
        return f"{label} uses a dynamic input scale"
    if consumer._forward_hooks or consumer._forward_pre_hooks:
        return f"hook on {label}: torch forward hook"
    return None
