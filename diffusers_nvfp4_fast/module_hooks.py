"""What is hooked into a module's call (diffusers hooks, accelerate hooks, torch forward hooks), and whether a module
is wrapped by a LoRA (peft) layer (ground floor: imports only torch). The patches' gates use them (a fused path must
not skip a hook or change what a hook observes, docs/design.md §5), so do the graph runner's keys and the loaders;
what only NVFP4 layers need is in ``patches/consumers.py``."""

from __future__ import annotations

import torch
from torch import nn

TORCH_FORWARD_HOOK = "torch forward hook"


def hooks_on(module: nn.Module) -> list[str]:
    """Names of the hooks that run when ``module`` is called: diffusers hook names, accelerate's hook class, and
    'torch forward hook' for hooks registered with ``register_forward_(pre_)hook``. Reads the instance dict only:
    gates call this for every block and step, and a missing attribute through ``nn.Module.__getattr__`` costs a
    raised exception each time (docs/performance.md, host cost)."""
    attrs = module.__dict__
    names = []
    registry = attrs.get("_diffusers_hook")
    if registry is not None and registry.hooks:
        names.extend(registry.hooks)
    accelerate_hook = attrs.get("_hf_hook")
    if accelerate_hook is not None:
        names.append(type(accelerate_hook).__name__)
    if attrs["_forward_hooks"] or attrs["_forward_pre_hooks"]:
        names.append(TORCH_FORWARD_HOOK)
    return names


def hook_device(module: nn.Module) -> torch.device | None:
    """Where an offloading hook on ``module`` runs it (accelerate's execution device, diffusers' group-offload onload
    device), or None where no such hook sits on it."""
    device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    if device is not None:
        return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    registry = getattr(module, "_diffusers_hook", None)
    hook = registry.hooks.get("group_offloading") if registry is not None else None
    return torch.device(hook.group.onload_device) if hook is not None else None


def offload_device(model: nn.Module, layer: nn.Module | None = None) -> torch.device | None:
    """The device an offloading hook on ``layer``, on ``model`` or on any of its submodules brings them to, or None
    where no such hook is installed (then they compute where their tensors are)."""
    for module in (*((layer,) if layer is not None else ()), model, *model.modules()):
        device = hook_device(module)
        if device is not None:
            return device
    return None


def is_lora_layer(module: nn.Module) -> bool:
    """True for a peft tuner layer (a LoRA wrapper around a base layer), without importing peft."""
    return "base_layer" in module.__dict__["_modules"] and hasattr(module, "active_adapters")


def call_changed_reason(label: str, module: nn.Module | None) -> str | None:
    """Why a fused path must not bypass or re-route the call of ``module`` (its diffusers name ``label``), or None."""
    if module is None:
        return None
    if is_lora_layer(module):
        return "lora"
    names = hooks_on(module)
    return f"hook on {label}: {', '.join(names)}" if names else None
