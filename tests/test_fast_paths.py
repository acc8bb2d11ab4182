"""``enable_fast_paths`` on whole models and pipelines: same PNG bytes on and off, every patched object put back,
per-instance patching, the report. CPU tests run the torch-reference ops; the ``gpu`` case runs the kernels in the
tiny pipelines. Hooks and processors: test_hooks_and_processors.py; verification: test_verification.py; compile and
CUDA graphs: test_compiled_fast_paths.py; per-model sites: test_flux2_sites.py, test_qwen_sites.py."""

import pytest

from diffusers_nvfp4_fast import (
    disable_fast_paths,
    enable_fast_paths,
    fast_path_report,
    fast_paths,
    load_nvfp4_transformer,
)
from diffusers_nvfp4_fast.testing import tiny
from diffusers_nvfp4_fast.utils import png_sha256, run_pipeline
from support.fast_paths import (
    pipeline,
    sha,
)

pytestmark = pytest.mark.usefixtures("fresh_verdicts")

# 2 single blocks; 1 double block: ff and ff_context (SwiGLU, residual-norm), its attention (rotary); norm1 of
# each single block and of both double-block streams (adaptive LayerNorm)
FLUX2_SITES = {"flux2_token_cat": 2, "flux2_rotary": 3, "flux2_swiglu": 2, "flux2_resnorm": 2, "flux2_adaln": 4}
# 2 NVFP4 Qwen blocks: 2 feed-forwards each (GELU), 2 streams' query/key/value each (adaptive LayerNorm), one
# attention processor each (query/key norm + rotary)
QWEN_SITES = {"qwen_resnorm": 2, "qwen_gelu": 4, "qwen_adaln": 4, "qwen_qk_rotary": 2}
SITES = {"flux2": FLUX2_SITES, "klein": FLUX2_SITES, "qwen": QWEN_SITES}
FLUX2_CALLS = {"flux2_token_cat_swiglu": 2, "flux2_swiglu": 2, "flux2_rotary": 6,  # per forward (query and key)
               "flux2_resnorm": 2, "flux2_adaln": 4}
CALLS_PER_FORWARD = {"flux2": FLUX2_CALLS, "klein": FLUX2_CALLS,
                     "qwen": {"qwen_resnorm": 4, "qwen_gelu": 4, "qwen_adaln": 4,  # qwen: 2 streams,
                              "qwen_qk_rotary": 8}}  # query and key of each



def _originals(model):
    blocks = [*getattr(model, "single_transformer_blocks", []), *getattr(model, "transformer_blocks", [])]
    procs = [b.attn.processor for b in blocks]
    forwards = [b.__dict__.get("forward") for b in getattr(model, "transformer_blocks", [])]
    return procs, forwards


@pytest.mark.parametrize("which", ["flux2", "klein", "qwen"])
def test_png_identical_on_off_and_restored(which, modelopt_exports):
    pipe, kwargs = pipeline(which, modelopt_exports)
    model = pipe.transformer
    off = sha(pipe, kwargs)
    procs, forwards = _originals(model)
    report = enable_fast_paths(pipe)
    entry = report[type(model).__name__]
    assert entry["enabled"] and entry["sites"] == SITES[which]
    on = sha(pipe, kwargs)
    entry = fast_path_report(pipe)[type(model).__name__]
    disable_fast_paths(pipe)
    assert on == off
    model_calls = 3 * (2 if which == "klein" else 1)  # 3 steps; klein runs CFG: two transformer calls per step
    assert entry["fused_calls"] == {kind: model_calls * n for kind, n in CALLS_PER_FORWARD[which].items()}
    assert entry["verifications"]["passed"] == len(CALLS_PER_FORWARD[which]) and entry["verifications"]["failed"] == 0
    assert entry["fallbacks"] == {}
    new_procs, new_forwards = _originals(model)
    assert all(a is b for a, b in zip(procs, new_procs)) and new_forwards == forwards
    assert not hasattr(model, "_nvfp4_fast_paths") and fast_path_report(pipe)[type(model).__name__]["enabled"] is False
    assert sha(pipe, kwargs) == off


def test_patched_objects_are_replaced_per_instance(modelopt_exports):
    from diffusers.models.transformers.transformer_flux2 import Flux2ParallelSelfAttnProcessor
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock

    flux = load_nvfp4_transformer(modelopt_exports("flux2"))
    qwen = load_nvfp4_transformer(modelopt_exports("qwen"))
    class_forward = QwenImageTransformerBlock.forward
    with fast_paths(flux), fast_paths(qwen):
        assert all(type(b.attn.processor) is not Flux2ParallelSelfAttnProcessor for b in flux.single_transformer_blocks)
        patched = [i for i, b in enumerate(qwen.transformer_blocks) if "forward" in b.__dict__]
        assert patched == [2, 3]  # blocks 0, 1, 4, 5 are BF16 in the checkpoint and stay untouched
        assert QwenImageTransformerBlock.forward is class_forward
    assert all(type(b.attn.processor) is Flux2ParallelSelfAttnProcessor for b in flux.single_transformer_blocks)
    assert not any("forward" in b.__dict__ for b in qwen.transformer_blocks)


def test_no_nvfp4_layers_warns_and_changes_nothing():
    model = tiny.tiny_flux2_transformer(True)
    procs = [b.attn.processor for b in model.single_transformer_blocks]
    with pytest.warns(UserWarning, match="no NVFP4 layers"):
        enable_fast_paths(model)
    assert [b.attn.processor for b in model.single_transformer_blocks] == procs
    assert not hasattr(model, "_nvfp4_fast_paths")


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["flux2", "klein", "qwen"])
def test_gpu_tiny_pipeline_png_identical_on_gpu(which, modelopt_exports):
    model = load_nvfp4_transformer(modelopt_exports(which), device="cuda")
    pipe, kwargs = tiny.TINY_PIPELINES[which](model)
    pipe.to("cuda")
    pipe.set_progress_bar_config(disable=True)
    off = png_sha256(run_pipeline(pipe, kwargs))
    report = enable_fast_paths(pipe)
    on = png_sha256(run_pipeline(pipe, kwargs))
    report = fast_path_report(pipe)
    disable_fast_paths(pipe)
    assert on == off
    entry = next(iter(report.values()))
    assert sum(entry["fused_calls"].values()) > 0 and entry["verifications"]["failed"] == 0, report
