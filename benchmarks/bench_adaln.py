"""Adaptive LayerNorm quantize (``LayerNorm(x) * (1 + scale) + shift -> NVFP4``, the input of the projections after a
block's norm1): fused kernel (packed, and FP16-decoded for the large-M GEMM) vs diffusers' eager chain + the standalone
quantize vs ``torch.compile`` of the chain (+ the same quantize), at the shapes of both models.

Usage: python benchmarks/bench_adaln.py [--shapes 4096x3072 512x3072 4608x6144 4096x6144]
Writes benchmarks/results/adaln-<device>.json (docs/design.md §10) and prints a table.

Timing: ``triton.testing.do_bench_cudagraph`` median (CUDA-graph replays: no Python launch overhead; L2 not flushed).
Bytes of the fused op: read x and scale/shift; write the packed values and 128x4 scales (``decoded``: the FP16
values). ``exact``: byte equality with the eager chain + standalone quantize (decoded: + its decode), checked in this
run; for ``compiled`` it records whether Inductor's code gave the eager bytes (it is not required to).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).parent))
from common import copy_bandwidth_gbps, header, write_result  # noqa: E402

from diffusers_nvfp4_fast import kernels  # noqa: E402
from diffusers_nvfp4_fast.ops.adaln_quantize import AdaLNInputs, adaln_chain  # noqa: E402

EPS = 1e-6
GOAL_FRACTION = 0.80  # of the copy bandwidth, for a memory-bound fusion


def time_us(fn) -> float:
    return 1000.0 * triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def make_inputs(rows: int, d: int) -> AdaLNInputs:
    """B=1, activation-like x; scale/shift are views of one modulation tensor, as diffusers makes them."""
    gen = torch.Generator(device="cuda").manual_seed(rows + d)
    x = torch.randn(1, rows, d, device="cuda", generator=gen)
    x = x * torch.rand(d, device="cuda", generator=gen) * 10 + torch.randn(d, device="cuda", generator=gen) * 3
    mod = (torch.randn(1, 6 * d, device="cuda", generator=gen) * 0.3).to(torch.bfloat16)
    shift, scale, _gate = mod.chunk(2, dim=-1)[0].chunk(3, dim=-1)
    return AdaLNInputs(x.to(torch.bfloat16), scale, shift)


def fused_bytes(rows: int, d: int, decoded: bool) -> int:
    read = rows * d * 2 + 2 * d * 2
    if decoded:
        return read + rows * d * 2
    return read + rows * d // 2 + (rows + 127) // 128 * 128 * ((d // 16 + 3) // 4 * 4)


def bits(outputs) -> list[torch.Tensor]:
    return [t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t for t in outputs]


def same_bytes(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(bits(a), bits(b), strict=True))


def bench_shape(rows: int, d: int, copy: float, compiled_chain) -> list[dict]:
    inputs = make_inputs(rows, d)
    g = torch.tensor([448.0 * 6.0 / adaln_chain(inputs, EPS).float().abs().max().item()], device="cuda")

    def fused(fast_math=True):
        return kernels.adaln_quantize_triton(*inputs, g, eps=EPS, fast_math=fast_math)

    def fused_decoded():
        return kernels.adaln_quantize_triton(*inputs, g, eps=EPS, decoded=True)

    def eager(fast_math=True):
        return kernels.quantize_nvfp4_triton(adaln_chain(inputs, EPS).reshape(-1, d), g, fast_math=fast_math)

    def eager_decoded():
        return (kernels.quantize_nvfp4_decoded(adaln_chain(inputs, EPS).reshape(-1, d), g),)

    def compiled():
        return kernels.quantize_nvfp4_triton(compiled_chain(inputs, EPS).reshape(-1, d), g, fast_math=True)

    exact = same_bytes(fused(True), eager(True)) and same_bytes(fused(False), eager(False))
    exact_decoded = same_bytes(fused_decoded(), eager_decoded())
    runs = {
        "fused": (fused, exact, False), "eager": (eager, True, False),
        "compiled": (compiled, same_bytes(compiled(), eager(True)), False),
        "fused_decoded": (fused_decoded, exact_decoded, True), "eager_decoded": (eager_decoded, True, True),
    }
    us = {name: time_us(fn) for name, (fn, _, _) in runs.items()}
    cases = []
    for name, (_, is_exact, decoded) in runs.items():
        gbps = fused_bytes(rows, d, decoded) / (us[name] * 1e-6) / 1e9
        peers = ("fused_decoded", "eager_decoded") if decoded else ("fused", "eager", "compiled")
        cases.append({
            "shape": {"rows": rows, "D": d}, "variant": name, "us": round(us[name], 2), "GBps": round(gbps, 1),
            "bw_fraction": round(gbps / copy, 3), "exact": is_exact,
            "speedup_vs": {o: round(us[o] / us[name], 2) for o in peers if o != name},
        })
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["4096x3072", "512x3072", "4608x6144", "4096x6144"],
                    help="ROWSxD: Qwen-Image image and text streams, FLUX.2-dev single-stream and double-stream image")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_adaln needs a CUDA GPU")
    t_start = time.time()
    copy = copy_bandwidth_gbps()
    result = header("adaln", copy)
    result["timing"] = "triton.testing.do_bench_cudagraph median (CUDA graph replays, L2 not flushed)"
    compiled_chain = torch.compile(adaln_chain, dynamic=False)
    for shape in args.shapes:
        rows, d = (int(v) for v in shape.split("x"))
        result["cases"] += bench_shape(rows, d, copy, compiled_chain)
    path = write_result(result)
    print(f"device {result['device']}  copy bandwidth {copy:.0f} GB/s  -> {path}  ({time.time() - t_start:.0f} s)")
    print(f"{'shape':>10} {'variant':14} {'us':>9} {'GB/s':>8} {'%copy':>6}  {'speedup_vs':40} exact")
    for c in result["cases"]:
        sv = " ".join(f"{k}={v}x" for k, v in c["speedup_vs"].items())
        shape = f"{c['shape']['rows']}x{c['shape']['D']}"
        print(f"{shape:>10} {c['variant']:14} {c['us']:9.1f} {c['GBps']:8.0f} {c['bw_fraction'] * 100:5.1f}%  "
              f"{sv:40} {c['exact']}")
    fused = [c for c in result["cases"] if c["variant"].startswith("fused")]
    met = all(c["bw_fraction"] >= GOAL_FRACTION and c["exact"] for c in fused)
    print(f"goal: every fused case exact and >= {GOAL_FRACTION:.0%} of copy bandwidth: {'PASS' if met else 'MISS'}")


if __name__ == "__main__":
    main()
