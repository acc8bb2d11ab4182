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
``sm90_block_m``'s pick and ``best_bm`` the fastest height measured.

``--small-m-sweep mma`` (M <= 64 only, the modulation layers' shapes) times the tensor-core small-M GEMM over
``SMALL_M_SWEEP`` configs x K splits instead, with the weight's bytes per second as a fraction of the copy bandwidth,
and checks that every config of one split gives the same bytes (gemm_small_m-mma-<device>.json). ``--small-m-sweep
gemv`` (M = 1) times the one-row kernel ``nvfp4_gemv``: its two activation forms, the whole layer call, the
tensor-core kernel it replaced, and ``GEMV_SWEEP`` tiles x K splits, checking that tiles of one BLOCK_K and split give
the same bytes (gemm_small_m-gemv-<device>.json). ``--stages-sweep`` times the SM90 GEMM at
every tile height x pipeline depth that fits shared memory, with byte equality to the default launch
(gemm_stages-<device>.json). ``--quantize-sweep`` times the large-M layers' activation quantize
(``quantize_nvfp4_decoded``, BF16 to the exact FP16 values the GEMM multiplies) over ``QUANTIZE_SWEEP`` tiles, beside
the same quantize built from E2M1 codes (``codes_then_decode``, the kernel before 2026-12-03's value rounding), with
bytes moved per second as a fraction of the copy bandwidth and byte equality with the codes kernel
(quantize_decoded-<device>.json).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))
from common import copy_bandwidth_gbps, header, time_us, write_result  # noqa: E402

from diffusers_nvfp4_fast.kernels import nvfp4_epilogue as ep  # noqa: E402
from diffusers_nvfp4_fast.kernels import quantize_nvfp4 as qn  # noqa: E402

SHAPES = {  # (N, K) of the transformer blocks' Linears
    "qwen-image": [(3072, 3072), (12288, 3072), (3072, 12288), (18432, 3072)],
    "flux2-dev": [(6144, 6144), (36864, 6144), (6144, 18432), (55296, 6144), (6144, 24576)],
}
STREAM_BYTES = 160 << 20
# (BLOCK_N, BLOCK_K, warps, stages) of the small-M sweep; BLOCK_M is 16 (the MMA's narrowest side).
SMALL_M_SWEEP = [(32, 256, 2, 4), (32, 512, 2, 3), (64, 128, 2, 4), (64, 256, 2, 3), (64, 256, 4, 4),
                 (64, 512, 4, 3), (64, 128, 4, 6), (128, 128, 4, 4), (128, 128, 4, 6), (128, 256, 4, 3),
                 (128, 128, 8, 4), (128, 256, 8, 3), (256, 128, 8, 3), (32, 256, 4, 4)]
SMALL_M_SPLITS = (1, 2, 3, 6, 12)
# (BLOCK_N, BLOCK_K, warps, stages) of the one-row kernel's sweep; BLOCK_N, warps and stages do not change a byte.
GEMV_SWEEP = [(64, 128, 4, 3), (32, 128, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3), (64, 128, 8, 3), (64, 128, 4, 1),
              (64, 128, 4, 4), (256, 128, 8, 3), (32, 128, 2, 3), (64, 256, 4, 3), (128, 256, 8, 3), (64, 64, 4, 3)]
GEMV_SPLITS = (1, 2, 4)
# (block rows, 16-block columns, warps) of the decoded quantize's sweep; the tile does not change a byte.
QUANTIZE_SWEEP = [(4, 32, 4), (8, 16, 4), (2, 64, 4), (1, 128, 4), (2, 32, 2), (4, 64, 8), (2, 64, 8), (4, 16, 2),
                  (8, 32, 8), (16, 16, 4)]
QUANTIZE_SHAPES = {"qwen-image": [(4096, 3072), (4096, 12288), (512, 3072), (512, 12288)],
                   "flux2-dev": [(4608, 6144), (4096, 18432)]}
MODULATION_SHAPES = {"qwen-image": [(18432, 3072)], "flux2-dev": [(36864, 6144), (18432, 6144)]}  # the M = 1 layers


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


def small_m_sweep(model: str, m: int, n: int, k: int, copy_gbps: float) -> list[dict]:
    """The in-kernel-X GEMM (``nvfp4_gemm``, M <= 64) per config of ``SMALL_M_SWEEP`` and K split, plus the default
    (autotuned config, ``split_k_for``'s split) and cuBLAS BF16; GPU µs per call under CUDA graphs."""
    import importlib

    import triton

    from diffusers_nvfp4_fast.kernels import quantize_nvfp4_triton

    gemm = importlib.import_module("diffusers_nvfp4_fast.kernels.nvfp4_gemm")

    shape = {"model": model, "M": m, "N": n, "K": k}
    weight_bytes = n * k // 2 + n * k // 16
    weights, alpha = streamed_weights(n, k)
    x = (torch.randn(m, k, device="cuda") * 3).bfloat16()
    xp, xs = quantize_nvfp4_triton(x, (2688.0 / x.float().abs().amax()).reshape(1))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []

    def row(label: str, split: int | None, us: float, same: bool | None) -> dict:
        gbps = weight_bytes / (us * 1e-6) / 1e9
        return {"shape": shape, "config": label, "splits": split, "us": round(us, 2), "weight_GBps": round(gbps, 1),
                "of_copy_bandwidth": round(gbps / copy_gbps, 3), "same_bytes_as_split_peers": same}

    default = gemm.split_k_for(m, n, k, sms)[0]
    us = graph_us([lambda w=w: gemm.nvfp4_gemm(xp, xs, w[0], w[1], alpha, torch.bfloat16) for w in weights])
    rows.append(row("default (autotuned)", default, us, None))
    for split in SMALL_M_SPLITS:
        chunk = -(-k // split)
        reference = None
        for bn, bk, warps, stages in SMALL_M_SWEEP:
            if split > 1 and (-(-chunk // 256) * 256) % bk:
                continue  # a split boundary would cut this config's K step
            cfg = triton.Config({"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_N": 8, "W_IN_REGS": False},
                                num_warps=warps, num_stages=stages)
            call = lambda w, cfg=cfg, split=split: gemm.nvfp4_gemm(  # noqa: E731
                xp, xs, w[0], w[1], alpha, torch.bfloat16, split_k=split, config=cfg)
            try:
                result = call(weights[0]).clone()
                us = graph_us([lambda w=w, call=call: call(w) for w in weights])
            except Exception as e:  # noqa: BLE001 - out of registers or shared memory: recorded, not fatal
                rows.append({"shape": shape, "config": f"BN{bn} BK{bk} w{warps} s{stages}", "splits": split,
                             "error": str(e)[:160]})
                continue
            reference = result if reference is None else reference
            rows.append(row(f"BN{bn} BK{bk} w{warps} s{stages}", split, us, torch.equal(result, reference)))
    del weights
    us = cublas_us(x, n, k)
    rows.append(row("cublas_bf16 (weight bytes: 2 per value)", None, us, None) | {
        "weight_GBps": round(n * k * 2 / (us * 1e-6) / 1e9, 1)})
    return rows


def gemv_sweep(model: str, n: int, k: int, copy_gbps: float) -> list[dict]:
    """The one-row kernel (M = 1): activation forms, the layer call, the tensor-core kernel, tiles x K splits, cuBLAS;
    GPU µs per call under CUDA graphs over >= 160 MB of weights."""
    import importlib

    from diffusers_nvfp4_fast import kernels
    from diffusers_nvfp4_fast.ops.linear import quantized_linear

    gemv = importlib.import_module("diffusers_nvfp4_fast.kernels.nvfp4_gemv")
    shape = {"model": model, "M": 1, "N": n, "K": k}
    weight_bytes = n * k // 2 + n * k // 16
    weights, alpha = streamed_weights(n, k)
    x = (torch.randn(1, k, device="cuda") * 3).bfloat16()
    g = (2688.0 / x.float().abs().amax()).reshape(1)
    xp, xs = kernels.quantize_nvfp4_triton(x, g)
    x16 = kernels.quantize_nvfp4_decoded(x, g)
    rows = []

    def timed(label: str, call, split=None, tile=None, reference=None) -> torch.Tensor | None:
        try:
            result = call(weights[0]).clone()
            us = graph_us([lambda w=w: call(w) for w in weights])
        except Exception as e:  # noqa: BLE001 - a tile that does not fit: recorded, not fatal
            rows.append({"shape": shape, "config": label, "splits": split, "error": str(e)[:160]})
            return None
        gbps = weight_bytes / (us * 1e-6) / 1e9
        rows.append({"shape": shape, "config": label, "splits": split, "tile": tile, "us": round(us, 2),
                     "weight_GBps": round(gbps, 1), "of_copy_bandwidth": round(gbps / copy_gbps, 3),
                     "same_bytes_as_peers": None if reference is None else torch.equal(result, reference)})
        return result

    first = timed("nvfp4_gemm (one row: the GEMV, packed row)", lambda w: kernels.nvfp4_gemm(xp, xs, w[0], w[1], alpha))
    timed("GEMV, FP16 row", lambda w: gemv.nvfp4_gemv(x16, w[0], w[1], alpha), reference=first)
    timed("quantized_linear (the layer call)",
          lambda w: quantized_linear(x, g, True, w[0], w[1], alpha, None, torch.bfloat16), reference=first)
    timed("tensor-core small-M kernel (autotuned; before the GEMV)",
          lambda w: kernels.nvfp4_gemm(xp, xs, w[0], w[1], alpha, kernel="triton", x_decode="in_kernel"))
    for split in GEMV_SPLITS:
        peers: dict[int, torch.Tensor] = {}
        for tile in GEMV_SWEEP:
            bn, bk, warps, stages = tile
            out = timed(f"GEMV BN{bn} BK{bk} w{warps} s{stages}", lambda w, tile=tile, split=split: gemv.nvfp4_gemv(
                x16, w[0], w[1], alpha, splits=split, tile=tile), split, list(tile), peers.get(bk))
            if out is not None:
                peers.setdefault(bk, out)
    weights.clear()  # free them before the BF16 weights
    us = cublas_us(x, n, k)
    rows.append({"shape": shape, "config": "cublas_bf16", "us": round(us, 2),
                 "weight_GBps": round(n * k * 2 / (us * 1e-6) / 1e9, 1)})
    return rows


@triton.jit
def codes_then_decode(x_ptr, g_ptr, out_ptr, M, K, row_stride, col_tiles, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                      IS_BF16: tl.constexpr, FAST_MATH: tl.constexpr, HW_E2M1: tl.constexpr):
    """The decoded quantize as it was built before 2026-12-03: E2M1 codes, then their FP16 values (the baseline)."""
    rows, kbs, mask = ep.block_tile(tl.program_id(0), col_tiles, M, K, BLOCK_R, BLOCK_C)
    q0, q1, q2, q3 = ep.load_blocks(x_ptr, rows, kbs, row_stride, mask)
    packed, sf_byte = ep.quantize_blocks(q0, q1, q2, q3, tl.load(g_ptr), IS_BF16, FAST_MATH, HW_E2M1)
    w0, w1, w2, w3 = qn.decoded_words(packed, ep.e4m3_value(sf_byte))
    qn.store_words(w0, w1, w2, w3, rows, kbs, out_ptr, K, mask)


def quantize_sweep(model: str, m: int, k: int, copy_gbps: float) -> list[dict]:
    """The decoded activation quantize of an ``[m, k]`` BF16 activation: the codes kernel, then every tile of the
    value-rounding kernel; GPU µs per call under CUDA graphs over >= 160 MB of distinct activations."""
    shape = {"model": model, "M": m, "K": k}
    count = max(1, math.ceil(STREAM_BYTES / (2 * m * k)))
    xs = [(torch.randn(m, k, device="cuda") * 3).bfloat16() for _ in range(count)]
    g = (2688.0 / xs[0].float().abs().amax()).reshape(1)
    moved = 4 * m * k  # BF16 in, FP16 out
    rows = []

    def timed(label: str, call, tile=None, reference=None) -> torch.Tensor:
        result = call(xs[0]).clone()
        us = graph_us([lambda x=x: call(x) for x in xs])
        gbps = moved / (us * 1e-6) / 1e9
        rows.append({"shape": shape, "config": label, "tile": tile, "us": round(us, 2), "GBps": round(gbps, 1),
                     "of_copy_bandwidth": round(gbps / copy_gbps, 3),
                     "same_bytes_as_codes_kernel": None if reference is None else torch.equal(result, reference)})
        return result

    old = (8, 16, 4)  # the codes kernel's tile (before 2026-12-03)
    codes = timed(f"codes_then_decode R{old[0]} C{old[1]} w{old[2]}", lambda x: qn.launch_decoded_quantize(
        codes_then_decode, x, g, True, *old), list(old))
    for tile in QUANTIZE_SWEEP:
        r, c, w = tile
        timed(f"quantize_nvfp4_decoded R{r} C{c} w{w}", lambda x, r=r, c=c, w=w: qn.quantize_nvfp4_decoded(
            x, g, block_r=r, block_c=c, num_warps=w), list(tile), codes)
    return rows


def stages_sweep(model: str, m: int, n: int, k: int) -> list[dict]:
    """The SM90 GEMM at every tile height x pipeline depth that fits (``sm90_max_stages``), GPU µs per call over
    streamed weights, each output compared with the default launch's bytes; cuBLAS BF16 beside."""
    from diffusers_nvfp4_fast.kernels import nvfp4_gemm_sm90 as sm90
    from diffusers_nvfp4_fast.kernels import quantize_nvfp4_decoded

    shape = {"model": model, "M": m, "N": n, "K": k}
    weights, alpha = streamed_weights(n, k)
    x = (torch.randn(m, k, device="cuda") * 3).bfloat16()
    x16 = quantize_nvfp4_decoded(x, (2688.0 / x.float().abs().amax()).reshape(1), fast_math=True)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    want = sm90.nvfp4_gemm_sm90(x16, weights[0][0], weights[0][1], alpha, out.clone())
    default_bm = sm90.sm90_block_m(m, n, torch.cuda.get_device_properties(0).multi_processor_count)
    rows = []
    for bm in sorted(sm90.SM90_TILE_COST, reverse=True):
        for stages in range(3, sm90.sm90_max_stages(bm, 2) + 1):
            row = {"shape": shape, "block_m": bm, "stages": stages,
                   "default": bm == default_bm and stages == sm90.SM90_STAGES}
            try:
                got = sm90.nvfp4_gemm_sm90(x16, weights[0][0], weights[0][1], alpha, out.clone(), stages=stages,
                                           block_m=bm)
                row["same_bytes_as_default"] = torch.equal(got, want)
                row["us"] = round(graph_us([lambda w=w, bm=bm, st=stages: sm90.nvfp4_gemm_sm90(
                    x16, w[0], w[1], alpha, out, stages=st, block_m=bm) for w in weights]), 2)
            except Exception as e:  # a depth the compiler cannot fit: recorded, not fatal
                row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            rows.append(row)
            print(model, m, n, k, bm, stages, row.get("us", row.get("error")), row.get("same_bytes_as_default"),
                  flush=True)
    del weights
    rows.append({"shape": shape, "variant": "cublas_bf16", "us": round(cublas_us(x, n, k), 2)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 17, 512, 1024, 2048, 4096, 4608])
    ap.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--small-m-sweep", choices=["mma", "gemv"], help="configs x K splits of the M <= 64 tensor-core "
                    "GEMM, or of the one-row kernel")
    ap.add_argument("--quantize-sweep", action="store_true", help="tiles of the large-M layers' activation quantize")
    ap.add_argument("--stages-sweep", action="store_true", help="the SM90 GEMM's tile heights x pipeline depths at "
                    "--m (default 512 1024) for --models")
    args = ap.parse_args()
    t0 = time.time()
    copy = copy_bandwidth_gbps()
    if args.stages_sweep:
        out = header("gemm_stages", copy)
        for model in args.models:
            for n, k in SHAPES[model]:
                for m in (args.m if args.m != ap.get_default("m") else [512, 1024]):
                    out["cases"] += stages_sweep(model, m, n, k)
        out["wall_s"] = round(time.time() - t0, 1)
        print("wrote", write_result(out, "gemm_stages"))
        return
    if args.quantize_sweep:
        out = header("quantize_decoded", copy)
        for model in args.models:
            for m, k in QUANTIZE_SHAPES[model]:
                cases = quantize_sweep(model, m, k, copy)
                out["cases"] += cases
                for c in cases:
                    print(model, m, k, c["config"], c["us"], c["of_copy_bandwidth"], c["same_bytes_as_codes_kernel"],
                          flush=True)
        out["wall_s"] = round(time.time() - t0, 1)
        print("wrote", write_result(out, "quantize_decoded"))
        return
    if args.small_m_sweep:
        name = {"mma": "gemm_small_m-mma", "gemv": "gemm_small_m-gemv"}[args.small_m_sweep]
        out = header(name, copy)
        for model in args.models:
            for n, k in MODULATION_SHAPES[model]:
                if args.small_m_sweep == "gemv":
                    out["cases"] += gemv_sweep(model, n, k, copy)
                    continue
                for m in (m for m in args.m if m <= 64):
                    out["cases"] += small_m_sweep(model, m, n, k, copy)
        best = {}
        for c in out["cases"]:
            key = str(c["shape"])
            if "us" in c and (key not in best or c["us"] < best[key]["us"]):
                best[key] = c
        for c in out["cases"]:
            print(c["shape"]["N"], c["shape"]["K"], c["config"], c.get("splits"), c.get("us", c.get("error")),
                  c.get("of_copy_bandwidth"), c.get("same_bytes_as_peers", c.get("same_bytes_as_split_peers")))
        for c in best.values():
            print("best", c)
        out["wall_s"] = round(time.time() - t0, 1)
        print("wrote", write_result(out, name))
        return
    out = header("gemm_tiles", copy)
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
