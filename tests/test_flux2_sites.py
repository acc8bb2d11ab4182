"""FLUX.2 sites beyond the pipelines' PNG test: the norm1 site's fallbacks, the KV-cache processors, the query/key
norm + rotary site on heads 128 wide (the real models'), and full-size FLUX.2-dev blocks on the GPU."""

import pytest
import torch
from torch import nn

from diffusers_nvfp4_fast import (
    disable_fast_paths,
    enable_fast_paths,
    fast_path_report,
)
from diffusers_nvfp4_fast.ops.verify import new_stats
from diffusers_nvfp4_fast.patches.flux2 import patch_flux2
from diffusers_nvfp4_fast.testing import export, tiny
from support.fast_paths import (
    Holder,
    on_off,
    pipeline,
    rotary_tables,
    sha,
    sha_one_step,
)

pytestmark = pytest.mark.usefixtures("fresh_verdicts")


def test_flux2_adaln_falls_back_when_a_projection_is_replaced(modelopt_exports):
    """A projection replaced after enabling (as a LoRA wrapper does) keeps the unfused norm1 for its stream."""
    pipe, kwargs = pipeline("flux2", modelopt_exports)
    attn = pipe.transformer.transformer_blocks[0].attn
    off = sha_one_step(pipe, kwargs)
    enable_fast_paths(pipe)
    original = attn.to_v
    attn.to_v = torch.nn.Sequential(original)  # same output, another module
    on = sha_one_step(pipe, kwargs)
    report = fast_path_report(pipe)["Flux2Transformer2DModel"]
    attn.to_v = original
    disable_fast_paths(pipe)
    assert on == off
    assert report["fallbacks"] == {"flux2_adaln: to_v is not an NVFP4Linear": 1}
    assert report["fused_calls"]["flux2_adaln"] == 3  # 2 single blocks + the text stream


def test_kv_cache_processor_variant_is_patched_too(modelopt_exports):
    from diffusers.models.transformers.transformer_flux2 import Flux2KVParallelSelfAttnProcessor

    from diffusers_nvfp4_fast.patches.flux2 import Flux2FusedKVParallelSelfAttnProcessor

    pipe, kwargs = pipeline("klein", modelopt_exports)
    originals = []
    for block in pipe.transformer.single_transformer_blocks:
        block.attn.set_processor(Flux2KVParallelSelfAttnProcessor())
        originals.append(block.attn.processor)
    off = sha(pipe, kwargs)
    enable_fast_paths(pipe)
    blocks = pipe.transformer.single_transformer_blocks
    assert all(type(b.attn.processor) is Flux2FusedKVParallelSelfAttnProcessor for b in blocks)
    on = sha(pipe, kwargs)
    disable_fast_paths(pipe)
    assert on == off
    assert all(b.attn.processor is p for b, p in zip(pipe.transformer.single_transformer_blocks, originals))


def _flux2_block_with_128_wide_heads(kind: str):
    """(holder, call) for a BF16 NVFP4 FLUX.2 block on the CPU with two heads of 128 (the real models' width; the
    tiny pipelines' heads are 16 wide), random RMSNorm weights, and a call on 24 image + 8 text tokens."""
    from diffusers.models.transformers.transformer_flux2 import Flux2SingleTransformerBlock, Flux2TransformerBlock

    torch.manual_seed(0)
    dim, rows_img, rows_txt = 256, 24, 8
    cls = Flux2TransformerBlock if kind == "double" else Flux2SingleTransformerBlock
    block = cls(dim=dim, num_attention_heads=2, attention_head_dim=128, mlp_ratio=3.0).to(torch.bfloat16)
    holder = Holder("transformer_blocks" if kind == "double" else "single_transformer_blocks", block)
    export.quantize_model_inplace(holder, (), 12.0)
    for module in block.modules():
        if isinstance(module, nn.RMSNorm):
            module.weight.data.normal_(1.0, 0.3)  # negative entries too: zeros of both signs reach the rotary
    angles = torch.arange(rows_img + rows_txt).float()[:, None] * torch.rand(64) * 50
    rotary = tuple(t.repeat_interleave(2, dim=1) for t in (angles.cos(), angles.sin()))
    img = torch.randn(1, rows_img, dim, dtype=torch.bfloat16)
    img[0, 3] = 0.0  # a zero row: its normalized query and key are signed zeros
    txt = torch.randn(1, rows_txt, dim, dtype=torch.bfloat16)
    if kind == "double":
        temb = torch.randn(1, 6 * dim, dtype=torch.bfloat16) * 0.1
        return holder, lambda: torch.cat([t.flatten() for t in block(img, txt, temb, temb, image_rotary_emb=rotary)])
    temb = torch.randn(1, 3 * dim, dtype=torch.bfloat16) * 0.1
    return holder, lambda: block(torch.cat([txt, img], dim=1), None, temb, image_rotary_emb=rotary)


@pytest.mark.parametrize("kind", ["double", "single"])
@torch.inference_mode()
def test_flux2_qk_rotary_site_with_128_wide_heads(kind):
    """Query/key norm + rotary as site ``flux2_qk_rotary``: in a double-stream block each stream is normalized and
    rotated with its rows of the joint tables, then joined. On the CPU the op runs its torch reference, so this checks
    the wiring against diffusers' order (norm, join, rotate); the kernel is checked in test_qk_norm_rotary.py."""
    holder, call = _flux2_block_with_128_wide_heads(kind)
    sites = ({"flux2_swiglu": 2, "flux2_rotary": 1, "flux2_qk_rotary": 1, "flux2_resnorm": 2, "flux2_adaln": 2}
             if kind == "double" else {"flux2_token_cat": 1, "flux2_rotary": 1, "flux2_qk_rotary": 1, "flux2_adaln": 1})
    stats, off, on = on_off(holder, patch_flux2, call, sites)
    calls = 4 if kind == "double" else 2
    assert stats.fused_calls["flux2_qk_rotary"] == calls and stats.verified["flux2_qk_rotary"] == calls, stats
    assert "flux2_rotary" not in stats.fused_calls and not stats.fallbacks, stats
    assert torch.equal(on.view(torch.int16), off.view(torch.int16))


@torch.inference_mode()
def test_flux2_pipeline_png_identical_with_the_qk_site():
    """The FLUX.2 pipeline with heads 128 wide (the real models' width, where ``flux2_qk_rotary`` installs; the tiny
    pipelines' heads are 16 wide): the PNG with fast paths on equals the one with them off, the QK site fused on
    every call and verified, nothing falling back."""
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(0)
    model = Flux2Transformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=2, attention_head_dim=128, num_attention_heads=2,
        joint_attention_dim=48, timestep_guidance_channels=256, axes_dims_rope=[32, 32, 32, 32], guidance_embeds=True,
    ).to(torch.bfloat16).eval()
    export.quantize_model_inplace(model, tiny.TINY_EXCLUDES["flux2"], 12.0)
    for module in model.modules():
        if isinstance(module, nn.RMSNorm):
            module.weight.data.normal_(1.0, 0.3)
    pipe, kwargs = tiny.tiny_flux2_pipeline(model)
    off = sha(pipe, kwargs)
    enable_fast_paths(pipe)
    on = sha(pipe, kwargs)
    entry = fast_path_report(pipe)[type(model).__name__]
    disable_fast_paths(pipe)
    assert on == off
    # 3 steps x (the double block's two streams' query and key, 4, + each single block's query and key, 2 x 2)
    assert entry["fused_calls"]["flux2_qk_rotary"] == 3 * 8 and entry["fallbacks"] == {}, entry
    assert entry["verifications"]["failed"] == 0


@torch.inference_mode()
def test_flux2_qk_rotary_falls_back_where_a_hook_observes_the_norm():
    """A hook on one query/key norm: the whole attention keeps diffusers' norms (the rotary alone in one kernel),
    counted once with the reason; the bytes are unchanged."""
    holder, call = _flux2_block_with_128_wide_heads("double")
    seen = []
    handle = holder.transformer_blocks[0].attn.norm_added_k.register_forward_hook(lambda m, a, out: seen.append(1))
    stats, off, on = on_off(holder, patch_flux2, call, {"flux2_swiglu": 2, "flux2_rotary": 1, "flux2_qk_rotary": 1,
                                                         "flux2_resnorm": 2, "flux2_adaln": 2})
    handle.remove()
    assert len(seen) == 2  # off and on
    assert stats.fallbacks == {"flux2_qk_rotary: hook on query/key norm: torch forward hook": 1}, stats
    assert stats.fused_calls["flux2_rotary"] == 2 and "flux2_qk_rotary" not in stats.fused_calls, stats
    assert torch.equal(on.view(torch.int16), off.view(torch.int16))


@torch.inference_mode()
def test_flux2_qk_rotary_falls_back_where_a_norm_is_replaced_after_enabling():
    """The new module's call is what runs (no kernel with the old weight), counted with the reason."""
    holder, call = _flux2_block_with_128_wide_heads("single")
    stats_id, stats = new_stats("always")
    restore: list = []
    patch_flux2(holder, stats_id, restore)
    holder.single_transformer_blocks[0].attn.norm_k = nn.Identity()
    on = call()
    for undo in restore:
        undo()
    assert stats.fallbacks == {"flux2_qk_rotary: query/key norm is Identity, not an RMSNorm over 128 values with a "
                               "weight and an eps": 1}, stats
    assert stats.fused_calls["flux2_rotary"] == 2, stats
    assert torch.equal(on.view(torch.int16), call().view(torch.int16))  # unpatched, with the identity key norm


@pytest.mark.gpu
@torch.inference_mode()
def test_gpu_full_size_flux2_dev_single_block_identical():
    from diffusers.models.transformers.transformer_flux2 import Flux2SingleTransformerBlock

    torch.manual_seed(0)
    dim, rows_img, rows_txt = 6144, 4096, 512
    block = Flux2SingleTransformerBlock(dim=dim, num_attention_heads=48, attention_head_dim=128, mlp_ratio=3.0)
    block = block.to("cuda", torch.bfloat16)
    holder = Holder("single_transformer_blocks", block)
    assert export.quantize_model_inplace(holder, (), 12.0) == 2
    rotary = rotary_tables(rows_img + rows_txt)
    for batch in (1, 2):
        h = torch.randn(batch, rows_img + rows_txt, dim, device="cuda", dtype=torch.bfloat16)
        temb = torch.randn(batch, 3 * dim, device="cuda", dtype=torch.bfloat16) * 0.1
        stats, off, on = on_off(holder, patch_flux2, lambda: block(h, None, temb, image_rotary_emb=rotary),
                                 {"flux2_token_cat": 1, "flux2_rotary": 1, "flux2_qk_rotary": 1, "flux2_adaln": 1})
        for kind, calls in (("flux2_token_cat_swiglu", 1), ("flux2_qk_rotary", 2), ("flux2_adaln", 1)):
            assert stats.fused_calls[kind] == calls and stats.verified[kind] == calls, stats
        assert "flux2_rotary" not in stats.fused_calls, stats  # the QK kernel rotates too
        assert torch.equal(on, off)


@pytest.mark.gpu
@torch.inference_mode()
def test_gpu_full_size_flux2_dev_double_block_identical():
    """The adaptive-LayerNorm kernel before both streams' query/key/value, the residual-norm kernel and SwiGLU
    quantize in both feed-forwards and the rotary embedding of a FLUX.2-dev double-stream block (4096 image + 512 text
    rows)."""
    from diffusers.models.transformers.transformer_flux2 import Flux2TransformerBlock

    torch.manual_seed(0)
    dim = 6144
    block = Flux2TransformerBlock(dim=dim, num_attention_heads=48, attention_head_dim=128, mlp_ratio=3.0)
    block = block.to("cuda", torch.bfloat16)
    holder = Holder("transformer_blocks", block)
    export.quantize_model_inplace(holder, (), 12.0)
    rotary = rotary_tables(512 + 4096)
    for batch in (1, 2):
        img = torch.randn(batch, 4096, dim, device="cuda", dtype=torch.bfloat16)
        txt = torch.randn(batch, 512, dim, device="cuda", dtype=torch.bfloat16)
        temb = torch.randn(batch, 6 * dim, device="cuda", dtype=torch.bfloat16) * 0.1
        stats, off, on = on_off(holder, patch_flux2, lambda: block(img, txt, temb, temb, image_rotary_emb=rotary),
                                 {"flux2_swiglu": 2, "flux2_rotary": 1, "flux2_qk_rotary": 1, "flux2_resnorm": 2,
                                  "flux2_adaln": 2})
        for kind in ("flux2_swiglu", "flux2_resnorm", "flux2_adaln"):  # both streams
            assert stats.fused_calls[kind] == 2 and stats.verified[kind] == 2, stats
        assert stats.fused_calls["flux2_qk_rotary"] == 4 and stats.verified["flux2_qk_rotary"] == 4, stats
        assert "flux2_rotary" not in stats.fused_calls, stats
        assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1])
