"""Quantize while diffusers' ``from_pretrained`` reads a BF16 transformer (``quantization_config=NVFP4FastConfig(...)``,
``diffusers_backend``): the layers ``quantize_transformer`` would quantize, with the same per-layer tensors, built into
``NVFP4Linear`` layers as ``load_nvfp4_transformer`` builds them from its checkpoint, so the model equals
``load_nvfp4_transformer(quantize_transformer(...))`` tensor for tensor (docs/checkpoints.md).

Nothing here touches diffusers' internals: the quantizer hands over the model and each shard's tensors. A quantized
Linear's weight and bias are taken out of the shard; a q/k/v group is quantized once every member's weight has
arrived (they share ``weight_scale_2``), also a member kept BF16, whose weight stays for diffusers to load.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn

from ..format import BLOCK_SIZE
from ..loaders.common import qkv_group, raise_scale_problems, record_load_summary, replace_linear
from ..loaders.errors import NVFP4CheckpointError
from ..loaders.finish import finish_model
from ..loaders.modelopt_export import QuantizationInfo, build_nvfp4_layer
from .layers import nvfp4_layer_tensors, weight_amax
from .recipes import RECIPE_SOURCES, exclude_patterns, kept_bf16
from .transformer import quantizable


@dataclass
class LayerPlan:
    """Which Linears become NVFP4, which are kept BF16 and why, and each quantized layer's input scale (None:
    computed per call)."""

    exclude: tuple[str, ...]
    recipe: str
    quantized: list[str]
    kept: list[str]
    input_scales: dict[str, float] | None
    groups: dict[str, list[str]] = field(default_factory=dict)  # quantized layer -> its q/k/v group (Linears)


def _check_input_scales(source: str, quantized: list[str], input_scales: Mapping[str, float]) -> None:
    unknown = sorted(set(input_scales) - set(quantized))
    missing = [n for n in quantized if n not in input_scales]
    problems = []
    if unknown:
        problems.append(f"input_scales names {len(unknown)} layer(s) that are not quantized here: {unknown[:8]}"
                        + (" ..." if len(unknown) > 8 else ""))
    if missing:
        problems.append(f"input_scales lacks {len(missing)} quantized layer(s): {missing[:8]}"
                        + (" ..." if len(missing) > 8 else "") + "; give their scales, keep them BF16 (exclude=), "
                        "or use dynamic=True (activation scales computed per call)")
    if problems:
        raise NVFP4CheckpointError(f"{source}: " + "; ".join(problems))


def plan_layers(model: nn.Module, exclude: Sequence[str] | None, input_scales: Mapping[str, float] | None,
                source: str) -> LayerPlan:
    """The layers ``quantize_transformer`` quantizes in this model (the recipe of its class, or ``exclude``), checked
    against ``input_scales`` (every quantized layer named, nothing else) before any weight is read."""
    class_name = type(model).__name__
    config = getattr(model, "config", {})
    patterns = tuple(exclude) if exclude is not None else exclude_patterns(class_name, config, source)
    recipe = "given by the caller" if exclude is not None else RECIPE_SOURCES[class_name]
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    quantized = [n for n, m in linears.items() if quantizable(n, m, patterns)]
    kept = [n for n in linears if n not in set(quantized)]
    if not quantized:
        excluded, narrow = kept_bf16(list(linears), patterns)
        raise ValueError(f"{source}: no Linear of this {class_name} would become NVFP4: the BF16-kept patterns "
                         f"({recipe}: {', '.join(patterns)}) match {excluded} of its {len(linears)} Linears"
                         + (f", and the other {narrow} have in_features that are not multiples of 16" if narrow else "")
                         + "; load it without quantization_config")
    if input_scales is not None:
        _check_input_scales(source, quantized, input_scales)
    groups = {n: [g for g in qkv_group(n) if g in linears] for n in quantized}
    return LayerPlan(patterns, recipe, quantized, kept, None if input_scales is None else dict(input_scales), groups)


class QuantizeOnLoad:
    """One ``from_pretrained`` of a BF16 transformer into ``model`` (diffusers' meta-device model), quantized to NVFP4
    on ``device`` in precise mode (the bytes of ``quantize_transformer`` on any device)."""

    def __init__(self, model: nn.Module, plan: LayerPlan, torch_dtype: torch.dtype, device: torch.device | str,
                 source: str) -> None:
        self.plan, self.torch_dtype, self.device, self.source = plan, torch_dtype, device, source
        self.linears = {n: cast(nn.Linear, model.get_submodule(n)) for g in plan.groups.values() for n in g}
        self.weights: dict[str, torch.Tensor] = {}  # weights of group members seen, until their group is done
        self.biases: dict[str, torch.Tensor] = {}
        self.done: set[str] = set()
        self.problems: list[str] = []
        dynamic = plan.quantized if plan.input_scales is None else []
        self.qinfo = QuantizationInfo(quant_algo="NVFP4", group_size=BLOCK_SIZE, source=source, dynamic_layers=dynamic)

    def take(self, model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Quantize the groups complete with this shard; returns the shard without the quantized layers' tensors."""
        quantized = set(self.plan.quantized)
        for key in list(state_dict):
            name, _, leaf = key.rpartition(".")
            if name in self.linears and leaf == "weight":
                self.weights[name] = state_dict.pop(key) if name in quantized else state_dict[key]
            elif name in quantized and leaf == "bias":
                self.biases[name] = state_dict.pop(key)
        for name in self.plan.quantized:
            if name not in self.done and self._complete(name):
                self._quantize_group(model, name)
        return state_dict

    def _complete(self, name: str) -> bool:
        members = self.plan.groups[name]
        return all(g in self.weights for g in members) and all(
            g in self.biases or self.linears[g].bias is None for g in members if g in self.plan.groups)

    def _quantize_group(self, model: nn.Module, name: str) -> None:
        members = self.plan.groups[name]
        weights = {g: self._read(self.weights[g]) for g in members}
        group_amax = max(weight_amax(w) for w in weights.values())
        for g in (g for g in members if g in self.plan.groups):
            tensors = nvfp4_layer_tensors(weights[g], group_amax, None)
            if self.plan.input_scales is not None:
                tensors["input_scale"] = torch.tensor(self.plan.input_scales[g], dtype=torch.float32)
            if g in self.biases:
                tensors["bias"] = self.biases.pop(g).to(self.torch_dtype)
            new, _ = build_nvfp4_layer(self.linears[g], g, tensors, "linear", self.qinfo, self.torch_dtype,
                                       self.problems)
            replace_linear(model, g, self.linears[g], new)
            self.done.add(g)
        for g in members:
            self.weights.pop(g, None)

    def _read(self, tensor: torch.Tensor) -> torch.Tensor:
        """A stored weight as ``quantize_transformer`` reads it: cast to the load's dtype, then moved."""
        return (tensor.to(self.torch_dtype) if tensor.is_floating_point() else tensor).to(self.device)

    def finish(self, model: nn.Module) -> None:
        left = [n for n in self.plan.quantized if n not in self.done]
        if left:
            raise NVFP4CheckpointError(f"{self.source}: the weight files diffusers read hold no weight (or bias) for "
                                       f"{len(left)} layer(s) to quantize: {left[:8]}" + (" ..." if len(left) > 8
                                                                                          else ""))
        raise_scale_problems(self.source, self.problems)
        finish_model(model, self.source, None)
        scales = "dynamic" if self.plan.input_scales is None else "input_scales"
        record_load_summary(model, self.source, format="quantized on load", exclude_patterns=list(self.plan.exclude),
                            exclude_recipe=self.plan.recipe, input_scales=scales)
