"""FLUX.2 token-cat quantize: fused vs torch.cat + standalone quantize vs torch.compile of the torch reference.

Usage: python benchmarks/bench_token_cat.py [--rows 17 512 4096 4608]
Writes benchmarks/results/token_cat-<device>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import bandwidth_cases, copy_bandwidth_gbps, header, time_us, write_result  # noqa: E402

from diffusers_nvfp4_fast import kernels  # noqa: E402
from diffusers_nvfp4_fast.format import quantize_nvfp4 as torch_quantize  # noqa: E402
from diffusers_nvfp4_fast.kernels.launch import padded_scale_shape  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[17, 512, 4096, 4608])
    ap.add_argument("--a", type=int, default=6144)
    ap.add_argument("--b", type=int, default=18432)
    ap.add_argument("--sweep", action="store_true", help="time tile configurations at 4096 rows and use the best")
    args = ap.parse_args()
    copy = copy_bandwidth_gbps()
    result = header("token_cat", copy)
    if args.sweep:
        result["tile_sweep"] = sweep(args.a, args.b)
        best = min(result["tile_sweep"], key=lambda r: r["fused_us"])
        print("best tile", best)
    g = torch.tensor([448.0 * 6.0 / 8.0], device="cuda")
    compiled_ref = torch.compile(lambda a, b: torch_quantize(torch.cat([a, b], -1), g[0], fast_math=False))
    for rows in args.rows:
        a = torch.randn(rows, args.a, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(rows, args.b, device="cuda", dtype=torch.bfloat16)
        k = args.a + args.b
        nbytes = rows * (2 * k + k // 2) + triton_scale_bytes(rows, k)
        fused = lambda: kernels.token_cat_quantize_triton(a, b, g)  # noqa: E731
        unfused = lambda: kernels.quantize_nvfp4_triton(torch.cat([a, b], -1), g)  # noqa: E731
        exact = all(torch.equal(x, y) for x, y in zip(fused(), unfused()))
        compiled_exact = all(torch.equal(x, y) for x, y in zip(
            compiled_ref(a, b), kernels.token_cat_quantize_triton(a, b, g, fast_math=False)))
        us = {"fused": time_us(fused), "unfused": time_us(unfused), "compiled": time_us(lambda: compiled_ref(a, b))}
        result["cases"] += bandwidth_cases({"rows": rows, "A": args.a, "B": args.b}, us, nbytes, copy, exact,
                                           compiled_exact)
    # The standalone quantize on its own (issue goal: >= 85% of copy bandwidth at 4096 x 24576).
    x = torch.randn(4096, args.a + args.b, device="cuda", dtype=torch.bfloat16)
    t = time_us(lambda: kernels.quantize_nvfp4_triton(x, g))
    k = x.shape[1]
    gbps = (4096 * (2 * k + k // 2) + triton_scale_bytes(4096, k)) / (t * 1e-6) / 1e9
    ref = torch_quantize(x, g[0], fast_math=False)
    result["cases"].append({"shape": {"rows": 4096, "K": k}, "variant": "standalone_quantize", "us": round(t, 2),
                            "GBps": round(gbps, 1), "bw_fraction": round(gbps / copy, 3), "speedup_vs": {},
                            "exact": all(torch.equal(p, q)
                                         for p, q in zip(kernels.quantize_nvfp4_triton(x, g, fast_math=False), ref))})
    path = write_result(result)
    print(f"copy bandwidth {copy:.0f} GB/s -> {path}")
    for c in result["cases"]:
        print(f"{str(c['shape']):45s} {c['variant']:20s} {c['us']:9.1f} us {c['bw_fraction']*100:5.1f}% bw "
              f"{c['speedup_vs']} exact={c['exact']}")


def sweep(a_width: int, b_width: int) -> list[dict]:
    """Fused and standalone kernel times for several (rows per tile, 16-blocks per tile, warps) at 4096 rows."""
    g = torch.tensor([448.0 * 6.0 / 8.0], device="cuda")
    a = torch.randn(4096, a_width, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, b_width, device="cuda", dtype=torch.bfloat16)
    x = torch.cat([a, b], -1)
    rows = []
    for block_r, block_c, warps in [(4, 32, 4), (8, 32, 4), (8, 16, 4), (16, 16, 4), (8, 64, 8), (16, 32, 8),
                                    (32, 16, 8), (4, 64, 4)]:
        kw = dict(block_r=block_r, block_c=block_c, num_warps=warps)
        rows.append({"block_r": block_r, "block_c": block_c, "num_warps": warps,
                     "fused_us": round(time_us(lambda: kernels.token_cat_quantize_triton(a, b, g, **kw)), 2),
                     "standalone_us": round(time_us(lambda: kernels.quantize_nvfp4_triton(x, g, **kw)), 2)})
        print(rows[-1])
    return rows


def triton_scale_bytes(rows: int, k: int) -> int:
    m, c = padded_scale_shape(rows, k)
    return m * c


if __name__ == "__main__":
    main()
