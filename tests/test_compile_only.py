"""The first call's compile-only pass (issue 58, "Cut it"; docs/design.md §8, "Compile-only pass"): the pool compiles
each binary once, all side by side; while the pass runs, nothing is learned from kernel outputs (verdicts, launch
plans, counters, the kernel-against-torch checks); the pass runs only where a second call cannot change anything,
never fails the call, leaves a mark that spares the same call a second pass, and the image is the same with and
without it. The skip reason names where this runs when the kernels do not import."""

from __future__ import annotations

import collections
import threading
import warnings

import pytest
import torch

from diffusers_nvfp4_fast import caches, disable_fast_paths, enable_fast_paths, fast_path_report
from diffusers_nvfp4_fast.ops import dispatch, linear, verify
from diffusers_nvfp4_fast.utils import png_sha256, run_pipeline
from support.fast_paths import pipeline

if dispatch.kernels is None:
    pytest.skip(f"the kernels do not import here ({dispatch.KERNELS_UNAVAILABLE}); the pass needs them: runs "
                "wherever Triton is installed, as CI installs it", allow_module_level=True)
launch = dispatch.kernels.launch


def _unusable_binder(*args, **kwargs):
    raise TypeError("another binder signature")


class _Kernel:
    """Stands in for a JITFunction: ``warmup`` records its specialization and waits for the others at ``meet``."""

    def __init__(self, name: str, meet: threading.Barrier | None = None):
        self.name, self.meet, self.compiled = name, meet, []
        # (who built it, a binder Triton's key cannot use: the pass then keys by specialization_key)
        self.device_caches = collections.defaultdict(lambda: (threading.current_thread().name, _unusable_binder))

    def warmup(self, *args, grid, **kwargs):
        assert self.device_caches[-1][0] == threading.main_thread().name, "the binder exists, made by the caller"
        if self.meet is not None:
            self.meet.wait(timeout=10)  # raises BrokenBarrierError unless the other compiles run meanwhile
        self.compiled.append((args, grid, kwargs))
        return object()  # no CompiledKernel: load_binary declines it


def test_each_specialization_compiles_once_and_all_side_by_side():
    meet = threading.Barrier(3)
    a, b = _Kernel("a", meet), _Kernel("b", meet)
    x16, x17 = torch.empty(16, dtype=torch.float16), torch.empty(17, dtype=torch.float16)
    with launch.compile_only(workers=4) as pending:
        assert launch.compiling_only() and dispatch.compiling_only()
        pending.add(a, (1,), -1, (x16, 16), {"D": 8})
        pending.add(a, (2,), -1, (torch.empty(32, dtype=torch.float16), 16), {"D": 8})  # the same key: once
        pending.add(b, (1,), -1, (x17, 17), {"D": 8})
        pending.add(a, (1,), -1, (x16, 17), {"D": 8})  # another specialization of a, beside the first
    assert not launch.compiling_only()
    assert pending.wait() == [], "the three compiles met: they ran at the same time"
    assert sorted(c[0][1] for c in a.compiled) == [16, 17] and len(b.compiled) == 1


def test_a_pending_compile_holds_dtypes_that_triton_specializes_as_the_aligned_tensors():
    """What the pool passes to ``warmup`` is specialized by the installed Triton exactly as the launch's arguments."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import MockTensor

    buffer = torch.zeros(64, dtype=torch.bfloat16)
    args = (buffer, buffer[1:], 7, 16, 1.5)
    held = launch.warmup_arguments(args)
    assert held[0] is torch.bfloat16 and held[1] is args[1] and held[2:] == args[2:]

    def spec(a):
        return native_specialize_impl(BaseBackend, MockTensor.wrap_dtype(a), False, True, True)

    assert [spec(a) for a in held] == [spec(a) for a in args]


def test_a_failed_compile_is_returned_and_a_second_pass_inside_the_first_is_refused():
    class Broken(_Kernel):
        def warmup(self, *args, grid, **kwargs):
            raise RuntimeError("ptxas died")

    with launch.compile_only(workers=1) as pending:
        pending.add(Broken("c"), (1,), -1, (1,), {})
        with pytest.raises(RuntimeError, match="already under way"):
            with launch.compile_only():
                pass
    assert [str(e) for e in pending.wait()] == ["ptxas died"]


def test_inside_the_pass_no_verdict_plan_or_count_is_learned():
    """A fused output that differs from the reference inside the pass (its kernels did not run) is no mismatch: no
    warning, no failed kind, no counter; and no launch plan counts the pass as a call."""
    stats_id, stats = verify.new_stats("first")
    site = verify.Site(stats_id, "flux2_swiglu")
    wrong, right = (torch.ones(2),), (torch.zeros(2),)
    seen = caches.registered()["ops.linear.calls_seen"].table
    key = ("quantize", 4096, 64)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with launch.compile_only(workers=1):
                out = verify.run_checked(site, "k", ("out",), lambda: wrong, lambda: right)
                linear.learn_plan(key, linear._quantize_plan, (), ())
        assert out is right
        assert verify.failed_kind_reason("flux2_swiglu") is None
        assert not (stats.verified or stats.verify_failed or stats.fused_calls)
        assert key not in seen
        assert verify.run_checked(site, "k", ("out",), lambda: right, lambda: right) is right  # outside: checked
        assert stats.verified["flux2_swiglu"] == 1
    finally:
        verify.drop_stats(stats_id)


@pytest.fixture
def klein(modelopt_exports):
    pipe, kwargs = pipeline("klein", modelopt_exports)
    yield pipe, kwargs
    disable_fast_paths(pipe)


def test_the_pass_runs_the_first_call_once_more_and_changes_no_byte_or_count(klein, monkeypatch, tmp_path):
    """On the CPU no kernel launches, so this checks the pass's plumbing: the first call runs twice (the pass, then
    the call), later calls once, the image and every counter are those of a run without the pass."""
    from diffusers_nvfp4_fast import preparation

    pipe, kwargs = klein
    verify.reset_verification()  # verdicts are process-wide: each run starts without them
    enable_fast_paths(pipe)
    sha_without = png_sha256(run_pipeline(pipe, kwargs, steps=2))
    counts_without = {k: v for k, v in fast_path_report(pipe)["Flux2Transformer2DModel"].items()
                      if k in ("fused_calls", "fallbacks", "verifications")}
    disable_fast_paths(pipe)
    calls = []
    model_class = type(pipe.transformer)
    forward = model_class.forward
    monkeypatch.setattr(model_class, "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    monkeypatch.setattr(preparation, "parallel_unavailable", lambda *a: None)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # no mark from an earlier run: the pass runs
    verify.reset_verification()
    enable_fast_paths(pipe)
    sha_with = png_sha256(run_pipeline(pipe, kwargs, steps=2))
    report = fast_path_report(pipe)["Flux2Transformer2DModel"]
    assert sha_with == sha_without
    assert {k: report[k] for k in counts_without} == counts_without
    parallel = report["preparation"]["parallel"]
    assert parallel == {"ran": True, "kernels": 0, "seconds": parallel["seconds"], "forward_s": parallel["forward_s"]}
    assert 0 < parallel["forward_s"] <= parallel["seconds"]
    guidance_calls = 2 * 2  # two steps, the transformer once per step and prompt batch
    assert len(calls) in (guidance_calls // 2 + 1, guidance_calls + 1), calls


def test_the_pass_is_skipped_with_hooks_compile_off_cuda_or_switched_off(klein, monkeypatch):
    from diffusers_nvfp4_fast.preparation import parallel_unavailable

    pipe, _ = klein
    model, cuda = pipe.transformer, torch.device("cuda")
    enable_fast_paths(pipe)  # its own hooks on the model are below nothing the pass runs
    assert parallel_unavailable(model, cuda, model.forward) is None
    model.transformer_blocks[0].register_forward_hook(lambda *a: None)
    assert parallel_unavailable(model, cuda, model.forward) == (
        "transformer_blocks.0 has hooks (torch forward hook): a second call could change their state")
    model.transformer_blocks[0]._forward_hooks.clear()
    assert parallel_unavailable(model, torch.device("cpu"), model.forward) == "the model runs on cpu"
    assert parallel_unavailable(model, cuda, None) == "the model's forward is wrapped by something unknown"
    monkeypatch.setenv("DIFFUSERS_NVFP4_PARALLEL_COMPILE", "0")
    assert parallel_unavailable(model, cuda, model.forward) == "DIFFUSERS_NVFP4_PARALLEL_COMPILE=0"
    monkeypatch.delenv("DIFFUSERS_NVFP4_PARALLEL_COMPILE")
    from diffusers.hooks import FirstBlockCacheConfig

    model.enable_cache(FirstBlockCacheConfig(threshold=0.1))
    try:
        assert "has hooks (" in parallel_unavailable(model, cuda, model.forward)
    finally:
        model.disable_cache()
    model.single_transformer_blocks[0].compile()
    assert parallel_unavailable(model, cuda, model.forward) == (
        "single_transformer_blocks.0 is compiled with torch.compile")


def test_the_kernel_against_torch_checks_inside_the_pass_compile_and_remember_nothing(monkeypatch):
    """The qk-norm tree check and the GELU check compare kernel outputs with torch's once per process: inside the
    pass, whose kernels leave their outputs unwritten, they must only compile (a garbage comparison remembered there
    turned Qwen-Image's qk-norm rotary site off for the process, GPU run of the compiled-paths test)."""
    from diffusers_nvfp4_fast.ops import gelu_quantize, qk_norm_rotary

    launched = []
    monkeypatch.setattr(dispatch.kernels, "qk_norm_rotary_triton",
                        lambda x, w, f, eps, tree: launched.append(("tree", tree)) or torch.empty_like(x))
    monkeypatch.setattr(dispatch.kernels, "gelu_triton", lambda v: launched.append("gelu") or torch.empty_like(v))
    tree_cache = caches.registered()["ops.qk_norm_rotary.tree"].table
    gelu_cache = caches.registered()["ops.gelu_quantize.eager_mismatch"].table
    device = torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # as on a GPU outside capture
    monkeypatch.delitem(tree_cache, str(device), raising=False)
    monkeypatch.delitem(gelu_cache, (str(device), torch.bfloat16), raising=False)
    with launch.compile_only(workers=1):
        assert qk_norm_rotary.tree_match(device).tree == 1
        assert gelu_quantize.gelu_mismatch(device, torch.bfloat16) is None
    assert launched == [("tree", 1), ("tree", 0), "gelu"]
    assert str(device) not in tree_cache and (str(device), torch.bfloat16) not in gelu_cache


def test_a_call_prepared_before_with_this_cache_skips_the_pass_and_a_new_shape_does_not(klein, monkeypatch, tmp_path):
    """A finished pass leaves a mark in Triton's cache directory; the next process (here: the next enable) loads the
    same call's kernels from the cache without a pass, which would only cost a forward of host time."""
    from diffusers_nvfp4_fast import preparation

    pipe, kwargs = klein
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(preparation, "parallel_unavailable", lambda *a: None)

    def first_call(size: int) -> dict:
        enable_fast_paths(pipe)
        run_pipeline(pipe, kwargs, steps=1, size=size)
        parallel = fast_path_report(pipe)["Flux2Transformer2DModel"]["preparation"]["parallel"]
        disable_fast_paths(pipe)
        return parallel

    assert first_call(64)["ran"]
    marks = list((tmp_path / "diffusers_nvfp4_fast" / "prepared").iterdir())
    assert len(marks) == 1 and marks[0].suffix == ".json"
    again = first_call(64)
    assert not again["ran"] and again["reason"].startswith(preparation.PREPARED_BEFORE), again
    assert first_call(32)["ran"], "another image size: other shapes, a pass of its own"


def test_a_text_encoders_first_call_gets_the_pass_and_its_mark(monkeypatch, tmp_path):
    """A transformers text encoder (its config no mapping) goes through the pass like a transformer: the mark is
    named from its config, and the prompt embeddings are those of fast paths off."""
    import warnings as _warnings

    from diffusers_nvfp4_fast import load_nvfp4_text_encoder, preparation
    from support import text_encoders as te
    from support.comfy_files import ck_quantize

    file = tmp_path / "qwen3_nvfp4.safetensors"
    te.write_comfy_file("qwen3", file, ck_quantize)
    pipe, kwargs = te.tiny_pipeline("qwen3", load_nvfp4_text_encoder(file, config=te.config_of("qwen3")))
    off = te.encoder_outputs(pipe, kwargs)[0]
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setattr(preparation, "parallel_unavailable", lambda *a: None)
    with _warnings.catch_warnings():
        _warnings.simplefilter("ignore")  # the tiny pipeline's transformer is BF16: enable_fast_paths says so
        enable_fast_paths(pipe)
    try:
        on = te.encoder_outputs(pipe, kwargs)[0]
        parallel = fast_path_report(pipe)["Qwen3ForCausalLM"]["preparation"]["parallel"]
    finally:
        disable_fast_paths(pipe)
    assert parallel["ran"], parallel
    assert len(list((tmp_path / "triton" / "diffusers_nvfp4_fast" / "prepared").iterdir())) == 1
    assert len(off) == len(on) > 0 and all(torch.equal(a, b) for a, b in zip(off, on, strict=True))


_MARK_NAME = """
import torch
from diffusers import Flux2Transformer2DModel
from diffusers_nvfp4_fast.preparation import prepared_record
with torch.device("meta"):  # four defaults left out: diffusers keeps their names in a set (_use_default_values)
    model = Flux2Transformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                    attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                    timestep_guidance_channels=16, axes_dims_rope=(4, 4, 4, 4))
x = torch.zeros(1, 16, 4)
print(prepared_record(model, torch.device("cpu"), (), {"hidden_states": x}).name)
"""


def test_the_mark_has_one_name_in_every_process(tmp_path):
    """The mark a process leaves is the one the next process looks for: its name does not follow PYTHONHASHSEED
    (it did, through diffusers' set of defaulted config names, and every warm process ran a pass again)."""
    import os
    import subprocess
    import sys

    def name(seed: str) -> str:
        env = {**os.environ, "PYTHONHASHSEED": seed, "TRITON_CACHE_DIR": str(tmp_path)}
        done = subprocess.run([sys.executable, "-c", _MARK_NAME], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.split()[-1]

    names = {name(seed) for seed in ("1", "2")}
    assert len(names) == 1, names
