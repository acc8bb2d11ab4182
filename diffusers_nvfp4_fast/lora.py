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
    "it, which changes the checkpoint's numbers. Keep the LoRA unfused (it runs as a side branch in the model dtype)"
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

        def _get_in_out_features(self, module: nn.Module) -> tuple[int, int] | tuple[None, None]:
            # peft warns "Unsupported layer type ... proceed at your own risk" for layers it does not know; this
            # class supports NVFP4Linear, whose features it reads here.
            if isinstance(module, NVFP4Linear):
                return module.in_features, module.out_features
            return super()._get_in_out_features(module)

        def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
            raise RuntimeError(f"{FUSE_REFUSED} (layer: {self.get_base_layer().extra_repr()})")

        def get_delta_weight(self, adapter):
            raise RuntimeError(FUSE_REFUSED)

    return NVFP4LoraLinear


def nvfp4_lora_layers(model: nn.Module, adapter_names: list[str] | str | None = None) -> list[str]:
    """Names of the LoRA layers on ``NVFP4Linear`` base layers in ``model`` that hold one of ``adapter_names``
    (any adapter when None)."""
    wanted = [adapter_names] if isinstance(adapter_names, str) else adapter_names
    found = []
    for name, module in model.named_modules():
        if type(module).__name__ == "NVFP4LoraLinear" and isinstance(getattr(module, "base_layer", None), NVFP4Linear):
            adapters = set(getattr(module, "lora_A", {}))
            if wanted is None or adapters & set(wanted):
                found.append(name)
    return found


class NVFP4FuseLora:
    """``model.fuse_lora`` for a diffusers model with ``NVFP4Linear`` layers: refuses before any layer is touched
    when a LoRA to fuse sits on an NVFP4 layer (diffusers scales each layer before merging it, so a refusal from the
    layer itself would leave the layers before it changed); otherwise diffusers' own ``fuse_lora``."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, lora_scale: float = 1.0, safe_fusing: bool = False, adapter_names=None):
        layers = nvfp4_lora_layers(self.model, adapter_names)
        if layers:
            raise RuntimeError(f"{FUSE_REFUSED}; {len(layers)} NVFP4 layer(s) hold it, e.g. {layers[0]}. Nothing was "
                               "fused or scaled.")
        return type(self.model).fuse_lora(self.model, lora_scale, safe_fusing=safe_fusing,  # type: ignore[attr-defined]
                                          adapter_names=adapter_names)


def install_fuse_lora_guard(model: nn.Module) -> None:
    """Give ``model`` (a diffusers model with ``fuse_lora``) ``NVFP4FuseLora``, on this instance only."""
    if hasattr(type(model), "fuse_lora") and not isinstance(model.__dict__.get("fuse_lora"), NVFP4FuseLora):
        model.fuse_lora = NVFP4FuseLora(model)  # type: ignore[assignment]  # an instance attribute shadows the method


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
