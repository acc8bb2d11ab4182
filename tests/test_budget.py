"""Offload plans for a memory budget (``diffusers_nvfp4_fast.budget``): the estimates follow the component sizes, the
choice is the fastest plan that fits, every plan gives the resident pipeline's PNG with the fused sites active, and
leaf-level group offloading gives each NVFP4 layer a group of its own (so its packed weight leaves the GPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diffusers_nvfp4_fast import NVFP4Linear, budget, disable_fast_paths, enable_fast_paths, fast_path_report
from diffusers_nvfp4_fast.utils import png_sha256, run_pipeline, tensor_bytes
from support.modelopt_exports import nvfp4_pipeline

pytestmark = pytest.mark.usefixtures("fresh_verdicts")

ROOT = Path(__file__).resolve().parents[1]
MODEL_CLASS = {"flux2": "Flux2Transformer2DModel", "qwen": "QwenImageTransformer2DModel"}
SITE = {"flux2": "flux2_token_cat_swiglu", "qwen": "qwen_resnorm"}


def _sizes(pipe) -> dict[str, int]:
    return {name: tensor_bytes(m) for name, m in pipe.components.items() if isinstance(m, torch.nn.Module)}


def test_estimates_follow_the_component_sizes(modelopt_exports):
    """The documented stage model: the text stage adds TEXT_HEADROOM_GIB, denoising and decoding add the headroom,
    every plan the CUDA context."""
    pipe, _ = nvfp4_pipeline("flux2", modelopt_exports("flux2"))
    gib, text_h, context = 2**30, budget.TEXT_HEADROOM_GIB, budget.CUDA_CONTEXT_GIB
    size = {name: b / gib for name, b in _sizes(pipe).items()}
    for h in (0.0, 3.0):
        est = budget.plan_estimates(pipe, headroom_gib=h)
        assert est["resident"] == sum(size.values()) + max(text_h, h) + context
        assert est["model_cpu_offload"] == max(size["text_encoder"] + text_h, size["transformer"] + h,
                                               size["vae"] + h) + context
        assert est["text_encoder_offload"] < est["resident"]
        assert est["group_offload_leaf"] <= min(v for k, v in est.items() if k != "group_offload_leaf")


def test_choice_is_the_fastest_plan_that_fits(modelopt_exports):
    pipe, _ = nvfp4_pipeline("qwen", modelopt_exports("qwen"))
    est = budget.plan_estimates(pipe, headroom_gib=0.0)
    assert budget.choose_plan(pipe, est["resident"], headroom_gib=0.0) == "resident"
    just_below = est["resident"] * 0.999
    want = next(p for p in budget.PLANS if est[p] <= just_below)
    assert want != "resident" and budget.choose_plan(pipe, just_below, headroom_gib=0.0) == want
    with pytest.raises(ValueError, match=r"no offload plan fits a 1e-09 GiB GPU budget .*group_offload_leaf"):
        budget.choose_plan(pipe, 1e-9, headroom_gib=0.0)
    with pytest.raises(ValueError, match="budget_gib must be positive, got -1"):
        budget.choose_plan(pipe, -1)
    with pytest.raises(ValueError, match="unknown offload plan 'fastest'"):
        budget.apply_plan(pipe, "fastest", "cpu")


def _on_meta(pipe):
    """The pipeline's weights off the CPU (as on a GPU), without using memory."""
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            module.to("meta")
    return pipe


def test_plans_whose_weights_do_not_fit_host_memory_are_skipped(modelopt_exports):
    """A plan moves its offloaded weights to host memory; where they are not there yet, they must fit the free host
    memory, or the plan is skipped and the error names what each plan adds."""
    pipe, _ = nvfp4_pipeline("qwen", modelopt_exports("qwen"))
    assert all(budget.host_bytes_needed(pipe, plan) == 0 for plan in budget.PLANS)  # already in host memory
    _on_meta(pipe)
    gib = 2**30
    need = {plan: budget.host_bytes_needed(pipe, plan) / gib for plan in budget.PLANS}
    assert need == {plan: budget.offloaded_bytes(pipe, plan) / gib for plan in budget.PLANS} and need["resident"] == 0
    est = budget.plan_estimates(pipe, headroom_gib=0.0)
    cap = est["text_encoder_offload"]
    assert cap < est["resident"]
    assert budget.choose_plan(pipe, cap, 0.0, host_gib=need["text_encoder_offload"]) == "text_encoder_offload"
    # Every other plan that fits the GPU offloads the text encoder too, and more: none fits the host.
    with pytest.raises(ValueError, match=r"fits a .* GiB GPU budget and 0\.0 GiB of free host memory \(host GiB "
                                         r"each plan adds: .*'text_encoder_offload'"):
        budget.choose_plan(pipe, cap, 0.0, host_gib=need["text_encoder_offload"] * 0.999)
    assert budget.choose_plan(pipe, est["resident"], 0.0, host_gib=0.0) == "resident"


def test_fit_to_budget_warns_when_setup_may_exceed_host_memory(modelopt_exports, monkeypatch, caplog):
    pipe = _on_meta(nvfp4_pipeline("qwen", modelopt_exports("qwen"))[0])
    monkeypatch.setattr(budget, "apply_plan", lambda *args: None)  # meta weights cannot be offloaded for real
    est = budget.plan_estimates(pipe, headroom_gib=0.0)
    need = budget.host_bytes_needed(pipe, "text_encoder_offload") / 2**30
    with caplog.at_level("WARNING", logger="diffusers_nvfp4_fast"):
        plan = budget.fit_to_budget(pipe, est["text_encoder_offload"], "cpu", headroom_gib=0.0, host_gib=need * 1.5)
    assert plan == "text_encoder_offload"
    assert "setting it up can peak" in caplog.text and "text_encoder_offload" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="diffusers_nvfp4_fast"):
        budget.fit_to_budget(pipe, est["text_encoder_offload"], "cpu", headroom_gib=0.0, host_gib=need * 2)
    assert "setting it up can peak" not in caplog.text


def test_leaf_level_group_offload_gives_each_nvfp4_layer_its_group(modelopt_exports):
    from diffusers.hooks import HookRegistry

    pipe, _ = nvfp4_pipeline("flux2", modelopt_exports("flux2"))
    enable_fast_paths(pipe)
    layers = [m for m in pipe.transformer.modules() if isinstance(m, NVFP4Linear)]
    budget.apply_plan(pipe, "group_offload_leaf", "cpu")
    hooked = [m for m in layers if HookRegistry.check_if_exists_or_initialize(m).get_hook("group_offloading")]
    assert layers and len(hooked) == len(layers)
    disable_fast_paths(pipe)


@pytest.mark.parametrize("plan", budget.PLANS[1:])
@pytest.mark.parametrize("which", ["flux2", "qwen"])
def test_every_plan_gives_the_resident_png(which, plan, modelopt_exports):
    pipe, kwargs = nvfp4_pipeline(which, modelopt_exports(which))
    enable_fast_paths(pipe)
    want = png_sha256(run_pipeline(pipe, kwargs))
    disable_fast_paths(pipe)

    pipe, kwargs = nvfp4_pipeline(which, modelopt_exports(which))
    enable_fast_paths(pipe)
    budget.apply_plan(pipe, plan, "cuda" if torch.cuda.is_available() else "cpu")
    assert png_sha256(run_pipeline(pipe, kwargs)) == want
    report = fast_path_report(pipe)[MODEL_CLASS[which]]
    assert report["fused_calls"].get(SITE[which], 0) > 0, report
    disable_fast_paths(pipe)


@pytest.mark.gpu
def test_gpu_leaf_level_keeps_nvfp4_weights_off_the_gpu(modelopt_exports):
    """While one NVFP4 layer computes, the packed weights of most others are on the CPU."""
    pipe, kwargs = nvfp4_pipeline("flux2", modelopt_exports("flux2"))
    enable_fast_paths(pipe)
    layers = [m for m in pipe.transformer.modules() if isinstance(m, NVFP4Linear)]
    budget.apply_plan(pipe, "group_offload_leaf", "cuda")
    on_gpu: list[int] = []
    handle = layers[-1].register_forward_hook(
        lambda *_: on_gpu.append(sum(m.weight.device.type == "cuda" for m in layers)))
    run_pipeline(pipe, kwargs)
    handle.remove()
    assert on_gpu and max(on_gpu) <= 2 < len(layers), (on_gpu, len(layers))
    disable_fast_paths(pipe)


@pytest.mark.parametrize("script", ["flux2_nvfp4.py", "qwen_image_nvfp4.py"])
def test_example_takes_a_plan(script, tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "examples" / script), "--tiny", "--plan", "group_offload_block"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "offload plan: group_offload_block" in out.stdout, out.stdout
    hashes = [line.split()[-1] for line in out.stdout.splitlines() if line.startswith("PNG SHA256")]
    assert len(hashes) == 2 and hashes[0] == hashes[1]


def test_budget_benchmark_dry_run(tmp_path):
    """The benchmark's whole logic (a process per case, plan, timers, PNG comparison, result file) on the tiny
    pipeline; the GPU run is the same code at real size."""
    import json

    out = tmp_path / "budget.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_pipeline_budget.py"), "--model", "flux2-dev", "--tiny",
           "--budgets", "24", "--plans", "model_cpu_offload", "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    cases = json.loads(out.read_text())["cases"]
    assert [(c["plan"], c["budget_gib"]) for c in cases] == [("resident", None), ("model_cpu_offload", 24.0)]
    for case in cases:
        assert case["fits"] and case["png_equal"] and case["fused_calls"]["flux2_token_cat_swiglu"] > 0, case
        assert case["s_per_image"] >= case["s_text"] + case["s_decode"] and case["peak_host_gib"] > 0, case


@pytest.mark.parametrize("model", ["qwen-image", "flux2-klein-4b", "flux2-klein-9b"])
def test_budget_benchmark_builds_nvfp4_text_encoders_by_modelopts_recipe(model):
    """``bench_pipeline_budget.py --dtype nvfp4-te`` (on the meta device, as its estimates are made): the real-size
    text encoder's Linears that ModelOpt's LLM recipe quantizes are NVFP4, the rest (vision tower, lm_head) BF16, and
    the estimates follow the smaller encoder."""
    import bench_pipeline_budget as bench

    from diffusers_nvfp4_fast.quantize.recipes import modelopt_llm_disabled

    bf16_te, nvfp4 = bench.meta_pipeline(model, "nvfp4"), bench.meta_pipeline(model, "nvfp4-te")
    linears = {n: m for n, m in nvfp4.text_encoder.named_modules() if isinstance(m, (torch.nn.Linear, NVFP4Linear))}
    assert all(isinstance(m, NVFP4Linear) != modelopt_llm_disabled(n) for n, m in linears.items())
    assert any(isinstance(m, NVFP4Linear) for m in linears.values())
    saved = tensor_bytes(bf16_te.text_encoder) - tensor_bytes(nvfp4.text_encoder)
    assert saved > 0
    before, after = budget.plan_estimates(bf16_te), budget.plan_estimates(nvfp4)
    assert (before["resident"] - after["resident"]) * budget.GIB == pytest.approx(saved, rel=1e-9)


# The BF16 bytes of the released text encoders: total_size of Qwen/Qwen3-4B's and Qwen/Qwen3-8B's
# model.safetensors.index.json (Qwen3-4B's lm_head is its embedding, stored once).
QWEN3_BYTES = {"flux2-klein-4b": 8_044_936_192, "flux2-klein-9b": 16_381_470_720}


@pytest.mark.parametrize("model", sorted(QWEN3_BYTES))
def test_budget_benchmark_estimates_klein_at_its_real_config(model):
    """``--estimate`` for FLUX.2-klein builds a meta ``Flux2KleinPipeline`` whose Qwen3 text encoder has the released
    checkpoint's bytes, whose width (three layers read) is the transformer's text width, and whose every cap of the
    model gets a plan that fits it."""
    import bench_pipeline_budget as bench
    from diffusers import Flux2KleinPipeline

    pipe = bench.meta_pipeline(model, "bf16")
    te = pipe.text_encoder
    assert isinstance(pipe, Flux2KleinPipeline) and type(te).__name__ == "Qwen3ForCausalLM"
    assert sum(p.numel() * p.element_size() for p in te.parameters()) == QWEN3_BYTES[model]
    assert 3 * te.config.hidden_size == pipe.transformer.config.joint_attention_dim
    estimates = budget.plan_estimates(pipe)
    assert all(estimates[budget.choose_plan(pipe, cap)] <= cap for cap in bench.BUDGETS[model])


def test_budget_benchmark_randomizes_tied_weights_once():
    """On a GPU the benchmark gives meta parameters values; Qwen3-4B's lm_head must stay its embedding (one tensor),
    or the resident pipeline holds 0.72 GiB more than the real one."""
    import bench_pipeline_budget as bench
    from accelerate import init_empty_weights
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with init_empty_weights(include_buffers=False):
        te = Qwen3ForCausalLM(Qwen3Config(hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=32,
                                          tie_word_embeddings=True))
    te.tie_weights()
    bench.randomize_(te, "cpu", seed=1)
    assert te.lm_head.weight is te.model.embed_tokens.weight and te.lm_head.weight.device.type == "cpu"


def test_resident_near_the_cap_gives_way_to_text_encoder_offload():
    """Qwen-Image with an NVFP4 text encoder (the estimates of ``bench_pipeline_budget.py --estimate``): resident
    fits 24 GiB at 23.3, where the H100 ran it 16% slower or with other decode bytes (docs/budget.md); text-encoder
    offload, 17.6, has room. Under 32 GiB resident has room itself; no roomy alternative keeps resident."""
    qwen = {"resident": 23.3, "text_encoder_offload": 17.6, "model_cpu_offload": 17.3, "group_offload_block": 6.3,
            "group_offload_leaf": 5.0}
    assert budget.choose_plan(None, 24, estimates=qwen) == "text_encoder_offload"
    assert budget.choose_plan(None, 32, estimates=qwen) == "resident"
    assert budget.choose_plan(None, 24, estimates=dict(qwen, text_encoder_offload=21.0)) == "resident"
    klein_4b = {"resident": 9.8, "text_encoder_offload": 7.2, "model_cpu_offload": 7.0, "group_offload_block": 5.5,
                "group_offload_leaf": 5.0}
    assert budget.choose_plan(None, 8, estimates=klein_4b) == "text_encoder_offload"  # tight, and the first to fit


def test_budget_benchmark_runs_a_larger_cap_again_after_a_tight_one():
    """A capped run stands for a larger cap only where the cap never bound it. On the H100 Qwen-Image with an NVFP4
    text encoder ran 11.1 s / image at a 24 GiB peak under 24 GiB and 9.6 s uncapped; the 32 GiB row had reused the
    11.1 s (benchmarks/results/pipeline_budget-h100.json)."""
    import bench_pipeline_budget as bench

    roomy = {"fits": True, "png_equal": True, "budget_gib": 24.0, "peak_gpu_gib": 19.4, "outside_allocator_gib": 0.73}
    assert bench.unbound_by_cap(roomy)
    assert not bench.unbound_by_cap(dict(roomy, peak_gpu_gib=23.72))
    assert not bench.unbound_by_cap(dict(roomy, png_equal=False))
    assert not bench.unbound_by_cap(dict(roomy, fits=False))


def test_budget_benchmark_flags_live_memory_over_the_estimate():
    """The H100 rows of 2026-12-06 (benchmarks/results/pipeline_budget-h100.json): Qwen-Image's text encoder offloaded
    while the SM90 GEMM's descriptors kept its layers on the GPU ran 3.5 GiB over its estimate; the same plan with the
    BF16 encoder, and Qwen-Image resident, did not. An uncapped case counts the context at the estimate's figure."""
    import bench_pipeline_budget as bench

    leaked = {"estimate_gib": 17.57, "peak_allocated_gib": 20.41, "outside_allocator_gib": 0.69}
    assert bench.live_over_estimate(leaked) == 3.53 > bench.ESTIMATE_SLACK_GIB
    bf16_offload = {"estimate_gib": 22.88, "peak_allocated_gib": 20.56, "outside_allocator_gib": 0.81}
    assert bench.live_over_estimate(bf16_offload) < 0
    resident = {"estimate_gib": 23.26, "peak_allocated_gib": 22.69}
    assert bench.live_over_estimate(resident) == round(22.69 + budget.CUDA_CONTEXT_GIB - 23.26, 2)
    assert bench.live_over_estimate(resident) <= bench.ESTIMATE_SLACK_GIB


def test_budget_benchmark_keeps_the_files_notes_and_other_cases(tmp_path):
    """A run rewrites only its own rows: the notes written by hand beside the H200 rows (why a case failed) were lost
    when a later run merged its cases into the file."""
    import json

    import bench_pipeline_budget as bench

    path = tmp_path / "budget.json"
    other = {"model": "qwen-image", "dtype": "bf16", "budget_gib": None, "plan": "resident", "s_per_image": 11.0}
    redone = {"model": "flux2-dev", "dtype": "nvfp4", "budget_gib": 24.0, "plan": "text_encoder_offload"}
    path.write_text(json.dumps({"cases": [other, dict(redone, s_per_image=9.0)], "runs": [],
                                "notes": {"flux2-dev bf16 24 GiB": "killed by the host"}}))
    header = {"benchmark": "pipeline_budget", "model": "flux2-dev", "dtype": "nvfp4", "date": "2026-12-06",
              "copy_bandwidth_GBps": None, "h2d_pinned_GBps": None}
    merged = bench.merge(path, header, [dict(redone, s_per_image=8.0)])
    assert merged["notes"] == {"flux2-dev bf16 24 GiB": "killed by the host"}
    assert merged["cases"] == [other, dict(redone, s_per_image=8.0)]


def test_budget_benchmark_runs_a_tiny_klein_case():
    """``--tiny`` for FLUX.2-klein (both sizes share the tiny klein pipeline): the cases in this process, NVFP4
    transformer and text encoder resident and under a plan, with the fused sites, every stage timed, the same PNG."""
    import bench_pipeline_budget as bench

    pipe, _ = bench.tiny_pipeline("flux2-klein-9b", "nvfp4-te")
    assert type(pipe).__name__ == "Flux2KleinPipeline"
    assert any(isinstance(m, NVFP4Linear) for m in pipe.text_encoder.modules())
    reference = bench.run_case("flux2-klein-4b", "nvfp4-te", "resident", None, tiny=True)
    case = bench.run_case("flux2-klein-4b", "nvfp4-te", "model_cpu_offload", 8.0, tiny=True)
    assert case["fits"] and case["fused_calls"]["flux2_token_cat_swiglu"] > 0, case
    assert case["png_sha256"] == reference["png_sha256"], (case, reference)
    assert case["s_per_image"] >= case["s_text"] + case["s_decode"] > 0, case
    assert case["estimates_gib"]["model_cpu_offload"] == case["estimate_gib"], case


def test_fit_to_budget_names_expandable_segments_when_the_plan_is_tight(modelopt_exports, monkeypatch, caplog):
    """A plan estimated close to the budget can fail on fragmentation alone (klein-4B under 8 GiB on the H100): the
    warning names the allocator setting, and is not given once the setting is there or the plan has room. A tight
    plan is said to risk the image's bytes either way (klein-9B under 12 GiB on the H100: other decode bytes)."""
    pipe = _on_meta(nvfp4_pipeline("qwen", modelopt_exports("qwen"))[0])
    monkeypatch.setattr(budget, "apply_plan", lambda *args: None)
    est = budget.plan_estimates(pipe, headroom_gib=0.0)["resident"]
    for value, budget_gib, warned in (("", est, True), ("expandable_segments:True", est, False),
                                      ("", est * 2, False)):
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", value)
        caplog.clear()
        with caplog.at_level("WARNING", logger="diffusers_nvfp4_fast"):
            assert budget.fit_to_budget(pipe, budget_gib, "cpu", headroom_gib=0.0, host_gib=1e6) == "resident"
        assert ("expandable_segments:True so that" in caplog.text) == warned, (value, budget_gib)
        assert ("changes the image's bytes" in caplog.text) == (budget_gib == est), (value, budget_gib)
