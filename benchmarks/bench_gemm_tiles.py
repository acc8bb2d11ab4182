"""NVFP4 layers of both models as the GPU runs them under CUDA graphs: the SM90 GEMM per token-tile height, the whole
layer (quantize + GEMM + bias) and cuBLAS BF16, side by side, with weights streamed from memory.

Usage: python benchmarks/bench_gemm_tiles.py [--m 1 17 512 1024 2048 4096 4608] [--models qwen-image flux2-dev]
Writes benchmarks/results/gemm_tiles-<device>.json and prints a table.

Why another GEMM benchmark: ``bench_gemm.py`` times with ``do_bench``, whose figure for a call shorter than its host
cost is the host cost (~50-150 µs per ``nvfp4_gemm`` call), so it cannot see the text streams (M = 512) or the
modulation (M = 1) on the GPU. Here each figure is a CUDA-graph replay of passes of ``R`` calls over ``R`` distinct
weights (at least 160 MB of weights per pass, more than the 50 MB L2, as in a step where each weight is read once),
divided by ``R``. Variants per (M, N, K):

* ``sm90_bm<h>``: the Gluon kernel on the decoded FP16 activation with ``h`` tokens per tile (M > 64 only).
* ``nvfp4_layer``: what ``NVFP4Linear`` runs per call: ``ops.linear.quantized_linear`` from BF16 X with a BF16 bias.
* ``cublas_bf16``: ``torch.nn.functional.linear`` with a BF16 weight and bias (the step's BF16 baseline).

``vs_cublas_bf16`` = cuBLAS time / variant time. ``exact``: every tile height gave the same bytes. ``chosen_bm`` is
``sm90_block_m``'s pick and ``best_bm`` the fastest height measured. The tuning sweeps that chose the small-M
kernels, the quantize tile and the pipeline depth are a study: benchmarks/studies/20261203_gemm_sweeps.py.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import copy_bandwidth_gbps, header, time_us, write_result  # noqa: E402

SHAPES = {  # (N, K) of the transformer blocks' Linears
    "qwen-image": [(3072, 3072), (12288, 3072), (3072, 12288), (18432, 3072)],
    "flux2-dev": [(6144, 6144), (36864, 6144), (6144, 18432), (55296, 6144), (6144, 24576)],
}
STREAM_BYTES = 160 << 20


def graph_us(calls: list) -> float:
    """Median GPU µs per call of CUDA-graph replays of passes over ``calls`` (``common.time_us``)."""
    return time_us(lambda: [c() for c in calls], warmup=1) / len(calls)


def nvfp4_weights(n: int, k: int, count: int):
    from diffusers_nvfp4_fast.format import quantize_nvfp4

    w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
    gw = 2688.0 / w.float().abs().amax()
    packed, scales = quantize_nvfp4(w, gw, fast_math=False)
    del w
    return [(packed.clone(), scales.clone()) for _ in range(count)], (1.0 / gw).float().reshape(1)


def streamed_weights(n: int, k: int):
    """``nvfp4_weights`` with as many copies as ``STREAM_BYTES`` of packed weights and scales take (at least one)."""
    return nvfp4_weights(n, k, max(1, math.ceil(STREAM_BYTES / (n * k * 9 // 16))))


def cublas_us(x: torch.Tensor, n: int, k: int, bias: torch.Tensor | None = None) -> float:
    """GPU µs per ``F.linear(x, w, bias)`` with BF16 ``[n, k]`` weights streamed from memory (``graph_us``)."""
    dense = [(torch.randn(n, k, device="cuda") * 0.02).bfloat16()
             for _ in range(max(1, math.ceil(STREAM_BYTES / (n * k * 2))))]
    return graph_us([lambda w=w: torch.nn.functional.linear(x, w, bias) for w in dense])


def run_shape(model: str, m: int, n: int, k: int) -> list[dict]:
    from diffusers_nvfp4_fast.kernels import nvfp4_gemm_sm90 as sm90
    from diffusers_nvfp4_fast.kernels.nvfp4_gemm import PREDECODE_MAX_M
    from diffusers_nvfp4_fast.ops.linear import quantized_linear

    shape = {"model": model, "M": m, "N": n, "K": k}
    weights, alpha = streamed_weights(n, k)
    x = (torch.randn(m, k, device="cuda") * 3).bfloat16()
    g = (2688.0 / x.float().abs().amax()).reshape(1)
    bias = torch.randn(n, device="cuda").bfloat16()
    us: dict[str, float] = {}
    exact = None
    chosen = best = None
    if m > PREDECODE_MAX_M:
        from diffusers_nvfp4_fast.kernels import quantize_nvfp4_decoded

        x16 = quantize_nvfp4_decoded(x, g, fast_math=True)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        outs = {}
        for bm in sorted(sm90.SM90_TILE_COST, reverse=True):
            us[f"sm90_bm{bm}"] = graph_us([
                lambda w=w, bm=bm: sm90.nvfp4_gemm_sm90(x16, w[0], w[1], alpha, out, block_m=bm) for w in weights])
            outs[bm] = sm90.nvfp4_gemm_sm90(x16, weights[0][0], weights[0][1], alpha, out.clone(), block_m=bm)
        exact = all(torch.equal(o, outs[256]) for o in outs.values())
        chosen = sm90.sm90_block_m(m, n, torch.cuda.get_device_properties(0).multi_processor_count)
        best = int(min((t, int(v[7:])) for v, t in us.items())[1])
    us["nvfp4_layer"] = graph_us([lambda w=w: quantized_linear(x, g, True, w[0], w[1], alpha, bias, torch.bfloat16)
                                  for w in weights])
    del weights
    us["cublas_bf16"] = cublas_us(x, n, k, bias)
    flop = 2 * m * n * k
    return [{"shape": shape, "variant": v, "us": round(t, 2), "tflops": round(flop / t / 1e6, 1),
             "vs_cublas_bf16": round(us["cublas_bf16"] / t, 3), "exact_tile_heights": exact,
             "chosen_bm": chosen, "best_bm": best} for v, t in us.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 17, 512, 1024, 2048, 4096, 4608])
    ap.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = ap.parse_args()
    t0 = time.time()
    out = header("gemm_tiles", copy_bandwidth_gbps())
    out["timing"] = (f"CUDA-graph replay (common.time_us), >= {STREAM_BYTES >> 20} MB of distinct weights per pass "
                     "over the calls")
    for model in args.models:
        for n, k in SHAPES[model]:
            for m in args.m:
                cases = run_shape(model, m, n, k)
                out["cases"] += cases
                row = " ".join(f"{c['variant']} {c['us']:.1f}us ({c['vs_cublas_bf16']:.2f}x)" for c in cases)
                print(f"{model} {m}x{n}x{k}: {row} chosen={cases[0]['chosen_bm']} best={cases[0]['best_bm']} "
                      f"exact={cases[0]['exact_tile_heights']}", flush=True)
                torch.cuda.empty_cache()
    from diffusers_nvfp4_fast.kernels.nvfp4_gemm_sm90 import SM90_TILE_COST

    out["sm90_tile_cost"] = {str(k): v for k, v in SM90_TILE_COST.items()}
    out["wall_s"] = round(time.time() - t0, 1)
    print("wrote", write_result(out, "gemm_tiles"))


if __name__ == "__main__":
    main()
