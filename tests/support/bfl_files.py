"""Test helpers: a real ModelOpt NVFP4 quantization of the tiny FLUX.2 transformer, its export, and a writer that
re-lays an export out as the (inferred) BFL / ComfyUI single-file format.

The BFL writer itself is ``support.bfl_writer`` (independent of the loaders).
"""

from __future__ import annotations

import copy
import json
import re
import warnings
from pathlib import Path

import torch

from support import bfl_writer
from support.bfl_writer import cublas_swizzle, marker  # noqa: F401 (the tests use them)

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


def write_bfl_file(export_dir: Path, out_file: Path, **kwargs) -> dict[str, list[str]]:
    """``support.bfl_writer.write_bfl_file`` of a ModelOpt export directory of the tiny FLUX.2 model."""
    cfg = json.loads((export_dir / "config.json").read_text())
    return bfl_writer.write_bfl_file(load_export_state(export_dir), cfg["num_layers"], cfg["num_single_layers"],
                                     out_file, **kwargs)
