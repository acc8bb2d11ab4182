"""Tiny NVFP4 text encoders of the four classes the pipelines use, written by their producers' own tools: ModelOpt
(``mtq.quantize`` with ``NVFP4_DEFAULT_CFG``, calibrated on one generation of the pipeline, then
``export_hf_checkpoint``) and comfy-kitchen (ComfyUI's per-layer format, ``support.comfy_files.ck_quantize``)."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from diffusers_nvfp4_fast.format import E2M1_MAX, E4M3_MAX
from diffusers_nvfp4_fast.testing import tiny
from diffusers_nvfp4_fast.testing.export import calibrate_input_amax
from support import tiny_family

CLASSES = ("mistral3", "qwen2_5_vl", "qwen3", "qwen3_vl")


def directory_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files of ``directory``, by stored key."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def tiny_mistral3() -> nn.Module:
    """tiny.py's Mistral3 text encoder with every Linear's sides multiples of 16 (ModelOpt cannot export an NVFP4
    layer with intermediate size 37; comfy-kitchen pads 8 key/value rows to 16)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    text = dict(model_type="mistral", vocab_size=272, hidden_size=16, intermediate_size=32,
                max_position_embeddings=512, num_attention_heads=4, num_hidden_layers=3, num_key_value_heads=4,
                rms_norm_eps=1e-5, rope_theta=1e9, sliding_window=None, bos_token_id=2, eos_token_id=3,
                pad_token_id=4)
    vision = dict(model_type="pixtral", hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
                  intermediate_size=32, image_size=30, patch_size=6, num_channels=3)
    config = Mistral3Config(  # type: ignore[call-arg]
        text_config=text, vision_config=vision, bos_token_id=2, eos_token_id=3, pad_token_id=4,
        image_seq_length=4, vision_feature_layer=-1, image_token_index=1,
    )
    torch.manual_seed(0)
    return Mistral3ForConditionalGeneration(config).eval().to(torch.bfloat16)


def tiny_pipeline(which: str, text_encoder: nn.Module | None = None) -> tuple[Any, dict]:
    """The tiny pipeline whose text encoder is of class ``which`` (BF16 transformer), with ``text_encoder`` in
    place of its own when given; progress bar off."""
    if which == "mistral3":
        pipe, kwargs = tiny.tiny_flux2_pipeline()
        pipe.register_modules(text_encoder=text_encoder or tiny_mistral3())
    elif which == "qwen3_vl":
        pipe, kwargs = tiny_family.tiny_qwen21_pipeline()
    else:
        pipe, kwargs = (tiny.tiny_qwen_pipeline if which == "qwen2_5_vl" else tiny.tiny_klein_pipeline)()
    if text_encoder is not None:
        pipe.register_modules(text_encoder=text_encoder)
    pipe.text_encoder.config.architectures = [type(pipe.text_encoder).__name__]
    pipe.set_progress_bar_config(disable=True)
    return pipe, {"height": 64, "width": 64, **kwargs}


def generate(pipe, kwargs: dict, steps: int = 2):
    """One deterministic generation; returns its image."""
    return tiny_family.generate(pipe, kwargs, steps=steps)[0]


def export_with_modelopt(which: str, out_dir: Path) -> Path:
    """ModelOpt's NVFP4 export of the tiny pipeline's text encoder, calibrated on one generation."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    pipe, kwargs = tiny_pipeline(which)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(pipe.text_encoder, mtq.NVFP4_DEFAULT_CFG, lambda _m: generate(pipe, kwargs, steps=1))
        export_hf_checkpoint(pipe.text_encoder, export_dir=out_dir)
    return out_dir


# The stored names of a Qwen2.5-VL file (Qwen's checkpoints, ComfyUI's files): transformers 5 renames them on load.
_QWEN25_STORED = (("model.language_model.", "model."), ("model.visual.", "visual."))
# What ComfyUI's text-encoder files keep in BF16: everything outside the language model's decoder layers.
_COMFY_FP4 = ".layers."


def stored_name(which: str, name: str) -> str:
    for new, old in _QWEN25_STORED if which == "qwen2_5_vl" else ():
        if name.startswith(new):
            return old + name[len(new):]
    return name


def _marker(spec: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(spec).encode()), dtype=torch.uint8)


def write_comfy_file(which: str, out_file: Path, quantize: Callable[[torch.Tensor], dict[str, torch.Tensor]],
                     edit: Callable[[dict[str, torch.Tensor]], None] | None = None,
                     header_only: bool = False) -> dict[str, str]:
    """The tiny pipeline's BF16 text encoder as a ComfyUI NVFP4 file: the decoder layers' Linears quantized by
    ``quantize``, each with a ``comfy_quant`` marker (or, ``header_only``, named in the ``_quantization_metadata``
    header alone) and an ``input_scale`` calibrated on one generation, the rest BF16, stored names. Returns
    {model layer name: stored layer name} of the NVFP4 layers."""
    from safetensors.torch import save_file

    pipe, kwargs = tiny_pipeline(which)
    model = pipe.text_encoder
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and _COMFY_FP4 in n
             and "visual" not in n and "vision" not in n]
    amax = calibrate_input_amax(model, lambda: generate(pipe, kwargs, steps=1), names)
    params = dict(model.named_parameters())  # a tied lm_head is stored once, as the embeddings
    tensors = {stored_name(which, k): v.detach().to(torch.bfloat16).contiguous()
               for k, v in model.state_dict().items() if k in params or not k.endswith(".weight")}
    written = {}
    for name in names:
        stored = stored_name(which, name)
        tensors.update({f"{stored}.{k}": v for k, v in quantize(tensors[f"{stored}.weight"]).items()})
        tensors[f"{stored}.input_scale"] = torch.tensor((amax[name] or 1.0) / (E4M3_MAX * E2M1_MAX))
        if not header_only:
            tensors[f"{stored}.comfy_quant"] = _marker({"format": "nvfp4"})
        written[name] = stored
    if edit is not None:
        edit(tensors)
    layers = {f"{stored}.weight": {"format": "nvfp4"} for stored in written.values()}
    metadata = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})}
    out_file.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_file),
              metadata=metadata if header_only else None)
    return written


def config_of(which: str) -> dict:
    """The tiny text encoder's config dict (what ``config=`` gets for a ComfyUI file)."""
    pipe, _ = tiny_pipeline(which)
    return pipe.text_encoder.config.to_dict()


def encoder_outputs(pipe, kwargs: dict, steps: int = 2) -> tuple[list[torch.Tensor], Any]:
    """(the prompt embeddings the transformer received at every call, the image) of one generation."""
    seen: list[torch.Tensor] = []

    def grab(_module, _args, call_kwargs):
        seen.append(call_kwargs["encoder_hidden_states"].clone())

    handle = pipe.transformer.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        image = generate(pipe, kwargs, steps=steps)
    finally:
        handle.remove()
    return seen, image
