"""Qwen-Image GELU quantize: fused vs diffusers' GELU + standalone quantize vs torch.compile of the same.

Usage: python benchmarks/bench_gelu.py [--rows 512 4096] [--sweep]
The site: FC2's input in a Qwen-Image feed-forward, ``gelu(h, approximate="tanh")`` with K = 12288, at the text (512
rows) and image (4096 rows at 1024x1024) streams. Bytes moved by the fused kernel: read ``h``, write the packed
values and the scales. The ``"output": "fp16"`` cases time what runs on Hopper above 64 rows, where FC2's GEMM takes
the decoded FP16 values: the fused kernel's decoded variant vs GELU + ``quantize_nvfp4_decoded`` (read ``h``, write
FP16). Writes benchmarks/results/gelu-<device>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import bandwidth_cases, copy_bandwidth_gbps, header, print_bandwidth_cases, time_us, write_result  # noqa: E402,E501

from diffusers_nvfp4_fast import kernels  # noqa: E402
from diffusers_nvfp4_fast.kernels.launch import padded_scale_shape  # noqa: E402


def unfused(h: torch.Tensor, g: torch.Tensor):
    """What diffusers and the unfused fast path run: GELU in torch, then the standalone quantize."""
    return kernels.quantize_nvfp4_triton(F.gelu(h, approximate="tanh"), g)


def case(rows: int, width: int, g: torch.Tensor, copy: float) -> list[dict]:
    h = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16) * 3
    m, c = padded_scale_shape(rows, width)
    nbytes = rows * (2 * width + width // 2) + m * c
    compiled = torch.compile(lambda h: unfused(h, g))
    fused = lambda: kernels.gelu_quantize_triton(h, g)  # noqa: E731
    exact = all(torch.equal(x, y) for x, y in zip(fused(), unfused(h, g)))
    us = {"fused": time_us(fused), "unfused": time_us(lambda: unfused(h, g)), "compiled": time_us(lambda: compiled(h))}
    compiled_exact = all(torch.equal(x, y) for x, y in zip(compiled(h), fused()))
    cases = bandwidth_cases({"rows": rows, "K": width, "output": "packed"}, us, nbytes, copy, exact, compiled_exact)
    fused16 = lambda: kernels.gelu_quantize_decoded_triton(h, g)  # noqa: E731
    unfused16 = lambda: kernels.quantize_nvfp4_decoded(F.gelu(h, approximate="tanh"), g)  # noqa: E731
    exact16 = torch.equal(fused16().view(torch.int16), unfused16().view(torch.int16))
    us16 = {"fused": time_us(fused16), "unfused": time_us(unfused16)}
    return cases + bandwidth_cases({"rows": rows, "K": width, "output": "fp16"}, us16, rows * width * 4, copy, exact16,
                                   exact16)


def sweep(width: int, g: torch.Tensor) -> list[dict]:
    h = torch.randn(4096, width, device="cuda", dtype=torch.bfloat16) * 3
    rows = []
    for block_r, block_c, warps in [(8, 16, 4), (4, 32, 4), (8, 32, 4), (16, 16, 4), (16, 8, 4), (8, 8, 2),
                                    (32, 16, 8)]:
        kw = dict(block_r=block_r, block_c=block_c, num_warps=warps)
        rows.append({"block_r": block_r, "block_c": block_c, "num_warps": warps,
                     "us": round(time_us(lambda: kernels.gelu_quantize_triton(h, g, **kw)), 2)})
        print(rows[-1])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--sweep", action="store_true", help="time tile configurations at 4096 rows")
    args = ap.parse_args()
    copy = copy_bandwidth_gbps()
    result = header("gelu", copy)
    g = torch.tensor([448.0 * 6.0 / 8.0], device="cuda")
    if args.sweep:
        result["tile_sweep"] = sweep(12288, g)
    result["note"] = ("compiled: torch.compile of the unfused code; inductor computes GELU its own way, so its bytes "
                      "may differ (exact=False there is inductor's, not the kernel's)")
    for rows in args.rows:
        result["cases"] += case(rows, 12288, g, copy)
    print_bandwidth_cases(result["cases"], copy, write_result(result))


if __name__ == "__main__":
    main()
