"""Seconds per image of whole pipelines, BF16 and NVFP4, eager, through the CUDA-graph runner, and compiled.

    python benchmarks/bench_pipeline.py --model qwen-image            # 30 steps, true CFG 4.0
    python benchmarks/bench_pipeline.py --model flux2-dev             # 28 steps, guidance 4.0
    python benchmarks/bench_pipeline.py --model flux2-klein-4b        # 4 steps, CFG
    python benchmarks/bench_pipeline.py --model qwen-image --modes eager runner   # without compiled
    python benchmarks/bench_pipeline.py --model qwen-image --tiny     # CPU dry run of the logic

Pipelines: real-size components with random weights made on the GPU (``bench_pipeline_budget.full_pipeline``; klein:
``Flux2KleinPipeline`` with a Qwen3 text encoder), 1024x1024, one prompt. Per dtype (NVFP4 with fast paths on, then
BF16, one pipeline at a time): a warm-up image of 2 steps (Triton compile, autotune, first-use verification),
then per mode one timed image (``runner``: ``capture_cuda_graphs(pipe)``; its first image captures, so it is timed
twice: ``s_first_image`` with the captures, ``s_per_image`` after; ``compiled``: ``compile_repeated_blocks`` inside
``exact_inductor``, also timed twice). ``png_equal_eager``: the mode's PNG has the bytes of the same dtype's eager PNG.
Writes benchmarks/results/pipeline-<device>.json (the cases of other models, dtypes and modes are kept, each dated).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def build(model: str, dtype: str, tiny_run: bool):
    import bench_pipeline_budget as budget

    return budget.tiny_pipeline(model, dtype) if tiny_run else budget.full_pipeline(model, dtype, "cuda")


def image(pipe, call: dict, steps: int, size: int):
    from diffusers_nvfp4_fast.utils import png_sha256, run_pipeline

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    img = run_pipeline(pipe, call, size=size, steps=steps)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, png_sha256(img)


def run_dtype(model: str, dtype: str, modes: list[str], steps: int, size: int, tiny_run: bool, log) -> list[dict]:
    from diffusers_nvfp4_fast import enable_fast_paths, exact_inductor
    from diffusers_nvfp4_fast.graphs import capture_cuda_graphs, graph_report, release_cuda_graphs

    pipe, call = build(model, dtype, tiny_run)
    pipe.set_progress_bar_config(disable=True)
    if dtype == "nvfp4":
        enable_fast_paths(pipe)
    image(pipe, call, 2, size)  # warm-up
    cases, eager_sha = [], None
    for mode in modes:
        case = {"model": model, "dtype": dtype, "mode": mode, "steps": steps, "size": size}
        if mode == "eager":
            case["s_per_image"], case["png_sha256"] = image(pipe, call, steps, size)
            eager_sha = case["png_sha256"]
        elif mode == "runner":
            capture_cuda_graphs(pipe)
            case["s_first_image"], _ = image(pipe, call, steps, size)
            case["s_per_image"], case["png_sha256"] = image(pipe, call, steps, size)
            case["cuda_graphs"] = graph_report(pipe.transformer)
            release_cuda_graphs(pipe)
        else:  # compiled
            pipe.transformer.compile_repeated_blocks(fullgraph=True)
            with exact_inductor():
                case["s_first_image"], _ = image(pipe, call, steps, size)
                case["s_per_image"], case["png_sha256"] = image(pipe, call, steps, size)
        case["png_equal_eager"] = None if eager_sha is None else case["png_sha256"] == eager_sha
        case = {k: round(v, 3) if isinstance(v, float) else v for k, v in case.items()}
        log(case)
        cases.append(case)
    del pipe
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return cases


def main() -> None:
    from bench_pipeline_budget import STEPS

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=list(STEPS), required=True)
    modes = ["eager", "runner", "compiled"]
    ap.add_argument("--modes", nargs="+", default=modes, choices=modes)
    ap.add_argument("--dtypes", nargs="+", default=["nvfp4", "bf16"], choices=("nvfp4", "bf16"))
    ap.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's usual count)")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--tiny", action="store_true", help="tiny pipelines on CPU: checks the logic, no timing value")
    args = ap.parse_args()
    if args.tiny:
        args.size = 64
    elif not torch.cuda.is_available():
        sys.exit("bench_pipeline needs a CUDA GPU (or --tiny)")
    steps = args.steps or STEPS[args.model]
    t_start = time.time()

    def log(msg) -> None:
        print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)

    cases: list[dict] = []
    for dtype in args.dtypes:  # written after each dtype, so that a run cut short keeps what it measured
        cases += run_dtype(args.model, dtype, args.modes, steps, args.size, args.tiny, log)
        add_speedups(cases)
        if not args.tiny:
            save(cases, time.time() - t_start)
    if args.tiny:
        print(json.dumps(cases, indent=1))
        return
    for c in cases:
        print(f"{c['dtype']:6s} {c['mode']:9s} {c['s_per_image']:7.2f} s/image  png_equal_eager={c['png_equal_eager']}"
              f"  {c['speedup_vs']}")


def add_speedups(cases: list[dict]) -> None:
    by = {(c["dtype"], c["mode"]): c["s_per_image"] for c in cases}
    for c in cases:
        c["speedup_vs"] = {f"{d}_{m}": round(t / c["s_per_image"], 3) for (d, m), t in by.items()
                           if (d, m) != (c["dtype"], c["mode"])}


def save(cases: list[dict], wall_s: float) -> None:
    import common

    path = Path(__file__).parent / "results" / f"pipeline-{common.device_slug()}.json"
    before = json.loads(path.read_text()) if path.exists() else {"cases": []}
    result = common.header("pipeline", common.copy_bandwidth_gbps())
    # Cases of other models, dtypes or modes stay, each with the date of the run that measured it.
    fresh = {(c["model"], c["dtype"], c["mode"]) for c in cases}
    kept = [{"date": before.get("date"), **c} for c in before["cases"]
            if (c["model"], c["dtype"], c["mode"]) not in fresh]
    result["cases"] = kept + [{**c, "date": result["date"]} for c in cases]
    result["wall_s"] = round(wall_s, 1)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", path, flush=True)


if __name__ == "__main__":
    main()
