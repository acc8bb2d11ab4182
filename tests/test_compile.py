"""Whole NVFP4 transformers under ``compile_repeated_blocks`` inside ``exact_inductor`` (GPU): compiled twice gives
the same bytes, compiled with fast paths on gives the bytes of compiled off, and the CUDA-graph runner replays the
compiled forward byte for byte. Full width, fewer blocks than the real models (the compiled code of a block class is
the same for every block; the count only changes the run time). The full-size figures: bench_transformer_step.py
--compile blocks, which also checks on == off and compiled-twice, and records dynamo's counters."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

CONFIGS = {
    "qwen-image": dict(num_layers=6),  # blocks 2 and 3 are NVFP4 under the public exclusion rule
    "flux2-dev": dict(num_layers=2, num_single_layers=4),
}


def _model(name: str):
    import diffusers
    from accelerate import init_empty_weights
    from bench_transformer_step import MODELS, make_inputs, materialize

    with init_empty_weights(include_buffers=False):
        model = getattr(diffusers, MODELS[name]["cls"])(**CONFIGS[name]).eval()
    materialize(model, name, torch.device("cuda"), nvfp4=True)
    return model.eval(), make_inputs(name, model, 1024, 1024, 512, "cuda")


def _compiled_run(model, inputs, fresh: bool = False) -> torch.Tensor:
    """Compile (``fresh``: with inductor's caches off, so that nothing of an earlier compile is reused) and run twice;
    the second output."""
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    with inductor_config.patch(force_disable_caches=fresh):
        model.compile_repeated_blocks(fullgraph=True)
        with torch.inference_mode():
            for _ in range(2):
                out = model(**inputs)[0]
    return out.clone()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpu_compiled_twice_and_on_equal_off(name):
    import torch._inductor.config as inductor_config

    from diffusers_nvfp4_fast import disable_fast_paths, enable_fast_paths, exact_inductor, fast_path_report
    from diffusers_nvfp4_fast.graphs import capture_cuda_graphs, graph_report, release_cuda_graphs

    model, inputs = _model(name)
    with exact_inductor():
        off = _compiled_run(model, inputs)
        off_again = _compiled_run(model, inputs, fresh=True)
        enable_fast_paths(model)
        on = _compiled_run(model, inputs, fresh=True)
        with inductor_config.patch(post_grad_custom_pre_pass=None):  # each layer quantizes its own input
            on_unshared = _compiled_run(model, inputs, fresh=True)
        counters = {k: dict(v) for k, v in torch._dynamo.utils.counters.items()}
        capture_cuda_graphs(model)
        with torch.inference_mode():
            replays = [model(**inputs)[0] for _ in range(3)]
        report = graph_report(model)
        fused = fast_path_report(model)[type(model).__name__]["fused_calls"]
        release_cuda_graphs(model)
        disable_fast_paths(model)
    assert all(_same(r, on) for r in replays) and report["replays"] == 2 and not report["eager_calls"], report
    assert torch.isfinite(off).all() and torch.isfinite(on).all(), "a compiled output holds NaN or inf"
    assert _same(off, off_again), "inductor gave other bytes when compiling the same model again"
    assert _same(on, off), f"compiled fast paths on != off (dynamo counters: {counters})"
    assert _same(on, on_unshared), "sharing one activation quantize among layers changed the bytes"
    if name == "qwen-image":  # GELU and FC2's quantize run as one kernel in the compiled graph too
        assert fused.get("qwen_gelu", 0) > 0, fused
