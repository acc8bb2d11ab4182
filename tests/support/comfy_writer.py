"""Write a BF16 diffusers transformer as an NVFP4 single file the way the public files are laid out: ComfyUI's format
(BFL names for FLUX.2, ComfyUI's fused ``gate_up`` for Qwen-Image 2.1, diffusers' names for Qwen-Image;
``comfy_quant`` markers and/or ``_quantization_metadata``; high nibble first, 128x4 scales; optional
``model.diffusion_model.`` prefix, ``input_scale``, ComfyUI's Edit-2511 marker) or diffusers' BFL format (header
``quantization='nvfp4'``, low nibble first, linear scales).

The quantizer is a parameter. ``comfy_quantize`` is this package's own implementation of the recipe comfy-kitchen
0.2.40 runs (``TensorCoreNVFP4Layout.quantize`` with its default per-tensor scale, eager backend), written from its
description with ``format``'s helpers; the CPU tests (tests/test_loader_comfy.py) write a file of every family and
marker style twice, with it and with comfy-kitchen's own quantizer, and require the same file bytes. So the GPU test,
where comfy-kitchen is not installed, loads the files comfy-kitchen would have written. The name tables are the
writer's own (what the files hold, docs/checkpoints.md), independent of the loaders, which must undo all of it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from diffusers_nvfp4_fast.format import (
    BLOCK_SIZE,
    E2M1_MAX,
    E4M3_MAX,
    e2m1_round,
    pack_nibbles,
    swap_nibbles,
    swizzle_scales,
)
from support.bfl_writer import bfl_modules, marker

Quantizer = Callable[[torch.Tensor], dict[str, torch.Tensor]]
StoredKind = Literal["linear", "scale", "swap"]
COMFY_PREFIX = "model.diffusion_model."
ZERO_COND_T_MARKER = "__index_timestep_zero__"  # ComfyUI's Qwen-Image buffer for Edit-2511 (index_timestep_zero)


def comfy_quantize(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """One weight in ComfyUI's NVFP4 layout, the bytes comfy-kitchen 0.2.40 writes for it.

    Per-tensor scale: ``amax / (448 * 6)`` computed in the weight's dtype, then FP32 (``weight_scale_2``). Per block
    of 16: ``(max|x| / 6) / weight_scale_2`` (two FP32 divisions), clamped to 448, rounded to E4M3; values
    ``x / (weight_scale_2 * block_scale)`` (an FP32 division; 0 where that product is 0), clamped to +-6, rounded to
    E2M1 (ties to even); packed high nibble first; block scales in the 128x4 layout. comfy-kitchen pads rows and
    columns to multiples of 16; those shapes are refused here (no public model has them).
    """
    if weight.dim() != 2 or weight.shape[0] % BLOCK_SIZE or weight.shape[1] % BLOCK_SIZE:
        raise ValueError(f"comfy_quantize takes a 2-D weight with both sides multiples of 16, got {list(weight.shape)}")
    rows, cols = weight.shape
    per_tensor = (weight.abs().amax() / (E4M3_MAX * E2M1_MAX)).to(torch.float32)
    blocks = weight.reshape(rows, cols // BLOCK_SIZE, BLOCK_SIZE)
    block_max = blocks.abs().amax(-1).to(torch.float32)
    scale_bytes = torch.clamp(block_max / E2M1_MAX / per_tensor, max=E4M3_MAX).to(torch.float8_e4m3fn)
    total = per_tensor * scale_bytes.to(torch.float32)
    zero = total == 0
    scaled = blocks.float() / torch.where(zero, torch.ones_like(total), total).unsqueeze(-1)
    scaled = torch.where(zero.unsqueeze(-1), torch.zeros_like(scaled), scaled).clamp(-E2M1_MAX, E2M1_MAX)
    packed = swap_nibbles(pack_nibbles(e2m1_round(scaled.reshape(rows, cols))))
    return {"weight": packed, "weight_scale": swizzle_scales(scale_bytes.view(torch.uint8)).view(torch.float8_e4m3fn),
            "weight_scale_2": per_tensor}


@dataclass(frozen=True)
class StoredModule:
    """One module as a file stores it: its name, the diffusers modules concatenated along rows into it, and how."""

    name: str
    parts: tuple[str, ...]
    kind: StoredKind = "linear"  # scale: an RMSNorm weight stored as .scale (BFL)


def _param_modules(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if n and any(True for _ in m.parameters(recurse=False))]


def stored_modules(model: nn.Module) -> list[StoredModule]:
    """The file's modules for ``model``'s class (FLUX.2: BFL names, fused qkv, [shift, scale] final modulation;
    Qwen-Image: diffusers' names; Qwen-Image 2.1: ComfyUI's fused ``img_mlp.gate_up``, gate rows first)."""
    name = type(model).__name__
    if name == "Flux2Transformer2DModel":
        config: Any = model.config
        out = []
        for bfl, (parts, is_norm) in bfl_modules(config.num_layers, config.num_single_layers).items():
            if bfl.startswith("guidance_in.") and not config.guidance_embeds:
                continue
            kind: StoredKind = "scale" if is_norm else "swap" if bfl == "final_layer.adaLN_modulation.1" else "linear"
            out.append(StoredModule(bfl, tuple(parts), kind))
        return out
    modules = _param_modules(model)
    if name == "QwenImageTransformer2DModel":
        return [StoredModule(m, (m,)) for m in modules]
    if name == "QwenImage21Transformer2DModel":
        fused = {m.removesuffix(".gate_layer") for m in modules if m.endswith(".img_mlp.gate_layer")}
        fused_parts = {f"{f}.{leaf}" for f in fused for leaf in ("gate_layer", "proj")}
        out = [StoredModule(m, (m,)) for m in modules if m not in fused_parts]
        out += [StoredModule(f"{f}.gate_up", (f"{f}.gate_layer", f"{f}.proj")) for f in sorted(fused)]
        return out
    raise ValueError(f"no single-file layout for {name}")


def fp4_modules(model: nn.Module, quantized: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """{stored module: its diffusers Linears} of the modules ``write_single_file`` stores as NVFP4 for ``quantized``."""
    fp4 = set(quantized)
    return {m.name: m.parts for m in stored_modules(model) if m.kind != "scale" and fp4.issuperset(m.parts)}


def _stored_tensor(state: Mapping[str, torch.Tensor], module: StoredModule, suffix: str) -> torch.Tensor | None:
    keys = [f"{p}.{suffix}" for p in module.parts]
    if keys[0] not in state:
        return None
    t = torch.cat([state[k] for k in keys], 0)
    return torch.cat(t.chunk(2, 0)[::-1], 0) if module.kind == "swap" else t  # diffusers [scale, shift] -> BFL


@dataclass
class FileStyle:
    """How a file marks its FP4 layers and names its keys."""

    convention: Literal["comfy", "diffusers"] = "comfy"
    markers: bool = True  # per-layer comfy_quant tensors (comfy)
    header: bool = True  # _quantization_metadata (comfy)
    prefix: str = ""
    zero_cond_t_marker: bool = False


def write_single_file(
    model: nn.Module,
    out_file: str | Path,
    quantized: Iterable[str],
    input_amax: Mapping[str, float] | None,
    *,
    quantize: Quantizer = comfy_quantize,
    style: FileStyle | None = None,
    drop_input_scale: Iterable[str] = (),
    edit: Callable[[dict[str, torch.Tensor], dict[str, str]], None] | None = None,
) -> dict[str, tuple[str, ...]]:
    """Write ``model`` (BF16) as an NVFP4 single file; returns {stored FP4 module: the diffusers Linears in it}.

    ``quantized`` names the diffusers Linears to store as NVFP4 (a fused module is FP4 when all its parts are);
    ``input_amax`` gives each one's calibrated activation maximum (``input_scale = amax / 2688``, the maximum over a
    fused module's parts), or None for a file without input scales; ``drop_input_scale`` names stored modules written
    without one (the "-mixed" style). ``edit(tensors, metadata)`` may change the result before it is written (keys
    without the prefix)."""
    from safetensors.torch import save_file

    style = style or FileStyle()
    fp4_parts, drop = set(quantized), set(drop_input_scale)
    state = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    tensors: dict[str, torch.Tensor] = {}
    written: dict[str, tuple[str, ...]] = {}
    for module in stored_modules(model):
        weight, bias = _stored_tensor(state, module, "weight"), _stored_tensor(state, module, "bias")
        if weight is None:
            continue
        if module.kind == "scale":
            tensors[f"{module.name}.scale"] = weight
            continue
        if bias is not None:
            tensors[f"{module.name}.bias"] = bias
        if not fp4_parts.issuperset(module.parts):
            assert fp4_parts.isdisjoint(module.parts), f"{module.name}: quantize all of {module.parts} or none"
            tensors[f"{module.name}.weight"] = weight
            continue
        tensors.update({f"{module.name}.{k}": v for k, v in quantize(weight).items()})
        if input_amax is not None and module.name not in drop:
            amax = max(input_amax[p] for p in module.parts)
            tensors[f"{module.name}.input_scale"] = torch.tensor(amax / (E4M3_MAX * E2M1_MAX), dtype=torch.float32)
        written[module.name] = module.parts
    assert drop <= set(written), f"drop_input_scale names modules that are not NVFP4: {sorted(drop - set(written))}"
    metadata = _mark(tensors, written, style)
    if edit is not None:
        edit(tensors, metadata)
    Path(out_file).parent.mkdir(parents=True, exist_ok=True)
    save_file({style.prefix + k: v.contiguous() for k, v in tensors.items()}, str(out_file), metadata=metadata or None)
    return written


def _mark(tensors: dict[str, torch.Tensor], written: Mapping[str, Any], style: FileStyle) -> dict[str, str]:
    """Markers, header metadata and family markers of ``style``; returns the header metadata."""
    if style.zero_cond_t_marker:
        tensors[ZERO_COND_T_MARKER] = torch.tensor([])
    if style.convention == "diffusers":  # diffusers' scripts/quantize_flux2_bfl.py writes exactly this header
        return {"format": "pt", "quantization": "nvfp4"}
    spec = {"format": "nvfp4"}
    if style.markers:
        tensors.update({f"{name}.comfy_quant": marker(spec) for name in written})
    if not style.header:
        return {}
    layers = {style.prefix + name: spec for name in written}  # ComfyUI's header names layers by their full keys
    return {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})}
