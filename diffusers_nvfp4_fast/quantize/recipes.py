"""Which Linears stay BF16 in an NVFP4 checkpoint, per diffusers transformer class (ModelOpt's published recipes).

Patterns are fnmatch patterns matched against a module name and each of its dotted prefixes (``loaders.common.
is_excluded``). Sources (NVIDIA/TensorRT-Model-Optimizer, ``examples/diffusers/quantization/utils.py``):

* FLUX.2 (dev and klein share ``Flux2Transformer2DModel``): ``filter_func_flux_dev``, the regex
  ``proj_out.*|.*(time_text_embed|context_embedder|x_embedder|norm_out|time_guidance_embed|stream_modulation).*``;
  spelled here as the module names that regex matches in diffusers 0.42.1's FLUX.2 transformer.
* Qwen-Image: ``filter_func_qwen_image``, "quantize only ``transformer_blocks``, keeping the first two and the last
  two in original precision"; the block count is read from the config (60 for Qwen-Image).
* Qwen-Image 2.1 (``QwenImage21Transformer2DModel``): ModelOpt publishes no recipe for it; this project applies the
  Qwen-Image rule (its layout is the same: embedders, one shared ``modulation`` and ``transformer_blocks``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any

from ..loaders.common import is_excluded

FLUX2_EXCLUDE = (
    "x_embedder", "context_embedder", "proj_out", "norm_out*", "time_guidance_embed*",
    "double_stream_modulation_img*", "double_stream_modulation_txt*", "single_stream_modulation*",
)
QWEN_EXCLUDE_TOP = ("img_in", "txt_in", "proj_out", "norm_out*", "time_text_embed*")
QWEN21_EXCLUDE_TOP = (*QWEN_EXCLUDE_TOP, "modulation*")

RECIPE_SOURCES = {
    "Flux2Transformer2DModel": "ModelOpt examples/diffusers filter_func_flux_dev (FLUX.2-dev and FLUX.2-klein)",
    "QwenImageTransformer2DModel": "ModelOpt examples/diffusers filter_func_qwen_image (Qwen-Image)",
    "QwenImage21Transformer2DModel": "the Qwen-Image rule of ModelOpt's filter_func_qwen_image, applied to Qwen-Image "
                                     "2.1 (ModelOpt publishes no recipe of its own for it)",
}


def qwen_exclude(num_layers: int, top: tuple[str, ...] = QWEN_EXCLUDE_TOP) -> tuple[str, ...]:
    """Qwen-Image's rule: everything outside ``transformer_blocks`` and the first two and last two blocks stay BF16."""
    keep = sorted({0, 1, num_layers - 2, num_layers - 1} & set(range(num_layers)))
    return top + tuple(f"transformer_blocks.{i}" for i in keep)


def kept_bf16(linear_names: Sequence[str], patterns: Sequence[str]) -> tuple[int, int]:
    """(how many of the Linears ``patterns`` keep BF16, how many others): where no Linear is quantized, the others are
    those whose in_features are not a multiple of 16. The counts behind every "nothing would become NVFP4" refusal."""
    excluded = sum(is_excluded(n, list(patterns)) for n in linear_names)
    return excluded, len(linear_names) - excluded


def qwen_rule_applies(class_name: str) -> bool:
    """Whether ``class_name``'s recipe is the Qwen-Image rule (whose block count decides what is quantized)."""
    return class_name in ("QwenImageTransformer2DModel", "QwenImage21Transformer2DModel")


class UnknownModelClassError(ValueError):
    """No exclusion recipe is known for this diffusers class (pass ``exclude=`` to give one)."""


def exclude_patterns(class_name: str, config: Mapping[str, Any], source: object = "") -> tuple[str, ...]:
    """The BF16-kept patterns for a transformer of ``class_name`` with diffusers ``config`` (its ``num_layers``).

    Raises:
        UnknownModelClassError: for a class without a recipe, naming it, the known ones and ``exclude=``.
    """
    if class_name == "Flux2Transformer2DModel":
        return FLUX2_EXCLUDE
    if qwen_rule_applies(class_name):
        top = QWEN21_EXCLUDE_TOP if class_name == "QwenImage21Transformer2DModel" else QWEN_EXCLUDE_TOP
        return qwen_exclude(int(config["num_layers"]), top)
    where = f"{source}: " if source else ""
    raise UnknownModelClassError(
        f"{where}_class_name={class_name!r} has no NVFP4 exclusion recipe (known: {', '.join(RECIPE_SOURCES)}); "
        "pass the layers to keep in BF16 explicitly (--exclude PATTERN ... / exclude=[...])"
    )


# --- Text encoders (transformers models) -------------------------------------------------------------------------
# ModelOpt's LLM recipe: the quantizers NVIDIA/TensorRT-Model-Optimizer 0.47 disables in NVFP4_DEFAULT_CFG
# (modelopt/torch/quantization/config.py, `_default_disabled_quantizer_cfg` merged into the "nvfp4" preset, the config
# examples/llm_ptq/hf_ptq.py uses for `--qformat nvfp4`), as fnmatch patterns over ModelOpt's quantizer names
# (`<module>.weight_quantizer`, `<module>.input_quantizer`). Embeddings are disabled there by class (nn.Embedding); they
# are not Linears, so they stay as stored here too. tests/test_quantize_text_encoder.py checks this tuple against the
# installed ModelOpt's config.
MODELOPT_LLM_DISABLED = (
    "*block_sparse_moe.gate*", "*linear_attn.conv1d*", "*self_attention.conv1d*", "*linear_attn.in_proj_a*",
    "*linear_attn.in_proj_b*", "*lm_head*", "*mixer.conv1d*", "*mlp.gate.*", "*mlp.shared_expert_gate.*",
    "*output_layer*", "*proj_out.*", "*router*", "mtp.*", "output.*", "*embed_vision*", "*vision_tower*", "*visual*",
    "*vision_model*", "*multi_modal_projector*",
)
TEXT_ENCODER_RECIPE = ("ModelOpt's LLM recipe: the quantizers NVFP4_DEFAULT_CFG disables (modelopt 0.47, as "
                       "examples/llm_ptq hf_ptq.py --qformat nvfp4): lm_head, embeddings, routers / gates, vision "
                       "towers and projectors")
# The pipelines' text encoders (transformers classes) this recipe is declared for.
TEXT_ENCODER_CLASSES = {
    "Mistral3ForConditionalGeneration": "Flux2Pipeline (FLUX.2-dev)",
    "Qwen2_5_VLForConditionalGeneration": "QwenImagePipeline and its Edit pipelines",
    "Qwen3ForCausalLM": "Flux2KleinPipeline (FLUX.2-klein)",
    "Qwen3VLForConditionalGeneration": "QwenImage21Pipeline",
}
# Linears that read one input together, whose NVFP4 scales ModelOpt's LLM export unifies (the max of their amaxes):
# `requantize_resmooth_fused_llm_layers` groups the modules that see the same input tensor; in these four classes'
# language models those are q/k/v and gate/up (checked against ModelOpt's export by the tests).
TEXT_SHARED_INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def modelopt_llm_disabled(module_name: str, patterns: Sequence[str] = MODELOPT_LLM_DISABLED) -> bool:
    """Whether ModelOpt's LLM recipe disables the quantizers of Linear ``module_name`` (its in-memory name)."""
    return any(fnmatch.fnmatchcase(f"{module_name}.{q}", p) for p in patterns
               for q in ("weight_quantizer", "input_quantizer"))
