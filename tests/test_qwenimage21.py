"""Qwen-Image 2.1 (``QwenImage21Transformer2DModel``): the fused sites of ``patches/qwenimage21.py`` and
``patches/qwen21_attention.py`` (``qwen21_adaln``, ``qwen21_resnorm``, ``qwen21_swiglu``, ``qwen21_qk_rotary``).

CPU: the transformer's output bytes (and the KV cache's) with fast paths off, on and off again, with per-token
modulation (``causal_condition``: condition and text tokens take the ``t = 0`` row), per-sample modulation, padded
prompts, a condition image, at every KV-cache mode; every site counted, verified at every call; hooks, LoRA and
other processors fall back, counted; the CUDA-graph runner (simulated); ``disable_fast_paths`` puts back the same
objects; under ``torch.compile`` the block runs diffusers' forward. On the CPU the ops run their torch references,
so these tests check the wiring against diffusers' code; the kernels are checked against those references in
``test_layer_norm_quantize.py`` (no shift, signed zeros), ``test_swiglu_quantize.py`` (gate and up as two tensors)
and ``test_qk_norm_rotary.py``.

GPU (``gpu``): one full-size block (diffusers' default config: width 4096, 32 heads of 128, feed-forward 12288) with
every site's kernel, verified at every call, eager on == off, at every KV-cache mode.
"""

from __future__ import annotations

import copy
import functools
import inspect

import pytest
import torch
from diffusers.models.transformers import transformer_qwenimage as qwen_module
from diffusers.models.transformers import transformer_qwenimage21 as qwen21_module
from torch import nn

from diffusers_nvfp4_fast import disable_fast_paths, enable_fast_paths, fast_path_report
from diffusers_nvfp4_fast.linear import NVFP4Linear
from diffusers_nvfp4_fast.ops.layer_norm_quantize import AdaLNInputs, ResNormInputs, adaln_chain, residual_norm_chain
from diffusers_nvfp4_fast.ops.qk_norm_rotary import probe_inputs
from diffusers_nvfp4_fast.ops.verify import new_stats
from diffusers_nvfp4_fast.patches.qwen21_attention import QwenImage21FusedAttnProcessor
from diffusers_nvfp4_fast.patches.qwenimage21 import patch_qwenimage21
from diffusers_nvfp4_fast.testing import export
from support.tiny_family import QWEN21_EXCLUDE, tiny_qwen21_transformer

pytestmark = pytest.mark.usefixtures("fresh_verdicts")

NAME = "QwenImage21Transformer2DModel"
# per transformer call, 2 blocks: norm1, norm2 and the feed-forward once each, the query/key norm twice (q and k)
CALLS = {"qwen21_adaln": 2, "qwen21_resnorm": 2, "qwen21_swiglu": 2, "qwen21_qk_rotary": 4}
SITES = {"qwen21_adaln": 2, "qwen21_resnorm": 2, "qwen21_swiglu": 2, "qwen21_qk_rotary": 2}


@functools.cache
def _quantized(causal_condition: bool = True) -> nn.Module:
    """The tiny transformer (2 blocks, width 256, heads of 128), every block Linear NVFP4 with one input scale, and
    random query/key RMSNorm weights (negative ones too); built once (quantizing takes seconds on a CPU)."""
    model = tiny_qwen21_transformer(causal_condition=causal_condition)
    export.quantize_model_inplace(model, QWEN21_EXCLUDE, 8.0)
    gen = torch.Generator().manual_seed(1)
    for module in model.modules():
        if type(module).__name__ == "RMSNorm" and module.weight is not None:
            module.weight.data = (1 + 0.8 * torch.randn(module.weight.shape, generator=gen)).bfloat16()
    return model


def _model(causal_condition: bool = True) -> nn.Module:
    """A fresh copy of ``_quantized`` (tests change processors, hooks and scales)."""
    return copy.deepcopy(_quantized(causal_condition))


def _inputs(batch: int = 1, padded: bool = False) -> dict:
    """A joint sequence as ``QwenImage21Pipeline`` builds it: 3 text tokens, a 2x4 condition image (2 vision-language
    slots), 3 more text tokens, then the 4x4 target image (4 slots); ``padded``: the last text token masked out."""
    gen = torch.Generator().manual_seed(2)
    img_mask = torch.tensor([[False] * 3 + [True] * 2 + [False] * 3 + [True] * 4] * batch)
    kwargs = dict(hidden_states=torch.randn(batch, 8 + 16, 16, generator=gen).bfloat16(),
                  encoder_hidden_states=torch.randn(batch, 8, 16, generator=gen).bfloat16(),
                  timestep=torch.full((batch,), 0.7).bfloat16(), img_shapes=[[(1, 2, 4), (1, 4, 4)]] * batch,
                  img_mask=img_mask, return_dict=False)
    if padded:
        mask = torch.ones(batch, 8, dtype=torch.bool)
        mask[:, -1] = False
        kwargs["encoder_hidden_states_mask"] = mask
    return kwargs


@torch.inference_mode()
def _run(model: nn.Module, kwargs: dict, cache: bool) -> list[torch.Tensor]:
    """The output (without ``cache``), or the outputs of an ``extract`` and a ``cached`` call and every layer's cached
    keys and values (with it)."""
    if not cache:
        return [model(**kwargs)[0]]
    kv = qwen21_module.QwenImage21KVCache(len(model.transformer_blocks))
    extract = model(**kwargs, kv_cache=kv, kv_cache_mode="extract")[0]
    cached = model(**kwargs, kv_cache=kv, kv_cache_mode="cached")[0]
    return [extract, cached, *[t for layer in kv.layer_caches for t in (layer.k, layer.v)]]


def _bits(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.view(torch.int16) for t in tensors]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(_bits(a), _bits(b), strict=True))


@functools.cache
def _off(causal_condition: bool, batch: int, padded: bool, cache: bool) -> list[torch.Tensor]:
    """The bytes with fast paths off (computed once per case: the CPU's emulated GEMM takes most of a test's time)."""
    return _run(_model(causal_condition), _inputs(batch, padded), cache)


def _on(model: nn.Module, kwargs: dict, cache: bool, verify="always") -> tuple[dict, list[torch.Tensor]]:
    """(report entry, outputs) with fast paths on; disabled again afterwards."""
    enable_fast_paths(model, verify=verify)
    try:
        out = _run(model, kwargs, cache)
        return fast_path_report(model)[NAME], out
    finally:
        disable_fast_paths(model)


def test_rotary_function_is_qwen_images():
    """The 2.1 module's ``apply_rotary_emb_qwen`` is a copy of Qwen-Image's, whose arithmetic the QK kernel and its
    reference reproduce; its query/key norms are the same ``RMSNorm`` class."""
    assert inspect.getsource(qwen21_module.apply_rotary_emb_qwen) == inspect.getsource(
        qwen_module.apply_rotary_emb_qwen)
    attn = qwen21_module.QwenImage21Attention(dim=256, heads=2, dim_head=128)
    assert type(attn.norm_q) is type(attn.norm_k) is qwen_module.RMSNorm


def test_reference_chains_are_diffusers_block_code():
    """The ops' references without a shift equal ``QwenImage21TransformerBlock``'s own norm1 and norm2 sections
    (``_modulate`` with per-token rows, ``h + tanh(gate) * attn``) byte for byte, on rows whose modulated values are
    zeros of both signs (a constant row normalizes to +0; ``scale = -2`` makes ``1 + scale = -1``)."""
    gen = torch.Generator().manual_seed(3)
    d, length = 256, 6
    x = torch.randn(1, length, d, generator=gen).bfloat16()
    x[0, 0] = 2.0
    mod = (torch.randn(2, 2 * d, generator=gen) * 0.5).bfloat16()  # the real row, then the t = 0 row
    mod[:, :d:5] = -2.0
    mask = torch.tensor([False, False, True, True, False, True])
    norm = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
    block_modulated, gate = qwen21_module.QwenImage21TransformerBlock._modulate(None, norm(x), mod, mask)
    scale = qwen21_module._select_modulation_rows(mod.chunk(2, dim=-1)[0], mask)
    ours = adaln_chain(AdaLNInputs(x, scale, None), 1e-6)
    assert torch.equal(ours.view(torch.int16), block_modulated.view(torch.int16))
    assert int((ours.view(torch.int16)[0, 0] == -32768).sum()) > 0  # -0 values reached the comparison

    attn = torch.randn(1, length, d, generator=gen).bfloat16()
    attn[0, 0] = 0.0
    hidden = x + gate.tanh() * attn
    block_modulated2, _ = qwen21_module.QwenImage21TransformerBlock._modulate(None, norm(hidden), mod, mask)
    r, m = residual_norm_chain(ResNormInputs(x, attn, None, gate.tanh(), scale, None), 1e-6)
    assert torch.equal(r.view(torch.int16), hidden.view(torch.int16))
    assert torch.equal(m.view(torch.int16), block_modulated2.view(torch.int16))


CASES = {  # id: (causal_condition, batch, padded prompt, KV cache)
    "per-token": (True, 1, False, False),
    "kv-extract-cached": (True, 1, False, True),
    "batch2-padded-kv": (True, 2, True, True),
    "per-sample-batch2": (False, 2, True, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_same_bytes_on_as_off(case):
    """Output (and KV cache) bytes with fast paths on equal those with them off; every site installed on both blocks,
    fused at every call, verified at every call (``verify="always"``), nothing falling back."""
    causal, batch, padded, cache = CASES[case]
    entry, on = _on(_model(causal), _inputs(batch, padded), cache)
    assert _same(on, _off(causal, batch, padded, cache))
    calls = 2 if cache else 1
    assert entry["sites"] == SITES
    assert entry["fused_calls"] == {kind: n * calls for kind, n in CALLS.items()}, entry
    assert entry["fallbacks"] == {} and entry["verifications"]["failed"] == 0, entry
    assert entry["verifications"]["passed_by_kind"] == entry["fused_calls"]


def test_off_again_after_disable_and_the_same_objects_back():
    """``disable_fast_paths`` puts back every forward and processor (the same objects) and the bytes are diffusers'
    again; a cache filled with fast paths on serves a step with them off (it holds diffusers' bytes)."""
    model, kwargs = _model(), _inputs()
    blocks = list(model.transformer_blocks)
    processors = [block.attn.processor for block in blocks]
    kv = qwen21_module.QwenImage21KVCache(2)
    enable_fast_paths(model)
    assert all(isinstance(block.attn.processor, QwenImage21FusedAttnProcessor) for block in blocks)
    assert all("forward" in block.__dict__ for block in blocks)
    with torch.inference_mode():
        extract = model(**kwargs, kv_cache=kv, kv_cache_mode="extract")[0]
        disable_fast_paths(model)
        cached = model(**kwargs, kv_cache=kv, kv_cache_mode="cached")[0]
    assert all(block.attn.processor is p for block, p in zip(blocks, processors, strict=True))
    assert not any("forward" in block.__dict__ or "_nvfp4_block_state" in block.__dict__ for block in blocks)
    assert _same([extract, cached], _off(True, 1, False, True)[:2])


class _Seen:
    def __init__(self):
        self.calls = 0

    def __call__(self, *_):
        self.calls += 1


HOOKED = {  # module of block 0 with a torch forward hook -> the fallback it causes (per transformer call)
    "img_norm1": {"qwen21_adaln: hook on norm1: torch forward hook": 1},
    "attn": {"qwen21_adaln: hook on attention: torch forward hook": 1},
    "attn.to_k": {"qwen21_adaln: hook on to_k: torch forward hook": 1},
    "attn.norm_k": {"qwen21_qk_rotary: hook on query/key norm: torch forward hook": 1},
    "img_norm2": {"qwen21_resnorm: hook on norm2: torch forward hook": 1},
    "img_mlp.proj": {"qwen21_resnorm: hook on proj: torch forward hook": 1},
    "img_mlp": {"qwen21_resnorm: hook on feed-forward: torch forward hook": 1,
                "qwen21_swiglu: hook on feed-forward: torch forward hook": 1},
    "img_mlp.activation_fn": {"qwen21_swiglu: hook on activation_fn: torch forward hook": 1},
    "img_mlp.out": {"qwen21_swiglu: hook on out: torch forward hook": 1},
}


@pytest.mark.parametrize("where", list(HOOKED))
def test_a_hook_makes_its_site_fall_back_counted(where):
    """A fused path must not bypass a hooked call or hand a hooked projection packed input: the site falls back with
    its reason, the hook runs once per call (as with fast paths off), and the bytes are unchanged."""
    model = _model()
    seen = _Seen()
    model.transformer_blocks[0].get_submodule(where).register_forward_hook(seen)
    entry, on = _on(model, _inputs(), cache=False)
    assert _same(on, _off(True, 1, False, False))
    assert seen.calls == 1
    assert entry["fallbacks"] == HOOKED[where], entry
    for key, n in HOOKED[where].items():  # the other block (and the other query/key tensor) still fuse
        kind = key.split(": ", 1)[0]
        assert entry["fused_calls"].get(kind, 0) == CALLS[kind] - n, entry


@pytest.mark.parametrize("target,site", [("to_v", "qwen21_adaln"), ("proj", "qwen21_resnorm"),
                                         ("out", "qwen21_swiglu")])
def test_a_lora_on_a_consumer_makes_its_site_fall_back(target, site):
    """A peft LoRA (random, so it changes the output) on one of a site's NVFP4 consumers in both blocks: that site
    falls back with reason ``lora`` at every call, the others fuse, and on == off with the LoRA."""
    peft = pytest.importorskip("peft", reason="peft is not installed, so the LoRA case did not run (CI installs it)")
    from diffusers_nvfp4_fast.lora import register_lora_support

    register_lora_support()
    model, kwargs = _model(), _inputs()
    model.add_adapter(peft.LoraConfig(r=4, lora_alpha=4, target_modules=[target], init_lora_weights=False))
    off = _run(model, kwargs, cache=False)
    entry, on = _on(model, kwargs, cache=False)
    assert _same(off, on) and not _same(off, _off(True, 1, False, False))
    assert entry["fallbacks"] == {f"{site}: lora": 2}, entry
    assert entry["fused_calls"] == {k: n for k, n in CALLS.items() if k != site}, entry


def test_flex_processor_keeps_diffusers_query_key_path_counted():
    """``QwenImage21FlexAttnProcessor`` (set after enabling) is not replaced: its blocks count a ``qwen21_qk_rotary``
    fallback per call and keep the norm1 site (the processor reads its input only through the projections); the
    processor the user set stays after ``disable_fast_paths``."""
    model, kwargs = _model(), _inputs()
    flex = qwen21_module.QwenImage21FlexAttnProcessor()
    model.set_attn_processor(flex)
    off = _run(model, kwargs, cache=False)
    model.set_attn_processor(qwen21_module.QwenImage21AttnProcessor())
    enable_fast_paths(model, verify="always")
    model.set_attn_processor(flex)
    on = _run(model, kwargs, cache=False)
    entry = fast_path_report(model)[NAME]
    disable_fast_paths(model)
    assert _same(off, on)
    assert entry["fallbacks"] == {"qwen21_qk_rotary: attention processor is QwenImage21FlexAttnProcessor": 2}, entry
    assert entry["fused_calls"] == {k: n for k, n in CALLS.items() if k != "qwen21_qk_rotary"}, entry
    assert all(block.attn.processor is flex for block in model.transformer_blocks)


def test_feed_forward_input_scales_must_agree():
    """``gate_layer`` and ``proj`` read one quantized input only with one input scale: otherwise that site is not
    installed (the others are) and the bytes stay diffusers'."""
    model, kwargs = _model(), _inputs()
    for block in model.transformer_blocks:
        proj = block.img_mlp.proj
        assert isinstance(proj, NVFP4Linear)
        proj.input_scale.mul_(2.0)
        proj.refresh_derived_scales_()
    off = _run(model, kwargs, cache=False)
    entry, on = _on(model, kwargs, cache=False)
    assert _same(off, on)
    assert entry["sites"] == {k: n for k, n in SITES.items() if k != "qwen21_resnorm"}, entry
    assert entry["fallbacks"] == {} and "qwen21_resnorm" not in entry["fused_calls"], entry


def test_cuda_graph_runner_replays_the_prefill_and_runs_cache_steps_eagerly():
    """The CUDA-graph runner (``"simulate"`` backend on the CPU): a call without a cache is captured and replayed with
    the fused sites' bytes; calls with a ``QwenImage21KVCache`` argument run eagerly, counted with that reason."""
    from diffusers_nvfp4_fast.graphs import capture_cuda_graphs, graph_report

    model, kwargs = _model(), _inputs()
    enable_fast_paths(model)
    capture_cuda_graphs(model, backend="simulate")
    try:
        replays = [_run(model, kwargs, cache=False)[0] for _ in range(3)]
        cached = _run(model, kwargs, cache=True)
        report = graph_report(model)
    finally:
        disable_fast_paths(model)
    assert all(_same([r], _off(True, 1, False, False)) for r in replays)
    assert _same(cached, _off(True, 1, False, True))
    assert report["captures"] == 1 and report["replays"] == 2, report
    assert report["eager_calls"] == {"argument kwargs['kv_cache'] is a QwenImage21KVCache": 2}, report


def test_compiled_blocks_run_diffusers_forward():
    """Under ``torch.compile`` (``compile_repeated_blocks``, ``aot_eager``) the block runs diffusers' forward: one
    graph for the block class, every site counted ``compiled: kept diffusers' op`` once for its trace, and the bytes of
    the eager model with fast paths off."""
    from torch._dynamo.utils import counters

    model = _model()
    enable_fast_paths(model)
    torch._dynamo.reset()
    counters.clear()
    model.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
    try:
        on = _run(model, _inputs(), cache=False)
        entry = fast_path_report(model)[NAME]
    finally:
        disable_fast_paths(model)
        torch._dynamo.reset()
    assert _same(on, _off(True, 1, False, False))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert entry["fused_calls"] == {}, entry
    assert entry["fallbacks"] == {f"{kind}: compiled: kept diffusers' op": 1 for kind in SITES}, entry


# ---------------------------------------------------------------------------------------------------------------
# GPU: one full-size block with the kernels.
# ---------------------------------------------------------------------------------------------------------------


class _Holder(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.transformer_blocks = nn.ModuleList([block])


@torch.inference_mode()
def _block_on_equals_off(device: str, dim: int, heads: int, prefix: int, target: int) -> None:
    """One NVFP4 ``QwenImage21TransformerBlock`` of width ``dim`` (heads of 128, feed-forward 3 x dim) after
    ``prefix`` text tokens and ``target`` image tokens: the prefill without a cache and batch 2 with per-sample
    modulation, then the ``extract`` step and the ``cached`` step (target rows only) with per-token modulation; every
    site fused and verified at every call, on == off byte for byte (the KV cache too)."""
    torch.manual_seed(0)
    block = qwen21_module.QwenImage21TransformerBlock(dim=dim, num_attention_heads=heads, attention_head_dim=128)
    block = block.to(device, torch.bfloat16)
    for norm in (block.attn.norm_q, block.attn.norm_k):
        norm.weight.data.normal_(1.0, 0.3)
    holder = _Holder(block)
    assert export.quantize_model_inplace(holder, (), 16.0) == 7
    seq = prefix + target
    rotary = probe_inputs(1, seq, 1, device=device, seed=1)[2]
    mask = torch.arange(seq, device=device) >= prefix

    def call(batch: int, mode: str | None = None, layer_cache=None) -> torch.Tensor:
        gen = torch.Generator(device=device).manual_seed(batch)
        h = torch.randn(batch, seq, dim, device=device, generator=gen).bfloat16()
        per_token = batch == 1  # causal_condition: B + 1 modulation rows, selected per token
        modulation = (torch.randn(batch + per_token, 4 * dim, device=device, generator=gen) * 0.5).bfloat16()
        if mode == "cached":
            return block(h[:, prefix:], modulation, rotary_emb=rotary[prefix:], target_token_mask=mask[prefix:],
                         layer_cache=layer_cache, kv_cache_mode=mode)
        return block(h, modulation, rotary_emb=rotary, target_token_mask=mask if per_token else None,
                     layer_cache=layer_cache, kv_cache_mode=mode, segments=[(0, prefix, True)],
                     cache_write_slice=slice(0, prefix) if mode == "extract" else None)

    def kv_steps() -> list[torch.Tensor]:
        cache = qwen21_module.QwenImage21KVLayerCache()
        extract = call(1, "extract", cache)
        cached = call(1, "cached", cache)
        return [extract, cached, *cache.get()]

    for label, fn, calls in (("prefill", lambda: [call(1)], 1), ("batch 2", lambda: [call(2)], 1),
                             ("extract + cached", kv_steps, 2)):
        off = fn()
        stats_id, stats = new_stats("always")
        restore: list = []
        assert patch_qwenimage21(holder, stats_id, restore) == {"qwen21_adaln": 1, "qwen21_resnorm": 1,
                                                                 "qwen21_swiglu": 1, "qwen21_qk_rotary": 1}
        try:
            on = fn()
        finally:
            for undo in restore:
                undo()
        assert _same(off, on), label
        for kind, n in (("qwen21_adaln", 1), ("qwen21_resnorm", 1), ("qwen21_swiglu", 1), ("qwen21_qk_rotary", 2)):
            assert stats.fused_calls[kind] == n * calls and stats.verified[kind] == n * calls, (label, stats)
        assert not stats.fallbacks and not stats.verify_failed, (label, stats)


def test_one_block_prefill_cache_steps_and_batch2():
    """The full-size GPU test's code on the CPU at the tiny width (the ops' torch references)."""
    _block_on_equals_off("cpu", dim=256, heads=2, prefix=8, target=16)


@pytest.mark.gpu
def test_gpu_full_size_block_identical():
    """diffusers' default ``QwenImage21Transformer2DModel`` block (width 4096, 32 heads of 128, feed-forward 12288),
    NVFP4, at 1024x1024 (4096 target tokens) after 512 prefix tokens, every site's kernel verified at every call."""
    _block_on_equals_off("cuda", dim=4096, heads=32, prefix=512, target=4096)


@pytest.mark.parametrize("kv_cached", [False, True], ids=["prefill", "kv-cached"])
def test_step_benchmark_tiny_run(kv_cached):
    """``benchmarks/bench_transformer_step.py --model qwen-image-2.1 --tiny [--kv-cached]``, in process: the NVFP4
    model under the public exclusion rule (blocks 2 and 3 of 6 NVFP4), fast paths on == off, every site fused."""
    import argparse

    import bench_transformer_step as bench

    args = argparse.Namespace(model="qwen-image-2.1", tiny=True, height=64, width=64, text_tokens=8, steps_timed=1,
                              warmup=1, skip_bf16=True, cuda_graph=False, compile=None, kv_cached=kv_cached)
    result = bench.run(args)
    on = next(c for c in result["cases"] if c["variant"] == "nvfp4_fast_on")
    assert on["exact"] and result["layers"]["nvfp4_linears"] == 14, result["layers"]
    assert on["fast_path_report"][NAME]["fused_calls"] == CALLS, on["fast_path_report"]
    assert on["fast_path_report"][NAME]["fallbacks"] == {}
