"""Tiny text encoders of the four classes the pipelines use, at sizes every Linear of the language model can be
NVFP4 (multiples of 16), saved as transformers saves them; and a stand-in pipeline whose ``encode_prompt`` runs the
text encoder over the prompt's bytes (token ids below the vision tokens)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
             head_dim=16, vocab_size=272, max_position_embeddings=128, bos_token_id=0, eos_token_id=0, pad_token_id=0)
_MROPE = {"mrope_section": [2, 2, 4], "rope_type": "default", "type": "default"}
_VL_IDS = dict(vision_start_token_id=265, vision_end_token_id=266, vision_token_id=267, image_token_id=268,
               video_token_id=269)


def tiny_text_encoder(name: str) -> nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    if name == "Qwen3ForCausalLM":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**_TEXT, tie_word_embeddings=True))
    if name == "Qwen2_5_VLForConditionalGeneration":
        config = tf.Qwen2_5_VLConfig(  # type: ignore[call-arg]
            text_config={**_TEXT, "rope_scaling": _MROPE, "rope_theta": 1e6},
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=32),
            **_VL_IDS)
        return tf.Qwen2_5_VLForConditionalGeneration(config)
    if name == "Qwen3VLForConditionalGeneration":
        config = tf.Qwen3VLConfig(  # type: ignore[call-arg]
            text_config={**_TEXT, "rope_scaling": {"mrope_section": [2, 2, 4], "rope_type": "default"}},
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=32,
                               deepstack_visual_indexes=[0]),
            image_token_id=268, video_token_id=269, vision_start_token_id=265, vision_end_token_id=266)
        return tf.Qwen3VLForConditionalGeneration(config)
    if name == "Mistral3ForConditionalGeneration":
        text = dict(model_type="mistral", **_TEXT, sliding_window=None)
        vision = dict(model_type="pixtral", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=32, image_size=28, patch_size=14, num_channels=3, head_dim=16)
        config = tf.Mistral3Config(text_config=text, vision_config=vision,  # type: ignore[call-arg]
                                   image_token_index=268, vision_feature_layer=-1)
        return tf.Mistral3ForConditionalGeneration(config)
    raise KeyError(name)


CLASSES = ("Qwen3ForCausalLM", "Qwen2_5_VLForConditionalGeneration", "Mistral3ForConditionalGeneration",
           "Qwen3VLForConditionalGeneration")


def save_tiny_text_encoder(name: str, directory: Path) -> Path:
    model = tiny_text_encoder(name).to(torch.bfloat16).eval()
    model.save_pretrained(directory)
    return directory


class PromptEncoder:
    """A pipeline stand-in: ``encode_prompt`` runs ``text_encoder`` over the prompt's bytes, as a pipeline runs its
    text encoder over the tokenized prompt, and returns the last hidden state."""

    def __init__(self, text_encoder: nn.Module | None = None) -> None:
        self.text_encoder = text_encoder

    def encode_prompt(self, prompt: str, device: torch.device | str = "cpu") -> torch.Tensor:
        assert self.text_encoder is not None
        ids = torch.tensor([list(prompt.encode())], device=device) % 256
        return self.text_encoder(input_ids=ids, output_hidden_states=True).hidden_states[-1]
