"""Query/key RMSNorm + rotary embedding (Qwen-Image, then FLUX.2-dev): which arithmetic torch's CUDA ops use, and the
fused kernels vs diffusers' chain (eager) vs ``torch.compile`` of it.

Usage: python benchmarks/bench_qk_norm_rotary.py [--seq 512 4096] [--heads 24] [--tiles]
Probe (exactness, before timing): each stage of the kernel's arithmetic against torch itself on this GPU: the mean of
squares (reduction tree), ``torch.rsqrt`` on every positive finite FP32 value, the complex product for each FMA form,
and the whole chain for each form (mismatching values; the kernel's default form, with the tree ``tree_match``
found, must give 0). Bytes moved by the kernel: read x and write the result (BF16), read the FP32 rotary table once.
``--tiles`` also times the norm kernels' tiles (rows and warps per program) and checks their bytes against the
default tile's. Writes benchmarks/results/qk_norm_rotary-<device>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))
from common import bandwidth_cases, copy_bandwidth_gbps, header, print_bandwidth_cases, time_us, write_result  # noqa: E402,E501

from diffusers_nvfp4_fast.kernels import flux2_qk_norm_rotary_triton, qk_norm_rotary_triton  # noqa: E402
from diffusers_nvfp4_fast.kernels.qk_norm_rotary import (  # noqa: E402
    FMA_FORMS,
    NORM_BLOCK_R,
    NORM_WARPS,
    _complex_product,
)
from diffusers_nvfp4_fast.kernels.rounding import rsqrt_like_torch  # noqa: E402
from diffusers_nvfp4_fast.ops.qk_norm_rotary import (  # noqa: E402
    EPS,
    flux2_qk_norm_rotary,
    flux2_qk_norm_rotary_reference,
    flux2_tables,
    qk_norm_rotary,
    qk_norm_rotary_reference,
    tree_match,
)
from diffusers_nvfp4_fast.ops.qk_norm_rotary import probe_inputs as qk_inputs  # noqa: E402


@triton.jit
def _rsqrt_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, rsqrt_like_torch(tl.load(x_ptr + i, mask=i < n), True), mask=i < n)


@triton.jit
def _complex_kernel(p_ptr, q_ptr, out_ptr, n, REAL_FMA: tl.constexpr, IMAG_FMA: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    real, imag = _complex_product(tl.load(p_ptr + 2 * i, mask=ok), tl.load(p_ptr + 2 * i + 1, mask=ok),
                                  tl.load(q_ptr + 2 * i, mask=ok), tl.load(q_ptr + 2 * i + 1, mask=ok),
                                  REAL_FMA, IMAG_FMA)
    tl.store(out_ptr + 2 * i, real, mask=ok)
    tl.store(out_ptr + 2 * i + 1, imag, mask=ok)


def _differ(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.view(torch.int32 if a.element_size() == 4 else torch.int16)
                != b.view(torch.int32 if b.element_size() == 4 else torch.int16)).sum())


def _tree_or_reason(device: torch.device) -> int | str:
    """The JSON's ``matching_tree``: the tree ``tree_match`` picked, or why none."""
    match = tree_match(device)
    return match.tree if match.tree is not None else str(match.reason)


def probe() -> dict:
    """Mismatch counts per stage and per FMA form (0 = the kernel's arithmetic is torch's there)."""
    x, weight, freqs = qk_inputs(2, 4096, 24, device="cuda", seed=1)
    rows = x.numel() // 128
    mean = torch.empty(rows, device="cuda")
    torch_mean = x.float().pow(2).mean(-1).flatten()
    result: dict = {"rows": rows, "matching_tree": _tree_or_reason(x.device), "mean_of_squares_rows_differing": {}}
    for tree in (1, 0):
        qk_norm_rotary_triton(x, weight, freqs, EPS, mean_out=mean, tree=tree)
        result["mean_of_squares_rows_differing"][f"tree {tree}"] = _differ(mean, torch_mean)
    differing = 0
    for start in range(1, 0x7F800000, 1 << 27):  # every positive finite FP32 value, in chunks
        bits = torch.arange(start, min(start + (1 << 27), 0x7F800000), device="cuda", dtype=torch.int32)
        v = bits.view(torch.float32)
        got = torch.empty_like(v)
        _rsqrt_kernel[(triton.cdiv(v.numel(), 1024),)](v, got, v.numel(), BLOCK=1024)
        differing += _differ(got, torch.rsqrt(v))
    result["rsqrt_values_differing"] = differing
    gen = torch.Generator(device="cuda").manual_seed(0)
    p = torch.randn(1 << 22, 2, device="cuda", generator=gen) * torch.exp2(
        torch.randint(-30, 30, (1 << 22, 1), device="cuda", generator=gen).float())
    q = torch.polar(torch.ones(1 << 22, device="cuda"), torch.rand(1 << 22, device="cuda", generator=gen) * 1e4)
    want = torch.view_as_real(torch.view_as_complex(p) * q)
    result["complex_product_differing"], result["chain_bytes_differing"] = {}, {}
    ref = qk_norm_rotary_reference(x, weight, freqs, EPS)
    for real_fma, imag_fma in FMA_FORMS:
        got = torch.empty_like(want)
        _complex_kernel[(triton.cdiv(p.shape[0], 1024),)](p, torch.view_as_real(q), got, p.shape[0], REAL_FMA=real_fma,
                                                           IMAG_FMA=imag_fma, BLOCK=1024, enable_fp_fusion=False)
        form = f"real {real_fma}, imag {imag_fma}"
        result["complex_product_differing"][form] = _differ(got, want)
        chain = qk_norm_rotary_triton(x, weight, freqs, EPS, real_fma=real_fma, imag_fma=imag_fma)
        result["chain_bytes_differing"][form] = _differ(chain, ref)
    result["chain_bytes_differing"]["tree 0, default form"] = _differ(
        qk_norm_rotary_triton(x, weight, freqs, EPS, tree=0), ref)
    result["op_exact"] = _differ(qk_norm_rotary(x, weight, freqs, EPS), ref) == 0
    cos, sin = flux2_tables(freqs)
    flux2_ref = flux2_qk_norm_rotary_reference(x, weight, cos, sin, EPS)
    result["flux2_chain_bytes_differing"] = {
        f"tree {tree}": _differ(flux2_qk_norm_rotary_triton(x, weight, cos, sin, EPS, tree=tree), flux2_ref)
        for tree in (1, 0)}
    return result


TILES = ((16, 4), (8, 2), (8, 1), (4, 1), (2, 1))  # (rows, warps) per program of the norm kernels


def tiles() -> list[dict]:
    """Each tile's kernel time at Qwen-Image's 4096 x 24 and FLUX.2-dev's 4608 x 48 rows, and whether its bytes equal
    the default tile's (they must: the tile only regroups rows). The tree sits in every thread's registers, so fewer
    threads per program repeat less work and compile faster (docs/performance.md, "First image")."""
    out = []
    for model, seq, heads in (("qwen-image", 4096, 24), ("flux2-dev", 4608, 48)):
        x, weight, freqs = qk_inputs(1, seq, heads, device="cuda", seed=seq)
        cos, sin = flux2_tables(freqs)

        def run(block_r: int, num_warps: int, model=model, x=x, weight=weight, freqs=freqs, cos=cos, sin=sin):
            if model == "qwen-image":
                return qk_norm_rotary_triton(x, weight, freqs, EPS, block_r=block_r, num_warps=num_warps)
            return flux2_qk_norm_rotary_triton(x, weight, cos, sin, EPS, block_r=block_r, num_warps=num_warps)

        default = run(NORM_BLOCK_R, NORM_WARPS)
        for block_r, num_warps in TILES:
            equal = torch.equal(run(block_r, num_warps), default)
            us = time_us(lambda: run(block_r, num_warps))  # noqa: B023 (timed before the next tile)
            out.append({"model": model, "seq": seq, "heads": heads, "block_r": block_r, "num_warps": num_warps,
                        "us": round(us, 2), "equal_to_default": equal,
                        "default": (block_r, num_warps) == (NORM_BLOCK_R, NORM_WARPS)})
            print(out[-1], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--tiles", action="store_true", help="also time the norm kernels' tiles (rows, warps per program)")
    args = ap.parse_args()
    copy = copy_bandwidth_gbps()
    result = header("qk_norm_rotary", copy)
    result["probe"] = probe()
    print(result["probe"])
    result["note"] = ("unfused: diffusers' chain (Qwen-Image: its RMSNorm + apply_rotary_emb_qwen; FLUX.2: F.rms_norm "
                      "+ apply_rotary_emb); compiled: torch.compile of it, inductor's own arithmetic (exact=False "
                      "there is inductor's)")
    compiled = torch.compile(qk_norm_rotary_reference)
    for seq in args.seq:
        x, weight, freqs = qk_inputs(1, seq, args.heads, device="cuda", seed=seq)
        nbytes = 2 * x.numel() * 2 + freqs.numel() * 8
        ref = qk_norm_rotary_reference(x, weight, freqs, EPS)
        exact = _differ(qk_norm_rotary(x, weight, freqs, EPS), ref) == 0
        compiled_exact = _differ(compiled(x, weight, freqs, EPS), ref) == 0
        us = {"fused": time_us(lambda: qk_norm_rotary(x, weight, freqs, EPS)),
              "unfused": time_us(lambda: qk_norm_rotary_reference(x, weight, freqs, EPS)),
              "compiled": time_us(lambda: compiled(x, weight, freqs, EPS))}
        result["cases"] += bandwidth_cases({"model": "qwen-image", "seq": seq, "heads": args.heads}, us, nbytes, copy,
                                           exact, compiled_exact)
    flux2_compiled = torch.compile(flux2_qk_norm_rotary_reference)
    for seq in (512, 4608):  # FLUX.2-dev: text stream, single-stream blocks; 48 heads
        x, weight, freqs = qk_inputs(1, seq, 48, device="cuda", seed=seq)
        cos, sin = flux2_tables(freqs)
        nbytes = 2 * x.numel() * 2 + 2 * cos.numel() * 4
        ref = flux2_qk_norm_rotary_reference(x, weight, cos, sin, EPS)
        exact = _differ(flux2_qk_norm_rotary(x, weight, cos, sin, EPS), ref) == 0
        compiled_exact = _differ(flux2_compiled(x, weight, cos, sin, EPS), ref) == 0
        us = {"fused": time_us(lambda: flux2_qk_norm_rotary(x, weight, cos, sin, EPS)),
              "unfused": time_us(lambda: flux2_qk_norm_rotary_reference(x, weight, cos, sin, EPS)),
              "compiled": time_us(lambda: flux2_compiled(x, weight, cos, sin, EPS))}
        result["cases"] += bandwidth_cases({"model": "flux2-dev", "seq": seq, "heads": 48}, us, nbytes, copy, exact,
                                           compiled_exact)
    if args.tiles:
        result["tiles"] = tiles()
    print_bandwidth_cases(result["cases"], copy, write_result(result))


if __name__ == "__main__":
    main()
