"""One denoising step of the full-size FLUX.2-dev / Qwen-Image transformer: NVFP4 (fast paths off / on) vs BF16.

    python benchmarks/bench_transformer_step.py --model qwen-image [--cuda-graphs] [--steps-timed 11]
    python benchmarks/bench_transformer_step.py --model qwen-image-2.1 [--kv-cached]
    python benchmarks/bench_transformer_step.py --model flux2-dev --compile [blocks]  # torch.compile (inductor)
    python benchmarks/bench_transformer_step.py --model flux2-dev --tiny     # CPU dry run of the whole logic
Writes benchmarks/results/transformer_step-<model>[-graph|-compile|-compile-blocks]-<device>.json (docs/design.md
§10) and prints a table. ``--compile blocks`` compiles each block as ``compile_repeated_blocks(fullgraph=True)``
does. With ``--compile`` fast paths off and on are timed in two phases (alternating would recompile at each switch)
with inductor's precision-cast emulation on, under which compiled on equals compiled off.

The NVFP4 model never exists in BF16: built on the meta device (class defaults = the public configs), each Linear the
public NVFP4 checkpoints quantize (``FLUX2_EXCLUDE`` / ``qwen_exclude(60)`` of ``testing.tiny``, matched with
``loaders.common.is_excluded``, ``in_features % 16 == 0``) gets a random BF16 weight ``randn * 0.02`` on the GPU,
quantized at once into an ``NVFP4Linear`` (``NVFP4Linear.from_weight``); the BF16 weight is freed before the next.
``input_scale`` is ``8 / 2688`` (block inputs are normalized and modulated; it changes which codes occur, not the
speed). Every other parameter is random BF16 (norm weights 1, biases 0). The BF16 reference model is built the same
way after the NVFP4 model is freed, when it fits in memory.

Inputs at H x W: FLUX.2: latent (H/16)*(W/16) tokens of 128 channels (4096 at 1024x1024) + ``--text-tokens`` text
tokens of 15360 channels, timestep 0.5, guidance 4.0, position ids as Flux2Pipeline builds them. Qwen-Image:
(H/16)*(W/16) tokens of 64 channels + text tokens of 3584 channels, no text mask, ``img_shapes = [[(1, H/16,
W/16)]]``. Qwen-Image 2.1 (diffusers 0.42.1's defaults: 32 blocks of width 4096): the target tokens after the text
tokens, no condition image; the full prefill (``kv_cache=None``), or with ``--kv-cached`` a decode step against a
cache filled once by an ``extract`` call (what QwenImage21Pipeline runs after its first step; the CUDA-graph runner
runs such calls, and the 2.1 forward, which reads its token masks on the host, eagerly).

Measured per variant: ms per step (median of ``--steps-timed`` forwards after ``--warmup``, CUDA events; fast paths
off and on alternate round by round so that clock drift cannot favour either), host ms, peak GPU memory, weight bytes.
With ``--cuda-graphs`` each variant runs through ``capture_cuda_graphs`` after the eager warm-up: fast paths off, then
on, then BF16 eager and BF16 through the same runner; ``replay_equals_eager`` compares each replay with the eager
output of its variant (``transformer_step-<model>-graph-<device>.json``). ``exact``: the fast-paths-on output has the
bytes of the fast-paths-off output (and off is repeatable). Models: ``flux2-dev``, ``flux2-klein-4b``,
``flux2-klein-9b`` (configs from the model cards, ``MODELS``), ``qwen-image``, ``qwen-image-2.1``.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))

INPUT_AMAX = 8.0  # activation amax behind the fixed input_scale (see the module docstring)
WEIGHT_STD = 0.02
# Step speed NVFP4 (fast paths on) / BF16 per model (issue 22), and the weight-memory ratio.
# Issue 34's goals: eager (and compiled) NVFP4 vs the same mode of BF16; with the CUDA-graph runner vs BF16 eager and
# vs BF16 with the same runner.
GOALS = {"nvfp4_vs_bf16_speed": {"flux2-dev": 1.15, "qwen-image": 1.0},
         "runner_vs_bf16_eager": {"flux2-dev": 1.2, "qwen-image": 1.2},
         "runner_vs_bf16_runner": {"flux2-dev": 1.2, "qwen-image": 1.15, "flux2-klein-4b": 1.15,
                                   "flux2-klein-9b": 1.15},
         "weight_memory_ratio": 3.5}

_KLEIN_TINY = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
                   num_attention_heads=2, joint_attention_dim=48, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False)
MODELS = {
    "flux2-dev": {
        "cls": "Flux2Transformer2DModel",
        "full": {},  # diffusers 0.42 defaults: 8 double + 48 single blocks, 48 x 128 heads, in 128, text 15360
        "tiny": dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
                     num_attention_heads=2, joint_attention_dim=48, axes_dims_rope=(4, 4, 4, 4)),
    },
    # FLUX.2-klein: transformer configs of black-forest-labs/FLUX.2-klein-4B and -9B (their transformer/config.json;
    # BFL's flux2 repository, src/flux2/model.py Klein4BParams / Klein9BParams; docs/design.md §5): no guidance
    # embedder, text width = 3 Qwen3 layers (2560 / 4096; bench_pipeline_budget.QWEN3).
    "flux2-klein-4b": {
        "cls": "Flux2Transformer2DModel",
        "full": dict(num_layers=5, num_single_layers=20, num_attention_heads=24, attention_head_dim=128,
                     joint_attention_dim=7680, guidance_embeds=False),
        "tiny": _KLEIN_TINY,
    },
    "flux2-klein-9b": {
        "cls": "Flux2Transformer2DModel",
        "full": dict(num_layers=8, num_single_layers=24, num_attention_heads=32, attention_head_dim=128,
                     joint_attention_dim=12288, guidance_embeds=False),
        "tiny": _KLEIN_TINY,
    },
    "qwen-image": {
        "cls": "QwenImageTransformer2DModel",
        "full": {},  # diffusers 0.42 defaults: 60 blocks, 24 x 128 heads, in 64, out 16, text 3584
        "tiny": dict(patch_size=2, in_channels=16, out_channels=4, num_layers=6, attention_head_dim=128,
                     num_attention_heads=4, joint_attention_dim=16, axes_dims_rope=(16, 56, 56)),
    },
    "qwen-image-2.1": {
        "cls": "QwenImage21Transformer2DModel",
        # diffusers 0.42.1's QwenImage21Transformer2DModel.__init__ defaults (no public checkpoint config to follow):
        # 32 blocks, 32 x 128 heads (width 4096), mlp_ratio 3 (12288), in/out 64, context 4096, causal_condition
        "full": {},
        "tiny": dict(patch_size=1, in_channels=16, out_channels=16, num_layers=6, attention_head_dim=128,
                     num_attention_heads=2, context_in_dim=16, axes_dims_rope=(32, 48, 48)),
    },
}


# ---------------------------------------------------------------------------------------------------------------
# Model construction.
# ---------------------------------------------------------------------------------------------------------------


def exclude_patterns(model_name: str, config: dict) -> tuple[str, ...]:
    from diffusers_nvfp4_fast.quantize import recipes

    return recipes.exclude_patterns(MODELS[model_name]["cls"], config)


def empty_model(model_name: str, tiny: bool) -> nn.Module:
    """The diffusers transformer with all parameters on the meta device (buffers real, on CPU)."""
    import diffusers
    from accelerate import init_empty_weights

    spec = MODELS[model_name]
    with init_empty_weights(include_buffers=False):
        model = getattr(diffusers, spec["cls"])(**spec["tiny" if tiny else "full"])
    return model.eval()


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.GroupNorm)) or "Norm" in type(module).__name__


def materialize(model: nn.Module, model_name: str, device: torch.device, *, nvfp4: bool, seed: int = 0) -> dict:
    """Replace meta parameters with random ones on ``device``, layer by layer; quantize Linears when ``nvfp4``.

    Returns counts: quantized and BF16 Linears.
    """
    from diffusers_nvfp4_fast import NVFP4Linear
    from diffusers_nvfp4_fast.loaders.common import is_excluded

    gen = torch.Generator(device=device).manual_seed(seed)
    patterns = list(exclude_patterns(model_name, dict(model.config)))
    input_scale = torch.tensor(INPUT_AMAX / 2688.0, dtype=torch.float32)
    counts = {"nvfp4_linears": 0, "bf16_linears": 0}
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, lin in linears:
        quantize = nvfp4 and not is_excluded(name, patterns) and lin.in_features % 16 == 0
        w = torch.randn(lin.out_features, lin.in_features, device=device, dtype=torch.bfloat16,
                        generator=gen) * WEIGHT_STD
        bias = None
        if lin.bias is not None:
            bias = torch.randn(lin.out_features, device=device, dtype=torch.bfloat16, generator=gen) * WEIGHT_STD
        if quantize:
            model.set_submodule(name, NVFP4Linear.from_weight(w, bias, input_scale))
            del w
            counts["nvfp4_linears"] += 1
        else:
            lin.weight = nn.Parameter(w, requires_grad=False)
            if bias is not None:
                lin.bias = nn.Parameter(bias, requires_grad=False)
            counts["bf16_linears"] += 1
    # Everything else still on meta: norms get weight 1 / bias 0, the rest random.
    for module in model.modules():
        for p_name, p in list(module.named_parameters(recurse=False)):
            if p.device.type != "meta":
                continue
            if _is_norm(module):
                value = torch.ones(p.shape, device=device, dtype=torch.bfloat16) if p_name == "weight" else \
                    torch.zeros(p.shape, device=device, dtype=torch.bfloat16)
            else:
                value = torch.randn(p.shape, device=device, dtype=torch.bfloat16, generator=gen) * WEIGHT_STD
            setattr(module, p_name, nn.Parameter(value, requires_grad=False))
    # Buffers were created for real (include_buffers=False); move them without touching any dtype (NVFP4Linear
    # keeps FP32 scales and uint8 weights, so no model.to(dtype)).
    model.to(device)
    left = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if left:
        raise RuntimeError(f"parameters left on meta: {left[:5]}")
    return counts


def bf16_param_bytes(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters()) * 2


# ---------------------------------------------------------------------------------------------------------------
# Inputs and timing.
# ---------------------------------------------------------------------------------------------------------------


def make_inputs(model_name: str, model: nn.Module, height: int, width: int, text_tokens: int, device,
                kv_cached: bool = False) -> dict:
    """Keyword arguments of one denoising-step forward (batch 1), as the diffusers pipelines build them."""
    cfg = model.config
    h, w = height // 16, width // 16  # VAE /8, then 2x2 patches (Qwen-Image 2.1: VAE /16, no patches)
    gen = torch.Generator(device=device).manual_seed(1234)
    bf16 = torch.bfloat16
    hidden = torch.randn(1, h * w, cfg.in_channels, device=device, dtype=bf16, generator=gen)
    if model_name == "qwen-image-2.1":
        return _qwen21_inputs(model, hidden, h, w, text_tokens, gen, kv_cached)
    text = torch.randn(1, text_tokens, cfg.joint_attention_dim, device=device, dtype=bf16, generator=gen)
    timestep = torch.full((1,), 0.5, device=device, dtype=bf16)
    if model_name.startswith("flux2"):
        img_ids = torch.cartesian_prod(torch.arange(1), torch.arange(h), torch.arange(w), torch.arange(1)).to(device)
        txt_ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1),
                                       torch.arange(text_tokens)).to(device)
        guidance = torch.full((1,), 4.0, device=device, dtype=torch.float32) if cfg.guidance_embeds else None
        return dict(hidden_states=hidden, encoder_hidden_states=text, timestep=timestep, img_ids=img_ids,
                    txt_ids=txt_ids, guidance=guidance, return_dict=False)
    return dict(hidden_states=hidden, encoder_hidden_states=text, encoder_hidden_states_mask=None, timestep=timestep,
                img_shapes=[[(1, h, w)]], return_dict=False)


def _qwen21_inputs(model: nn.Module, hidden: torch.Tensor, h: int, w: int, text_tokens: int, gen,
                   kv_cached: bool) -> dict:
    """QwenImage21Pipeline's transformer call for a text-to-image step: ``text_tokens`` vision-language text
    positions, then one slot per 2x2 group of the (h*w) target tokens. With ``kv_cached`` a decode step: the cache is
    filled by one ``extract`` call first (with the model as it is: the cache holds the same bytes with fast paths on
    and off, tests/test_qwenimage21.py), and the step reads it (``"cached"``), which leaves it unchanged."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    device = hidden.device
    text = torch.randn(1, text_tokens, model.config.context_in_dim, device=device, dtype=torch.bfloat16,
                       generator=gen)
    img_mask = torch.cat([torch.zeros(1, text_tokens, dtype=torch.bool), torch.ones(1, h * w // 4, dtype=torch.bool)],
                         dim=1).to(device)
    inputs = dict(hidden_states=hidden, encoder_hidden_states=text, timestep=torch.full((1,), 0.5, device=device,
                  dtype=torch.bfloat16), img_shapes=[[(1, h, w)]], img_mask=img_mask, return_dict=False)
    if kv_cached:
        cache = QwenImage21KVCache(len(model.transformer_blocks))
        with torch.inference_mode():
            model(**inputs, kv_cache=cache, kv_cache_mode="extract")
        inputs.update(kv_cache=cache, kv_cache_mode="cached")
    return inputs


def forward(model: nn.Module, inputs: dict) -> torch.Tensor:
    with torch.inference_mode():
        return model(**inputs)[0]


class GraphedForward:
    """``forward(model, inputs)`` through the package's CUDA-graph runner (``capture_cuda_graphs``, the public API):
    the first call runs eagerly and captures, later calls replay. Calling it returns the replayed output (a fresh
    tensor, as users get it)."""

    def __init__(self, model: nn.Module, inputs: dict):
        from diffusers_nvfp4_fast.graphs import capture_cuda_graphs

        self.model, self.inputs = model, inputs
        capture_cuda_graphs(model)
        forward(model, inputs)  # eager + capture
        self.eager_then_replay = forward(model, inputs)  # the first replay

    def __call__(self) -> torch.Tensor:
        return forward(self.model, self.inputs)

    def report(self) -> dict:
        from diffusers_nvfp4_fast.graphs import graph_report

        return graph_report(self.model) or {}

    def release(self) -> None:
        from diffusers_nvfp4_fast.graphs import release_cuda_graphs

        release_cuda_graphs(self.model)


def _timed_call(fn) -> tuple[float, float, torch.Tensor]:
    """(CUDA-event ms, host ms, output) of one call of ``fn``. Host ms is the time until ``fn`` returns, before the
    GPU has finished: when it is close to the CUDA-event time, the step is bound by the host CPU."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    out = fn()
    host_ms = (time.perf_counter() - t0) * 1000.0
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end), host_ms, out


def _timed(fn, device) -> tuple[float, float, torch.Tensor]:
    """``_timed_call`` on a GPU; wall time on the CPU (the --tiny dry run)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        out = fn()
        ms = (time.perf_counter() - t0) * 1000.0
        return ms, ms, out
    return _timed_call(fn)


def _timed_forward(model: nn.Module, inputs: dict, device) -> tuple[float, float, torch.Tensor]:
    return _timed(lambda: forward(model, inputs), device)


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def gpu_bound_ms(fn, host_ms: float, rounds: int = 5) -> float | None:
    """Median CUDA-event ms of ``fn`` queued behind a sleep kernel that outlasts its host time: the step as if the
    host were never late (the GPU's own work and launch gaps only). Set against ``ms_per_step`` it tells how much of
    a step is spent waiting for the host (docs/performance.md, "Host time in compiled graphs")."""
    if not torch.cuda.is_available():
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    cycles_per_ms = 10_000_000 / start.elapsed_time(end)
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(cycles_per_ms * (2.0 * host_ms + 20.0)))
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return _median(times)


def host_speed(device) -> dict:
    """Two fixed host-CPU probes, so that eager step times from different machines can be compared: the median
    time of a pure-Python loop, and of one ``torch.empty`` on the device (what each kernel wrapper pays)."""
    def loop() -> None:
        total = 0
        for i in range(100_000):
            total += i & 7

    loop_ms, empty_us = [], []
    for _ in range(7):
        t0 = time.perf_counter()
        loop()
        loop_ms.append((time.perf_counter() - t0) * 1000.0)
        t0 = time.perf_counter()
        for _ in range(1000):
            torch.empty(256, device=device)
        empty_us.append((time.perf_counter() - t0) * 1000.0)
    return {"python_loop_100k_ms": round(_median(loop_ms), 3), "torch_empty_us": round(_median(empty_us), 3)}


def _peak_gb(device) -> float:
    return torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else 0.0


def _reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def time_steps(model: nn.Module, inputs: dict, warmup: int, timed: int, device,
               graph: bool = False) -> tuple[float, float, float, torch.Tensor]:
    """(median ms per step, median host ms per step, peak GB during the timed steps, output of the last step). With
    ``graph`` the steps go through the CUDA-graph runner, which is released afterwards."""
    out = None
    for _ in range(warmup):
        out = forward(model, inputs)
    step = GraphedForward(model, inputs) if graph else None
    _reset_peak(device)
    times, host = [], []
    for _ in range(timed):
        t, h, out = _timed(step, device) if step is not None else _timed_forward(model, inputs, device)
        times.append(t)
        host.append(h)
    if step is not None:
        step.release()
    return _median(times), _median(host), _peak_gb(device), out


def time_graph_phases(model: nn.Module, inputs: dict, warmup: int, timed: int, device, enable, disable) -> dict:
    """Fast paths off, then on, each through the CUDA-graph runner (``disable_fast_paths`` frees the runner's graphs,
    so the modes cannot alternate): per mode the median ms, host ms, peak GB, the replayed output, whether it has
    the bytes of the same mode's eager call, and the runner's report."""
    runs: dict = {}
    for mode, switch in (("off", disable), ("on", enable)):
        switch(model)
        eager = None
        for _ in range(warmup):  # compile, autotune and first-use verification, eagerly
            eager = forward(model, inputs)
        step = GraphedForward(model, inputs)
        _reset_peak(device)
        times, host = [], []
        for _ in range(timed):
            t, h, out = _timed(step, device)
            times.append(t)
            host.append(h)
        runs[mode] = {"ms": _median(times), "host_ms": _median(host), "peak": _peak_gb(device), "out": out,
                      "times": times, "replay_equals_eager": same_bytes(out, eager), "graphs": step.report()}
    runs["on"]["report"] = enable(model)
    disable(model)  # frees the graphs
    for r in runs.values():
        r.pop("eager", None)
    return runs


def time_off_on(model: nn.Module, inputs: dict, warmup: int, timed: int, device, enable, disable) -> dict:
    """Fast paths off and on, timed in alternating rounds (off, on, off, on, ...) so that clock or thermal drift
    during the run cannot favour either side. Returns per mode: median ms, peak GB, the last output, and for "on"
    the fast-path report taken after its last round."""
    modes = [("off", disable), ("on", enable)]
    runs = {mode: {"times": [], "host": [], "peak": 0.0} for mode, _ in modes}
    for _ in range(warmup):  # compile, autotune and first-use verification happen here, for both modes
        for _, switch in modes:
            switch(model)
            forward(model, inputs)
    for _ in range(timed):
        for mode, switch in modes:
            switch(model)
            _reset_peak(device)
            t, h, runs[mode]["out"] = _timed_forward(model, inputs, device)
            runs[mode]["times"].append(t)
            runs[mode]["host"].append(h)
            runs[mode]["peak"] = max(runs[mode]["peak"], _peak_gb(device))
    runs["on"]["report"] = enable(model)  # the report (its counts cover the last round)
    disable(model)
    for r in runs.values():
        r["ms"], r["host_ms"] = _median(r["times"]), _median(r["host"])
    return runs


def time_off_then_on(runner, inputs: dict, warmup: int, timed: int, device, enable, disable) -> dict:
    """``time_off_on`` for a compiled model: all rounds with fast paths off, then all with them on. Alternating would
    recompile at every switch (enabling installs new processor objects, which the compiled graph's guards check)."""
    runs: dict = {}
    for mode, switch in (("off", disable), ("on", enable)):
        report = switch(runner)
        ms, host_ms, peak, out = time_steps(runner, inputs, warmup, timed, device)
        runs[mode] = {"ms": ms, "host_ms": host_ms, "peak": peak, "out": out, "times": [ms],
                      "gpu_bound_ms": gpu_bound_ms(lambda: forward(runner, inputs), host_ms)}
        if mode == "off":  # is inductor itself repeatable? A second compile of the same model must give these bytes
            torch._dynamo.reset()
            runs["off"]["recompiled_identical"] = same_bytes(forward(runner, inputs), out)
    runs["on"]["report"] = enable(runner)
    disable(runner)
    del report
    return runs


def compiled(model: nn.Module, how: str | None) -> nn.Module:
    """The callable to time: ``model`` itself (eager, or its blocks compiled in place) or ``torch.compile(model)``."""
    if how == "blocks":
        model.compile_repeated_blocks(fullgraph=True)
        return model
    return torch.compile(model) if how == "model" else model


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality (NaN-safe, unlike torch.equal on floats)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _free() -> None:
    """Collect garbage and hand the allocator's free blocks back to the device."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------------
# Main.
# ---------------------------------------------------------------------------------------------------------------


def _fast_path_verbs():
    """(enable_fast_paths, disable_fast_paths), or (None, None) where this checkout has none: 'off' is timed alone."""
    try:
        from diffusers_nvfp4_fast import disable_fast_paths, enable_fast_paths
    except ImportError:
        return None, None
    return enable_fast_paths, disable_fast_paths


def _timing(args) -> str:
    """The result's ``timing`` field: what was timed, how, in which mode."""
    timing = (f"median of {args.steps_timed} forwards after {args.warmup} warm-up forwards (CUDA events); "
              + ("NVFP4 fast paths off, then on (a compile each)" if args.compile else
                 "NVFP4 fast paths off and on timed in alternating rounds")
              + ("; each variant captured once in a CUDA graph and replayed" if args.cuda_graph
                 else "" if args.compile else "; eager"))
    if args.compile:  # main() runs this inside exact_inductor(): on == off holds there (docs/design.md §1)
        timing += ("; torch.compile(transformer)" if args.compile == "model" else
                   "; compile_repeated_blocks(fullgraph=True)") + (
                       ", inductor inside exact_inductor() (emulate_precision_casts, deterministic)")
    return timing


def _header(args) -> dict:
    """The result before any case: the run's device and versions, the model, the inputs and how they are timed."""
    if args.tiny:
        result = {"benchmark": "transformer_step", "device": "cpu (tiny dry run)", "cases": []}
    else:
        import common

        result = common.header("transformer_step", common.copy_bandwidth_gbps())
    result["model"] = args.model
    result["tiny"] = args.tiny
    result["inputs"] = {"height": args.height, "width": args.width,
                        "image_tokens": (args.height // 16) * (args.width // 16),
                        "text_tokens": args.text_tokens, "batch": 1}
    if args.model == "qwen-image-2.1":
        result["inputs"]["step"] = "decode (kv_cache_mode='cached')" if args.kv_cached else "prefill (no KV cache)"
    result["timing"] = _timing(args)
    result["cuda_graph"] = args.cuda_graph
    result["compile"] = args.compile or False
    result["input_scale"] = f"fixed: amax {INPUT_AMAX} -> input_scale = {INPUT_AMAX}/2688"
    return result


def _logger(start: float):
    def log(msg: str) -> None:
        print(f"[{time.time() - start:7.1f}s] {msg}", flush=True)

    return log


def _step_case(shape: dict, variant: str, ms: float, host_ms: float, peak: float, weight_bytes: int, exact) -> dict:
    """The fields every step case has, in the JSON's order."""
    return {"shape": shape, "variant": variant, "ms_per_step": round(ms, 2), "host_ms_per_step": round(host_ms, 2),
            "peak_mem_GB": round(peak, 2), "weight_GB": round(weight_bytes / 1e9, 3), "weight_bytes": weight_bytes,
            "exact": exact}


def _time_nvfp4(args, model: nn.Module, runner, inputs: dict, device, log) -> dict:
    """Fast paths off (and on, where this checkout has them) in the mode ``args`` asks for: ``{"off": ..., "on":
    ...}`` as ``time_off_on`` and its siblings return them; ``"off"`` alone without fast paths."""
    enable, disable = _fast_path_verbs()
    if enable is None:
        log("enable_fast_paths is not available: timing 'off' only")
        ms, host_ms, peak, out = time_steps(runner, inputs, args.warmup, args.steps_timed, device, args.cuda_graph)
        return {"off": {"ms": ms, "host_ms": host_ms, "peak": peak, "out": out}}
    switches = (lambda _: enable(model), lambda _: disable(model))
    if args.compile:
        return time_off_then_on(runner, inputs, args.warmup, args.steps_timed, device, *switches)
    if args.cuda_graph:
        return time_graph_phases(runner, inputs, args.warmup, args.steps_timed, device, *switches)
    return time_off_on(runner, inputs, args.warmup, args.steps_timed, device, *switches)


def _on_cases(runs: dict, shape: dict, out_off: torch.Tensor, out_off2: torch.Tensor, weight_bytes: int,
              log) -> list[dict]:
    """The fast-paths-on case."""
    on = runs["on"]
    exact = same_bytes(on["out"], out_off) and same_bytes(out_off2, out_off)
    log(f"fast paths on: {on['ms']:.1f} ms/step (host {on['host_ms']:.1f} ms), peak {on['peak']:.1f} GB, "
        f"byte-identical to off: {exact}")
    for entry in on["report"].values():  # what ran fused in the last round, and why the rest did not
        log(f"fused calls {entry.get('fused_calls')}, fallbacks {entry.get('fallbacks')}")
    cases = [_step_case(shape, "nvfp4_fast_on", on["ms"], on["host_ms"], on["peak"], weight_bytes, exact) | {
        "times_ms": [round(t, 2) for t in on["times"]], "fast_path_report": _jsonable(on["report"])}]
    return cases


def _mode_fields(runs: dict, off: dict, on: dict, log) -> None:
    """What the CUDA-graph and compiled modes add to the off and on cases, in the JSON's order."""
    off["times_ms"] = [round(t, 2) for t in runs["off"]["times"]]
    for case, mode in ((off, "off"), (on, "on")):
        if "replay_equals_eager" in runs[mode]:
            case["replay_equals_eager"] = runs[mode]["replay_equals_eager"]
            case["cuda_graphs"] = _jsonable(runs[mode]["graphs"])
            log(f"fast paths {mode} through the runner: replay == eager bytes: {case['replay_equals_eager']}, "
                f"{case['cuda_graphs']}")
    for case, mode in ((off, "off"), (on, "on")):
        if runs[mode].get("gpu_bound_ms") is not None:
            case["gpu_bound_ms"] = round(runs[mode]["gpu_bound_ms"], 2)
            log(f"fast paths {mode}, the host given a head start: {case['gpu_bound_ms']:.1f} ms/step")
    if "recompiled_identical" in runs["off"]:
        off["recompiled_identical"] = runs["off"]["recompiled_identical"]
        log(f"fast paths off, compiled a second time: byte-identical to the first: "
            f"{runs['off']['recompiled_identical']}")


def _nvfp4_cases(args, device, result: dict, shape: dict, log) -> tuple[list[dict], int]:
    """Build the NVFP4 model, time it with fast paths off (and on), free it; returns its cases and the bytes its BF16
    twin will take."""
    from diffusers_nvfp4_fast import utils
    from diffusers_nvfp4_fast.ops.dispatch import gemm_backend

    model = empty_model(args.model, args.tiny)
    bf16_bytes = bf16_param_bytes(model)
    counts = materialize(model, args.model, device, nvfp4=True)
    weight_bytes = utils.tensor_bytes(model)
    backend = gemm_backend(device)
    log(f"NVFP4 {args.model} built: {counts}, weights {weight_bytes / 1e9:.2f} GB "
        f"(BF16 would be {bf16_bytes / 1e9:.2f} GB), GEMM backend {backend}")
    result["gemm_backend"] = backend
    result["layers"] = counts
    inputs = make_inputs(args.model, model, args.height, args.width, args.text_tokens, device, args.kv_cached)
    runner = compiled(model, args.compile)  # the fast paths are switched on the model itself
    runs = _time_nvfp4(args, model, runner, inputs, device, log)
    off = runs["off"]
    log(f"fast paths off: {off['ms']:.1f} ms/step (host {off['host_ms']:.1f} ms), peak {off['peak']:.1f} GB")
    out_off2 = forward(runner, inputs)  # fast paths are disabled again here
    finite = torch.isfinite(off["out"].float()).float().mean().item()
    cases = [_step_case(shape, "nvfp4_fast_off", off["ms"], off["host_ms"], off["peak"], weight_bytes,
                        same_bytes(off["out"], out_off2)) | {"finite_fraction": round(finite, 6)}]
    if "on" in runs:
        cases += _on_cases(runs, shape, off["out"], out_off2, weight_bytes, log)
        _mode_fields(runs, cases[0], cases[1], log)
    return cases, bf16_bytes  # the caller frees the model's memory, once nothing here holds it


def _bf16_fits(device, bf16_bytes: int) -> bool:
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info()
    return bf16_bytes + 12e9 < free  # weights + headroom for activations at these token counts


def _bf16_cases(args, device, bf16_bytes: int, shape: dict, log) -> list[dict]:
    """The BF16 model, built only after the NVFP4 model is gone: eager, and through the runner with --cuda-graph."""
    if args.skip_bf16 or not _bf16_fits(device, bf16_bytes):
        log(f"BF16 model skipped ({'--skip-bf16' if args.skip_bf16 else f'needs {bf16_bytes / 1e9:.1f} GB'})")
        return []
    from diffusers_nvfp4_fast import utils

    model = empty_model(args.model, args.tiny)
    materialize(model, args.model, device, nvfp4=False)
    bf16_weight = utils.tensor_bytes(model)
    inputs = make_inputs(args.model, model, args.height, args.width, args.text_tokens, device, args.kv_cached)
    runner = compiled(model, args.compile)
    cases = []
    for graph in (False, True) if args.cuda_graph else (False,):  # BF16 eager, and with the same runner
        ms, host_ms, peak, out = time_steps(runner, inputs, args.warmup, args.steps_timed, device, graph)
        variant = "bf16_graph" if graph else "bf16"
        log(f"{variant}: {ms:.1f} ms/step (host {host_ms:.1f} ms), peak {peak:.1f} GB, "
            f"weights {bf16_weight / 1e9:.2f} GB")
        cases.append(_step_case(shape, variant, ms, host_ms, peak, bf16_weight, None))
        if graph:
            cases[-1]["replay_equals_eager"] = same_bytes(out, forward(runner, inputs))
        elif args.compile and device.type == "cuda":
            bound = gpu_bound_ms(lambda: forward(runner, inputs), host_ms)
            cases[-1]["gpu_bound_ms"] = round(bound, 2) if bound is not None else None
            log(f"{variant}, the host given a head start: {bound:.1f} ms/step")
    return cases


def _summarize(result: dict, cases: list[dict], args, device) -> None:
    """Speedups between the cases, the goals, the host's speed and, compiled, dynamo's counters."""
    times = {c["variant"]: c["ms_per_step"] for c in cases}
    for c in cases:
        c["speedup_vs"] = {o: round(t / c["ms_per_step"], 3) for o, t in times.items() if o != c["variant"]}
    result["cases"] = cases
    result["goals"] = goals(cases, args.model)
    result["host_speed"] = host_speed(device)
    if args.compile:  # recompiles, graph breaks, frames: why a compiled step might run eagerly or differ
        result["dynamo_counters"] = {k: dict(v) for k, v in torch._dynamo.utils.counters.items()}
        import common

        result["shared_quantize_nodes"] = common.shared_quantize_nodes()


def run(args) -> dict:
    """Time one step of ``args.model``: NVFP4 with fast paths off and on, then BF16; the result JSON."""
    device = torch.device("cpu" if args.tiny else "cuda")
    result = _header(args)
    shape = {"model": args.model, **result["inputs"]}
    t_start = time.time()
    log = _logger(t_start)
    cases, bf16_bytes = _nvfp4_cases(args, device, result, shape, log)
    _free()  # the NVFP4 model's memory back to the device before the BF16 model is sized and built
    cases += _bf16_cases(args, device, bf16_bytes, shape, log)
    _free()
    _summarize(result, cases, args, device)
    result["wall_s"] = round(time.time() - t_start, 1)
    return result


def goals(cases: list[dict], model_name: str) -> dict:
    by = {c["variant"]: c for c in cases}
    best = by.get("nvfp4_fast_on") or by.get("nvfp4_fast_off")
    out = {}
    if "bf16" in by and best:
        speed = by["bf16"]["ms_per_step"] / best["ms_per_step"]
        mem = by["bf16"]["weight_bytes"] / best["weight_bytes"]
        # with the runner, BF16 eager is not the same mode: compare like with like
        same_mode = by.get("bf16_graph", by["bf16"])
        speed = same_mode["ms_per_step"] / best["ms_per_step"]
        goal = GOALS["nvfp4_vs_bf16_speed"].get(model_name)
        out["nvfp4_vs_bf16_speed"] = {"value": round(speed, 3), "goal": goal,
                                      "met": None if goal is None else speed >= goal}
        out["weight_memory_ratio"] = {"value": round(mem, 2), "goal": f"about {GOALS['weight_memory_ratio']}",
                                      "met": mem >= GOALS["weight_memory_ratio"] * 0.9}
    if "bf16_graph" in by and best:
        for name, base in (("runner_vs_bf16_eager", "bf16"), ("runner_vs_bf16_runner", "bf16_graph")):
            speed = by[base]["ms_per_step"] / best["ms_per_step"]
            goal = GOALS[name].get(model_name)
            out[name] = {"value": round(speed, 3), "goal": goal, "met": None if goal is None else speed >= goal}
    if "nvfp4_fast_on" in by:
        on, off = by["nvfp4_fast_on"], by["nvfp4_fast_off"]
        faster = on["ms_per_step"] < off["ms_per_step"]
        out["fast_paths_on_faster_and_identical"] = {"speedup": round(off["ms_per_step"] / on["ms_per_step"], 3),
                                                     "exact": on["exact"], "met": faster and bool(on["exact"])}
    return out


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (int, float, str, bool)) or obj is None:
        return obj if not (isinstance(obj, float) and math.isnan(obj)) else None
    return str(obj)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=list(MODELS), required=True)
    ap.add_argument("--height", type=int, default=1024)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--text-tokens", type=int, default=512)
    ap.add_argument("--steps-timed", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2, help="untimed forwards first (Triton compile + GEMM autotune)")
    ap.add_argument("--skip-bf16", action="store_true", help="do not build/time the BF16 model")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny config on CPU (emulated GEMM): checks the logic, no timing value")
    ap.add_argument("--cuda-graph", "--cuda-graphs", action="store_true",
                    help="run each variant through the package's CUDA-graph runner (capture_cuda_graphs; GPU only); "
                         "BF16 is timed eager and through the runner")
    ap.add_argument("--kv-cached", action="store_true",
                    help="qwen-image-2.1 only: time a decode step against a filled KV cache (kv_cache_mode='cached') "
                         "instead of the full prefill")
    ap.add_argument("--tag", default="", help="appended to the result's file name (another host, say)")
    ap.add_argument("--compile", nargs="?", const="model", choices=("model", "blocks"),
                    help="time torch.compile(transformer) ('model', the default) or each block compiled as "
                         "compile_repeated_blocks(fullgraph=True) does ('blocks'); inductor, precision-cast "
                         "emulation on; instead of eager")
    args = ap.parse_args()
    if args.cuda_graph and args.compile:
        sys.exit("--cuda-graph and --compile are separate modes; run them one at a time")
    if args.kv_cached and args.model != "qwen-image-2.1":
        sys.exit("--kv-cached is for --model qwen-image-2.1 (its KV cache)")
    if args.tiny:
        args.height = args.width = min(args.height, 64)
        args.text_tokens = min(args.text_tokens, 8)
    elif not torch.cuda.is_available():
        sys.exit("bench_transformer_step needs a CUDA GPU (or --tiny for a CPU dry run)")
    if args.steps_timed < 1 or (args.steps_timed < 5 and not args.tiny):
        print("note: the issue asks for the median of >= 5 timed steps", file=sys.stderr)

    if args.compile:
        from diffusers_nvfp4_fast.inductor import exact_inductor

        with exact_inductor():
            result = run(args)
    else:
        result = run(args)
    if args.tiny:
        print("tiny dry run (not written):")
    else:
        import common

        mode = "-graph" if args.cuda_graph else {"model": "-compile", "blocks": "-compile-blocks"}.get(args.compile, "")
        mode += "-kv-cached" if args.kv_cached else ""
        path = common.write_result(result, name=f"transformer_step-{args.model}{mode}"
                                   + (f"-{args.tag}" if args.tag else ""))
        print(f"-> {path}")
    print(f"{'variant':16s} {'ms/step':>10s} {'host ms':>8s} {'peak GB':>8s} {'weight GB':>9s} {'exact':>6s}  "
          "speedup_vs")
    for c in result["cases"]:
        print(f"{c['variant']:16s} {c['ms_per_step']:10.1f} {c['host_ms_per_step']:8.1f} {c['peak_mem_GB']:8.2f} "
              f"{c['weight_GB']:9.3f} "
              f"{str(c['exact']):>6s}  {c['speedup_vs']}")
    print(f"goals: {result['goals']}")
    print(f"wall {result['wall_s']} s")


if __name__ == "__main__":
    main()
