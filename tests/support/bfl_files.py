"""Test helpers: a real ModelOpt NVFP4 quantization of the tiny FLUX.2 transformer, its export, and a writer that
re-lays an export out as the (inferred) BFL / ComfyUI single-file format.

The BFL writer is deliberately independent of ``diffusers_nvfp4_fast.loaders.bfl``: its own name table (what the BFL
file is believed to contain), its own 128x4 swizzle (written as cuBLAS documents it, not via ``format.py``), its
own nibble swap. The loader must undo all of it byte for byte.
"""

from __future__ import annotations

import copy
import json
import re
import warnings
from collections.abc import Iterable
from pathlib import Path

import torch

# ModelOpt's FLUX filter (examples/diffusers/quantization/utils.py::filter_func_flux_dev), plus the text-stream q/k/v:
# the real BFL file keeps txt_attn.qkv in BF16 (docs/design.md §4), so the export used for comparison does too.
FLUX_EXCLUDE_RE = re.compile(
    r"(proj_out.*|.*(time_text_embed|context_embedder|x_embedder|norm_out|time_guidance_embed|stream_modulation).*)"
)
TXT_QKV_RE = re.compile(r".*attn\.add_[qkv]_proj.*")


def flux2_batch(model, gen: torch.Generator, batch: int = 1, img_tokens: int = 64, txt_tokens: int = 16) -> dict:
    """One random calibration batch for ``Flux2Transformer2DModel.forward``."""
    c = model.config
    img_ids = torch.stack(
        torch.meshgrid(torch.zeros(1), torch.arange(8.0), torch.arange(img_tokens // 8.0), torch.zeros(1),
                       indexing="ij"), -1
    ).reshape(-1, 4)
    return dict(
        hidden_states=torch.randn(batch, img_tokens, c.in_channels, generator=gen).to(torch.bfloat16),
        encoder_hidden_states=torch.randn(batch, txt_tokens, c.joint_attention_dim, generator=gen).to(torch.bfloat16),
        timestep=torch.rand(batch, generator=gen).to(torch.bfloat16),
        img_ids=img_ids, txt_ids=torch.zeros(txt_tokens, 4),
        guidance=torch.full((batch,), 4.0) if c.guidance_embeds else None, return_dict=False,
    )


def quantize_tiny_flux2(guidance_embeds: bool = True, *, bf16_txt_qkv: bool = True, seed: int = 0):
    """``tiny_flux2_transformer`` quantized in memory by ModelOpt (NVFP4 W4A4 diffusers preset, max calibration)."""
    warnings.filterwarnings("ignore", module="modelopt")
    import modelopt.torch.quantization as mtq
    from modelopt.torch.quantization.config import _load_quantize_config_dict

    from diffusers_nvfp4_fast.testing.tiny import tiny_flux2_transformer

    model = tiny_flux2_transformer(guidance_embeds, seed=seed)
    with torch.no_grad():
        # Give q, k and v different weight amaxes, so the exporter's QKV fusion (shared weight_scale_2 = max) really
        # changes something: the re-quantized (fake quant) or re-rounded (compressed) block scales of k and v.
        for block in model.transformer_blocks:
            for name, factor in (("to_k", 0.6), ("to_v", 0.8), ("add_k_proj", 0.7), ("add_v_proj", 0.9)):
                getattr(block.attn, name).weight.mul_(factor)
    gen = torch.Generator().manual_seed(seed + 1)
    batches = [flux2_batch(model, gen) for _ in range(2)]

    def forward_loop(m):
        with torch.no_grad():
            for b in batches:
                m(**b)

    mtq.quantize(model, _load_quantize_config_dict("configs/ptq/presets/diffusers/nvfp4"), forward_loop)
    mtq.disable_quantizer(model, lambda n: FLUX_EXCLUDE_RE.match(n) is not None)
    if bf16_txt_qkv:
        mtq.disable_quantizer(model, lambda n: TXT_QKV_RE.match(n) is not None)
    return model


def export_modelopt(model, out_dir: Path, *, copy_first: bool = True) -> Path:
    """``export_hf_checkpoint`` (of a copy by default: the exporter rewrites the modules it exports; a compressed
    model cannot be deep-copied, so pass ``copy_first=False`` and do not use it afterwards)."""
    from modelopt.torch.export import export_hf_checkpoint

    export_hf_checkpoint(copy.deepcopy(model) if copy_first else model, export_dir=out_dir)
    return out_dir


def load_export_state(export_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(export_dir / "diffusion_pytorch_model.safetensors"))


# ---------------------------------------------------------------------------------------------------------------
# The BFL / ComfyUI layout (inferred; docs/design.md §4).
# ---------------------------------------------------------------------------------------------------------------

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
    export_dir: Path,
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
    edit=None,
) -> dict[str, list[str]]:
    """Re-lay a ModelOpt export of the tiny FLUX.2 model out as a BFL single file.

    Returns {BFL NVFP4 module: [diffusers modules]}. ``edit(tensors, metadata)`` may corrupt the result before it is
    written (keys without the prefix).
    """
    from safetensors.torch import save_file

    sd = load_export_state(export_dir)
    cfg = json.loads((export_dir / "config.json").read_text())
    drop = set(drop_input_scale)
    tensors: dict[str, torch.Tensor] = {}
    layers: dict[str, dict] = {}
    fp4: dict[str, list[str]] = {}
    for bfl, (parts, is_norm) in bfl_modules(cfg["num_layers"], cfg["num_single_layers"]).items():
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
