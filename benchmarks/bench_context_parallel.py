"""Full-size FLUX.2-dev / Qwen-Image transformer steps on one GPU and split over two with diffusers' context
parallelism: NVFP4 fast paths off and on, and BF16.

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_context_parallel.py --model flux2-dev --mode ulysses
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_context_parallel.py --model qwen-image --mode ring
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_context_parallel.py --model flux2-dev --tiny   # CPU

Each rank builds the model as ``bench_transformer_step.py`` does (same seeds, so the same weights and inputs on
every rank), times the step on its own GPU (the 1-GPU figure; both ranks run at once on their own GPUs), then calls
``enable_parallelism`` (Ulysses or ring, degree 2; attention backend ``_native_cudnn``, which returns the
log-sum-exp ring needs) and times the same step split over the two GPUs. Fast paths off and on alternate round by
round (``bench_transformer_step.time_off_on``); ``exact``: on == off byte for byte in the same configuration.
Scaling efficiency = ms on 1 GPU / (2 x ms on 2 GPUs). Keep NVLink multicast off (NCCL_NVLS_ENABLE=0; the device
notes say why). Rank 0 writes benchmarks/results/context_parallel-<device>.json (cases of the other model or mode
already there are kept).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

import bench_transformer_step as step  # noqa: E402


def setup(tiny: bool) -> torch.device:
    if tiny:
        dist.init_process_group("gloo")
        if torch.accelerator.device_count() == 0:  # diffusers 0.42.1 divides by it (examples/context_parallel.py)
            torch.accelerator.device_count = lambda *args, **kwargs: 1  # type: ignore[method-assign]
        return torch.device("cpu")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    return torch.device("cuda", local)


def build(model_name: str, tiny: bool, nvfp4: bool, device):
    model = step.empty_model(model_name, tiny)
    step.materialize(model, model_name, device, nvfp4=nvfp4)
    text_tokens, size = (8, 64) if tiny else (512, 1024)
    inputs = step.make_inputs(model_name, model, size, size, text_tokens, device)
    for key in ("img_ids", "txt_ids"):  # FLUX.2's context-parallel plan splits them as [B, L, 4] (the pipeline's)
        if key in inputs:
            inputs[key] = inputs[key].unsqueeze(0)
    return model, inputs


def time_variant(model, inputs, args, device, nvfp4: bool) -> dict:
    """ms per step (and on == off) for the model as it is configured now."""
    from diffusers_nvfp4_fast import disable_fast_paths, enable_fast_paths

    dist.barrier()
    if nvfp4:
        runs = step.time_off_on(model, inputs, args.warmup, args.steps_timed, device, enable_fast_paths,
                                disable_fast_paths)
        return {"nvfp4_fast_off": runs["off"]["ms"], "nvfp4_fast_on": runs["on"]["ms"],
                "exact": step.same_bytes(runs["on"]["out"], runs["off"]["out"]),
                "fused_calls": dict(next(iter(runs["on"]["report"].values()))["fused_calls"])}
    ms, _, _, _ = step.time_steps(model, inputs, args.warmup, args.steps_timed, device)
    return {"bf16": ms}


def measure(args, device, nvfp4: bool) -> dict:
    from diffusers import ContextParallelConfig

    model, inputs = build(args.model, args.tiny, nvfp4, device)
    one = time_variant(model, inputs, args, device, nvfp4)
    model.set_attention_backend("native" if args.tiny else "_native_cudnn")
    degree = {"ring_degree": 2} if args.mode == "ring" else {"ulysses_degree": 2}
    model.enable_parallelism(config=ContextParallelConfig(**degree))
    two = time_variant(model, inputs, args, device, nvfp4)
    del model, inputs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"one": one, "two": two}


def cases(args, results: dict) -> list[dict]:
    out = []
    for dtype, res in results.items():
        for variant in [v for v in res["one"] if v in ("nvfp4_fast_off", "nvfp4_fast_on", "bf16")]:
            one, two = res["one"][variant], res["two"][variant]
            for gpus, ms in ((1, one), (2, two)):
                case = {"model": args.model, "mode": args.mode if gpus == 2 else None, "gpus": gpus,
                        "variant": variant, "ms_per_step": round(ms, 2)}
                if gpus == 2:
                    case["scaling_efficiency"] = round(one / (2 * two), 3)
                if dtype == "nvfp4":
                    case["exact_on_equals_off"] = res["one" if gpus == 1 else "two"]["exact"]
                    if variant == "nvfp4_fast_on":
                        case["fused_calls"] = res["one" if gpus == 1 else "two"]["fused_calls"]
                out.append(case)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=list(step.MODELS), required=True)
    ap.add_argument("--mode", choices=("ulysses", "ring"), default="ulysses")
    ap.add_argument("--steps-timed", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--skip-bf16", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="tiny configs on the CPU with gloo (Ulysses): logic only")
    ap.add_argument("--out", type=Path, help="result file (default benchmarks/results/context_parallel-<device>.json)")
    args = ap.parse_args()
    if args.tiny and args.mode == "ring":
        sys.exit("ring needs an attention backend that returns the log-sum-exp; none runs on the CPU")
    device = setup(args.tiny)
    if dist.get_world_size() != 2:
        sys.exit("launch with torchrun --nproc-per-node 2")
    t0 = time.time()
    results = {"nvfp4": measure(args, device, nvfp4=True)}
    if not args.skip_bf16:
        results["bf16"] = measure(args, device, nvfp4=False)
    everyone: list = [None] * 2
    dist.all_gather_object(everyone, results)
    if dist.get_rank() == 0:
        write(args, everyone, time.time() - t0)
    dist.barrier()
    dist.destroy_process_group()


def write(args, everyone: list, wall_s: float) -> None:
    import common

    if args.tiny:
        result = {"benchmark": "context_parallel", "device": "cpu (tiny dry run)", "cases": []}
    else:
        result = common.header("context_parallel", common.copy_bandwidth_gbps())
    result["cases"] = [dict(c, rank=rank) for rank, res in enumerate(everyone) for c in cases(args, res)]
    result["timing"] = (f"median of {args.steps_timed} eager forwards after {args.warmup} warm-ups, CUDA events, per "
                        "rank; 1 GPU: both ranks at once, each on its own GPU without parallelism")
    result["wall_s"] = round(wall_s, 1)
    path = args.out or common.RESULTS / f"context_parallel-{'cpu' if args.tiny else common.device_slug()}.json"
    if path.exists():  # keep what this run did not measure again
        def key(c: dict) -> tuple:
            return c["model"], c["gpus"], c.get("mode"), c["variant"], c["rank"]

        redone = {key(c) for c in result["cases"]}
        result["cases"] = [c for c in json.loads(path.read_text()).get("cases", []) if key(c) not in redone] + \
            result["cases"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"-> {path}")
    for c in result["cases"]:
        print(f"rank {c['rank']} {c['model']:<10} {c['gpus']} GPU {str(c['mode']):<7} {c['variant']:<15} "
              f"{c['ms_per_step']:9.2f} ms  efficiency {c.get('scaling_efficiency')}  "
              f"exact {c.get('exact_on_equals_off')}")


if __name__ == "__main__":
    main()
