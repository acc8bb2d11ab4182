"""Whole FLUX.2 and Qwen-Image pipelines under a GPU memory cap: which offload plan fits, and how fast it is.

    python benchmarks/bench_pipeline_budget.py --model flux2-dev --dtype nvfp4 --budgets 24 32
    python benchmarks/bench_pipeline_budget.py --model qwen-image --dtype nvfp4-te --budgets 24   # + NVFP4 text encoder
    python benchmarks/bench_pipeline_budget.py --model flux2-klein-4b --dtype nvfp4-te   # its cap, 8 GiB (BUDGETS)
    python benchmarks/bench_pipeline_budget.py --model flux2-dev --tiny --out /tmp/x.json   # CPU dry run of the logic

Pipelines: real-size configs, random weights made on the GPU, never downloaded. FLUX.2-dev: ``Flux2Pipeline``, a
Mistral Small 3.1 text encoder (24B, untied embeddings), ``AutoencoderKLFlux2``; 28 steps, guidance 4.0, 512 text
tokens. Qwen-Image: ``QwenImagePipeline``, a Qwen2.5-VL-7B text encoder, ``AutoencoderKLQwenImage``; 30 steps, true
CFG 4.0 with a negative prompt. FLUX.2-klein-4B / -9B: ``Flux2KleinPipeline``, a Qwen3-4B / Qwen3-8B text encoder
(``QWEN3``), ``AutoencoderKLFlux2``; 4 steps, CFG 4.0. The transformer is NVFP4 as ``bench_transformer_step.py`` builds
it (its ``MODELS`` configs; ``--dtype nvfp4``, fast paths on) or BF16 with the same random values (``--dtype bf16``);
``--dtype nvfp4-te`` also makes the text encoder's Linears that ModelOpt's LLM recipe quantizes NVFP4. Weights
``randn * 0.02`` (norms 1 and 0; tied embeddings stay tied), VAEs default-initialised, the byte-level tokenizers of
``diffusers_nvfp4_fast.testing.tiny``.

Each case runs in a process of its own (the driver never touches CUDA; run nothing else on the GPU): build on the GPU,
apply the plan (``diffusers_nvfp4_fast.budget``), cap the allocator at the budget minus the CUDA context
(``torch.cuda.set_per_process_memory_fraction``), one warm-up image of one step, then the timed 1024x1024 image. A
plan whose offloaded weights do not fit the free host memory is not run and says so. The first case is the uncapped
resident pipeline, whose PNG SHA256 every capped case must reproduce (``png_equal``); a plan that fitted with the same
image and a peak below 85% of a smaller budget (or lacked host memory) is not run again for a larger one
(``same_run_as_budget_gib``).

Writes benchmarks/results/pipeline_budget-<device>.json (cases of other models/dtypes already there are kept):
cases ``{model, dtype, budget_gib, plan, estimate_gib, fits, s_per_image, s_text, s_denoise, s_decode,
peak_gpu_gib, peak_allocated_gib, live_over_estimate_gib, peak_host_gib, png_sha256, png_equal, error}``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from diffusers_nvfp4_fast.budget import CUDA_CONTEXT_GIB, tight
from diffusers_nvfp4_fast.switches import ALLOC_CONF, EXPANDABLE_SEGMENTS

sys.path.insert(0, str(Path(__file__).parent))

GIB = 2**30
STEPS = {"flux2-dev": 28, "qwen-image": 30, "flux2-klein-4b": 4, "flux2-klein-9b": 4}
BUDGETS = {"flux2-dev": [24.0, 32.0], "qwen-image": [24.0, 32.0], "flux2-klein-4b": [8.0], "flux2-klein-9b": [12.0]}
TINY = {"flux2-dev": "flux2", "qwen-image": "qwen", "flux2-klein-4b": "klein", "flux2-klein-9b": "klein"}
NVFP4 = ("nvfp4", "nvfp4-te")  # NVFP4 transformer; -te: and NVFP4 text encoder
HOST_MARGIN_GIB = 8.0  # host memory left to the OS and this process when a plan offloads weights
ESTIMATE_SLACK_GIB = 0.5  # live memory this far above a plan's estimate: something stayed on the GPU (docs/budget.md)


# ---------------------------------------------------------------------------------------------------------------
# Pipelines.
# ---------------------------------------------------------------------------------------------------------------


def randomize_(model: nn.Module, device, seed: int) -> nn.Module:
    """Give every meta parameter a random value on ``device`` (norm weights 1, norm biases 0, the rest
    ``randn * 0.02``), in BF16; tied parameters stay one tensor; buffers (made for real) follow to ``device``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    made: dict[nn.Parameter, nn.Parameter] = {}  # meta parameter -> its value, once per tied group
    for module in model.modules():
        norm = "Norm" in type(module).__name__
        for name, p in list(module.named_parameters(recurse=False)):
            if not p.is_meta:
                continue
            if p not in made:
                value = (torch.full(p.shape, 1.0 if name == "weight" else 0.0, device=device, dtype=torch.bfloat16)
                         if norm else torch.randn(p.shape, device=device, dtype=torch.bfloat16, generator=gen) * 0.02)
                made[p] = nn.Parameter(value, requires_grad=False)
            setattr(module, name, made[p])
    return model.to(device).eval()


def mistral_small_31_config():
    from transformers import Mistral3Config

    # Mistral Small 3.1 (24B; Mistral3Config's own defaults, spelled out: a partial dict would start from the 7B
    # MistralConfig defaults instead). The vision tower keeps Mistral3Config's (Pixtral) defaults.
    text = dict(model_type="mistral", hidden_size=5120, intermediate_size=32768, num_hidden_layers=40,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=131072,
                max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=1e9, sliding_window=None,
                tie_word_embeddings=False)
    return Mistral3Config(text_config=text, tie_word_embeddings=False)


def qwen25_vl_7b_config():
    from transformers import Qwen2_5_VLConfig

    text = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                num_key_value_heads=4, vocab_size=152064, max_position_embeddings=128000, rms_norm_eps=1e-6,
                rope_theta=1e6, tie_word_embeddings=False,
                rope_scaling={"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"})
    vision = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                  fullatt_block_indexes=[7, 15, 23, 31], window_size=112, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2)
    return Qwen2_5_VLConfig(  # type: ignore[call-arg]  # transformers' configs take sub-configs as kwargs
        text_config=text, vision_config=vision, vocab_size=152064, hidden_size=3584, tie_word_embeddings=False,
        vision_start_token_id=151652, vision_end_token_id=151653, vision_token_id=151654, image_token_id=151655,
        video_token_id=151656)


# FLUX.2-klein's text encoders: Qwen3-4B for klein-4B, Qwen3-8B for klein-9B (black-forest-labs/flux2, src/flux2/util.py
# FLUX2_MODEL_INFO: load_qwen3_embedder(variant="4B" / "8B"), i.e. Qwen/Qwen3-4B / -8B). Sizes from the config.json of
# Qwen/Qwen3-4B (as FLUX.2-klein-4B's text_encoder/config.json) and Qwen/Qwen3-8B (transformers 4.51 exports): both
# 36 layers, 32 heads (8 KV) of 128, vocab 151936, 40960 positions, RoPE theta 1e6; 4B ties lm_head to its embedding.
QWEN3 = {"flux2-klein-4b": dict(hidden_size=2560, intermediate_size=9728, tie_word_embeddings=True),
         "flux2-klein-9b": dict(hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False)}


def qwen3_config(model: str):
    from transformers import Qwen3Config

    return Qwen3Config(num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6,
                       **QWEN3[model])


def text_encoder(model: str, device, nvfp4: bool = False) -> nn.Module:
    """The text encoder with random weights on ``device``, or left on the meta device where ``device`` is "meta";
    ``nvfp4``: the Linears ModelOpt's LLM recipe quantizes become NVFP4 (``quantize_text_encoder``'s recipe) and the
    ``lm_head`` is left out, as ``load_nvfp4_text_encoder(..., lm_head=False)`` loads it for a pipeline (a tied one
    held no bytes of its own)."""
    from accelerate import init_empty_weights
    from transformers import Mistral3ForConditionalGeneration, Qwen2_5_VLForConditionalGeneration, Qwen3ForCausalLM

    from diffusers_nvfp4_fast.loaders.text_encoder import drop_lm_head
    from diffusers_nvfp4_fast.quantize.recipes import modelopt_llm_disabled

    with init_empty_weights(include_buffers=False):
        te = (Mistral3ForConditionalGeneration(mistral_small_31_config()) if model == "flux2-dev"
              else Qwen2_5_VLForConditionalGeneration(qwen25_vl_7b_config()) if model == "qwen-image"
              else Qwen3ForCausalLM(qwen3_config(model)))
    te.tie_weights()  # transformers 5 ties at from_pretrained only: Qwen3-4B's lm_head is its embedding
    if nvfp4:
        drop_lm_head(te)
    te = te.to(torch.bfloat16) if str(device) == "meta" else randomize_(te, device, seed=1)
    return nvfp4_linears_(te, modelopt_llm_disabled, str(device) == "meta") if nvfp4 else te


def nvfp4_linears_(module: nn.Module, kept_bf16, meta: bool = False) -> nn.Module:
    """Every Linear whose name ``kept_bf16`` refuses and whose width is a multiple of 16, as an NVFP4Linear of its
    weight (shapes only where ``meta``)."""
    import bench_transformer_step as step

    from diffusers_nvfp4_fast import NVFP4Linear

    for name, lin in [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Linear)]:
        if not kept_bf16(name) and lin.in_features % 16 == 0:
            bias = None if lin.bias is None else lin.bias.data
            module.set_submodule(name, NVFP4Linear(lin.in_features, lin.out_features, bias is not None, device="meta")
                                 if meta else NVFP4Linear.from_weight(lin.weight.data, bias, step.INPUT_AMAX / 2688))
    return module


def transformer_kept_bf16(model: str, net: nn.Module):
    """Whether a Linear of ``net`` stays BF16 under the public checkpoints' recipe (``bench_transformer_step``'s)."""
    import bench_transformer_step as step

    from diffusers_nvfp4_fast.loaders.common import is_excluded

    patterns = list(step.exclude_patterns(model, dict(net.config)))
    return lambda name: is_excluded(name, patterns)


def transformer(model: str, dtype: str, device) -> nn.Module:
    """The transformer as ``bench_transformer_step.py`` builds it; on the meta device, NVFP4 layers of the same
    shapes and no values."""
    import bench_transformer_step as step

    net = step.empty_model(model, tiny=False)
    if str(device) != "meta":
        step.materialize(net, model, device, nvfp4=dtype in NVFP4)
        return net
    return (nvfp4_linears_(net, transformer_kept_bf16(model, net), meta=True) if dtype in NVFP4 else net).to(
        torch.bfloat16)


def full_pipeline(model: str, dtype: str, device):
    """(pipeline, call kwargs) at real size on ``device`` ("meta": shapes only, for the estimates)."""
    from diffusers import (
        AutoencoderKLFlux2,
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Pipeline,
        QwenImagePipeline,
    )

    from diffusers_nvfp4_fast.testing import tiny

    torch.manual_seed(2)
    with torch.device(device):  # default initialisation, or shapes only on "meta"
        vae = AutoencoderKLQwenImage() if model == "qwen-image" else AutoencoderKLFlux2()
    parts = dict(scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True), vae=vae.to(torch.bfloat16),
                 text_encoder=text_encoder(model, device, nvfp4=dtype == "nvfp4-te"),
                 transformer=transformer(model, dtype, device))
    prompt = "a red fox in fresh snow, morning light, a wooden sign reading WINTER"
    if model == "qwen-image":
        return (QwenImagePipeline(tokenizer=tiny.qwen_tokenizer(), **parts),
                dict(prompt=prompt, negative_prompt="blurry, low quality", true_cfg_scale=4.0))
    flux2 = Flux2Pipeline(tokenizer=tiny.mistral_tokenizer(), **parts) if model == "flux2-dev" else \
        Flux2KleinPipeline(tokenizer=tiny.qwen_tokenizer(), **parts)  # klein: CFG, as guidance 4.0 asks
    return flux2, dict(prompt=prompt, guidance_scale=4.0)


def tiny_pipeline(model: str, dtype: str):
    """The embedded tiny pipeline of the family; with ``dtype`` nvfp4 its transformer quantized as the full-size one
    is (nvfp4-te: its text encoder too)."""
    from diffusers_nvfp4_fast.quantize.recipes import modelopt_llm_disabled
    from diffusers_nvfp4_fast.testing import tiny

    pipe, call = tiny.TINY_PIPELINES[TINY[model]]()
    if dtype == "nvfp4-te":
        nvfp4_linears_(pipe.text_encoder, modelopt_llm_disabled)
    if dtype in NVFP4:
        nvfp4_linears_(pipe.transformer, transformer_kept_bf16(model, pipe.transformer))
    return pipe, (dict(call, true_cfg_scale=4.0) if model == "qwen-image" else call)


# ---------------------------------------------------------------------------------------------------------------
# One case (in its own process).
# ---------------------------------------------------------------------------------------------------------------


def host_gib(field: str = "VmHWM") -> float:
    """A memory figure of this process from /proc/self/status (VmHWM: peak resident set) in GiB; 0 elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024 / GIB
    except OSError:
        pass
    return 0.0


def cap_allocator(budget_gib: float) -> float:
    """Cap PyTorch's allocator so that it plus what the CUDA context holds outside it stays within the budget.
    Returns the GiB held outside the allocator."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    outside = (total - free) - torch.cuda.memory_reserved()
    fraction = (budget_gib * GIB - outside) / total
    if fraction <= 0:
        raise RuntimeError(f"the CUDA context alone holds {outside / GIB:.2f} GiB, over the budget of {budget_gib} GiB")
    torch.cuda.set_per_process_memory_fraction(fraction)
    return outside / GIB


def run_case(model: str, dtype: str, plan: str, budget_gib: float | None, tiny: bool) -> dict:
    import common

    from diffusers_nvfp4_fast import budget, enable_fast_paths, fast_path_report
    from diffusers_nvfp4_fast.utils import png_sha256, run_pipeline

    cuda = torch.cuda.is_available() and not tiny
    device = torch.device("cuda" if cuda else "cpu")
    size, steps = (64, 3) if tiny else (1024, STEPS[model])
    case: dict = {"model": model, "dtype": dtype, "budget_gib": budget_gib, "plan": plan,
                  "alloc_conf": os.environ.get(ALLOC_CONF[0])}
    t0 = time.perf_counter()
    pipe, call = tiny_pipeline(model, dtype) if tiny else full_pipeline(model, dtype, device)
    pipe.set_progress_bar_config(disable=True)
    case["build_s"] = round(time.perf_counter() - t0, 1)
    case["estimates_gib"] = {p: round(v, 2) for p, v in budget.plan_estimates(pipe).items()}
    case["estimate_gib"] = case["estimates_gib"][plan]
    # The weights start on the GPU here, so setting a plan up peaks at HOST_PEAK_FACTOR x what it offloads.
    offloaded, have = budget.offloaded_bytes(pipe, plan) / GIB, budget.available_host_gib()
    if have is not None and offloaded * budget.HOST_PEAK_FACTOR > have - HOST_MARGIN_GIB:
        return dict(case, fits=False, error=f"not run: the plan keeps {offloaded:.1f} GiB of weights in host memory "
                                            f"(peak about {offloaded * budget.HOST_PEAK_FACTOR:.0f} GiB while "
                                            f"offloading), {have:.1f} GiB is available")
    if dtype in NVFP4:
        enable_fast_paths(pipe)
    budget.apply_plan(pipe, plan, device)
    if cuda and budget_gib is not None:
        case["outside_allocator_gib"] = round(cap_allocator(budget_gib), 2)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        run_pipeline(pipe, call, size=size, steps=1)  # warm-up: compile, autotune, first-use verification
        timer = common.StageTimer(pipe, cuda)
        t0 = time.perf_counter()
        image = run_pipeline(pipe, call, size=size, steps=steps)
        total = time.perf_counter() - t0
    except torch.OutOfMemoryError as e:
        case.update(fits=False, error=f"out of memory: {str(e).splitlines()[0][:300]}")
    else:
        stages = timer.split(total, {})
        case.update(fits=True, s_per_image=round(total, 2), png_sha256=png_sha256(image),
                    **{f"s_{stage}": round(seconds, 2) for stage, seconds in stages.items()})
        if dtype in NVFP4:
            report = fast_path_report(pipe)[type(pipe.transformer).__name__]
            case["fused_calls"] = dict(report["fused_calls"])
    if cuda:
        outside = case.get("outside_allocator_gib", 0.0)
        case["peak_gpu_gib"] = round(torch.cuda.max_memory_reserved() / GIB + outside, 2)
        case["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
        case["live_over_estimate_gib"] = live_over_estimate(case)
    case["peak_host_gib"] = round(host_gib(), 2)
    if budget_gib is None:  # the reference case also describes the machine (the driver process never touches CUDA)
        case["env"] = environment(cuda)
    return case


def environment(cuda: bool) -> dict:
    """Device, versions, date and, on a GPU, its copy bandwidth and the pinned host-to-device bandwidth."""
    import common

    if not cuda:
        return {"benchmark": "pipeline_budget", "device": "cpu (tiny dry run)", "date": time.strftime("%Y-%m-%d"),
                "copy_bandwidth_GBps": None, "h2d_pinned_GBps": None}
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1.0)
    return common.header("pipeline_budget", common.copy_bandwidth_gbps()) | {"h2d_pinned_GBps": h2d_gbps()}


def h2d_gbps() -> float:
    """Pinned host-to-device copy bandwidth (GB/s), measured now."""
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return round(5 * host.numel() / (time.perf_counter() - t0) / 1e9, 1)


# ---------------------------------------------------------------------------------------------------------------
# Driver.
# ---------------------------------------------------------------------------------------------------------------


def host_failure(case: dict) -> bool:
    """Whether a case failed for want of host memory, which no larger GPU budget changes."""
    error = case.get("error") or ""
    return error.startswith("not run") or "exited -9" in error


@functools.cache
def meta_pipeline(model: str, dtype: str):
    """The pipeline with meta tensors: shapes and bytes, no memory."""
    return full_pipeline(model, dtype, "meta")[0]


def spawn_case(args, plan: str, budget_gib: float | None) -> dict:
    from diffusers_nvfp4_fast import budget

    cmd = [sys.executable, __file__, "--case", plan, "--model", args.model, "--dtype", args.dtype]
    cmd += ["--case-budget", str(budget_gib)] if budget_gib is not None else []
    cmd += ["--tiny"] if args.tiny else []
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.case_timeout, env=case_env())
    lines = [line for line in out.stdout.splitlines() if line.startswith("CASE ")]
    if out.returncode != 0 or not lines:
        tail = (out.stdout + out.stderr).strip().splitlines()[-3:]
        offloaded_gib = budget.offloaded_bytes(meta_pipeline(args.model, args.dtype), plan) / GIB
        why = (" (SIGKILL: most likely the host's out-of-memory killer; the plan keeps "
               f"{offloaded_gib:.1f} GiB of weights in host memory)") if out.returncode == -9 else ""
        return {"model": args.model, "dtype": args.dtype, "budget_gib": budget_gib, "plan": plan, "fits": False,
                "error": f"case process exited {out.returncode}{why}; its last lines: {' | '.join(tail)[:400]}"}
    case = json.loads(lines[-1][5:])
    case["process_s"] = round(time.perf_counter() - t0, 1)
    return case


def case_env() -> dict[str, str]:
    """The case's environment: PyTorch's allocator maps segments on demand unless the caller says otherwise, since
    under a tight cap fragmentation alone fails a plan (docs/budget.md)."""
    return {**os.environ, ALLOC_CONF[0]: os.environ.get(ALLOC_CONF[0], EXPANDABLE_SEGMENTS)}


def plans_for(args, estimates: dict[str, float], budget_gib: float) -> list[str]:
    from diffusers_nvfp4_fast import budget

    if args.plans != "chosen":
        return args.plans.split(",")
    try:
        return [budget.choose_plan(None, budget_gib, estimates=estimates)]
    except ValueError:  # none fits: the smallest, to see by how much
        return ["group_offload_leaf"]


def print_estimates(args) -> None:
    from diffusers_nvfp4_fast import budget
    from diffusers_nvfp4_fast.utils import tensor_bytes

    pipe = meta_pipeline(args.model, args.dtype)
    sizes = {n: round(tensor_bytes(m) / GIB, 2) for n, m in pipe.components.items() if isinstance(m, nn.Module)}
    print(f"{args.model} {args.dtype}: weights GiB {sizes}")
    print("estimated peak GiB: " + ", ".join(f"{p} {v:.1f}" for p, v in budget.plan_estimates(pipe).items()))
    for budget_gib in args.budgets:
        try:
            print(f"budget {budget_gib:g} GiB: {budget.choose_plan(pipe, budget_gib)}")
        except ValueError as e:
            print(f"budget {budget_gib:g} GiB: {e}")


def merge(path: Path, header: dict, cases: list[dict]) -> dict:
    """Keep the cases of ``path`` that this run did not redo (other models, dtypes, budgets or plans), and its notes."""
    key = ("model", "dtype", "budget_gib", "plan")
    old = json.loads(path.read_text()) if path.exists() else {"cases": [], "runs": []}
    redone = {tuple(c[k] for k in key) for c in cases}
    kept = [c for c in old.get("cases", []) if tuple(c.get(k) for k in key) not in redone]
    runs = [r for r in old.get("runs", []) if (r["model"], r["dtype"]) != (header["model"], header["dtype"])]
    return {k: v for k, v in header.items() if k not in ("model", "dtype", "cases")} | {
        "runs": runs + [{k: header[k] for k in ("model", "dtype", "date", "copy_bandwidth_GBps", "h2d_pinned_GBps")}],
        "cases": kept + cases} | ({"notes": old["notes"]} if "notes" in old else {})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(STEPS), required=True)
    ap.add_argument("--dtype", choices=(*NVFP4, "bf16"), default="nvfp4",
                    help="nvfp4-te: the text encoder NVFP4 too (ModelOpt's LLM recipe)")
    ap.add_argument("--budgets", type=float, nargs="+", help="GPU memory caps in GiB (default: the model's, BUDGETS)")
    ap.add_argument("--plans", default="chosen",
                    help="'chosen' (the plan budget.choose_plan picks for each budget) or a comma-separated list")
    ap.add_argument("--tiny", action="store_true", help="tiny pipelines on the CPU, no cap: checks the logic only")
    ap.add_argument("--out", type=Path, help="result file (default benchmarks/results/pipeline_budget-<device>.json)")
    ap.add_argument("--estimate", action="store_true",
                    help="only print each plan's estimated peak and the plan chosen per budget (CPU, no weights)")
    ap.add_argument("--case-timeout", type=float, default=600)
    ap.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case in this process
    ap.add_argument("--case-budget", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.budgets = args.budgets or BUDGETS[args.model]
    if args.case:
        print("CASE " + json.dumps(run_case(args.model, args.dtype, args.case, args.case_budget, args.tiny)))
        return
    if args.estimate:
        print_estimates(args)
        return
    if not args.tiny and not torch.cuda.is_available():
        sys.exit("bench_pipeline_budget needs a CUDA GPU (or --tiny for a CPU dry run)")

    reference = spawn_case(args, "resident", None)
    print(json.dumps(reference), flush=True)
    cases = [dict(reference, png_equal=True if reference.get("png_sha256") else None)]
    write(args, cases)
    fitted: dict[str, dict] = {}  # plan -> its case under the smallest budget it fitted
    for budget_gib in sorted(args.budgets):
        for plan in plans_for(args, reference.get("estimates_gib", {}), budget_gib):
            if plan in fitted:  # ran under a smaller cap that never bound it (or failed on the host): same run
                case = dict(fitted[plan], budget_gib=budget_gib, same_run_as_budget_gib=fitted[plan]["budget_gib"])
            else:
                case = spawn_case(args, plan, budget_gib)
                case["png_equal"] = case.get("png_sha256") == reference.get("png_sha256") if case.get("fits") else None
                if unbound_by_cap(case) or host_failure(case):
                    fitted[plan] = case
            print(json.dumps(case), flush=True)
            cases.append(case)
            write(args, cases)  # after every case: a run cut short keeps what it measured
    summarize(cases)


def live_over_estimate(case: dict) -> float:
    """GiB by which the live peak (PyTorch's allocated peak plus what the CUDA context holds outside it) exceeded the
    plan's estimate. Above ``ESTIMATE_SLACK_GIB`` the estimate missed something: an offloaded text encoder whose GPU
    copies stayed alive showed so (17.6 GiB estimated, 21.1 live; docs/budget.md)."""
    context = case.get("outside_allocator_gib", CUDA_CONTEXT_GIB)
    return round(case["peak_allocated_gib"] + context - case["estimate_gib"], 2)


def unbound_by_cap(case: dict) -> bool:
    """Whether a capped case ran as it would have uncapped: it fitted, kept the image, and its GPU peak stayed below
    ``TIGHT_FRACTION`` of the cap. Near the cap the allocator frees and maps memory again during the run, and the VAE
    decode's convolutions run with another algorithm (other bytes): a larger cap then gives another result."""
    return bool(case.get("fits") and case.get("png_equal") and case.get("budget_gib")
                and not tight(case.get("peak_gpu_gib") or 0.0, case["budget_gib"]))  # peak with the context


def write(args, cases: list[dict]) -> None:
    """Merge ``cases`` into the result file; the machine facts come from the reference case's process."""
    import common

    header = dict(cases[0].get("env") or {"benchmark": "pipeline_budget", "device": "unknown (reference case failed)",
                                          "date": time.strftime("%Y-%m-%d")})
    header.setdefault("copy_bandwidth_GBps", None)
    header.setdefault("h2d_pinned_GBps", None)
    header |= {"model": args.model, "dtype": args.dtype, "python": sys.version.split()[0],
               "host_memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB, 1)}
    for name in ("diffusers", "transformers"):
        header[name] = __import__(name).__version__
    slug = common.device_slug(header["device"].split("(")[0].strip())  # "cpu (tiny dry run)" -> cpu
    path = args.out or common.RESULTS / f"pipeline_budget-{slug}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    plain = [{k: v for k, v in c.items() if k != "env"} for c in cases]
    path.write_text(json.dumps(merge(path, header, plain), indent=1) + "\n")
    print(f"-> {path}", flush=True)


def summarize(cases: list[dict]) -> None:
    for c in cases:
        figures = (f"{c['s_per_image']:7.1f} s (text {c['s_text']}, denoise {c['s_denoise']}, decode {c['s_decode']})"
                   if c.get("fits") else f"does not fit: {c.get('error', '')[:90]}")
        over = c.get("live_over_estimate_gib")
        missed = f" LIVE {over} GiB OVER THE ESTIMATE" if over is not None and over > ESTIMATE_SLACK_GIB else ""
        print(f"{c['model']:<10} {c['dtype']:<5} {str(c['budget_gib']):>5} GiB {c['plan']:<21} {figures} "
              f"peak GPU {c.get('peak_gpu_gib')} host {c.get('peak_host_gib')} png_equal {c.get('png_equal')}{missed}")


if __name__ == "__main__":
    main()
