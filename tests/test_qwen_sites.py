"""Qwen-Image sites beyond the pipelines' PNG test: the GELU site's fallbacks, the norm1 site's input-scale checks,
the query/key norm + rotary site beside hooks, the output bias moved into the kernel, and a full-size block on the
GPU."""

import pytest
import torch

from diffusers_nvfp4_fast import (
    disable_fast_paths,
    enable_fast_paths,
    fast_path_report,
)
from diffusers_nvfp4_fast.patches.qwenimage import patch_qwenimage
from support.fast_paths import (
    full_size_qwen_block,
    on_off,
    pipeline,
    qwen_rotary,
    sha,
    sha_one_step,
)

pytestmark = pytest.mark.usefixtures("fresh_verdicts")


def test_qwen_gelu_falls_back_where_the_kernel_differs_from_torch(modelopt_exports, monkeypatch):
    """Where the run-time check finds the kernel's GELU differing from torch's on some value of the dtype, every GELU
    site runs diffusers' op, counted with that reason, and the image is unchanged; a dropout in training mode before
    FC2 also keeps diffusers' op."""
    from diffusers_nvfp4_fast.patches import qwenimage

    pipe, kwargs = pipeline("qwen", modelopt_exports)
    off = sha(pipe, kwargs)
    monkeypatch.setattr(qwenimage, "triton_runs_on", lambda t: True)  # take the GPU branch of the gate on the CPU
    monkeypatch.setattr(qwenimage, "gelu_mismatch", lambda device, dtype: "7 of 65536 values differ")
    enable_fast_paths(pipe)
    on = sha(pipe, kwargs)
    report = fast_path_report(pipe)["QwenImageTransformer2DModel"]
    monkeypatch.undo()
    dropout = pipe.transformer.transformer_blocks[2].img_mlp.net[1]
    dropout.p, dropout.training = 0.1, True
    gate = qwenimage.gelu_fc2_reason(pipe.transformer.transformer_blocks[2].img_mlp, torch.zeros(2, 64).bfloat16())
    disable_fast_paths(pipe)
    assert on == off
    assert report["fallbacks"] == {"qwen_gelu: 7 of 65536 values differ": 12}  # 4 sites x 3 steps
    assert "qwen_gelu" not in report["fused_calls"] and report["fused_calls"]["qwen_resnorm"] == 12
    assert gate == "dropout in training mode"


def test_adaln_site_needs_equal_input_scales(modelopt_exports):
    """One quantized norm1 output serves query, key and value only when their input scales are equal: a stream whose
    scales differ gets no site (diffusers' ops run there, the image is unchanged)."""
    pipe, kwargs = pipeline("qwen", modelopt_exports)
    to_k = pipe.transformer.transformer_blocks[2].attn.to_k
    with torch.no_grad():
        to_k.input_scale.mul_(2.0)
    to_k.refresh_derived_scales_()
    off = sha_one_step(pipe, kwargs)
    report = enable_fast_paths(pipe)["QwenImageTransformer2DModel"]
    on = sha_one_step(pipe, kwargs)
    calls = fast_path_report(pipe)["QwenImageTransformer2DModel"]["fused_calls"]
    disable_fast_paths(pipe)
    assert on == off
    assert report["sites"]["qwen_adaln"] == 3 and calls["qwen_adaln"] == 3  # 3 streams, 1 step


def test_adaln_falls_back_after_scale_reload_or_processor_change(modelopt_exports):
    """Scales of a projection reloaded after enabling are checked again at the next call: the same values keep the
    site fused, another input scale (one quantized input can no longer serve all three projections) keeps diffusers'
    norm1 ops there; an attention processor whose code the fused path does not know does too, counted with its
    reason."""
    pipe, kwargs = pipeline("qwen", modelopt_exports)
    model = pipe.transformer
    off = sha_one_step(pipe, kwargs)
    enable_fast_paths(pipe)
    to_q = model.transformer_blocks[3].attn.to_q
    to_q.refresh_derived_scales_()  # a reload of the same values
    same = sha_one_step(pipe, kwargs)
    same_calls = fast_path_report(pipe)["QwenImageTransformer2DModel"]["fused_calls"]["qwen_adaln"]
    scale = to_q.input_scale.clone()
    to_q.input_scale.mul_(2)
    to_q.refresh_derived_scales_()  # a reload of another value
    reloaded = sha_one_step(pipe, kwargs)
    report = fast_path_report(pipe)["QwenImageTransformer2DModel"]
    disable_fast_paths(pipe)
    reloaded_off = sha_one_step(pipe, kwargs)
    to_q.input_scale.copy_(scale)
    to_q.refresh_derived_scales_()
    assert same == off and same_calls == 4 and reloaded == reloaded_off

    class OtherProcessor(type(model.transformer_blocks[2].attn.processor)):
        pass

    model.transformer_blocks[2].attn.set_processor(OtherProcessor())
    enable_fast_paths(pipe)
    other = sha_one_step(pipe, kwargs)
    other_report = fast_path_report(pipe)["QwenImageTransformer2DModel"]
    disable_fast_paths(pipe)
    assert other == off
    assert report["fallbacks"] == {"qwen_adaln: the input scales of to_q, to_k, to_v differ (one quantized input "
                                   "cannot serve all) (changed after enable_fast_paths)": 1}  # block 3's image stream
    assert report["fused_calls"]["qwen_adaln"] == 4 + 3  # the other three stay fused
    assert other_report["fallbacks"] == {"qwen_adaln: attention processor is OtherProcessor": 2}
    assert other_report["fused_calls"]["qwen_adaln"] == 2  # the other block's two streams


def test_qwen_qk_rotary_falls_back_where_a_hook_observes_the_norm(modelopt_exports):
    """A hook on a query/key norm must see the norm's own call: that tensor keeps diffusers' norm and rotary ops,
    counted with the reason; the other seven tensors stay fused and the image is unchanged."""
    pipe, kwargs = pipeline("qwen", modelopt_exports)
    seen = []
    norm = pipe.transformer.transformer_blocks[2].attn.norm_added_k
    off = sha_one_step(pipe, kwargs)
    enable_fast_paths(pipe)
    handle = norm.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    on = sha_one_step(pipe, kwargs)
    report = fast_path_report(pipe)["QwenImageTransformer2DModel"]
    handle.remove()
    disable_fast_paths(pipe)
    assert on == off and len(seen) == 1
    assert report["fallbacks"] == {"qwen_qk_rotary: hook on query/key norm: torch forward hook": 1}
    assert report["fused_calls"]["qwen_qk_rotary"] == 7


def test_qwen_attention_bias_moves_into_the_kernel(modelopt_exports, monkeypatch):
    """NVFP4 output projections with a bias skip it and the fused kernel adds it: PNG bytes unchanged, the kernel
    gets the bias, training-mode dropout keeps the bias in the projection, and disable restores the processor."""
    from diffusers_nvfp4_fast.linear import NVFP4Linear
    from diffusers_nvfp4_fast.ops.layer_norm_quantize import resnorm_quantize
    from diffusers_nvfp4_fast.patches import qwenimage

    pipe, kwargs = pipeline("qwen", modelopt_exports)
    model = pipe.transformer
    off = sha(pipe, kwargs)
    blocks = [model.transformer_blocks[i] for i in (2, 3)]
    assert all(isinstance(b.attn.to_out[0], NVFP4Linear) and b.attn.to_out[0].bias is not None for b in blocks)
    originals = [b.attn.processor for b in blocks]
    seen_bias = []
    impl = resnorm_quantize.impl  # (residual, x, bias, ...)
    monkeypatch.setattr(resnorm_quantize, "impl", lambda *args: seen_bias.append(args[2] is not None) or impl(*args))
    enable_fast_paths(pipe)
    assert all(isinstance(b.attn.processor, qwenimage.QwenDeferredBiasAttnProcessor) for b in blocks)
    assert all(qwenimage.bias_deferral_reason(b.attn) is None for b in blocks)
    assert sha(pipe, kwargs) == off
    assert seen_bias and all(seen_bias)

    # Dropout in training mode: the projections keep their bias and the kernel gets none.
    for b in blocks:
        b.attn.to_out[1].train()
        b.attn.to_out[1].p = 0.5
    assert all(qwenimage.bias_deferral_reason(b.attn) == "dropout in training mode" for b in blocks)
    for b in blocks:
        b.attn.to_out[1].eval()
        b.attn.to_out[1].p = 0.0

    disable_fast_paths(pipe)
    assert all(b.attn.processor is p for b, p in zip(blocks, originals))
    assert sha(pipe, kwargs) == off


@pytest.mark.gpu
@torch.inference_mode()
def test_gpu_full_size_qwen_block_identical():
    dim = 3072
    block, holder = full_size_qwen_block()
    rotary = qwen_rotary(4096, 512)
    for batch in (1, 2):
        img = torch.randn(batch, 4096, dim, device="cuda", dtype=torch.bfloat16)
        txt = torch.randn(batch, 512, dim, device="cuda", dtype=torch.bfloat16)
        temb = torch.randn(batch, dim, device="cuda", dtype=torch.bfloat16)
        stats, off, on = on_off(holder, patch_qwenimage, lambda: block(img, txt, None, temb, rotary),
                                 {"qwen_resnorm": 1, "qwen_gelu": 2, "qwen_adaln": 2, "qwen_qk_rotary": 1})
        for kind in ("qwen_resnorm", "qwen_gelu", "qwen_adaln"):  # both streams
            assert stats.fused_calls[kind] == 2 and stats.verified[kind] == 2, stats
        assert stats.fused_calls["qwen_qk_rotary"] == 4 and stats.verified["qwen_qk_rotary"] == 4, stats  # q, k
        assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1])
