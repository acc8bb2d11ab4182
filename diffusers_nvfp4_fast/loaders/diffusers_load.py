"""An NVFP4 checkpoint read by diffusers' own ``from_pretrained`` (``diffusers_backend.NVFP4FastQuantizer``): the plan
and checks of ``load_nvfp4_transformer`` run on the model diffusers built, and each NVFP4 layer is built by the same
function from the tensors diffusers reads, shard by shard, so both routes give the same bytes (docs/checkpoints.md).

Nothing here touches diffusers' internals: the quantizer hands over the model, the weight files and each shard's
tensors; the plain tensors stay in the shard for diffusers to load (cast to the load's dtype, as the loader does).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import cast

import torch
from torch import nn

from ..format import ScaleLayout
from ..linear import NVFP4Linear
from .common import NVFP4_SUFFIXES, raise_scale_problems, record_load_summary, replace_linear
from .errors import NVFP4CheckpointError
from .finish import finish_model
from .modelopt_export import build_nvfp4_layer, plan_export_into, raise_plan_problems, read_quantization_info
from .safetensors_header import CheckpointIndex


class PendingLayers:
    """Tensors of NVFP4 layers taken out of diffusers' shards until a layer has all of them (a layer's tensors may
    lie in two shards): layer name -> {suffix: tensor}."""

    def __init__(self, needed: dict[str, tuple[str, ...]]) -> None:
        self.needed = needed
        self.tensors: dict[str, dict[str, torch.Tensor]] = {}

    def take(self, state_dict: dict[str, torch.Tensor]) -> list[str]:
        """Move this shard's tensors of the planned layers out of ``state_dict``; returns the layers now complete."""
        touched = set()
        for key in [k for k in state_dict if k.rpartition(".")[0] in self.needed]:
            name, _, suffix = key.rpartition(".")
            if suffix in self.needed[name]:
                self.tensors.setdefault(name, {})[suffix] = state_dict.pop(key)
                touched.add(name)
        return [n for n in sorted(touched) if set(self.tensors[n]) >= set(self.needed[n])]

    def pop(self, name: str) -> dict[str, torch.Tensor]:
        del self.needed[name]
        return self.tensors.pop(name)

    def missing(self) -> list[str]:
        """``name.suffix`` of every planned tensor no shard held."""
        return [f"{n}.{s}" for n, suffixes in self.needed.items() for s in suffixes
                if s not in self.tensors.get(n, {})]


def _meta_skeleton(linear: nn.Linear, layout: ScaleLayout) -> NVFP4Linear:
    """An ``NVFP4Linear`` on the meta device, so diffusers expects the checkpoint's NVFP4 keys for this layer."""
    return NVFP4Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, scale_layout=layout,
                       device="meta")


class PrequantizedLoad:
    """One ``from_pretrained`` of an NVFP4 checkpoint directory into ``model`` (diffusers' meta-device model).

    Construction checks every key, dtype and shape against the model (headers only, as ``load_nvfp4_transformer``
    does) and refuses the checkpoint before any weight is read; the quantized Linears become meta ``NVFP4Linear``
    skeletons. ``take`` builds each layer once its tensors have arrived; ``finish`` refuses what is missing or
    unusable and finishes the model as every loader does (``save_pretrained``, ``fuse_lora`` guard, load summary).
    """

    def __init__(self, model: nn.Module, files: Sequence[str | Path], quantization_config: dict,
                 torch_dtype: torch.dtype) -> None:
        if not files:
            raise NVFP4CheckpointError(f"{type(model).__name__}: diffusers named no weight files for this NVFP4 "
                                       "checkpoint; load it with diffusers_nvfp4_fast.load_nvfp4_transformer")
        paths = [Path(f) for f in files]
        self.model_dir = paths[0].parent
        qinfo = read_quantization_info(self.model_dir, {"quantization_config": quantization_config})
        self.plan = plan_export_into(model, self.model_dir, qinfo, CheckpointIndex(paths))
        raise_plan_problems(self.plan)
        self.torch_dtype = torch_dtype
        self.linears: dict[str, nn.Linear] = {}
        needed = {}
        for name, layout in self.plan.quantized.items():
            linear = cast(nn.Linear, model.get_submodule(name))
            self.linears[name] = linear
            needed[name] = (*NVFP4_SUFFIXES, *(["bias"] if linear.bias is not None else []))
            replace_linear(model, name, linear, _meta_skeleton(linear, layout))
        self.pending = PendingLayers(needed)
        self.problems: list[str] = []
        self.swizzled = 0

    def take(self, model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Build the layers whose tensors are complete with this shard; returns the shard without them."""
        for name in self.pending.take(state_dict):
            new, swizzled = build_nvfp4_layer(self.linears[name], name, self.pending.pop(name),
                                              self.plan.quantized[name], self.plan.qinfo, self.torch_dtype,
                                              self.problems)
            replace_linear(model, name, model.get_submodule(name), new)
            self.swizzled += swizzled
        return state_dict

    def finish(self, model: nn.Module) -> None:
        missing = self.pending.missing()
        if missing:
            raise NVFP4CheckpointError(f"{self.model_dir}: the weight files diffusers read hold no {missing[:8]}"
                                       + (" ..." if len(missing) > 8 else ""))
        raise_scale_problems(self.model_dir, self.problems)
        finish_model(model, self.model_dir, None)
        record_load_summary(model, self.model_dir, format="modelopt_export", loaded_by="diffusers from_pretrained",
                            scales_swizzled_on_load=self.swizzled)
