"""Tiny NVFP4 single files of every family member, in the formats people download, written by the producers' own
quantizers: comfy-kitchen 0.2.40 (ComfyUI's format; ``comfy_kitchen`` is imported only where a file is written with
it, so the GPU tests run without it), diffusers' ``quantize_nvfp4`` (its BFL files), and this package's
``support.comfy_writer.comfy_quantize`` (the same bytes as comfy-kitchen's, which the CPU tests prove)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from diffusers_nvfp4_fast.loaders.common import is_excluded
from diffusers_nvfp4_fast.quantize.recipes import QWEN_EXCLUDE_TOP
from diffusers_nvfp4_fast.testing import tiny
from support import tiny_family as tf
from support.comfy_writer import (
    COMFY_PREFIX,
    FileStyle,
    Quantizer,
    fp4_modules,
    write_single_file,
)

# The real BFL FLUX.2 files keep the text stream's fused qkv in BF16 (docs/design.md §4).
FLUX2_FILE_EXCLUDE = (*tiny.FLUX2_EXCLUDE, "*.add_q_proj", "*.add_k_proj", "*.add_v_proj")
# Two Qwen-Image blocks, the first NVFP4 and the second BF16 (as the public files keep their outer blocks BF16).
QWEN_FILE_EXCLUDE = (*QWEN_EXCLUDE_TOP, "transformer_blocks.1")


def tiny_qwen(latent_channels: int = 4, **flags: bool) -> nn.Module:
    """A 2-block Qwen-Image transformer of width 256 (2 heads x 128) for ``tiny_family``'s Qwen-Image pipelines;
    ``flags``: ``zero_cond_t`` (Edit-2511), ``use_additional_t_cond`` and ``use_layer3d_rope`` (Layered)."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    return QwenImageTransformer2DModel(
        patch_size=2, in_channels=4 * latent_channels, out_channels=latent_channels, num_layers=2,
        attention_head_dim=128, num_attention_heads=2, joint_attention_dim=16, guidance_embeds=False,
        axes_dims_rope=(16, 56, 56), **flags,
    ).to(torch.bfloat16).eval()


def ck_quantize(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """comfy-kitchen's own quantization of one weight, as ComfyUI saves it: ``TensorCoreNVFP4Layout.quantize`` (its
    default per-tensor scale) on the eager backend, keys from the layout's ``state_dict_tensors`` ("" -> weight,
    "_scale" -> weight_scale, "_scale_2" -> weight_scale_2)."""
    import comfy_kitchen as ck
    from comfy_kitchen.tensor.nvfp4 import TensorCoreNVFP4Layout

    with ck.registry.use_backend("eager"):
        qdata, params = TensorCoreNVFP4Layout.quantize(weight)
    tensors = TensorCoreNVFP4Layout.state_dict_tensors(qdata, params)
    return {"weight" + suffix: t for suffix, t in tensors.items()}


def ck_dequantize(packed: torch.Tensor, weight_scale_2: torch.Tensor, weight_scale: torch.Tensor,
                  dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """comfy-kitchen's eager ``dequantize_nvfp4`` (high nibble first, 128x4 scales). In float64 every product is
    exact, so two correct decodes of the same bytes are equal bit for bit."""
    from comfy_kitchen.backends.eager.quantization import dequantize_nvfp4

    return dequantize_nvfp4(packed, weight_scale_2, weight_scale.view(torch.float8_e4m3fn), dtype)


def diffusers_quantize(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """diffusers 0.42.1's own BFL quantizer (``quantizers/bfl/utils.py``, what ``scripts/quantize_flux2_bfl.py`` runs):
    low nibble first, linear ``[N, K/16]`` E4M3 scales, ``weight_scale_2 = amax / 2688``."""
    from diffusers.quantizers.bfl.utils import quantize_nvfp4

    packed, scales, ws2 = quantize_nvfp4(weight)
    return {"weight": packed, "weight_scale": scales, "weight_scale_2": ws2.reshape(())}


@dataclass(frozen=True)
class Family:
    """A tiny family member: its BF16 transformer, the Linears kept BF16, its pipeline, and the config keys the shapes
    cannot tell that the tiny model sets differently from the family's default."""

    name: str
    make: Callable[[], nn.Module]
    exclude: tuple[str, ...]
    pipeline: Callable[[nn.Module], tuple[Any, dict]] | None = None
    config: dict = field(default_factory=dict)
    zero_cond_t_marker: bool = False


FAMILIES = {
    "flux2": Family("flux2", lambda: tiny.tiny_flux2_transformer(True), FLUX2_FILE_EXCLUDE, tf.flux2_text_to_image),
    "klein": Family("klein", lambda: tiny.tiny_flux2_transformer(False), FLUX2_FILE_EXCLUDE, tf.klein_text_to_image),
    "qwen": Family("qwen", tiny_qwen, QWEN_FILE_EXCLUDE, tf.qwen_text_to_image),
    "qwen_edit_2511": Family("qwen_edit_2511", lambda: tiny_qwen(zero_cond_t=True), QWEN_FILE_EXCLUDE,
                             tf.qwen_edit_plus, zero_cond_t_marker=True),
    "qwen_layered": Family("qwen_layered", lambda: tiny_qwen(tf.LAYERED_LATENT_CHANNELS, use_additional_t_cond=True,
                                                             use_layer3d_rope=True), QWEN_FILE_EXCLUDE),
    "qwen21": Family("qwen21", tf.tiny_qwen21_transformer, tf.QWEN21_EXCLUDE, tf.tiny_qwen21_pipeline,
                     config={"axes_dims_rope": [32, 48, 48]}),
}


def quantized_linears(model: nn.Module, exclude: tuple[str, ...]) -> list[str]:
    return [n for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and not is_excluded(n, list(exclude)) and m.in_features % 16 == 0]


@dataclass
class Source:
    """A family member's BF16 transformer, its FP4 Linears and their input maxima."""

    family: Family
    model: nn.Module
    quantized: list[str]
    amax: dict[str, float]


def make_source(family: Family) -> Source:
    """The BF16 model, its FP4 Linears and their input maxima: a fixed 4.0 (any positive value is a valid calibration
    for what the tests check, and a calibration run would cost more than all the files together)."""
    model = family.make()
    quantized = quantized_linears(model, family.exclude)
    return Source(family, model, quantized, dict.fromkeys(quantized, 4.0))


@dataclass(frozen=True)
class FileCase:
    """One file of the matrix: which family, how it is marked, which input scales it has."""

    id: str
    family: str
    convention: str = "comfy"  # "comfy" | "diffusers" | "bare" (ComfyUI's bytes, no metadata at all)
    markers: bool = True
    header: bool = True
    prefix: str = ""
    input_scales: str = "all"  # "all" | "some" (two FP4 modules without) | "none"

    @property
    def loads(self) -> bool:
        """The verdict of ``load_nvfp4_transformer(file)`` with default arguments, by design."""
        return self.input_scales == "all" and self.convention != "bare"


P = COMFY_PREFIX
FILE_MATRIX = (
    FileCase("flux2-markers+header-prefix", "flux2", prefix=P),
    FileCase("flux2-markers", "flux2", header=False),
    FileCase("flux2-header-prefix-some_input_scales", "flux2", markers=False, prefix=P, input_scales="some"),
    FileCase("klein-header", "klein", markers=False),
    FileCase("klein-markers-prefix-no_input_scales", "klein", header=False, prefix=P, input_scales="none"),
    FileCase("qwen-markers+header-prefix", "qwen", prefix=P),
    FileCase("qwen-markers", "qwen", header=False),
    FileCase("qwen-header-prefix-some_input_scales", "qwen", markers=False, prefix=P, input_scales="some"),
    FileCase("qwen_edit_2511-markers+header-prefix", "qwen_edit_2511", prefix=P),
    FileCase("qwen_layered-header", "qwen_layered", markers=False),
    FileCase("qwen21-markers+header-prefix", "qwen21", prefix=P),
    FileCase("qwen21-markers-prefix-some_input_scales", "qwen21", header=False, prefix=P, input_scales="some"),
    FileCase("flux2-diffusers", "flux2", convention="diffusers"),
    FileCase("qwen-diffusers", "qwen", convention="diffusers"),
    FileCase("qwen21-diffusers", "qwen21", convention="diffusers"),
    FileCase("flux2-bare", "flux2", convention="bare"),
)


def write_case(source: Source, case: FileCase, path: Path, quantize: Quantizer | None = None) -> dict:
    """Write ``case`` of ``source`` to ``path`` (comfy-kitchen's quantizer for ComfyUI's format unless ``quantize`` is
    given, diffusers' for its own); returns {stored FP4 module: its diffusers Linears}."""
    family = source.family
    diffusers_style = case.convention == "diffusers"
    style = FileStyle("diffusers" if diffusers_style else "comfy", markers=case.markers and case.convention == "comfy",
                      header=case.header and case.convention == "comfy", prefix=case.prefix,
                      zero_cond_t_marker=family.zero_cond_t_marker)
    quantize = quantize or (diffusers_quantize if diffusers_style else ck_quantize)
    amax = None if case.input_scales == "none" else source.amax
    drop = sorted(fp4_modules(source.model, source.quantized))[:2] if case.input_scales == "some" else []
    return write_single_file(source.model, path, source.quantized, amax, quantize=quantize, style=style,
                             drop_input_scale=drop)
