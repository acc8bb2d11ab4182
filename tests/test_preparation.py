"""Progress and report of the kernels' one-time preparation (issue 58, "Say it"): the generic bar over a module's
blocks during one call, and, on a tiny NVFP4 pipeline, the bar that opens exactly when the Triton compilation
listener reports a compile during a first call (simulated: no kernel compiles on a CPU), its respect for the
pipeline's progress-bar settings, and ``fast_path_report``'s ``preparation``."""

from __future__ import annotations

import io
import types

import pytest
import torch
from torch import nn

from diffusers_nvfp4_fast import disable_fast_paths, enable_fast_paths, fast_path_report
from diffusers_nvfp4_fast.module_hooks import hooks_on
from diffusers_nvfp4_fast.progress import CallProgress, repeated_blocks
from diffusers_nvfp4_fast.utils import run_pipeline
from support.fast_paths import pipeline

triton = pytest.importorskip("triton", reason="the compilation listener is Triton's, so the bar and report tests did "
                                               "not run; they run wherever Triton is installed, as in CI")


class _Bar:
    def __init__(self, total: int):
        self.total, self.n, self.description, self.postfix, self.closed = total, 0, "", "", False

    def update(self, n: int) -> None:
        self.n += n

    def set_description(self, text: str) -> None:
        self.description = text

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text

    def close(self) -> None:
        self.closed = True


class _Blocks(nn.Module):
    def __init__(self, on_block=None):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.on_block = on_block or (lambda i: None)

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            self.on_block(i)
            x = block(x)
        return x


def test_the_generic_bar_counts_blocks_of_one_call_and_opens_only_when_shown():
    bars: list[_Bar] = []
    keep = [True]
    model = _Blocks()
    progress = CallProgress(model, repeated_blocks(model), lambda total: bars.append(_Bar(total)) or bars[-1],
                            lambda: keep[0])
    seen_inside: list = []

    def on_block(i):
        seen_inside.append([hooks_on(b) for b in model.blocks])
        if i == 2:
            progress.show("preparing")
            progress.set_postfix("kernel_x")

    model.on_block = on_block
    model(torch.zeros(1, 4))
    assert len(bars) == 1 and (bars[0].total, bars[0].n, bars[0].description) == (3, 3, "preparing")
    assert bars[0].postfix == "kernel_x" and bars[0].closed
    assert seen_inside == [[[], [], []]] * 3, "no hook inside the model while it runs"
    model.on_block = lambda i: None
    keep[0] = False
    model(torch.zeros(1, 4))  # not shown: no new bar; then the watch ends
    assert len(bars) == 1 and not model._forward_hooks and not model._forward_pre_hooks
    progress.show("after")  # outside a call: nothing
    assert len(bars) == 1


def _event(cache_hit: bool, name: str = "_quantize_nvfp4_kernel"):
    fn = types.SimpleNamespace(__module__="diffusers_nvfp4_fast.kernels.quantize_nvfp4")
    return dict(src=types.SimpleNamespace(name=name, fn=fn), metadata={"name": name}, metadata_group={},
                times=types.SimpleNamespace(total=2_500_000 if not cache_hit else 1000), cache_hit=cache_hit)


def _fire_in_block(block: nn.Module, cache_hit: bool, event: dict | None = None):
    """Triton's listener hears one of the package's kernels (or ``event``) once, as ``block`` starts its next call
    (a pipeline with guidance calls its transformer twice a step: the second call hears nothing). An instance
    forward, not a hook: a hook inside the model would keep the CUDA-graph runner from capturing the call."""
    forward, fired = block.forward, []

    def fire(*args, **kwargs):
        if not fired:
            fired.append(True)
            triton.knobs.compilation.listener(**(event or _event(cache_hit)))
        return forward(*args, **kwargs)

    block.forward = fire


ON_CPU = {"ran": False, "reason": "the model runs on cpu"}


@pytest.fixture
def klein(modelopt_exports):
    pipe, kwargs = pipeline("klein", modelopt_exports)
    yield pipe, kwargs
    disable_fast_paths(pipe)


def _blocks(pipe) -> int:
    return len(pipe.transformer.transformer_blocks) + len(pipe.transformer.single_transformer_blocks)


def test_a_compile_during_the_first_call_shows_blocks_done_of_the_block_count(klein):
    pipe, kwargs = klein
    out = io.StringIO()
    pipe.set_progress_bar_config(file=out, mininterval=0, ascii=True)
    enable_fast_paths(pipe)
    assert fast_path_report(pipe)["Flux2Transformer2DModel"]["preparation"]["reason"].startswith("the model has not")
    _fire_in_block(pipe.transformer.single_transformer_blocks[0], cache_hit=False)
    run_pipeline(pipe, kwargs, steps=1)
    text = out.getvalue()
    n = _blocks(pipe)
    assert "Compiling NVFP4 kernels for cpu, once per machine (Triton cache: " in text, text
    assert f"1/{n}" in text and f"{n}/{n}" in text and "_quantize_nvfp4_kernel" in text, text
    # the first call compiled, so the second (guidance's) was watched too; it compiled nothing: the watch ended there
    prep = fast_path_report(pipe)["Flux2Transformer2DModel"]["preparation"]
    assert prep == {"cache": "cold", "seconds": 2.5, "compiled": 1, "from_cache": 0, "calls": 2,
                    "kernels_compiled": {"_quantize_nvfp4_kernel": 2.5}, "parallel": ON_CPU}
    assert text.count(f"{n}/{n}") >= 1 and "Compiling" not in text.rsplit(f"{n}/{n}", 1)[1], "one bar, one call"
    assert "preparation: Triton cache cold, 1 of 1 kernel(s) compiled, 2.5 s" in str(fast_path_report(pipe))
    assert not pipe.transformer._forward_hooks and not pipe.transformer._forward_pre_hooks


def test_a_warm_cache_shows_nothing_and_is_reported_warm(klein):
    pipe, kwargs = klein
    out = io.StringIO()
    pipe.set_progress_bar_config(file=out, mininterval=0)
    enable_fast_paths(pipe)
    _fire_in_block(pipe.transformer.transformer_blocks[0], cache_hit=True)
    run_pipeline(pipe, kwargs, steps=1)
    assert "Compiling" not in out.getvalue()
    prep = fast_path_report(pipe)["Flux2Transformer2DModel"]["preparation"]
    assert prep == {"cache": "warm", "seconds": 0.001, "compiled": 0, "from_cache": 1, "calls": 1, "parallel": ON_CPU}
    assert "preparation: Triton cache warm, 1 kernel(s) loaded from it in 0.0 s" in str(fast_path_report(pipe))
    assert not pipe.transformer._forward_hooks, "a call without a compile ends the watch"


def test_a_disabled_progress_bar_stays_disabled_and_the_report_still_counts(klein):
    pipe, kwargs = klein
    out = io.StringIO()
    pipe.set_progress_bar_config(file=out, disable=True)
    enable_fast_paths(pipe)
    _fire_in_block(pipe.transformer.transformer_blocks[0], cache_hit=False)
    run_pipeline(pipe, kwargs, steps=1)
    assert out.getvalue() == ""
    assert fast_path_report(pipe)["Flux2Transformer2DModel"]["preparation"]["compiled"] == 1


def test_events_outside_a_call_or_of_other_kernels_are_not_counted(klein):
    pipe, kwargs = klein
    enable_fast_paths(pipe)
    triton.knobs.compilation.listener(**_event(False))  # outside any call of the model
    other = _event(False, "triton_poi_fused_add_0")
    other["src"].fn = types.SimpleNamespace(__module__="torch._inductor.generated")
    _fire_in_block(pipe.transformer.transformer_blocks[0], False, other)
    run_pipeline(pipe, kwargs, steps=1)
    prep = fast_path_report(pipe)["Flux2Transformer2DModel"]["preparation"]
    assert (prep["cache"], prep["compiled"], prep["from_cache"]) == ("unknown", 0, 0)
    assert prep["reason"].startswith("no NVFP4 Triton kernel was compiled or loaded during the first call")
    disable_fast_paths(pipe)
    assert triton.knobs.compilation.listener is None, "the listener goes once no model is watched"


def test_without_a_listener_the_cache_is_unknown_with_the_reason(klein, monkeypatch):
    from diffusers_nvfp4_fast import preparation

    monkeypatch.setattr(preparation, "listener_unavailable", lambda: "Triton 3.3 has no compilation listener")
    pipe, kwargs = klein
    enable_fast_paths(pipe)
    assert fast_path_report(pipe)["Flux2Transformer2DModel"]["preparation"] == {
        "cache": "unknown", "reason": "Triton 3.3 has no compilation listener"}
    assert "preparation: Triton cache unknown (Triton 3.3 has no" in str(fast_path_report(pipe))


def test_a_bad_worker_count_fails_enable_fast_paths_naming_it_and_changes_nothing(klein, monkeypatch):
    pipe, _ = klein
    monkeypatch.setenv("DIFFUSERS_NVFP4_COMPILE_WORKERS", "four")
    with pytest.raises(ValueError, match="DIFFUSERS_NVFP4_COMPILE_WORKERS='four': expected a count"):
        enable_fast_paths(pipe)
    assert fast_path_report(pipe)["Flux2Transformer2DModel"]["enabled"] is False
    assert "_nvfp4_fast_paths" not in pipe.transformer.__dict__ and "forward" not in pipe.transformer.__dict__


def test_a_binary_compiled_by_a_worker_process_counts_as_compiled(klein):
    """A worker's binary is loaded here from the cache (the listener hears a cache hit): the report counts it as
    compiled, with the worker's seconds, and the cache as cold."""
    pipe, kwargs = klein
    enable_fast_paths(pipe)
    _fire_in_block(pipe.transformer.single_transformer_blocks[0], cache_hit=True)
    preparation = pipe.transformer.__dict__["_nvfp4_fast_paths"].preparation
    preparation.compiled_elsewhere = [("_fake_kernel", 1.5)]
    run_pipeline(pipe, kwargs, steps=1)
    report = fast_path_report(pipe)["Flux2Transformer2DModel"]["preparation"]
    assert (report["cache"], report["compiled"], report["from_cache"]) == ("cold", 1, 0), report
    assert report["kernels_compiled"] == {"_fake_kernel": 1.5}


def test_under_the_graph_runner_the_first_call_is_captured_and_counted_once(klein):
    """The watch puts no hook inside the model, so the CUDA-graph runner (simulated capture: the call runs again)
    captures the first call as without it, and the blocks it runs twice count once."""
    from diffusers_nvfp4_fast.graphs import capture_cuda_graphs

    pipe, kwargs = klein
    out = io.StringIO()
    pipe.set_progress_bar_config(file=out, mininterval=0)
    enable_fast_paths(pipe)
    capture_cuda_graphs(pipe, backend="simulate")
    _fire_in_block(pipe.transformer.single_transformer_blocks[0], cache_hit=False)
    run_pipeline(pipe, kwargs, steps=1)
    graphs = fast_path_report(pipe)["Flux2Transformer2DModel"]["cuda_graphs"]
    assert graphs["captures"] >= 1 and not graphs["eager_calls"], graphs
    n = _blocks(pipe)
    assert f"{n}/{n}" in out.getvalue() and f"{n + 1}/{n}" not in out.getvalue(), out.getvalue()


def test_tritons_key_is_computed_once_on_a_thread_and_a_failure_is_reported_not_raised(monkeypatch):
    """``start_key_parts`` computes Triton's cache-key parts for the device's architecture on one thread per process
    (a second start starts nothing); ``await_key_parts`` waits for it. A failure there is recorded, not raised: the
    first compile computes the parts itself and raises what it must."""
    from triton.runtime.cache import triton_key

    from diffusers_nvfp4_fast import preparation

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(preparation, "_KEY_PARTS", {})
    assert preparation.await_key_parts() is None, "nothing started, nothing to wait for"
    assert preparation.start_key_parts(torch.device("cpu")) is False and not preparation._KEY_PARTS
    triton_key.cache_clear()
    assert preparation.start_key_parts(torch.device("cuda", 0)) is True
    thread = preparation._KEY_PARTS["thread"]
    assert preparation.start_key_parts(torch.device("cuda", 0)) is True
    assert preparation._KEY_PARTS["thread"] is thread and thread.name == "nvfp4-triton-key"
    assert preparation.await_key_parts() >= 0 and not thread.is_alive()
    assert preparation._KEY_PARTS["seconds"] > 0 and "failed" not in preparation._KEY_PARTS
    assert triton_key.cache_info().currsize == 1

    def fails(arch):
        raise RuntimeError(f"no ptxas for sm_{arch}")

    monkeypatch.setattr(preparation, "_KEY_PARTS", {})
    monkeypatch.setattr(preparation._compat(), "compute_cache_key_parts", fails)
    preparation.start_key_parts(torch.device("cuda", 0))
    preparation.await_key_parts()
    assert preparation._KEY_PARTS["failed"] == "RuntimeError: no ptxas for sm_90"


def test_the_first_call_waits_for_tritons_key_before_its_first_block_and_reports_it(klein, monkeypatch):
    """A first call joins the key's thread before anything of it runs (so no compile of the call computes the key
    again), and the report gives the thread's seconds and the wait."""
    from diffusers_nvfp4_fast import preparation

    order: list[str] = []
    thread = types.SimpleNamespace(join=lambda: order.append("joined"))
    monkeypatch.setattr(preparation, "_KEY_PARTS", {"thread": thread, "seconds": 0.3})
    monkeypatch.setattr(preparation, "start_key_parts", lambda device: True)  # as for a CUDA model
    pipe, kwargs = klein
    enable_fast_paths(pipe)
    pipe.transformer.transformer_blocks[0].register_forward_pre_hook(lambda *_: order.append("block"))
    run_pipeline(pipe, kwargs, steps=1)
    assert order[:2] == ["joined", "block"] and order.count("joined") == 1, order
    key = fast_path_report(pipe)["Flux2Transformer2DModel"]["preparation"]["triton_key"]
    assert key["seconds"] == 0.3 and 0 <= key["waited_s"] < 1, key


_TWO_PROCESSES = """
import json, sys, tempfile
from pathlib import Path
import torch
from diffusers_nvfp4_fast import enable_fast_paths, fast_path_report, load_nvfp4_transformer
from diffusers_nvfp4_fast.testing.export import quantize_tiny_pipeline
from diffusers_nvfp4_fast.testing.tiny import TINY_PIPELINES
from diffusers_nvfp4_fast.utils import png_sha256, run_pipeline

with tempfile.TemporaryDirectory() as tmp:
    checkpoint = quantize_tiny_pipeline("flux2", Path(tmp) / "flux2", steps=1)
    pipe, kwargs = TINY_PIPELINES["flux2"](load_nvfp4_transformer(checkpoint, device="cuda"))
pipe.to("cuda")
enable_fast_paths(pipe)
sha = png_sha256(run_pipeline(pipe, kwargs, size=64, steps=2))
print(json.dumps({"sha": sha, **fast_path_report(pipe)["Flux2Transformer2DModel"]["preparation"]}))
"""


@pytest.mark.gpu
def test_gpu_a_new_cache_is_reported_cold_and_the_next_process_warm(tmp_path):
    """Two fresh processes on one empty Triton cache directory: the first compiles the NVFP4 kernels it runs and says
    "cold", the second loads every one of them from the cache and says "warm"; the same PNG."""
    import json
    import os
    import subprocess
    import sys

    if not torch.cuda.is_available():
        pytest.skip("the two-process cold / warm preparation run did not run: no CUDA GPU here; it runs on the GPU "
                    "machine (pytest -m gpu tests/test_preparation.py)")
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _TWO_PROCESSES], env=env, capture_output=True, text=True,
                              timeout=280)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["cache"] == "cold" and cold["compiled"] > 0 and cold["seconds"] > 0, cold
    assert all("failed" not in run["triton_key"] and run["triton_key"]["waited_s"] is not None for run in runs), runs
    assert warm["cache"] == "warm" and warm["compiled"] == 0, warm
    assert warm["from_cache"] == cold["compiled"] + cold["from_cache"], (cold, warm)
    assert cold["sha"] == warm["sha"]


@pytest.mark.gpu
def test_gpu_the_pass_in_worker_processes_compiles_the_same_binaries_and_image(tmp_path):
    """A fresh process on an empty cache with ``DIFFUSERS_NVFP4_COMPILE_WORKERS=4``: every binary the pass asks for
    is compiled by a worker and loaded here, none fails, the report counts them as compiled ("cold"), and the PNG is
    that of a process compiling on threads."""
    import json
    import os
    import subprocess
    import sys

    if not torch.cuda.is_available():
        pytest.skip("the worker-process pass did not run: no CUDA GPU here; it runs on the GPU machine "
                    "(pytest -m gpu tests/test_preparation.py)")
    runs = []
    for name, workers in (("threads", "0"), ("workers", "4")):
        env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / name), "DIFFUSERS_NVFP4_COMPILE_WORKERS": workers}
        done = subprocess.run([sys.executable, "-c", _TWO_PROCESSES], env=env, capture_output=True, text=True,
                              timeout=280)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    threads, workers = runs
    processes = workers["parallel"]["processes"]
    assert processes["workers"] == 4 and "failed" not in processes, workers
    assert 0 < processes["compiled"] <= workers["parallel"]["kernels"], workers
    assert workers["cache"] == "cold" and workers["compiled"] == threads["compiled"], (threads, workers)
    assert workers["sha"] == threads["sha"]


def test_the_first_image_benchmark_says_how_a_warm_recompile_differs_from_the_cold_binary():
    """``bench_first_image.py``: a binary the warm process compiles again is listed with the entries of its key that
    differ from the nearest cold binary of that kernel (here an alignment), "same key" where none differs."""
    import bench_first_image as bench

    spec = {"fn": "abc", "constants": {"D": "3072"}, "attrs": {"x_ptr": "[['tt.divisibility', 16]]"}}
    moved = {**spec, "attrs": {}}
    cold = {"compiles": [{"name": "k", "hit": False, "spec": spec}, {"name": "g", "hit": False, "spec": spec}]}
    warm = {"compiles": [{"name": "k", "hit": False, "spec": moved}, {"name": "g", "hit": False, "spec": spec},
                         {"name": "q", "hit": True, "spec": spec}]}
    bench.explain_recompiles(cold, warm)
    assert warm["recompiled"] == [
        {"name": "k", "differs": {"attrs": {"x_ptr": ["[['tt.divisibility', 16]]", None]}}},
        {"name": "g", "differs": "same key"}]
    assert [set(c) for c in warm["compiles"]] == [{"name", "hit", "key"}] * 3
    assert warm["compiles"][1]["key"] == cold["compiles"][1]["key"] != warm["compiles"][0]["key"]


def test_the_benchmarks_split_a_pipeline_call_into_text_denoise_and_decode(monkeypatch):
    """``common.StageTimer`` (``bench_first_image.py``'s ``stages``, the budget benchmark's seconds): time inside
    ``encode_prompt`` is text, inside ``vae.decode`` decode, the rest of the call denoising."""
    import types

    import common

    ticks = iter([1.0, 2.5, 7.0, 7.25, 9.0, 9.5])
    monkeypatch.setattr(common, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    pipe = types.SimpleNamespace(encode_prompt=lambda prompt: prompt,
                                 vae=types.SimpleNamespace(decode=lambda latents: latents))
    timer = common.StageTimer(pipe, cuda=False)
    assert pipe.encode_prompt("p") == "p" and pipe.vae.decode("z") == "z"
    assert timer.split(5.0, {}) == {"text": 1.5, "denoise": 3.25, "decode": 0.25}
    before = dict(timer.seconds)
    pipe.encode_prompt("q")
    assert timer.split(1.0, before) == {"text": 0.5, "denoise": 0.5, "decode": 0.0}
