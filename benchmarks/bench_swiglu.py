"""FLUX.2 SwiGLU quantize: fused vs diffusers' SwiGLU + (cat +) standalone quantize vs torch.compile of the same.

Usage: python benchmarks/bench_swiglu.py [--rows 512 4096 4608] [--sweep]
Two sites of FLUX.2-dev at 1024x1024: a double-stream feed-forward (``linear_out``'s input: ``swiglu(h)``, H = 18432)
and a single-stream block (``to_out``'s input: ``cat([attn, swiglu(h)])``, A = 6144). Bytes moved by the fused kernel:
read ``h`` (and ``attn``), write the packed values and the scales. Writes benchmarks/results/swiglu-<device>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import bandwidth_cases, copy_bandwidth_gbps, header, print_bandwidth_cases, time_us, write_result  # noqa: E402,E501

from diffusers_nvfp4_fast import kernels  # noqa: E402
from diffusers_nvfp4_fast.kernels.launch import padded_scale_shape  # noqa: E402
from diffusers_nvfp4_fast.ops.swiglu_quantize import swiglu_reference  # noqa: E402


def unfused(h: torch.Tensor, attn: torch.Tensor | None, g: torch.Tensor):
    """What diffusers and the unfused fast path run: SwiGLU in torch, the concatenation, the standalone quantize."""
    x = swiglu_reference(h)
    if attn is not None:
        x = torch.cat([attn, x], -1)
    return kernels.quantize_nvfp4_triton(x, g)


def case(rows: int, a_width: int, h_width: int, g: torch.Tensor, copy: float) -> list[dict]:
    h = torch.randn(rows, 2 * h_width, device="cuda", dtype=torch.bfloat16)
    attn = torch.randn(rows, a_width, device="cuda", dtype=torch.bfloat16) if a_width else None
    k = a_width + h_width
    m, c = padded_scale_shape(rows, k)
    nbytes = rows * (2 * a_width + 4 * h_width + k // 2) + m * c
    compiled = torch.compile(lambda h, a: unfused(h, a, g))
    fused = lambda: kernels.swiglu_quantize_triton(h, g, attn)  # noqa: E731
    exact = all(torch.equal(x, y) for x, y in zip(fused(), unfused(h, attn, g)))
    us = {"fused": time_us(fused), "unfused": time_us(lambda: unfused(h, attn, g)),
          "compiled": time_us(lambda: compiled(h, attn))}
    compiled_exact = all(torch.equal(x, y) for x, y in zip(compiled(h, attn), fused()))
    return bandwidth_cases({"rows": rows, "A": a_width, "H": h_width}, us, nbytes, copy, exact, compiled_exact)


def sweep(a_width: int, h_width: int, g: torch.Tensor) -> list[dict]:
    h = torch.randn(4608, 2 * h_width, device="cuda", dtype=torch.bfloat16)
    attn = torch.randn(4608, a_width, device="cuda", dtype=torch.bfloat16)
    rows = []
    for block_r, block_c, warps in [(8, 16, 4), (4, 32, 4), (8, 32, 4), (16, 16, 4), (16, 8, 4), (8, 8, 2),
                                    (32, 16, 8)]:
        kw = dict(block_r=block_r, block_c=block_c, num_warps=warps)
        rows.append({"block_r": block_r, "block_c": block_c, "num_warps": warps,
                     "us": round(time_us(lambda: kernels.swiglu_quantize_triton(h, g, attn, **kw)), 2)})
        print(rows[-1])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[512, 4096, 4608])
    ap.add_argument("--sweep", action="store_true", help="time tile configurations at 4608 rows (single-stream)")
    args = ap.parse_args()
    copy = copy_bandwidth_gbps()
    result = header("swiglu", copy)
    g = torch.tensor([448.0 * 6.0 / 8.0], device="cuda")
    if args.sweep:
        result["tile_sweep"] = sweep(6144, 18432, g)
    result["note"] = ("compiled: torch.compile of the unfused code; inductor rounds SiLU its own way, so its bytes "
                      "may differ (exact=False there is inductor's, not the kernel's)")
    for rows in args.rows:
        for a_width in (0, 6144):
            result["cases"] += case(rows, a_width, 18432, g, copy)
    print_bandwidth_cases(result["cases"], copy, write_result(result))


if __name__ == "__main__":
    main()
