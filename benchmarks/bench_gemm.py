"""NVFP4 W4A4 GEMM on Hopper/Ampere: the Triton kernel vs cuBLAS BF16 vs dequantize-then-matmul, side by side.

Usage: python benchmarks/bench_gemm.py [--m 17 1024 4608 9216] [--models flux2-dev qwen-image] [--quick]
Writes benchmarks/results/gemm-<device>.json (with --sweep-configs: gemm_config_sweep-<device>.json; docs/design.md
§10) and prints a table.

Variants per (M, N, K), all in one process:
* ``nvfp4_gemm``: ``kernels.nvfp4_gemm`` on pre-quantized X and W, the GEMM ``NVFP4Linear`` runs (on SM90 with
  M > 64 the Gluon kernel ``nvfp4_gemm_sm90``, else the Triton kernel with its shipped config; ``config`` says which).
* ``nvfp4_triton_kernel``: the same call forced onto the Triton kernel (``kernel="triton"``), for comparison.
* ``nvfp4_quant_gemm``: the Triton activation quantizer + ``nvfp4_gemm``, i.e. what ``NVFP4Linear`` pays per call.
* ``cublas_bf16``: ``torch.nn.functional.linear`` on BF16 X and a BF16 weight (cuBLAS), the speed goal's baseline.
* ``dequant_matmul``: decode W and X to BF16 per call (Triton decode kernel) and run cuBLAS: what projects that
  "support" NVFP4 on Hopper by dequantizing whole weights do.
TFLOP/s counts 2*M*N*K. ``vs_cublas_bf16`` = cuBLAS time / variant time (> 1: faster than cuBLAS).
``rel_err``: ||out - ref|| / ||ref|| against the exact FP32 emulation (decoded operands, FP32 matmul without TF32), on
the first ``--ref-rows`` rows; for ``nvfp4_gemm`` it is measured on an FP32 output of the same kernel and config, and
``exact`` records that the BF16 output equals that FP32 output rounded to BF16 and that both kernels gave the same
BF16 bytes. Timing: ``triton.testing.do_bench`` median (L2 flushed before each call). Goal (issue 6):
``nvfp4_gemm`` >= 0.8x cuBLAS BF16 at M = 4608 on every FLUX.2-dev shape. At M = 4608 the ratio is also measured
paired (``vs_cublas_bf16_paired``: median over 5 rounds of cuBLAS, ours, cuBLAS back to back), because the separate
timings drift with the GPU's clocks over a long run, and as CUDA-graph replays (``vs_cublas_bf16_graph``, 3 paired
rounds: GPU time without the host's launch cost, which do_bench partly counts; see ``paired_ratio``).
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import copy_bandwidth_gbps, header, write_result  # noqa: E402
from common import time_us as time_us_graph  # noqa: E402

SHAPES = {  # (N, K) of the transformer blocks' Linears
    "flux2-dev": [(55296, 6144), (6144, 24576), (18432, 6144), (6144, 6144), (36864, 6144), (6144, 18432)],
    "qwen-image": [(3072, 3072), (12288, 3072), (3072, 12288), (18432, 3072)],
}
GOAL_M, GOAL_RATIO = 4608, 0.8
DEVICE = "cuda"  # a module constant so that the logic can be dry-run on CPU under the Triton interpreter


def time_us(fn) -> float:
    import triton.testing

    return 1000.0 * triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def paired_ratio(ours, baseline, rounds: int = 5, graph: bool = False) -> list[float]:
    """cuBLAS time / our time, measured ``rounds`` times as baseline, ours, baseline back to back (baseline time =
    mean of the two around ours). Clock and power drift over a long run moves separate timings of the two by several
    percent; the ratio of adjacent timings is steadier. Returns the per-round ratios.

    ``graph=False``: ``do_bench`` (L2 flushed before each call; the host's launch cost can leave the GPU idle inside
    the timed interval: ~150 us per ``nvfp4_gemm`` call, ~10 us per cuBLAS call). ``graph=True``: replays of a CUDA
    graph of 10 calls (GPU time only, L2 not flushed), as the GEMMs run inside a captured denoising step."""
    import triton.testing

    def t(fn):
        if graph:
            return time_us_graph(fn)
        return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")

    ratios = []
    for _ in range(rounds):
        before, mine, after = t(baseline), t(ours), t(baseline)
        ratios.append((before + after) / 2 / mine)
    return ratios


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def make_weight(n: int, k: int, seed: int):
    """BF16 W [n, k] ~ N(0, 0.02^2) and its NVFP4 form (precise mode, 128x4 scales, weight_scale_2 = amax/2688)."""
    from diffusers_nvfp4_fast.format import quantize_nvfp4

    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    w = (torch.randn(n, k, device=DEVICE, generator=gen) * 0.02).to(torch.bfloat16)
    w_scale_2 = (w.float().abs().amax() / 2688.0).reshape(())
    wp, ws = quantize_nvfp4(w, 1.0 / w_scale_2, fast_math=False)
    return w, wp, ws, w_scale_2


def make_input(m: int, k: int, seed: int):
    """BF16 X [m, k] ~ N(0, 1), its global scale (input_scale = amax/2688) and NVFP4 form (Triton quantizer)."""
    from diffusers_nvfp4_fast import kernels

    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(m, k, device=DEVICE, generator=gen).to(torch.bfloat16)
    x_scale = (x.float().abs().amax() / 2688.0).reshape(1)
    g_x = (1.0 / x_scale).to(torch.float32)
    xp, xs = kernels.quantize_nvfp4_triton(x, g_x)
    return x, xp, xs, g_x, x_scale.reshape(())


def bench_shape(model: str, weight, m: int, ref_rows: int, gemm_mod, result: dict) -> list[dict]:
    """Time all variants for one (M, N, K); ``weight`` = ``make_weight(N, K, ...)``. Appends rows to ``result``."""
    import torch.nn.functional as F

    from diffusers_nvfp4_fast import kernels

    w, wp, ws, w_scale_2 = weight
    n, k = w.shape
    x, xp, xs, g_x, x_scale = make_input(m, k, seed=m)
    alpha = (x_scale * w_scale_2).to(torch.float32)
    flops = 2.0 * m * n * k
    shape = {"model": model, "M": m, "N": n, "K": k}

    # Ours: the first call compiles (not timed); the shape class's config is reused for an FP32 output.
    ours = lambda: gemm_mod.nvfp4_gemm(xp, xs, wp, ws, alpha, torch.bfloat16)  # noqa: E731
    portable = lambda: gemm_mod.nvfp4_gemm(xp, xs, wp, ws, alpha, torch.bfloat16, kernel="triton")  # noqa: E731
    out = ours()
    same_bytes = torch.equal(portable(), out)
    best = gemm_mod.launch_config(m <= gemm_mod.PREDECODE_MAX_M, m, n, k, wp.device) if wp.is_cuda else None
    sm90 = gemm_mod.sm90_kernel_for(m, k, wp, ws) is not None
    out32 = gemm_mod.nvfp4_gemm(xp, xs, wp, ws, alpha, torch.float32, config=None if sm90 else best)
    r = min(ref_rows, m)
    x32 = gemm_mod.decode_nvfp4_rows(xp[:r].contiguous(), _row_slice_scales(xs, r), torch.float32)
    w32 = gemm_mod.decode_nvfp4_rows(wp, ws, torch.float32)
    ref = (x32 @ w32.t()) * alpha
    del w32, x32
    ours_err = rel_err(out32[:r], ref)
    exact_epilogue = torch.equal(out, out32.to(torch.bfloat16)) and same_bytes
    del out32

    quant_gemm = lambda: gemm_mod.nvfp4_gemm(*kernels.quantize_nvfp4_triton(x, g_x), wp, ws, alpha, torch.bfloat16)  # noqa: E731
    cublas = lambda: F.linear(x, w)  # noqa: E731

    def dequant():
        w16 = gemm_mod.decode_nvfp4_rows(wp, ws, torch.bfloat16)
        x16 = gemm_mod.decode_nvfp4_rows(xp, xs, torch.bfloat16)
        return (F.linear(x16, w16).float() * alpha).to(torch.bfloat16)

    deq_err = rel_err(dequant()[:r], ref)
    del ref
    times = {"nvfp4_gemm": time_us(ours), "nvfp4_triton_kernel": time_us(portable),
             "nvfp4_quant_gemm": time_us(quant_gemm), "cublas_bf16": time_us(cublas),
             "dequant_matmul": time_us(dequant)}
    errs = {"nvfp4_gemm": ours_err, "nvfp4_triton_kernel": ours_err, "nvfp4_quant_gemm": ours_err, "cublas_bf16": None,
            "dequant_matmul": deq_err}
    rows = []
    for variant, us in times.items():
        rows.append({
            "shape": shape, "variant": variant, "us": round(us, 2), "tflops": round(flops / (us * 1e-6) / 1e12, 1),
            "vs_cublas_bf16": round(times["cublas_bf16"] / us, 3),
            "rel_err": None if errs[variant] is None else float(f"{errs[variant]:.3e}"),
            "exact": exact_epilogue if variant == "nvfp4_gemm" else None,
        })
    if m == GOAL_M:
        for name, rounds_key, graph, rounds in (("paired", "paired_rounds", False, 5),
                                                ("graph", "graph_rounds", True, 3)):
            ratios = paired_ratio(ours, cublas, rounds=rounds, graph=graph)
            rows[0][f"vs_cublas_bf16_{name}"] = round(statistics.median(ratios), 3)
            rows[0][rounds_key] = [round(r, 3) for r in ratios]
    rows[0]["config"] = _sm90_config_str() if sm90 else _config_str(best)
    rows[1]["config"] = _config_str(best)
    result["cases"].extend(rows)
    return rows


def sweep_configs(model: str, weight, m: int, gemm_mod) -> list[dict]:
    """Time every candidate config of the variant M selects (the autotuner's view, with do_bench medians)."""
    w, wp, ws, w_scale_2 = weight
    n, k = w.shape
    _, xp, xs, _, x_scale = make_input(m, k, seed=m)
    alpha = (x_scale * w_scale_2).to(torch.float32)
    rows = []
    sm90 = gemm_mod.sm90_kernel_for(m, k, wp, ws)
    if sm90 is not None:
        x16 = gemm_mod.decode_nvfp4_rows(xp, xs)
        out = torch.empty(m, n, device=DEVICE, dtype=torch.bfloat16)
        for stages in (3, 4, 5):  # 6 stages no longer fit next to the warp-specialized kernel's buffers
            us = time_us(lambda stages=stages: sm90.nvfp4_gemm_sm90(x16, wp, ws, alpha.reshape(1), out, stages))
            rows.append({"shape": {"model": model, "M": m, "N": n, "K": k}, "config": _sm90_config_str(stages),
                         "us": round(us, 2), "tflops": round(2.0 * m * n * k / (us * 1e-6) / 1e12, 1),
                         "note": "GEMM alone, X already decoded"})
    for cfg in gemm_mod.gemm_configs(m <= gemm_mod.PREDECODE_MAX_M):
        try:
            us = time_us(lambda cfg=cfg: gemm_mod.nvfp4_gemm(xp, xs, wp, ws, alpha, torch.bfloat16, config=cfg))
        except Exception as e:  # e.g. out of shared memory on a smaller GPU
            rows.append({"shape": {"model": model, "M": m, "N": n, "K": k}, "config": _config_str(cfg),
                         "error": str(e)[:200]})
            continue
        rows.append({"shape": {"model": model, "M": m, "N": n, "K": k}, "config": _config_str(cfg), "us": round(us, 2),
                     "tflops": round(2.0 * m * n * k / (us * 1e-6) / 1e12, 1)})
    return rows


def _row_slice_scales(scales: torch.Tensor, rows: int) -> torch.Tensor:
    """128x4 scales of the first ``rows`` rows: whole 128-row blocks, so a prefix of the swizzled tensor."""
    keep = (rows + 127) // 128 * 128
    return scales[:keep].contiguous()


def _sm90_config_str(stages: int | None = None) -> str:
    from diffusers_nvfp4_fast.kernels import nvfp4_gemm_sm90 as s

    return f"sm90 gluon BN{s.BLOCK_N} BK{s.BLOCK_K} w{s.NUM_WARPS} S{stages or 'default'}"


def _config_str(cfg) -> str:
    if cfg is None:
        return "?"
    kw = cfg.kwargs
    regs = " Wregs" if kw.get("W_IN_REGS") else ""
    return f"BM{kw['BLOCK_M']} BN{kw['BLOCK_N']} BK{kw['BLOCK_K']} w{cfg.num_warps} s{cfg.num_stages}{regs}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", type=int, nargs="+", default=[17, 1024, 4608, 9216], help="token counts (GEMM rows)")
    ap.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--quick", action="store_true", help="M in {17, 4608}, FLUX.2-dev shapes only")
    ap.add_argument("--ref-rows", type=int, default=1024, help="rows checked against the FP32 emulation")
    ap.add_argument("--sweep-configs", action="store_true",
                    help=f"also time every GEMM config at M={GOAL_M} (and 17) on each shape "
                         "(for tuning the config list)")
    args = ap.parse_args()
    if args.quick:
        args.m, args.models = [17, GOAL_M], ["flux2-dev"]
    if not torch.cuda.is_available():
        sys.exit("bench_gemm needs a CUDA GPU")
    major, _ = torch.cuda.get_device_capability()
    if not 8 <= major <= 9:
        print(f"note: SM{major}x is not a target of the Triton GEMM (SM80-SM90); timing it anyway", file=sys.stderr)
    torch.backends.cuda.matmul.allow_tf32 = False  # the FP32 reference must be FP32
    gemm_mod = importlib.import_module("diffusers_nvfp4_fast.kernels.nvfp4_gemm")

    t0 = time.time()
    copy = copy_bandwidth_gbps()
    result = header("gemm", copy)
    result["timing"] = "triton.testing.do_bench median, L2 flushed before each call; first call (compile) untimed"
    result["predecode_max_m"] = gemm_mod.PREDECODE_MAX_M
    sweep = []
    for model in args.models:
        for n, k in SHAPES[model]:
            weight = make_weight(n, k, seed=n + k)
            for m in args.m:
                rows = bench_shape(model, weight, m, args.ref_rows, gemm_mod, result)
                print(f"[{time.time() - t0:6.1f}s] {model:10s} M={m:5d} N={n:5d} K={k:5d} "
                      + "  ".join(f"{r['variant']} {r['tflops']:7.1f} TF/s" for r in rows), flush=True)
                if args.sweep_configs and m in (17, GOAL_M):
                    sweep.extend(sweep_configs(model, weight, m, gemm_mod))
            del weight
            torch.cuda.empty_cache()

    goal_rows = [c for c in result["cases"] if c["variant"] == "nvfp4_gemm" and c["shape"]["M"] == GOAL_M
                 and c["shape"]["model"] == "flux2-dev"]
    result["goal"] = {
        "statement": f"nvfp4_gemm >= {GOAL_RATIO}x cuBLAS BF16 at M={GOAL_M} on every FLUX.2-dev shape",
        "min_ratio": min((c["vs_cublas_bf16"] for c in goal_rows), default=None),
        "met": bool(goal_rows) and all(c["vs_cublas_bf16"] >= GOAL_RATIO for c in goal_rows),
        "min_ratio_paired": min((c["vs_cublas_bf16_paired"] for c in goal_rows), default=None),
        "met_paired": bool(goal_rows) and all(c["vs_cublas_bf16_paired"] >= GOAL_RATIO for c in goal_rows),
        "min_ratio_graph": min((c["vs_cublas_bf16_graph"] for c in goal_rows), default=None),
        "met_graph": bool(goal_rows) and all(c["vs_cublas_bf16_graph"] >= GOAL_RATIO for c in goal_rows),
    }
    if sweep:
        result["config_sweep"] = sweep
    result["wall_s"] = round(time.time() - t0, 1)
    path = write_result(result, "gemm_config_sweep" if args.sweep_configs else None)  # the sweep is its own file

    print(f"\ncopy bandwidth {copy:.0f} GB/s; {result['wall_s']} s -> {path}")
    print(f"{'model':10s} {'M':>5s} {'N':>6s} {'K':>6s} {'variant':17s} {'us':>10s} {'TF/s':>7s} {'vs cuBLAS':>9s} "
          f"{'rel_err':>9s} config")
    for c in result["cases"]:
        s = c["shape"]
        err = "" if c["rel_err"] is None else f"{c['rel_err']:.1e}"
        print(f"{s['model']:10s} {s['M']:5d} {s['N']:6d} {s['K']:6d} {c['variant']:17s} {c['us']:10.1f} "
              f"{c['tflops']:7.1f} {c['vs_cublas_bf16']:9.2f} {err:>9s} {c.get('config', '')}")
    for r in sweep:
        timing = f"{r['us']:10.1f} us {r['tflops']:7.1f} TF/s" if "us" in r else r["error"]
        print(f"sweep {r['shape']} {r['config']:28s} {timing}")
    print(f"goal: {result['goal']}")


if __name__ == "__main__":
    main()
