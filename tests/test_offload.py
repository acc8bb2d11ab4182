"""Every diffusers offload mode with fast paths on gives the PNG of the same pipeline without offload: model CPU
offload, sequential CPU offload, group offloading at block level and at leaf level with CUDA streams (``gpu``). On the
CPU, group offloading (onload and offload device both the CPU) still wraps every module in hooks, which the fused
paths must call through; and the report names the backend that runs, not the one of the offloaded weights."""

from __future__ import annotations

import pytest
import torch

from diffusers_nvfp4_fast import disable_fast_paths, enable_fast_paths, fast_path_report
from diffusers_nvfp4_fast.utils import png_sha256, run_pipeline
from support.modelopt_exports import nvfp4_pipeline

pytestmark = pytest.mark.usefixtures("fresh_verdicts")

MODEL_CLASS = {"flux2": "Flux2Transformer2DModel", "qwen": "QwenImageTransformer2DModel"}
SITE = {"flux2": "flux2_token_cat_swiglu", "qwen": "qwen_resnorm"}


def _pipeline(which, modelopt_exports):
    return nvfp4_pipeline(which, modelopt_exports(which))


@pytest.mark.parametrize("level", ["block_level", "leaf_level"])
@pytest.mark.parametrize("which", ["flux2", "qwen"])
def test_group_offload_hooks_on_cpu(which, level, modelopt_exports):
    pipe, kwargs = _pipeline(which, modelopt_exports)
    want = png_sha256(run_pipeline(pipe, kwargs))
    enable_fast_paths(pipe)
    kw = {"num_blocks_per_group": 1} if level == "block_level" else {}
    pipe.transformer.enable_group_offload(torch.device("cpu"), offload_device=torch.device("cpu"),
                                          offload_type=level, **kw)
    assert png_sha256(run_pipeline(pipe, kwargs)) == want
    report = fast_path_report(pipe)[MODEL_CLASS[which]]
    assert report["fused_calls"].get(SITE[which], 0) > 0, report
    disable_fast_paths(pipe)


OFFLOAD_MODES = {
    "model_cpu_offload": lambda pipe: pipe.enable_model_cpu_offload(device="cuda"),
    "sequential_cpu_offload": lambda pipe: pipe.enable_sequential_cpu_offload(device="cuda"),
    "group_block_level": lambda pipe: pipe.transformer.enable_group_offload(
        torch.device("cuda"), offload_device=torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1),
    "group_leaf_level_stream": lambda pipe: pipe.transformer.enable_group_offload(
        torch.device("cuda"), offload_device=torch.device("cpu"), offload_type="leaf_level", use_stream=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("mode", sorted(OFFLOAD_MODES))
@pytest.mark.parametrize("which", ["flux2", "qwen"])
def test_gpu_offload_modes_png_identical(which, mode, modelopt_exports):
    pipe, kwargs = _pipeline(which, modelopt_exports)
    pipe.to("cuda")
    enable_fast_paths(pipe)
    want = png_sha256(run_pipeline(pipe, kwargs))
    disable_fast_paths(pipe)

    pipe, kwargs = _pipeline(which, modelopt_exports)
    enable_fast_paths(pipe)
    if mode.startswith("group"):
        pipe.to("cuda")
        pipe.transformer.to("cpu")
    OFFLOAD_MODES[mode](pipe)
    got = png_sha256(run_pipeline(pipe, kwargs))
    report = fast_path_report(pipe)[MODEL_CLASS[which]]
    assert got == want, report
    assert report["gemm_backend"] == "triton", report
    assert report["fused_calls"].get(SITE[which], 0) > 0, report
