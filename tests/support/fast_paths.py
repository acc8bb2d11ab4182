"""What the fast-path test files share: the tiny pipelines from the ModelOpt exports, PNG hashes of a generation,
a holder that gives a lone block the attribute the model patchers walk, and full-size blocks and rotary tables for the
GPU cases."""

from __future__ import annotations

import torch
from torch import nn

from diffusers_nvfp4_fast.ops.qk_norm_rotary import probe_inputs
from diffusers_nvfp4_fast.ops.verify import new_stats
from diffusers_nvfp4_fast.testing import export
from diffusers_nvfp4_fast.utils import png_sha256, run_pipeline
from support.modelopt_exports import nvfp4_pipeline


def pipeline(which, modelopt_exports):
    return nvfp4_pipeline(which, modelopt_exports(which))


def sha(pipe, kwargs):
    return png_sha256(run_pipeline(pipe, kwargs))


def sha_one_step(pipe, kwargs):
    return png_sha256(run_pipeline(pipe, kwargs, steps=1))


class Holder(nn.Module):
    """Gives a lone block the attribute the model patchers walk."""

    def __init__(self, name: str, block: nn.Module):
        super().__init__()
        setattr(self, name, nn.ModuleList([block]))


def on_off(holder, patcher, call, sites: dict):
    """(stats, output unpatched, output with ``patcher``'s sites installed, verification on every call)."""
    off = call()
    stats_id, stats = new_stats("always")
    restore: list = []
    assert patcher(holder, stats_id, restore) == sites
    on = call()
    for undo in restore:
        undo()
    return stats, off, on


def rotary_tables(seq: int, dim: int = 128):
    """FP32 (cos, sin) ``[seq, dim]`` with each angle repeated per pair, as FLUX.2's position embedding builds them."""
    angles = torch.arange(seq, device="cuda").float()[:, None] * torch.rand(dim // 2, device="cuda")
    angles = angles.repeat_interleave(2, dim=1)
    return angles.cos(), angles.sin()


def full_size_qwen_block():
    """(block, holder): one Qwen-Image block at full width (3072, 24 x 128 heads), NVFP4, on the GPU; seed 0."""
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock

    torch.manual_seed(0)
    block = QwenImageTransformerBlock(dim=3072, num_attention_heads=24, attention_head_dim=128)
    block = block.to("cuda", torch.bfloat16)
    holder = Holder("transformer_blocks", block)
    export.quantize_model_inplace(holder, (), 16.0)
    return block, holder


def qwen_rotary(img_tokens: int, txt_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen-Image-like complex64 rotary factors ``([img_tokens, 64], [txt_tokens, 64])`` on the GPU."""
    _, _, img = probe_inputs(1, img_tokens, 1, device="cuda", seed=1)
    _, _, txt = probe_inputs(1, txt_tokens, 1, device="cuda", seed=2)
    return img, txt
