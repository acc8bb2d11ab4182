"""First-use verification and the report's counters (docs/design.md §8): a fused path whose bytes differ falls
back with a warning, the verify modes, gate reasons counted, the verification key, and the suite's check that no op
returns an input."""

import os

import pytest
import torch

from diffusers_nvfp4_fast import (
    caches,
    disable_fast_paths,
    enable_fast_paths,
    fast_path_report,
    load_nvfp4_transformer,
)
from diffusers_nvfp4_fast.ops import quantize as quantize_op
from diffusers_nvfp4_fast.ops import swiglu_quantize as swiglu_op
from diffusers_nvfp4_fast.ops import token_cat_quantize as token_cat_op
from diffusers_nvfp4_fast.testing import tiny
from diffusers_nvfp4_fast.utils import run_pipeline
from support.fast_paths import (
    pipeline,
    sha,
)

pytestmark = pytest.mark.usefixtures("fresh_verdicts")


def _flip_first_byte(packed: torch.Tensor) -> torch.Tensor:
    packed = packed.clone()
    packed[0, 0] ^= 0x11
    return packed


def test_verification_mismatch_falls_back_with_a_warning(modelopt_exports, monkeypatch):
    """A single-stream site whose SwiGLU fold fails verification keeps the plain fused token-cat path."""
    pipe, kwargs = pipeline("flux2", modelopt_exports)
    off = sha(pipe, kwargs)
    good = swiglu_op.swiglu_quantize.impl

    def broken(hidden, attn, g, fast_math):
        packed, scales = good(hidden, attn, g, fast_math)
        return (packed if attn is None else _flip_first_byte(packed)), scales

    monkeypatch.setattr(swiglu_op.swiglu_quantize, "impl", broken)
    enable_fast_paths(pipe)
    with pytest.warns(RuntimeWarning, match=r"flux2_token_cat_swiglu .*\(packed: 1 of \d+ bytes differ"):
        on = sha(pipe, kwargs)
    report = fast_path_report(pipe)["Flux2Transformer2DModel"]
    disable_fast_paths(pipe)
    assert on == off
    assert report["verifications"]["failed"] == 1 and "flux2_token_cat_swiglu" not in report["fused_calls"]
    # the later 5 of 6 single-stream calls run the plain token-cat
    assert report["fused_calls"] == {"flux2_swiglu": 6, "flux2_rotary": 18, "flux2_token_cat": 5, "flux2_resnorm": 6,
                                     "flux2_adaln": 12}
    assert report["fallbacks"] == {"flux2_token_cat_swiglu: verification failed earlier in this process": 5}


def test_token_cat_mismatch_falls_back_to_diffusers(modelopt_exports, monkeypatch):
    """With SwiGLU not foldable (a hook on the activation), the plain token-cat path runs, and falls back to
    diffusers' code once its verification fails."""
    pipe, kwargs = pipeline("flux2", modelopt_exports)
    off = sha(pipe, kwargs)

    def broken(attn, mlp, g, fast_math):
        cat = torch.cat([attn, mlp], -1)
        packed, scales = quantize_op.quantize(cat.reshape(-1, cat.shape[-1]), g, fast_math)
        return _flip_first_byte(packed), scales

    monkeypatch.setattr(token_cat_op.token_cat_quantize, "impl", broken)
    blocks = pipe.transformer.single_transformer_blocks
    handles = [b.attn.mlp_act_fn.register_forward_hook(lambda *_: None) for b in blocks]
    enable_fast_paths(pipe)
    with pytest.warns(RuntimeWarning, match=r"flux2_token_cat .*\(packed: 1 of \d+ bytes differ"):
        on = sha(pipe, kwargs)
    report = fast_path_report(pipe)["Flux2Transformer2DModel"]
    disable_fast_paths(pipe)
    for handle in handles:
        handle.remove()
    assert on == off
    assert report["verifications"]["failed"] == 1
    assert report["fused_calls"] == {"flux2_swiglu": 6, "flux2_rotary": 18, "flux2_resnorm": 6, "flux2_adaln": 12}
    assert report["fallbacks"]["flux2_token_cat_swiglu: hook on act_fn: torch forward hook"] == 6
    assert report["fallbacks"]["flux2_token_cat: verification failed earlier in this process"] == 5


def test_verify_always_and_off(modelopt_exports):
    pipe, kwargs = pipeline("qwen", modelopt_exports)
    off = sha(pipe, kwargs)
    enable_fast_paths(pipe, verify="always")
    assert sha(pipe, kwargs) == off
    passed = 60  # every call: 3 steps x (4 residual-norm + 4 GELU + 4 adaptive-LayerNorm + 8 QK-norm calls)
    assert fast_path_report(pipe)["QwenImageTransformer2DModel"]["verifications"]["passed"] == passed
    enable_fast_paths(pipe, verify="off")  # enabling again only changes the mode
    assert sha(pipe, kwargs) == off
    assert fast_path_report(pipe)["QwenImageTransformer2DModel"]["verifications"]["passed"] == passed
    disable_fast_paths(pipe)
    with pytest.raises(ValueError, match="verify"):
        enable_fast_paths(pipe, verify="sometimes")


def test_gate_reasons_are_counted(modelopt_exports):
    model = load_nvfp4_transformer(modelopt_exports("qwen"))
    model.transformer_blocks[3].txt_mlp.net[0].proj.dynamic_input_scale = True
    pipe, kwargs = tiny.TINY_PIPELINES["qwen"](model)
    pipe.set_progress_bar_config(disable=True)
    enable_fast_paths(pipe)
    run_pipeline(pipe, kwargs)
    report = fast_path_report(pipe)["QwenImageTransformer2DModel"]
    disable_fast_paths(pipe)
    assert report["fallbacks"] == {"qwen_resnorm: FC1 uses a dynamic input scale": 3}
    assert report["fused_calls"]["qwen_resnorm"] == 9


def test_remembered_call_class_is_the_verification_key():
    """``fused.call_class`` (the memo every checked call asks) gives ``verification_key``'s string for every argument
    it depends on: dtype, rank, trailing width, layout, scalar tensors, device, and plain values that compare equal
    but print differently (0.0 / -0.0, True / 1); an unhashable plain value falls back to the string itself."""
    from diffusers_nvfp4_fast.ops import fused

    x = torch.zeros(2, 8, 16, dtype=torch.bfloat16)
    variants = [
        (x, 1e-6, True), (x, 1e-6, 1), (x, 0.0, True), (x, -0.0, True), (x.float(), 1e-6, True),
        (x[..., :8], 1e-6, True), (x.transpose(0, 1), 1e-6, True), (x.reshape(16, 16), 1e-6, True),
        (torch.tensor(1.0), x, None), (x, torch.tensor(1.0), None), (x, torch.zeros(1), "a"), (x, [1, 2], None),
        (x, x.to("meta"), None), (None, 3, x),
    ]
    caches.reset("ops.fused.verification_keys")
    for _ in range(2):  # computed, then remembered
        for args in variants:
            assert fused.call_class("op", args) == fused.verification_key("op", args), args
    keys = [fused.verification_key("op", a) for a in variants]
    assert len(set(keys)) == len(keys)


def test_ops_that_return_an_input_are_refused_under_the_suite():
    """The plain registration (``dispatch.define_op``) does not check aliasing itself; with the suite's
    ``DIFFUSERS_NVFP4_CHECK_OPS=1`` an op whose output shares an input's storage raises, naming the op."""
    from diffusers_nvfp4_fast.ops import dispatch
    from diffusers_nvfp4_fast.switches import CHECK_OPS

    assert os.environ.get(CHECK_OPS) == "1"

    def fresh(x: torch.Tensor, scale: float) -> torch.Tensor:
        return x * scale

    def returns_view(x: torch.Tensor, scale: float) -> torch.Tensor:
        return x[1:]

    fresh_op = dispatch.define_op("test_fresh_output", fresh, lambda x, scale: x.new_empty(x.shape))
    view_op = dispatch.define_op("test_view_output", returns_view, lambda x, scale: x.new_empty(x[1:].shape))
    x = torch.arange(4.0)
    assert torch.equal(fresh_op(x, 2.0), x * 2)
    with pytest.raises(RuntimeError, match="nvfp4_fast::test_view_output: output"):
        view_op(x, 2.0)
