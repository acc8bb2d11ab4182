"""LoRA (peft) on ``NVFP4Linear`` layers: ``pipe.load_lora_weights``, ``set_adapters`` and ``unload_lora_weights``.

peft builds LoRA layers only for the module types it knows, and ``NVFP4Linear`` is deliberately not an
``nn.Linear``. ``register_lora_support`` teaches peft one more type: a target whose base layer is an
``NVFP4Linear`` becomes ``NVFP4LoraLinear``, which computes ``nvfp4_linear(x) + lora_B(lora_A(x)) * scaling`` exactly
as peft's ``Linear`` does for a BF16 layer (the low-rank branch in the model dtype, on the unquantized input). The
packed weight is never dequantized or requantized, so ``fuse_lora`` is refused (docs/checkpoints.md, "LoRA").
"""

from __future__ import annotations

import functools

from torch import nn

from .linear import NVFP4Linear

FUSE_REFUSED = (
    "fuse_lora cannot merge a LoRA into an NVFP4 layer: its weight is packed FP4, and merging would mean requantizing "
    "it, which changes the checkpoint's numbers. Keep the LoRA unfused (it runs as a side branch in the model dtype); "
    "layers fused before this one stay fused until pipe.unfuse_lora()."
)


def _lora_class() -> type:
    from peft.tuners.lora.layer import Linear as PeftLoraLinear

    class NVFP4LoraLinear(PeftLoraLinear):
        """peft's LoRA ``Linear`` around an ``NVFP4Linear`` base layer; merging is refused."""

        def __init__(self, base_layer: nn.Module, adapter_name: str, config, **kwargs) -> None:
            if config.use_dora:
                raise ValueError("DoRA needs the base weight in floating point; NVFP4 layers keep it packed. "
                                 "Use a plain LoRA for NVFP4 transformers.")
            super().__init__(base_layer, adapter_name, config=config, **kwargs)

        def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
            raise RuntimeError(f"{FUSE_REFUSED} (layer: {self.get_base_layer().extra_repr()})")

        def get_delta_weight(self, adapter):
            raise RuntimeError(FUSE_REFUSED)

    return NVFP4LoraLinear


@functools.cache
def register_lora_support() -> bool:
    """Let peft put LoRA layers on ``NVFP4Linear`` (once per process). False where peft is not installed."""
    try:
        from peft.tuners.lora.model import LoraModel
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return False
    lora_cls = _lora_class()
    create_new_module = LoraModel._create_new_module

    def create(lora_config, adapter_name, target, **kwargs):
        base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
        if isinstance(base, NVFP4Linear):
            kwargs.pop("device_map", None)
            return lora_cls(target, adapter_name, config=lora_config, **kwargs)
        return create_new_module(lora_config, adapter_name, target, **kwargs)

    LoraModel._create_new_module = staticmethod(create)  # type: ignore[method-assign]  # peft's hook point, on purpose
    return True
