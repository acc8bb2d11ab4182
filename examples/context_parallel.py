"""NVFP4 FLUX.2 / Qwen-Image with diffusers' context parallelism: the sequence split across processes, fast paths
off and on, the PNG bytes compared on every rank.

    torchrun --nproc-per-node 2 examples/context_parallel.py --model flux2 --mode ulysses \\
        --nvfp4 PATH_OR_REPO [--subfolder transformer] [--filename F] --base black-forest-labs/FLUX.2-dev
    torchrun --nproc-per-node 2 examples/context_parallel.py --model qwen --mode ring --nvfp4 ... --base Qwen/Qwen-Image
    torchrun --nproc-per-node 2 examples/context_parallel.py --model flux2 --mode ulysses --tiny   # offline, CPU too

GPUs: one per process (NCCL). Call ``transformer.enable_parallelism`` before ``enable_fast_paths`` or after: the fused
processors keep diffusers' ``_parallel_config``, and the attention runs through diffusers' dispatch either way.
Ring attention needs an attention backend that returns the log-sum-exp (here ``_native_cudnn``); Ulysses runs on
``native`` too. On a machine without GPUs (``--tiny``: gloo, CPU) only Ulysses runs, and diffusers 0.42.1 needs a
workaround there: ``enable_parallelism`` computes ``rank % torch.accelerator.device_count()``, which divides by zero
when there is no accelerator, for a device it does not use for context parallelism (the mesh is built on the CPU).
"""

import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("flux2", "qwen"), default="flux2")
    ap.add_argument("--mode", choices=("ulysses", "ring"), default="ulysses")
    ap.add_argument("--tiny", action="store_true", help="the embedded tiny model (no download)")
    ap.add_argument("--nvfp4", help="ModelOpt NVFP4 export (dir or repo) or a BFL/ComfyUI .safetensors file")
    ap.add_argument("--subfolder", default=None)
    ap.add_argument("--filename", default=None)
    ap.add_argument("--base", help="pipeline repo for the other components")
    ap.add_argument("--backend", help="attention backend (default: _native_cudnn for ring on GPUs, else native)")
    ap.add_argument("--prompt", default="a red fox in fresh snow, morning light")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--fast-paths-first", action="store_true",
                    help="enable_fast_paths before enable_parallelism (then on is generated first, off after disable)")
    return ap.parse_args()


def setup() -> torch.device:
    """Join the process group torchrun describes; one GPU per process, or the CPU with gloo."""
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        return torch.device("cuda", local)
    dist.init_process_group("gloo")
    if torch.accelerator.device_count() == 0:  # diffusers 0.42.1 divides by this count (see the module docstring)
        torch.accelerator.device_count = lambda *args, **kwargs: 1  # type: ignore[method-assign]
    return torch.device("cpu")


def load(args: argparse.Namespace):
    """(pipeline, call kwargs, size, steps)."""
    from diffusers_nvfp4_fast import load_nvfp4_transformer
    from diffusers_nvfp4_fast.testing import export, tiny

    if args.tiny:
        # Every rank builds the same export (seeded), each in a directory of its own.
        checkpoint = export.quantize_tiny_pipeline(args.model, tempfile.mkdtemp(prefix=f"{args.model}-tiny-nvfp4-"))
        pipe, call = tiny.TINY_PIPELINES[args.model](load_nvfp4_transformer(checkpoint))
        return pipe, call, 64, 3
    from diffusers import Flux2Pipeline, QwenImagePipeline

    extra = {"filename": args.filename} if args.filename else {}
    transformer = load_nvfp4_transformer(args.nvfp4, subfolder=args.subfolder, **extra)
    cls = Flux2Pipeline if args.model == "flux2" else QwenImagePipeline
    base = args.base or ("black-forest-labs/FLUX.2-dev" if args.model == "flux2" else "Qwen/Qwen-Image")
    pipe = cls.from_pretrained(base, transformer=transformer, dtype=torch.bfloat16)
    return pipe, {"prompt": args.prompt}, args.size, args.steps


def main() -> None:
    from diffusers import ContextParallelConfig

    from diffusers_nvfp4_fast import disable_fast_paths, enable_fast_paths, fast_path_report
    from diffusers_nvfp4_fast.utils import png_sha256, run_pipeline

    args = parse()
    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.mode == "ring" and device.type == "cpu":
        raise SystemExit("ring attention needs the log-sum-exp, which no CPU attention backend of diffusers 0.42.1 "
                         "returns; use --mode ulysses on the CPU")
    pipe, call, size, steps = load(args)
    pipe.to(device)
    pipe.set_progress_bar_config(disable=rank != 0)
    backend = args.backend or ("_native_cudnn" if args.mode == "ring" and device.type == "cuda" else "native")
    pipe.transformer.set_attention_backend(backend)
    degree = {"ring_degree": world} if args.mode == "ring" else {"ulysses_degree": world}
    config = ContextParallelConfig(**degree)

    if args.fast_paths_first:
        enable_fast_paths(pipe)
        pipe.transformer.enable_parallelism(config=config)
        image = run_pipeline(pipe, call, size=size, steps=steps)
        report = next(iter(fast_path_report(pipe).values()))
        disable_fast_paths(pipe)  # the parallel config stays on diffusers' processors
        off = png_sha256(run_pipeline(pipe, call, size=size, steps=steps))
    else:
        pipe.transformer.enable_parallelism(config=config)
        off = png_sha256(run_pipeline(pipe, call, size=size, steps=steps))
        enable_fast_paths(pipe)
        image = run_pipeline(pipe, call, size=size, steps=steps)
        report = next(iter(fast_path_report(pipe).values()))
        disable_fast_paths(pipe)
    on = png_sha256(image)
    mine = {"rank": rank, "off": off, "on": on, "fused_calls": report["fused_calls"], "fallbacks": report["fallbacks"]}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        for entry in everyone:
            print("RANK " + json.dumps(entry))
        same = all(e["on"] == e["off"] == everyone[0]["off"] for e in everyone)
        print(f"{args.model} {args.mode} x{world} ({backend}): PNG SHA256 off {off}, on {on}: "
              + ("identical on every rank" if same else "DIFFERENT"))
        image.save(f"context_parallel_{args.model}.png")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
