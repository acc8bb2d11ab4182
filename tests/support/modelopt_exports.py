"""Real ModelOpt NVFP4 exports of the tiny transformers (mtq.quantize + export_hf_checkpoint on CPU).

Calibration runs one tiny-pipeline generation through ModelOpt's calibration mode (max), so every exported
``input_scale`` is a real calibrated value.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import torch
from torch import nn

from diffusers_nvfp4_fast.testing import tiny
from diffusers_nvfp4_fast.utils import png_sha256, run_pipeline

FLUX2_EXCLUDE_RE = re.compile(
    r"(proj_out.*|.*(time_text_embed|context_embedder|x_embedder|norm_out|time_guidance_embed|stream_modulation).*)"
)


def _modelopt_config(which: str, model: nn.Module) -> dict:
    from modelopt.torch.quantization.config import _load_quantize_config_dict

    cfg = _load_quantize_config_dict("configs/ptq/presets/diffusers/nvfp4")
    cfg = {**cfg, "quant_cfg": list(cfg["quant_cfg"])}
    if which == "qwen":
        # ModelOpt's Qwen-Image recipe: only transformer_blocks, without the first two and the last two.
        n = len(model.transformer_blocks)
        cfg["quant_cfg"] += [
            {"quantizer_name": "*weight_quantizer", "enable": False},
            {"quantizer_name": "*input_quantizer", "enable": False},
            {"quantizer_name": "*transformer_blocks.*weight_quantizer", "enable": True},
            {"quantizer_name": "*transformer_blocks.*input_quantizer", "enable": True},
        ]
        for i in sorted({0, 1, n - 2, n - 1}):
            cfg["quant_cfg"] += [
                {"quantizer_name": f"*transformer_blocks.{i}.*weight_quantizer", "enable": False},
                {"quantizer_name": f"*transformer_blocks.{i}.*input_quantizer", "enable": False},
            ]
    return cfg


def quantize_with_modelopt(which: str):
    """Tiny ``which`` pipeline whose transformer ModelOpt quantized and calibrated in memory (not exported)."""
    import modelopt.torch.quantization as mtq

    pipe, kwargs = tiny.TINY_PIPELINES[which]()
    pipe.set_progress_bar_config(disable=True)
    model = pipe.transformer

    def forward_loop(_model):
        run_pipeline(pipe, kwargs, steps=2)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(model, _modelopt_config(which, model), forward_loop)
        if which != "qwen":
            mtq.disable_quantizer(model, lambda name: FLUX2_EXCLUDE_RE.match(name) is not None)
    return pipe


def export_with_modelopt(which: str, out_dir: Path) -> Path:
    """Tiny ``which`` pipeline -> ModelOpt-quantized transformer exported to ``out_dir``; returns ``out_dir``."""
    from modelopt.torch.export import export_hf_checkpoint

    model = quantize_with_modelopt(which).transformer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_hf_checkpoint(model, export_dir=out_dir)
    return out_dir


def base_transformer(which: str) -> nn.Module:
    """The BF16 transformer the tiny pipeline builds (same seed as the exported one)."""
    return tiny.tiny_qwen_transformer() if which == "qwen" else tiny.tiny_flux2_transformer(which == "flux2")


def nvfp4_pipeline(which: str, export_dir: Path, device: str | None = None):
    """The tiny ``which`` pipeline around ``load_nvfp4_transformer(export_dir)``, progress bar off, optionally moved
    to ``device``. Returns (pipe, call kwargs)."""
    from diffusers_nvfp4_fast import load_nvfp4_transformer

    pipe, kwargs = tiny.TINY_PIPELINES[which](load_nvfp4_transformer(export_dir, device=device))
    if device is not None:
        pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe, kwargs


def pipeline_sha(which: str, transformer: nn.Module, **kw) -> str:
    pipe, kwargs = tiny.TINY_PIPELINES[which](transformer)
    pipe.set_progress_bar_config(disable=True)
    return png_sha256(run_pipeline(pipe, kwargs, **kw))


def no_grad_forward(model, **inputs):
    with torch.inference_mode():
        return model(**inputs)


if __name__ == "__main__":  # python tests/support/modelopt_exports.py WHICH EXPORT_DIR: the PNG SHA256 in a new process
    import sys

    from diffusers_nvfp4_fast import load_nvfp4_transformer

    print("SHA", pipeline_sha(sys.argv[1], load_nvfp4_transformer(sys.argv[2])))
