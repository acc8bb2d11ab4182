"""Write NVFP4 checkpoints of (tiny or full-size) diffusers transformers with this package's own quantizer.

``export_nvfp4`` writes the layout of a ModelOpt diffusers export (docs/design.md §4) of a model in memory, with the
per-layer recipe of ``quantize.layers`` (precise mode, which agrees with ModelOpt's weight quantizer byte for byte on
ordinary blocks); the tests also use the real ModelOpt. The supported command for files is ``quantize_transformer``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from ..linear import NVFP4Linear
from ..loaders.common import is_excluded, qkv_group, replace_linear
from ..quantize.calibration import record_input_amax
from ..quantize.layers import nvfp4_layer_tensors, weight_amax
from ..utils import run_pipeline
from .tiny import TINY_EXCLUDES, TINY_PIPELINES


def calibrate_input_amax(model: nn.Module, run: Callable[[], None], names: list[str]) -> dict[str, float]:
    """Max |input| seen by each named Linear while ``run()`` executes (0.0 for one never called)."""
    return record_input_amax(model, names, run)


def export_nvfp4(
    model: nn.Module,
    out_dir: str | Path,
    exclude: tuple[str, ...],
    input_amax: dict[str, float],
) -> Path:
    """Write ``model`` as a ModelOpt-style NVFP4 diffusers export (config.json with quantization_config)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    quant = [n for n, m in linears.items() if not is_excluded(n, list(exclude)) and m.in_features % 16 == 0]
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    for name in quant:
        group = [g for g in qkv_group(name) if g in linears]
        w_amax = max(weight_amax(linears[g].weight) for g in group)
        a_amax = max(input_amax.get(g, 0.0) for g in group) or 1.0
        tensors = nvfp4_layer_tensors(linears[name].weight.detach().to(torch.bfloat16), w_amax, a_amax)
        state.update({f"{name}.{suffix}": t for suffix, t in tensors.items()})
    save_file(state, str(out_dir / "diffusion_pytorch_model.safetensors"))
    config = dict(cast(Any, model).config)  # a diffusers ModelMixin
    config["_class_name"] = type(model).__name__
    config["quantization_config"] = {
        "quant_method": "modelopt", "quant_algo": "NVFP4", "producer": {"name": "diffusers-nvfp4-fast"},
        "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 16},
                                      "input_activations": {"num_bits": 4, "type": "float", "group_size": 16},
                                      "targets": ["Linear"]}},
        "ignore": sorted(exclude), "weight_scale_layout": "linear", "nibble_order": "lo_first",
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, default=list))
    return out_dir


def quantize_tiny_pipeline(which: str, out_dir: str | Path, *, size: int = 64, steps: int = 2) -> Path:
    """Build the tiny ``which`` pipeline, calibrate on one generation, export its transformer as NVFP4."""
    pipe, kwargs = TINY_PIPELINES[which]()
    pipe.set_progress_bar_config(disable=True)
    exclude = TINY_EXCLUDES[which]
    names = [n for n, m in pipe.transformer.named_modules()
             if isinstance(m, nn.Linear) and not is_excluded(n, list(exclude))]
    amax = calibrate_input_amax(pipe.transformer, lambda: run_pipeline(pipe, kwargs, size=size, steps=steps), names)
    return export_nvfp4(pipe.transformer, out_dir, exclude, amax)


@torch.no_grad()
def quantize_model_inplace(
    model: nn.Module, exclude: tuple[str, ...], input_amax: dict[str, float] | float, *, init_std: float | None = None
) -> int:
    """Replace every non-excluded ``nn.Linear`` by an ``NVFP4Linear`` quantized from its weight, layer by layer.

    With ``init_std`` the BF16 weight is first drawn as ``randn * init_std`` on the layer's device (meta layers
    included), so a full-size model never exists in BF16 at once. ``input_amax`` gives each layer's calibrated
    activation max (or one value for all). Returns the number of layers replaced.
    """
    count = 0
    for name, linear in list(model.named_modules()):
        if not isinstance(linear, nn.Linear) or is_excluded(name, list(exclude)) or linear.in_features % 16:
            continue
        device = linear.weight.device
        if device.type == "meta" and init_std is None:
            raise ValueError(f"{name} is on the meta device: pass init_std= to draw its weight, there is none to "
                             "quantize")
        if init_std is not None:
            device = device if device.type != "meta" else torch.device("cuda" if torch.cuda.is_available() else "cpu")
            weight = torch.randn(linear.out_features, linear.in_features, device=device,
                                 dtype=torch.bfloat16) * init_std
        else:
            weight = linear.weight.to(torch.bfloat16)
        amax = input_amax if isinstance(input_amax, float) else input_amax.get(name, 1.0)
        bias = None
        if linear.bias is not None:
            bias = (linear.bias if linear.bias.device.type != "meta"
                    else torch.randn(linear.out_features, device=device) * 0.02)
        new = NVFP4Linear.from_weight(weight, bias, amax / 2688.0)
        replace_linear(model, name, linear, new)
        del weight
        count += 1
    return count
