"""``diffusers-nvfp4-fast demo``: the main job end to end on an embedded tiny model, offline, on CPU or GPU.

On a 2-core CPU it takes 10-15 s for each model once Python's caches are warm; the first run after installing
compiles the imported packages' bytecode and can take a minute or more. It prints how long it took.

Builds a tiny random FLUX.2 / FLUX.2-klein / Qwen-Image pipeline, quantizes its transformer to an NVFP4 checkpoint
in the ModelOpt export layout, loads it back with ``load_nvfp4_transformer``, generates an image with fast paths
off and on, and prints what happened: the load summary, the fast-path report and both PNG SHA256s.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ..api import disable_fast_paths, enable_fast_paths, fast_path_report
from ..loaders import load_nvfp4_transformer, load_summary
from ..testing.export import quantize_tiny_pipeline
from ..testing.tiny import TINY_PIPELINES
from ..utils import png_sha256, run_pipeline


def _imports_seconds() -> float:
    """Seconds since this process started (the imports before ``main``), from the OS clock of the process."""
    import psutil

    return time.time() - psutil.Process().create_time()


def _step(progress: bool, text: str) -> None:
    if progress:
        print(text, file=sys.stderr, flush=True)


def run_demo(
    model: str = "flux2", *, device: str = "cpu", size: int = 64, steps: int = 3, out_dir: str | None = None,
    progress: bool = False,
) -> dict:
    """Run the demo; returns a summary dict (hashes, report, timings). ``progress`` prints each step to stderr."""
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        _step(progress, f"[1/4] building a tiny random {model} pipeline and quantizing its transformer to NVFP4")
        checkpoint = quantize_tiny_pipeline(model, Path(out_dir or tmp) / f"{model}-nvfp4")
        _step(progress, "[2/4] loading the checkpoint with load_nvfp4_transformer")
        transformer = load_nvfp4_transformer(checkpoint, device=device)
        pipe, kwargs = TINY_PIPELINES[model](transformer)
        pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        t1 = time.perf_counter()
        _step(progress, f"[3/4] generating a {size}x{size} image, {steps} steps, fast paths off")
        off = run_pipeline(pipe, kwargs, size=size, steps=steps)
        _step(progress, "[4/4] the same with fast paths on")
        enable_fast_paths(pipe)
        on = run_pipeline(pipe, kwargs, size=size, steps=steps)
        report = fast_path_report(pipe)
        disable_fast_paths(pipe)
        t2 = time.perf_counter()
        if out_dir:
            on.save(Path(out_dir) / f"{model}-fast.png")
    return {
        "model": model, "device": device, "checkpoint": str(checkpoint) if out_dir else "(temporary)",
        "load": load_summary(transformer), "sha256_fast_paths_off": png_sha256(off),
        "sha256_fast_paths_on": png_sha256(on), "identical": png_sha256(off) == png_sha256(on),
        "report": report, "seconds": {"build_quantize_load": round(t1 - t0, 2), "generate_twice": round(t2 - t1, 2)},
    }


def main(argv: Sequence[str] | None = None) -> int:
    started = time.perf_counter() - _imports_seconds()
    ap = argparse.ArgumentParser(prog="diffusers-nvfp4-fast demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(TINY_PIPELINES), default="flux2")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=None, help="keep the checkpoint and the image in this folder")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(level=logging.WARNING)
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    summary = run_demo(args.model, device=args.device, size=args.size, steps=args.steps, out_dir=args.out,
                       progress=not args.json)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        entry = next(iter(summary["report"].values()))
        load = summary["load"]
        print(f"tiny {args.model} pipeline on {args.device}: {load['nvfp4_linears']} NVFP4 linears, "
              f"{load['bf16_linears']} BF16 linears "
              f"({summary['seconds']['build_quantize_load']} s to build, quantize, load)")
        print(f"GEMM backend: {entry.get('gemm_backend')}; fused sites: {entry.get('sites')}")
        print(f"fused calls: {entry.get('fused_calls')}; fallbacks: {entry.get('fallbacks') or 'none'}; "
              f"verifications: {entry.get('verifications', {}).get('passed')} passed, "
              f"{entry.get('verifications', {}).get('failed')} failed")
        print(f"PNG SHA256 fast paths off: {summary['sha256_fast_paths_off']}")
        print(f"PNG SHA256 fast paths on:  {summary['sha256_fast_paths_on']}")
        print("identical" if summary["identical"] else "DIFFERENT (please report this)")
        print(f"done in {time.perf_counter() - started:.1f} s (imports included)")
    return 0 if summary["identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
