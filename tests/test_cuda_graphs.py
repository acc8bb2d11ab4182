"""The CUDA-graph runner (``capture_cuda_graphs``, ``enable_fast_paths(pipe, cuda_graphs=True)``).

CPU cases use the ``"simulate"`` backend: the runner's own code (keys, static buffers, warm-up, capture bookkeeping,
output hand-off, eviction, fallbacks) runs as on the GPU, and a replay re-runs the captured call on the static
buffers and overwrites the static outputs, as a CUDA graph replay does. So a replay that read stale inputs, or
outputs handed out without a copy, change the image here too. What only a GPU can show (pointers baked into a graph,
capture errors) is in the ``gpu`` cases, which use real CUDA graphs.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from diffusers_nvfp4_fast import disable_fast_paths, enable_fast_paths, fast_path_report
from diffusers_nvfp4_fast.graphs import capture_cuda_graphs, graph_report, release_cuda_graphs
from diffusers_nvfp4_fast.graphs.keys import UnkeyableCall, alignment, call_key, copy_into, static_like
from diffusers_nvfp4_fast.testing import tiny
from diffusers_nvfp4_fast.utils import png_sha256, run_pipeline
from support.modelopt_exports import nvfp4_pipeline

pytestmark = pytest.mark.usefixtures("fresh_verdicts")

CLASS = {"flux2": "Flux2Transformer2DModel", "klein": "Flux2Transformer2DModel", "qwen": "QwenImageTransformer2DModel"}


def _pipe(which: str, modelopt_exports, device: str | None = None):
    pipe, kwargs = nvfp4_pipeline(which, modelopt_exports(which), device=device)
    if which == "qwen":
        kwargs["true_cfg_scale"] = 4.0  # two transformer calls per step, of different text lengths
    return pipe, kwargs


def _sha(pipe, kwargs, **kw) -> str:
    return png_sha256(run_pipeline(pipe, kwargs, **kw))


def _graphs(pipe) -> dict:
    return graph_report(pipe.transformer)


@pytest.mark.parametrize("which", ["flux2", "klein", "qwen"])
def test_replays_give_the_eager_image(which, modelopt_exports):
    pipe, kwargs = _pipe(which, modelopt_exports)
    enable_fast_paths(pipe)
    eager = _sha(pipe, kwargs)
    capture_cuda_graphs(pipe, backend="simulate")
    assert [_sha(pipe, kwargs) for _ in range(2)] == [eager, eager]
    report = fast_path_report(pipe)[CLASS[which]]["cuda_graphs"]
    calls_per_image = 3 * (1 if which == "flux2" else 2)  # klein and Qwen-Image: real CFG, two calls per step
    assert report["captures"] == (2 if which == "qwen" else 1), report  # CFG: the prompt and the negative prompt
    assert report["replays"] == 2 * calls_per_image - report["captures"]
    assert report["eager_calls"] == {} and report["graphs"] == report["captures"]
    disable_fast_paths(pipe)
    assert "forward" not in pipe.transformer.__dict__ and _graphs(pipe) is None
    assert "cuda_graphs" not in fast_path_report(pipe)[CLASS[which]]


def test_enable_with_cuda_graphs_on_cpu_runs_eagerly_and_says_why(modelopt_exports):
    pipe, kwargs = _pipe("flux2", modelopt_exports)
    plain = _sha(pipe, kwargs)
    with pytest.warns(UserWarning, match=r"Flux2Transformer2DModel computes on cpu, so its calls run eagerly"):
        report = enable_fast_paths(pipe, cuda_graphs=True)["Flux2Transformer2DModel"]["cuda_graphs"]
    assert report["backend"] == "cuda" and report["graphs"] == 0
    assert _sha(pipe, kwargs) == plain
    eager = _graphs(pipe)["eager_calls"]
    assert eager == {"tensor arguments on ['cpu'] (CUDA graphs need every tensor on one CUDA device)": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: enabling again installs nothing and warns no more
        enable_fast_paths(pipe, cuda_graphs=True)  # again: still one runner
    assert _sha(pipe, kwargs) == plain and sum(_graphs(pipe)["eager_calls"].values()) == 6


def _step_inputs(pipe, kwargs, text_tokens: int = 7, seed: int = 0) -> dict:
    """Keyword arguments of one tiny FLUX.2 transformer call."""
    g = torch.Generator().manual_seed(seed)
    cfg = pipe.transformer.config
    hidden = torch.randn(1, 16, cfg.in_channels, generator=g).to(torch.bfloat16)
    text = torch.randn(1, text_tokens, cfg.joint_attention_dim, generator=g).to(torch.bfloat16)
    img_ids = torch.cartesian_prod(torch.arange(1), torch.arange(4), torch.arange(4), torch.arange(1))
    txt_ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(text_tokens))
    return dict(hidden_states=hidden, encoder_hidden_states=text, timestep=torch.full((1,), 0.5, dtype=torch.bfloat16),
                img_ids=img_ids, txt_ids=txt_ids, guidance=torch.full((1,), 4.0), return_dict=False)


def _call(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs)[0]


def test_outputs_stay_the_callers_and_new_signatures_capture(modelopt_exports):
    pipe, kwargs = _pipe("flux2", modelopt_exports)
    model = pipe.transformer
    enable_fast_paths(model)
    inputs = [_step_inputs(pipe, kwargs, seed=s) for s in range(3)] + [_step_inputs(pipe, kwargs, 9, seed=3)]
    eager = [_call(model, x) for x in inputs]
    capture_cuda_graphs(model, backend="simulate")
    outs = [_call(model, x) for x in inputs]  # capture, replay, replay, a new text length: capture
    for out, ref in zip(outs, eager):  # each output is still the caller's after the later replays
        assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
    report = graph_report(model)
    assert (report["captures"], report["replays"], report["graphs"]) == (2, 2, 2)


def test_least_recently_used_graph_goes_first(modelopt_exports):
    pipe, kwargs = _pipe("flux2", modelopt_exports)
    model = pipe.transformer
    short, long = _step_inputs(pipe, kwargs, 7), _step_inputs(pipe, kwargs, 9)
    eager = [_call(model, short), _call(model, long)]
    capture_cuda_graphs(model, max_graphs=1, backend="simulate")
    for _ in range(2):
        assert torch.equal(_call(model, short), eager[0]) and torch.equal(_call(model, long), eager[1])
    report = graph_report(model)
    assert (report["graphs"], report["captures"], report["evictions"], report["replays"]) == (1, 4, 3, 0)


def test_model_changes_are_part_of_the_key(modelopt_exports, monkeypatch):
    pipe, kwargs = _pipe("flux2", modelopt_exports)
    model = pipe.transformer
    x = _step_inputs(pipe, kwargs)
    capture_cuda_graphs(model, backend="simulate")
    _call(model, x)
    _call(model, x)
    assert graph_report(model)["captures"] == 1
    enable_fast_paths(model)  # other forwards and processors: a new key
    on = _call(model, x)
    assert graph_report(model)["captures"] == 2 and torch.equal(_call(model, x), on)
    monkeypatch.setenv("FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH", "1")  # the quantize recipe the ops read per call
    _call(model, x)
    assert graph_report(model)["captures"] == 3
    param = model.proj_out.weight
    param.data = param.data.clone()  # same values at another address: the graphs reading the old one are freed
    _call(model, x)
    report = graph_report(model)
    assert report["captures"] == 4 and report["evictions"] == 3 and report["graphs"] == 1


def _lora_pipe(modelopt_exports, device: str | None = None):
    """(pipe, call kwargs, {adapter weight: eager PNG SHA256}) of the tiny FLUX.2 pipeline with a LoRA, fast paths
    on."""
    pytest.importorskip("peft", reason="peft is not installed: the LoRA case did not run (CI installs it)")
    from test_lora import TARGETS, lora_state_dict

    pipe, kwargs = _pipe("flux2", modelopt_exports, device=device)
    pipe.load_lora_weights(lora_state_dict("flux2", TARGETS["flux2"]), adapter_name="style")
    enable_fast_paths(pipe)
    shas = {}
    for weight in (1.0, 0.5):
        pipe.set_adapters(["style"], [weight])
        shas[weight] = _sha(pipe, kwargs)
    assert shas[1.0] != shas[0.5]
    return pipe, kwargs, shas


def _replay_each_scale(pipe, kwargs, shas: dict) -> None:
    for weight in (1.0, 0.5, 1.0):
        pipe.set_adapters(["style"], [weight])
        assert _sha(pipe, kwargs) == shas[weight]


def test_lora_scale_change_recaptures(modelopt_exports):
    pipe, kwargs, shas = _lora_pipe(modelopt_exports)
    capture_cuda_graphs(pipe, backend="simulate")
    _replay_each_scale(pipe, kwargs, shas)
    report = _graphs(pipe)
    assert report["captures"] == 2 and report["replays"] == 7, report
    pipe.unload_lora_weights()  # modules replaced: the walk sees the new structure
    assert _sha(pipe, kwargs) == _sha(*_pipe("flux2", modelopt_exports)) and _graphs(pipe)["captures"] == 3


def test_hooks_inside_the_model_run_eagerly(modelopt_exports):
    from diffusers.hooks import HookRegistry, ModelHook

    pipe, kwargs = _pipe("qwen", modelopt_exports)
    enable_fast_paths(pipe)
    eager = _sha(pipe, kwargs)
    capture_cuda_graphs(pipe, backend="simulate")
    block = pipe.transformer.transformer_blocks[1]
    handle = block.register_forward_hook(lambda *_: None)
    assert _sha(pipe, kwargs) == eager
    assert _graphs(pipe)["eager_calls"] == {"hook on transformer_blocks.1: torch forward hook": 6}
    handle.remove()
    HookRegistry.check_if_exists_or_initialize(block).register_hook(ModelHook(), "probe")  # a cache hook's kind
    assert _sha(pipe, kwargs) == eager
    assert _graphs(pipe)["eager_calls"]["hook on transformer_blocks.1: probe"] == 6
    HookRegistry.check_if_exists_or_initialize(block).remove_hook("probe")
    assert _sha(pipe, kwargs) == eager and _graphs(pipe)["replays"] == 4  # the registry left a forward: new key


def test_hook_on_the_transformer_itself_runs_at_every_call(modelopt_exports):
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    class Count(ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Count.calls += 1
            return args, kwargs

    pipe, kwargs = _pipe("flux2", modelopt_exports)
    eager = _sha(pipe, kwargs)
    add_hook_to_module(pipe.transformer, Count())  # as enable_model_cpu_offload does
    capture_cuda_graphs(pipe, backend="simulate")
    assert _sha(pipe, kwargs) == eager and Count.calls == 3 and _graphs(pipe)["replays"] == 2
    release_cuda_graphs(pipe)
    assert _sha(pipe, kwargs) == eager and Count.calls == 6
    remove_hook_from_module(pipe.transformer)
    assert pipe.transformer.forward.__func__ is type(pipe.transformer).forward


def test_calls_that_cannot_be_keyed_run_eagerly(modelopt_exports):
    pipe, kwargs = _pipe("flux2", modelopt_exports)
    model = pipe.transformer
    x = _step_inputs(pipe, kwargs)
    ref = _call(model, x)
    capture_cuda_graphs(model, backend="simulate")
    assert torch.equal(model(**x)[0], ref)  # grad mode on
    with torch.no_grad():
        assert torch.equal(model(**x, joint_attention_kwargs={"cache": object()})[0], ref)
    eager = graph_report(model)["eager_calls"]
    assert eager == {"grad mode is enabled (graphs replay inference: call under torch.no_grad(), as diffusers "
                     "pipelines do)": 1, "argument kwargs['joint_attention_kwargs']['cache'] is a object": 1}


def test_a_failed_capture_keeps_the_eager_result(modelopt_exports, monkeypatch):
    pipe, kwargs = _pipe("flux2", modelopt_exports)
    model = pipe.transformer
    x = _step_inputs(pipe, kwargs)
    ref = _call(model, x)
    capture_cuda_graphs(model, backend="simulate")
    runner = model.__dict__["_nvfp4_cuda_graphs"].runner

    def fail(fn):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(runner.backend, "capture", fail)
    assert torch.equal(_call(model, x), ref) and torch.equal(_call(model, x), ref)
    assert graph_report(model)["eager_calls"] == {
        "capture failed: RuntimeError: operation not permitted when stream is capturing": 2}


def test_compiled_transformer_is_captured_as_compiled(modelopt_exports):
    pipe, kwargs = _pipe("flux2", modelopt_exports)
    pipe.transformer = torch.compile(pipe.transformer, backend="aot_eager", fullgraph=True)
    compiled = _sha(pipe, kwargs)
    capture_cuda_graphs(pipe, backend="simulate")
    assert _sha(pipe, kwargs) == compiled and _graphs(pipe)["replays"] == 2
    release_cuda_graphs(pipe)
    assert "_nvfp4_cuda_graphs" not in pipe.transformer.__dict__
    model = pipe.transformer._orig_mod
    model.compile(backend="aot_eager", fullgraph=True)
    pipe.transformer = model
    assert _sha(pipe, kwargs) == compiled
    capture_cuda_graphs(pipe, backend="simulate")
    assert _sha(pipe, kwargs) == compiled and _graphs(pipe)["replays"] == 2


def test_bf16_transformer():
    pipe, kwargs = tiny.tiny_qwen_pipeline()
    pipe.set_progress_bar_config(disable=True)
    eager = _sha(pipe, kwargs)
    capture_cuda_graphs(pipe, backend="simulate")
    assert _sha(pipe, kwargs) == eager and _graphs(pipe)["replays"] == 2


def test_static_buffers_keep_strides_broadcasts_and_alignment():
    base = torch.arange(40, dtype=torch.bfloat16)
    for t in (base[3:35].view(4, 8), base[8:].view(4, 8)[:, ::2], torch.ones(1, 5).expand(3, 5), base[:0]):
        static = static_like(t)
        assert (static.shape, static.stride(), static.dtype, alignment(static)) == \
            (t.shape, t.stride(), t.dtype, alignment(t))
        copy_into(static, t)
        assert torch.equal(static, t)
    with pytest.raises(UnkeyableCall, match="overlaps itself"):
        static_like(base.as_strided((4, 4), (2, 1)))
    with pytest.raises(UnkeyableCall, match="share memory"):
        call_key((base, base[1:]), {})
    assert call_key((0.0,), {})[0] != call_key((-0.0,), {})[0] and call_key((1,), {})[0] != call_key((True,), {})[0]


# ------------------------------------------------------------------------------------------------------------------
# GPU: real CUDA graphs.
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["flux2", "klein", "qwen"])
def test_gpu_replays_give_the_eager_image(which, modelopt_exports):
    pipe, kwargs = _pipe(which, modelopt_exports, device="cuda")
    enable_fast_paths(pipe)
    eager = _sha(pipe, kwargs)
    enable_fast_paths(pipe, cuda_graphs=True)
    assert [_sha(pipe, kwargs) for _ in range(2)] == [eager, eager]
    report = _graphs(pipe)
    assert report["eager_calls"] == {} and report["replays"] > 0 and report["pool_bytes"] > 0, report
    disable_fast_paths(pipe)
    assert _sha(pipe, kwargs) == eager


@pytest.mark.gpu
def test_gpu_lora_scale_and_weight_moves(modelopt_exports):
    pipe, kwargs, shas = _lora_pipe(modelopt_exports, device="cuda")
    enable_fast_paths(pipe, cuda_graphs=True)
    _replay_each_scale(pipe, kwargs, shas)
    pipe.transformer.to("cpu")
    pipe.transformer.to("cuda")  # every weight at a new address: the old graphs would read freed memory
    assert _sha(pipe, kwargs) == shas[1.0]
    assert _graphs(pipe)["eager_calls"] == {}


def _allocated() -> int:
    import gc

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


MIB = 2**20


@pytest.mark.gpu
def test_gpu_disable_and_release_give_back_every_byte_over_ten_cycles(modelopt_exports):
    """Ten sizes per round (8 graphs kept, 2 evicted), then disable_fast_paths or release_cuda_graphs: allocated
    memory is at most the eager baseline right after, and the baseline again after the next eager round. Before the
    fix each cycle kept the cuBLAS workspace torch made for the runner's side stream (32 MiB on Hopper)."""
    from diffusers_nvfp4_fast import capture_cuda_graphs, release_cuda_graphs
    from diffusers_nvfp4_fast.torch_compat import clear_cublas_workspaces

    pipe, kwargs = _pipe("flux2", modelopt_exports, device="cuda")
    enable_fast_paths(pipe)
    clear_cublas_workspaces()  # the baseline holds only what this eager run makes (no earlier test's workspaces)

    def generate():
        for size in range(64, 224, 16):
            run_pipeline(pipe, kwargs, size=size, steps=2)

    generate()
    baseline = _allocated()
    for cycle in range(10):
        if cycle % 2:
            capture_cuda_graphs(pipe)
        else:
            enable_fast_paths(pipe, cuda_graphs=True)
        generate()
        report = _graphs(pipe)
        assert report["graphs"] == 8 and report["evictions"] >= 2 and report["pool_bytes"] > 0, report
        held = _allocated()
        if cycle % 2:
            release_cuda_graphs(pipe)
        else:
            disable_fast_paths(pipe)
        released = _allocated()
        assert released <= baseline + MIB, (cycle, baseline, held, released)
        enable_fast_paths(pipe)
        generate()
        assert abs(_allocated() - baseline) <= MIB, (cycle, baseline, held, released, _allocated())


@pytest.mark.gpu
def test_gpu_full_size_klein_release_gives_back_the_pool(modelopt_exports):
    """FLUX.2-klein-4B at its real size (random NVFP4 weights, 1024x1024, 512 text tokens): the runner's pool (about
    1.4 GB on the H100) and every other byte it held return at release."""
    import bench_transformer_step as step

    from diffusers_nvfp4_fast import release_cuda_graphs

    model = step.empty_model("flux2-klein-4b", tiny=False)
    step.materialize(model, "flux2-klein-4b", torch.device("cuda"), nvfp4=True)
    enable_fast_paths(model)
    inputs = step.make_inputs("flux2-klein-4b", model, 1024, 1024, 512, "cuda")
    with torch.no_grad():
        eager = model(**inputs)[0]
        baseline = _allocated()
        enable_fast_paths(model, cuda_graphs=True)
        outs = [model(**inputs)[0] for _ in range(3)]  # capture, then replays
    report = graph_report(model)
    assert report["replays"] == 2 and report["pool_bytes"] > 2**28, report
    assert all(torch.equal(o.view(torch.int16), eager.view(torch.int16)) for o in outs)
    del outs
    release_cuda_graphs(model)
    assert _allocated() <= baseline + MIB
