"""Write NVFP4 FLUX.2 weights as a BFL / ComfyUI single file, in the official layout (high nibble first, 128x4 block
scales, ``comfy_quant`` markers and ``_quantization_metadata``) or in the layout diffusers' ``BFLQuantizationConfig``
reads (low nibble first, linear scales), for the tests and the benchmarks.

Deliberately independent of ``diffusers_nvfp4_fast.loaders.bfl``: its own name table (what the BFL file is believed to
contain, docs/checkpoints.md), its own 128x4 swizzle (written as cuBLAS documents it, not via ``format.py``), its own
nibble swap. The loaders must undo all of it byte for byte.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

_DOUBLE = {
    "img_attn.proj": "attn.to_out.0", "img_mlp.0": "ff.linear_in", "img_mlp.2": "ff.linear_out",
    "txt_attn.proj": "attn.to_add_out", "txt_mlp.0": "ff_context.linear_in", "txt_mlp.2": "ff_context.linear_out",
}
_DOUBLE_NORMS = {
    "img_attn.norm.query_norm": "attn.norm_q", "img_attn.norm.key_norm": "attn.norm_k",
    "txt_attn.norm.query_norm": "attn.norm_added_q", "txt_attn.norm.key_norm": "attn.norm_added_k",
}
_SINGLE = {"linear1": "attn.to_qkv_mlp_proj", "linear2": "attn.to_out"}
_SINGLE_NORMS = {"norm.query_norm": "attn.norm_q", "norm.key_norm": "attn.norm_k"}
_TOP = {
    "img_in": "x_embedder", "txt_in": "context_embedder",
    "time_in.in_layer": "time_guidance_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_guidance_embed.timestep_embedder.linear_2",
    "guidance_in.in_layer": "time_guidance_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_guidance_embed.guidance_embedder.linear_2",
    "double_stream_modulation_img.lin": "double_stream_modulation_img.linear",
    "double_stream_modulation_txt.lin": "double_stream_modulation_txt.linear",
    "single_stream_modulation.lin": "single_stream_modulation.linear",
    "final_layer.linear": "proj_out", "final_layer.adaLN_modulation.1": "norm_out.linear",
}


def bfl_modules(n_double: int, n_single: int) -> dict[str, tuple[list[str], bool]]:
    """BFL module -> (diffusers modules concatenated along rows, is an RMSNorm scale)."""
    out: dict[str, tuple[list[str], bool]] = {}
    for i in range(n_double):
        out[f"double_blocks.{i}.img_attn.qkv"] = ([f"transformer_blocks.{i}.attn.to_{x}" for x in "qkv"], False)
        out[f"double_blocks.{i}.txt_attn.qkv"] = ([f"transformer_blocks.{i}.attn.add_{x}_proj" for x in "qkv"], False)
        out.update({f"double_blocks.{i}.{b}": ([f"transformer_blocks.{i}.{d}"], False) for b, d in _DOUBLE.items()})
        out.update({f"double_blocks.{i}.{b}": ([f"transformer_blocks.{i}.{d}"], True)
                    for b, d in _DOUBLE_NORMS.items()})
    for i in range(n_single):
        out.update({f"single_blocks.{i}.{b}": ([f"single_transformer_blocks.{i}.{d}"], False)
                    for b, d in _SINGLE.items()})
        out.update({f"single_blocks.{i}.{b}": ([f"single_transformer_blocks.{i}.{d}"], True)
                    for b, d in _SINGLE_NORMS.items()})
    out.update({b: ([d], False) for b, d in _TOP.items()})
    return out


def cublas_swizzle(scales: torch.Tensor) -> torch.Tensor:
    """cuBLAS 'block scaling factors layout': 128x4 tiles, each stored as [32 rows][4 row groups][4 cols]."""
    s = scales.view(torch.uint8)
    rows, cols = s.shape
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    padded = torch.zeros(rp, cp, dtype=torch.uint8)
    padded[:rows, :cols] = s
    out = torch.empty(rp * cp, dtype=torch.uint8)
    m = torch.arange(rp).view(-1, 1)
    k = torch.arange(cp).view(1, -1)
    offset = (m // 128) * (cp * 128) + (k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4
    out[offset.flatten()] = padded.flatten()
    return out.view(rp, cp)


def hi_first(packed: torch.Tensor) -> torch.Tensor:
    p = packed.view(torch.uint8)
    return ((p & 0x0F) << 4) | (p >> 4)


def marker(spec: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(spec).encode()), dtype=torch.uint8)


def write_bfl_file(
    sd: dict[str, torch.Tensor],
    n_double: int,
    n_single: int,
    out_file: Path,
    *,
    markers: bool = True,
    header: bool = True,
    layer_flags: dict | None = None,
    file_flags: dict | None = None,
    nibble_order: str = "hi_first",
    swizzle: bool = True,
    drop_input_scale: Iterable[str] = (),
    prefix: str = "",
    edit: Callable | None = None,
) -> dict[str, list[str]]:
    """Re-lay ``sd`` (a ModelOpt-export state dict of a FLUX.2 transformer: diffusers names, packed weights low nibble
    first, linear scales) out as a BFL single file. Returns {BFL NVFP4 module: [diffusers modules]}.
    ``edit(tensors, metadata)`` may change the result before it is written (keys without the prefix)."""
    from safetensors.torch import save_file

    drop = set(drop_input_scale)
    tensors: dict[str, torch.Tensor] = {}
    layers: dict[str, dict] = {}
    fp4: dict[str, list[str]] = {}
    for bfl, (parts, is_norm) in bfl_modules(n_double, n_single).items():
        if parts[0] + ".weight" not in sd:
            continue
        weight = torch.cat([sd[p + ".weight"] for p in parts], 0)
        if bfl == "final_layer.adaLN_modulation.1":  # diffusers (scale, shift) -> BFL (shift, scale)
            weight = torch.cat(weight.chunk(2, 0)[::-1], 0)
        if is_norm:
            tensors[bfl + ".scale"] = weight
            continue
        if parts[0] + ".weight_scale" not in sd:
            tensors[bfl + ".weight"] = weight
            continue
        for p in parts[1:]:  # one fused tensor has one weight_scale_2 / input_scale: the export must agree
            assert torch.equal(sd[p + ".weight_scale_2"], sd[parts[0] + ".weight_scale_2"])
            assert torch.equal(sd[p + ".input_scale"], sd[parts[0] + ".input_scale"])
        scales = torch.cat([sd[p + ".weight_scale"].view(torch.uint8) for p in parts], 0)
        tensors[bfl + ".weight"] = hi_first(weight) if nibble_order == "hi_first" else weight
        tensors[bfl + ".weight_scale"] = (cublas_swizzle(scales) if swizzle else scales).view(torch.float8_e4m3fn)
        tensors[bfl + ".weight_scale_2"] = sd[parts[0] + ".weight_scale_2"]
        if bfl not in drop:
            tensors[bfl + ".input_scale"] = sd[parts[0] + ".input_scale"]
        spec = {"format": "nvfp4", **(layer_flags or {})}
        layers[bfl] = spec
        if markers:
            tensors[bfl + "." + "comfy_quant"] = marker(spec)
        fp4[bfl] = parts
    unknown = drop - set(fp4)
    assert not unknown, f"drop_input_scale names non-NVFP4 layers {unknown}"
    metadata = {}
    if header:
        metadata["_quantization_metadata"] = json.dumps({"format_version": "1.0", **(file_flags or {}),
                                                         "layers": layers})
    if edit is not None:
        edit(tensors, metadata)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    save_file({prefix + k: v.contiguous() for k, v in tensors.items()}, str(out_file), metadata=metadata or None)
    return fp4
