"""FLUX.2 rotary embedding on query / key: the fused kernel vs diffusers' ``apply_rotary_emb`` (eager) vs
``torch.compile`` of it.

Usage: python benchmarks/bench_rotary.py [--seq 512 4608] [--heads 48]
Bytes moved by the kernel: read x (BF16), write the result, read the FP32 cos / sin tables once. Writes
benchmarks/results/rotary-<device>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import bandwidth_cases, copy_bandwidth_gbps, header, print_bandwidth_cases, time_us, write_result  # noqa: E402,E501

from diffusers_nvfp4_fast import kernels  # noqa: E402
from diffusers_nvfp4_fast.ops.rotary import rotary_reference  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, nargs="+", default=[512, 4608])
    ap.add_argument("--heads", type=int, default=48)
    ap.add_argument("--dim", type=int, default=128)
    args = ap.parse_args()
    copy = copy_bandwidth_gbps()
    result = header("rotary", copy)
    result["note"] = ("compiled: torch.compile of diffusers' function; inductor contracts its multiply-adds, so its "
                      "bytes may differ (exact=False there is inductor's)")
    compiled = torch.compile(rotary_reference)
    for seq in args.seq:
        x = torch.randn(1, seq, args.heads, args.dim, device="cuda", dtype=torch.bfloat16)
        angles = torch.rand(seq, args.dim // 2, device="cuda").repeat_interleave(2, dim=1) * 100
        cos, sin = angles.cos(), angles.sin()
        nbytes = 2 * x.numel() * 2 + 2 * cos.numel() * 4
        ref = rotary_reference(x, cos, sin)
        exact = torch.equal(kernels.rotary_triton(x, cos, sin).view(torch.int16), ref.view(torch.int16))
        compiled_exact = torch.equal(compiled(x, cos, sin).view(torch.int16), ref.view(torch.int16))
        us = {"fused": time_us(lambda: kernels.rotary_triton(x, cos, sin)),
              "unfused": time_us(lambda: rotary_reference(x, cos, sin)),
              "compiled": time_us(lambda: compiled(x, cos, sin))}
        result["cases"] += bandwidth_cases({"seq": seq, "heads": args.heads, "dim": args.dim}, us, nbytes, copy, exact,
                                           compiled_exact)
    print_bandwidth_cases(result["cases"], copy, write_result(result))


if __name__ == "__main__":
    main()
