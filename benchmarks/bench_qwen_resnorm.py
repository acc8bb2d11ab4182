"""Qwen-Image residual + LayerNorm + modulate + NVFP4 quantize: fused kernel vs diffusers' eager chain + standalone
quantize vs ``torch.compile`` of the chain (+ the same standalone quantize), at hidden size 3072.

Usage: python benchmarks/bench_qwen_resnorm.py [--rows 17 1024 4096 4608] [--dim 3072]
Writes benchmarks/results/qwen_resnorm-<device>.json (docs/design.md §10) and prints a table.

Timing: ``triton.testing.do_bench_cudagraph`` median (CUDA-graph replays, so Python launch overhead is excluded;
the L2 cache is not flushed, so at 1024 rows, ~20 MB, inputs can stay L2-resident).
Bytes of the fused op: read residual, x, bias, gate/scale/shift; write residual_out, packed values, 128x4 scales.
``exact``: byte equality (residual_out, packed, every scale byte) with the eager chain + standalone quantize, checked
in this run in fast-math (the default) and precise mode; for ``compiled`` it records whether Inductor's code gave the
eager bytes (it is not required to).
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
from diffusers_nvfp4_fast.ops.layer_norm_quantize import ResNormInputs, residual_norm_chain  # noqa: E402

EPS = 1e-6
GOAL_ROWS = 4096
GOALS = {"eager": 6.0, "compiled": 1.5, "bw_fraction": 0.80}


def time_us(fn) -> float:
    # CUDA-graph replays: GPU time without Python launch overhead (which dominates at 17 rows otherwise).
    return 1000.0 * triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def make_inputs(rows: int, d: int):
    """B=1, L=rows, activation-like residual; shift/scale/gate are views of one mod_params tensor, as in diffusers."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    residual = torch.randn(1, rows, d, device="cuda", generator=gen)
    residual = (residual * torch.rand(d, device="cuda", generator=gen) * 10
                + torch.randn(d, device="cuda", generator=gen) * 3)
    attn = torch.randn(1, rows, d, device="cuda", generator=gen) * 0.7
    bias = torch.randn(d, device="cuda", generator=gen) * 0.1
    mod = torch.randn(1, 6 * d, device="cuda", generator=gen) * 0.3
    shift, scale, gate = mod.to(torch.bfloat16).chunk(2, dim=-1)[1].chunk(3, dim=-1)
    return residual.to(torch.bfloat16), attn.to(torch.bfloat16), bias.to(torch.bfloat16), gate, scale, shift


def fused_bytes(rows: int, d: int, batch: int = 1) -> int:
    padded_rows = (rows + 127) // 128 * 128
    read = 2 * rows * d * 2 + d * 2 + 3 * batch * d * 2  # residual, x, bias, gate/scale/shift
    written = rows * d * 2 + rows * d // 2 + padded_rows * ((d // 16 + 3) // 4 * 4)  # residual_out, packed, scales
    return read + written


def same_bytes(a, b) -> bool:
    return all(torch.equal(x.view(torch.int16) if x.dtype == torch.bfloat16 else x,
                           y.view(torch.int16) if y.dtype == torch.bfloat16 else y) for x, y in zip(a, b, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[17, 1024, 4096, 4608])
    ap.add_argument("--dim", type=int, default=3072)
    args = ap.parse_args()
    t_start = time.time()
    d = args.dim
    copy = copy_bandwidth_gbps()
    result = header("qwen_resnorm", copy)
    result["timing"] = "triton.testing.do_bench_cudagraph median (CUDA graph replays, L2 not flushed)"
    compiled_chain = torch.compile(residual_norm_chain, dynamic=False)

    for rows in args.rows:
        case = make_inputs(rows, d)
        m_ref = residual_norm_chain(ResNormInputs(*case), EPS)[1]
        g = torch.tensor([448.0 * 6.0 / m_ref.float().abs().max().item()], dtype=torch.float32, device="cuda")

        def fused(fast_math=True, case=case, g=g):
            return kernels.resnorm_quantize_triton(*case, g, eps=EPS, fast_math=fast_math)

        def eager(fast_math=True, case=case, g=g):
            r, m = residual_norm_chain(ResNormInputs(*case), EPS)
            return (r, *kernels.quantize_nvfp4_triton(m.reshape(-1, d), g, fast_math=fast_math))

        def compiled(case=case, g=g):
            r, m = compiled_chain(ResNormInputs(*case), EPS)
            return (r, *kernels.quantize_nvfp4_triton(m.reshape(-1, d), g, fast_math=True))

        exact = same_bytes(fused(True), eager(True)) and same_bytes(fused(False), eager(False))
        exact_compiled = same_bytes(compiled(), eager(True))
        us = {
            "fused": time_us(fused),
            "eager": time_us(eager),
            "compiled": time_us(compiled),
            # context: no quantize
            "eager_chain": time_us(lambda case=case: residual_norm_chain(ResNormInputs(*case), EPS)),
        }
        exact_of = {"fused": exact, "eager": True, "compiled": exact_compiled, "eager_chain": None}
        nbytes = fused_bytes(rows, d)
        for variant, t in us.items():
            gbps = nbytes / (t * 1e-6) / 1e9
            result["cases"].append({
                "shape": {"rows": rows, "D": d}, "variant": variant, "us": round(t, 2),
                "GBps": round(gbps, 1), "bw_fraction": round(gbps / copy, 3),
                "speedup_vs": {o: round(us[o] / t, 2) for o in ("fused", "eager", "compiled") if o != variant},
                "exact": exact_of[variant],
            })

    path = write_result(result)
    print(f"device {result['device']}  copy bandwidth {copy:.0f} GB/s  -> {path}  ({time.time() - t_start:.0f} s)")
    print(f"{'rows':>6} {'variant':12} {'us':>9} {'GB/s':>8} {'%copy':>6}  {'speedup_vs':34} exact")
    for c in result["cases"]:
        sv = " ".join(f"{k}={v}x" for k, v in c["speedup_vs"].items())
        print(f"{c['shape']['rows']:>6} {c['variant']:12} {c['us']:9.1f} {c['GBps']:8.0f} "
              f"{c['bw_fraction'] * 100:5.1f}%  {sv:34} {c['exact']}")
    goal = next((c for c in result["cases"] if c["shape"]["rows"] == GOAL_ROWS and c["variant"] == "fused"), None)
    if goal is not None:
        checks = {
            f">= {GOALS['eager']}x eager": goal["speedup_vs"]["eager"] >= GOALS["eager"],
            f">= {GOALS['compiled']}x compiled": goal["speedup_vs"]["compiled"] >= GOALS["compiled"],
            f">= {GOALS['bw_fraction']:.0%} of copy bandwidth": goal["bw_fraction"] >= GOALS["bw_fraction"],
            "byte-identical": bool(goal["exact"]),
        }
        print(f"goals at {GOAL_ROWS} rows: " + ", ".join(f"{k}: {'PASS' if v else 'MISS'}" for k, v in checks.items()))


if __name__ == "__main__":
    main()
