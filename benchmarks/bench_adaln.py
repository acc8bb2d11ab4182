"""Adaptive LayerNorm quantize (``LayerNorm(x) * (1 + scale) + shift -> NVFP4``, the input of the projections after a
block's norm1): fused kernel vs diffusers' eager chain + the standalone quantize vs ``torch.compile`` of the chain (+
the same quantize), at the shapes of both models.

Usage: python benchmarks/bench_adaln.py [--shapes 4096x3072 512x3072 4608x6144 4096x6144]
Bytes moved by the fused kernel: read x and scale/shift, write the packed values and 128x4 scales. The ``"output":
"fp16"`` cases time what runs on Hopper above 64 rows, where the GEMM takes the decoded FP16 values: the kernel's
decoded variant vs the chain + ``quantize_nvfp4_decoded`` (write FP16). ``exact``: byte equality with the eager chain
+ standalone quantize, checked in this run (the packed form in both quantize modes); for ``compiled`` whether
Inductor's code gave the eager bytes (it is not required to). Writes benchmarks/results/adaln-<device>.json.
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
from diffusers_nvfp4_fast.ops.layer_norm_quantize import AdaLNInputs, adaln_chain  # noqa: E402

EPS = 1e-6


def make_inputs(rows: int, d: int) -> AdaLNInputs:
    """B=1, activation-like x; scale/shift are views of one modulation tensor, as diffusers makes them."""
    gen = torch.Generator(device="cuda").manual_seed(rows + d)
    x = torch.randn(1, rows, d, device="cuda", generator=gen)
    x = x * torch.rand(d, device="cuda", generator=gen) * 10 + torch.randn(d, device="cuda", generator=gen) * 3
    mod = (torch.randn(1, 6 * d, device="cuda", generator=gen) * 0.3).to(torch.bfloat16)
    shift, scale, _gate = mod.chunk(2, dim=-1)[0].chunk(3, dim=-1)
    return AdaLNInputs(x.to(torch.bfloat16), scale, shift)


def same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True))


def case(rows: int, d: int, copy: float) -> list[dict]:
    inputs = make_inputs(rows, d)
    g = torch.tensor([448.0 * 6.0 / adaln_chain(inputs, EPS).float().abs().max().item()], device="cuda")
    compiled_chain = torch.compile(adaln_chain, dynamic=False)

    def unfused(fast_math=True):
        return kernels.quantize_nvfp4_triton(adaln_chain(inputs, EPS).reshape(-1, d), g, fast_math=fast_math)

    def fused(fast_math=True):
        return kernels.adaln_quantize_triton(*inputs, g, eps=EPS, fast_math=fast_math)

    def compiled():
        return kernels.quantize_nvfp4_triton(compiled_chain(inputs, EPS).reshape(-1, d), g)

    exact = same(fused(True), unfused(True)) and same(fused(False), unfused(False))
    us = {"fused": time_us(fused), "unfused": time_us(unfused), "compiled": time_us(compiled)}
    m, c = padded_scale_shape(rows, d)
    nbytes = rows * (2 * d + d // 2) + m * c + 4 * d
    cases = bandwidth_cases({"rows": rows, "D": d, "output": "packed"}, us, nbytes, copy, exact,
                            same(compiled(), unfused()))
    fused16 = lambda: kernels.adaln_quantize_triton(*inputs, g, eps=EPS, decoded=True)  # noqa: E731
    unfused16 = lambda: (kernels.quantize_nvfp4_decoded(adaln_chain(inputs, EPS).reshape(-1, d), g),)  # noqa: E731
    exact16 = same(fused16(), unfused16())
    us16 = {"fused": time_us(fused16), "unfused": time_us(unfused16)}
    return cases + bandwidth_cases({"rows": rows, "D": d, "output": "fp16"}, us16, rows * d * 4 + 4 * d, copy,
                                   exact16, exact16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["4096x3072", "512x3072", "4608x6144", "4096x6144"],
                    help="ROWSxD: Qwen-Image image and text streams, FLUX.2-dev single-stream and double-stream image")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_adaln needs a CUDA GPU")
    copy = copy_bandwidth_gbps()
    result = header("adaln", copy)
    result["note"] = ("compiled: torch.compile of the unfused chain; inductor computes LayerNorm its own way, so its "
                      "bytes may differ (exact=False there is inductor's, not the kernel's)")
    for shape in args.shapes:
        rows, d = (int(v) for v in shape.split("x"))
        result["cases"] += case(rows, d, copy)
    print_bandwidth_cases(result["cases"], copy, write_result(result))


if __name__ == "__main__":
    main()
