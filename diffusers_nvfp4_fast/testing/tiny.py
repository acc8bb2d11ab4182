"""Tiny offline FLUX.2, FLUX.2-klein and Qwen-Image pipelines, for the demo, the tests and the benchmarks.

Everything here runs without a network: tokenizers are byte-level BPE vocabularies built in memory, models are
built from small configs with seeded random weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# The public NVFP4 checkpoints' BF16-kept layers (ModelOpt's recipes) are declared in quantize/recipes.py.
from ..quantize.recipes import FLUX2_EXCLUDE, QWEN_EXCLUDE_TOP, qwen_exclude  # noqa: F401  (re-exported)

# ---------------------------------------------------------------------------------------------------------------
# Offline tokenizers: 256 byte tokens plus specials, no merges.
# ---------------------------------------------------------------------------------------------------------------


def _byte_unicode_map() -> dict[int, str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _byte_vocab(specials: list[str]) -> dict[str, int]:
    vocab = {s: i for i, s in enumerate(specials)}
    for _, ch in sorted(_byte_unicode_map().items()):
        vocab[ch] = len(vocab)
    return vocab


_QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}{{ c['text'] }}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
_MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{% for c in m['content'] %}{{ c['text'] }}{% endfor %}"
    "[/SYSTEM_PROMPT]{% elif m['role'] == 'user' %}[INST]{% for c in m['content'] %}"
    "{% if c['type'] == 'text' %}{{ c['text'] }}{% else %}[IMG]{% endif %}{% endfor %}[/INST]"
    "{% else %}{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{{ eos_token }}{% endif %}{% endfor %}"
)


def qwen_tokenizer():
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Qwen2Tokenizer(vocab=_byte_vocab(specials), merges=[], chat_template=_QWEN_TEMPLATE)
    tok.add_tokens([AddedToken(s, special=True, normalized=False) for s in specials[1:]], special_tokens=True)
    return tok


def mistral_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "[IMG]", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]
    bpe = Tokenizer(models.BPE(vocab=_byte_vocab(specials), merges=[], unk_token=None, fuse_unk=False))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        padding_side="left", chat_template=_MISTRAL_TEMPLATE,
    )


# ---------------------------------------------------------------------------------------------------------------
# Tiny transformers and pipelines.
# ---------------------------------------------------------------------------------------------------------------

_TEXT_LAYERS, _TEXT_HIDDEN = 3, 16


def tiny_flux2_transformer(guidance_embeds: bool = True, seed: int = 0) -> nn.Module:
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(seed)
    return Flux2Transformer2DModel(  # type: ignore[attr-defined]  # mypy picks diffusers' dummy placeholder class
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=_TEXT_LAYERS * _TEXT_HIDDEN, timestep_guidance_channels=256,
        axes_dims_rope=[4, 4, 4, 4], guidance_embeds=guidance_embeds,
    ).to(torch.bfloat16).eval()


def tiny_qwen_transformer(seed: int = 0) -> nn.Module:
    """6 blocks of width 512 (4 heads x 128): blocks 2 and 3 are NVFP4 under the public exclusion rule."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    return QwenImageTransformer2DModel(  # type: ignore[attr-defined]  # (as above)
        patch_size=2, in_channels=16, out_channels=4, num_layers=6, attention_head_dim=128, num_attention_heads=4,
        joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(16, 56, 56),
    ).to(torch.bfloat16).eval()


def _tiny_flux2_vae():
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(0)
    return AutoencoderKLFlux2(
        sample_size=32, in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",), block_out_channels=(4,), layers_per_block=1, latent_channels=1,
        norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
    )


def tiny_flux2_pipeline(transformer: nn.Module | None = None):
    """Flux2Pipeline (Mistral-style text encoder). Returns (pipe, call kwargs)."""
    from diffusers import Flux2Pipeline
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    text = dict(
        model_type="mistral", vocab_size=272, hidden_size=_TEXT_HIDDEN, intermediate_size=37,
        max_position_embeddings=512, num_attention_heads=4, num_hidden_layers=_TEXT_LAYERS, num_key_value_heads=2,
        rms_norm_eps=1e-5, rope_theta=1e9, sliding_window=None, bos_token_id=2, eos_token_id=3, pad_token_id=4,
    )
    vision = dict(model_type="pixtral", hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
                  intermediate_size=37, image_size=30, patch_size=6, num_channels=3)
    config = Mistral3Config(  # type: ignore[call-arg]  # transformers' configs take extra attributes as kwargs
        text_config=text, vision_config=vision, bos_token_id=2, eos_token_id=3, pad_token_id=4,
        image_seq_length=4, vision_feature_layer=-1, image_token_index=1,
    )
    torch.manual_seed(0)
    text_encoder = Mistral3ForConditionalGeneration(config).eval()
    return _flux2_family(Flux2Pipeline, text_encoder, mistral_tokenizer(), transformer or tiny_flux2_transformer(True),
                         max_sequence_length=256)


def tiny_klein_pipeline(transformer: nn.Module | None = None):
    """Flux2KleinPipeline (Qwen3 text encoder, real CFG). Returns (pipe, call kwargs)."""
    from diffusers import Flux2KleinPipeline
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(intermediate_size=16, hidden_size=_TEXT_HIDDEN, num_hidden_layers=_TEXT_LAYERS,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=8, vocab_size=272,
                         max_position_embeddings=512)
    torch.manual_seed(0)
    text_encoder = Qwen3ForCausalLM(config).eval()
    return _flux2_family(Flux2KleinPipeline, text_encoder, qwen_tokenizer(),
                         transformer or tiny_flux2_transformer(False), max_sequence_length=64)


def _flux2_family(pipeline_cls, text_encoder: nn.Module, tokenizer, transformer: nn.Module,
                  max_sequence_length: int):
    """A FLUX.2 or Klein pipeline around ``text_encoder`` in BF16, and its call kwargs (all text layers read)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipe = pipeline_cls(scheduler=FlowMatchEulerDiscreteScheduler(), vae=_tiny_flux2_vae(), text_encoder=text_encoder,
                        tokenizer=tokenizer, transformer=transformer)
    pipe.to(torch.bfloat16)
    kwargs = dict(prompt="a dog is dancing", guidance_scale=4.0, max_sequence_length=max_sequence_length,
                  text_encoder_out_layers=tuple(range(1, _TEXT_LAYERS + 1)))
    return pipe, kwargs


def tiny_qwen_pipeline(transformer: nn.Module | None = None):
    """QwenImagePipeline (Qwen2.5-VL text encoder). Returns (pipe, call kwargs)."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                                 temperal_downsample=[False, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    text = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, vocab_size=272, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
                rope_theta=1e6)
    vision = dict(depth=2, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16)
    # Vision token ids lie outside the byte vocabulary, so text never reaches the vision tower.
    config = Qwen2_5_VLConfig(  # type: ignore[call-arg]  # (as above)
        text_config=text, vision_config=vision, hidden_size=16, vocab_size=272,
        vision_start_token_id=265, vision_end_token_id=266, vision_token_id=267,
        image_token_id=268, video_token_id=269,
    )
    torch.manual_seed(0)
    text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder, tokenizer=qwen_tokenizer(),
        transformer=transformer or tiny_qwen_transformer(),
    )
    pipe.to(torch.bfloat16)  # type: ignore[attr-defined]  # diffusers' dummy placeholder (see above)
    kwargs = dict(prompt="dance monkey", negative_prompt="bad quality", true_cfg_scale=1.0, max_sequence_length=256)
    return pipe, kwargs


TINY_PIPELINES: dict[str, Callable] = {
    "flux2": tiny_flux2_pipeline, "klein": tiny_klein_pipeline, "qwen": tiny_qwen_pipeline,
}
TINY_EXCLUDES = {"flux2": FLUX2_EXCLUDE, "klein": FLUX2_EXCLUDE, "qwen": qwen_exclude(6)}
