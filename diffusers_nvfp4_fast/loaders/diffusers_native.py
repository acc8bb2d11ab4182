"""Layers that diffusers' own NVFP4 quantizer built, converted in place to ``NVFP4Linear`` (and back on disable).

``Flux2Transformer2DModel.from_single_file(path, quantization_config=BFLQuantizationConfig())`` (diffusers >= 0.42)
builds ``diffusers.quantizers.bfl.utils.BFLNVFP4Linear`` layers: an ``nn.Linear`` subclass holding a uint8 weight
``[N, K/2]`` that diffusers reads low nibble first, float8 block scales ``[N, K/16]`` that it reads in the linear
layout, and FP32 ``weight_scale_2`` and ``input_scale``. The converted layer shares the packed weight (the same
parameter object), puts the block scales in the 128x4 layout once, and computes the checkpoint's W4A4 recipe with its
``input_scale``: what diffusers computes on SM100+ through FlashInfer. Below SM100 diffusers itself dequantizes the
weight and multiplies BF16 activations (W4A16), so there the converted outputs differ from diffusers' own
(docs/checkpoints.md).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..format import swizzle_scales
from ..linear import NVFP4Linear
from ..module_hooks import TORCH_FORWARD_HOOK, hooks_on
from .common import copy_tp_annotations, layer_tensor_problems, raise_scale_problems, scale_problems
from .errors import NVFP4CheckpointError

SOURCE = "diffusers BFLQuantizationConfig"
# diffusers 0.42 splits and reads block scales as linear [N, K/16]; another shape means another layout in the file.
BFL_LAYOUT_HINT = (
    "block scales that are not [N, K/16]: this file is in the BFL/Comfy layout (128x4 block scales), which diffusers' "
    "BFLQuantizationConfig misreads; load it with diffusers_nvfp4_fast.load_nvfp4_transformer(path)"
)


def is_bfl_nvfp4(module: nn.Module) -> bool:
    """True for diffusers' ``BFLNVFP4Linear`` (checked by name: no import of diffusers' quantizer needed)."""
    cls = type(module)
    return cls.__name__ == "BFLNVFP4Linear" and cls.__module__.startswith("diffusers.quantizers.bfl")


def _offload_hooks(module: nn.Module) -> list[str]:
    """diffusers' and accelerate's hooks on ``module`` (torch forward hooks are not offloading hooks)."""
    return [name for name in hooks_on(module) if name != TORCH_FORWARD_HOOK]


@torch.no_grad()
def from_bfl_layer(layer: nn.Module) -> NVFP4Linear:
    """An ``NVFP4Linear`` computing ``layer``'s checkpoint recipe: same packed weight object and bias tensor, 128x4
    scales, copies of ``weight_scale_2`` / ``input_scale``, on the same device; no BF16 copy of the weight."""
    bfl: Any = layer  # diffusers' BFLNVFP4Linear: its scales are registered buffers, which are not typed
    device = bfl.weight.device
    dtype = getattr(layer, "compute_dtype", None) or (bfl.bias.dtype if bfl.bias is not None else torch.bfloat16)
    new = NVFP4Linear(bfl.in_features, bfl.out_features, bias=False, dtype=dtype, device="meta")
    new.weight = bfl.weight  # the same (frozen) parameter: its storage and its identity for offloading hooks
    new.weight_scale = nn.Parameter(swizzle_scales(bfl.weight_scale.view(torch.uint8)), requires_grad=False)
    # Own copies of the scalars: diffusers shares one tensor among the q/k/v parts of a fused layer, which
    # safetensors cannot save.
    new._buffers["weight_scale_2"] = bfl.weight_scale_2.detach().reshape(()).clone()
    new._buffers["input_scale"] = bfl.input_scale.detach().reshape(()).clone()
    new._buffers["bias"] = bfl.bias.data if bfl.bias is not None else None
    new._buffers["alpha"] = torch.empty((), dtype=torch.float32, device=device)
    new._buffers["input_scale_inv"] = torch.empty((), dtype=torch.float32, device=device)
    new.refresh_derived_scales_()
    new.input_scale_source = "checkpoint"
    copy_tp_annotations(layer, new)
    return new


def _raise_tensor_problems(model_name: str, layers: dict[str, Any]) -> None:
    """Refuse (before any layer changes) layers whose tensors are not what ``from_bfl_layer`` reads."""
    problems = [p for name, m in layers.items()
                for p in layer_tensor_problems(name, m.out_features, m.in_features, m.weight, m.weight_scale,
                                               m.weight_scale_2, m.input_scale, m.bias)]
    if problems:
        hint = BFL_LAYOUT_HINT if any(".weight_scale:" in p for p in problems) else ""
        raise NVFP4CheckpointError(
            f"{model_name}: {len(problems)} problem(s) in the NVFP4 layers diffusers loaded; nothing was converted"
            + (f" ({hint})" if hint else "") + ":\n  " + "\n  ".join(problems))


def convert_diffusers_native(model: nn.Module, restore: list) -> dict[str, int]:
    """Replace every ``BFLNVFP4Linear`` in ``model`` by an ``NVFP4Linear`` (also inside LoRA wrappers).

    Every layer is checked before anything changes: tensors of another shape, dtype or layout than diffusers' own
    reading gives (block scales ``[N, K/16]``; other shapes mean a BFL / ComfyUI-layout file that diffusers misread)
    and unusable scales raise one ``NVFP4CheckpointError`` naming the layers. Appends to
    ``restore`` one undo per layer, which puts the original object back (unless the user replaced the layer since).
    Returns ``{source: number of layers converted}`` (empty when there was nothing to convert).
    """
    names = [name for name, module in model.named_modules() if is_bfl_nvfp4(module)]
    if not names:
        return {}
    originals: dict[str, Any] = {name: model.get_submodule(name) for name in names}  # BFLNVFP4Linear (untyped)
    hooked = {name: hooks for name, m in originals.items() if (hooks := _offload_hooks(m))}
    if hooked:
        first = next(iter(hooked))
        raise RuntimeError(
            f"enable_fast_paths: {len(hooked)} diffusers NVFP4 layer(s) already have offloading hooks (e.g. {first}: "
            f"{', '.join(hooked[first])}). Converting them would leave the hooks on the old layers: call "
            "enable_fast_paths(pipe) first, then enable_model_cpu_offload / enable_sequential_cpu_offload / "
            "enable_group_offload."
        )
    _raise_tensor_problems(type(model).__name__, originals)
    raise_scale_problems(type(model).__name__, [
        p for name, m in originals.items()
        for p in scale_problems(name, m.weight_scale, m.weight_scale_2, m.input_scale)
    ])
    for name, old in originals.items():
        new = from_bfl_layer(old)
        model.set_submodule(name, new)

        def undo(name=name, old=old, new=new) -> None:
            if model.get_submodule(name) is new:
                model.set_submodule(name, old)

        restore.append(undo)
    return {SOURCE: len(names)}
