"""Study, last run 2026-12-03: the tuning sweeps behind the GEMM's small-M kernels, the large-M activation quantize's
tile and the SM90 GEMM's pipeline depth (docs/performance.md and docs/history.md quote the results). Each figure is a
CUDA-graph replay over streamed weights, as in ``benchmarks/bench_gemm_tiles.py`` (the product measurement), whose
helpers it uses.

    python benchmarks/studies/20261203_gemm_sweeps.py --small-m-sweep mma --m 1   # gemm_small_m-mma-<device>.json
    python benchmarks/studies/20261203_gemm_sweeps.py --small-m-sweep gemv        # gemm_small_m-gemv-<device>.json
    python benchmarks/studies/20261203_gemm_sweeps.py --quantize-sweep            # quantize_decoded-<device>.json
    python benchmarks/studies/20261203_gemm_sweeps.py --stages-sweep --models qwen-image --m 512  # gemm_stages-...

``--small-m-sweep mma`` (M <= 64 only, the modulation layers' shapes) times the tensor-core small-M GEMM over
``SMALL_M_SWEEP`` configs x K splits, with the weight's bytes per second as a fraction of the copy bandwidth, and
checks that every config of one split gives the same bytes. ``--small-m-sweep gemv`` (M = 1) times the one-row kernel
``nvfp4_gemv``: its two activation forms, the whole layer call, the tensor-core kernel it replaced, and ``GEMV_SWEEP``
tiles x K splits, checking that tiles of one BLOCK_K and split give the same bytes. ``--stages-sweep`` times the SM90
GEMM at every tile height x pipeline depth that fits shared memory, with byte equality to the default launch.
``--quantize-sweep`` times the large-M layers' activation quantize (``quantize_nvfp4_decoded``, BF16 to the exact FP16
values the GEMM multiplies) over ``QUANTIZE_SWEEP`` tiles, beside the same quantize built from E2M1 codes
(``codes_then_decode``, the kernel before 2026-12-03's value rounding), with bytes moved per second as a fraction of the
copy bandwidth and byte equality with the codes kernel. Results go to this folder's ``results/``.
"""

from __future__ import annotations

import argparse
import math
import time

import study  # this folder's shared helpers; puts benchmarks/ on the path
import torch
import triton
import triton.language as tl
from bench_gemm_tiles import SHAPES, STREAM_BYTES, cublas_us, graph_us, streamed_weights
from common import copy_bandwidth_gbps, header

from diffusers_nvfp4_fast.kernels import nvfp4_epilogue as ep
from diffusers_nvfp4_fast.kernels import quantize_nvfp4 as qn

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
    sweep = ap.add_mutually_exclusive_group(required=True)
    sweep.add_argument("--small-m-sweep", choices=["mma", "gemv"], help="configs x K splits of the M <= 64 "
                       "tensor-core GEMM, or of the one-row kernel")
    sweep.add_argument("--quantize-sweep", action="store_true", help="tiles of the large-M layers' activation quantize")
    sweep.add_argument("--stages-sweep", action="store_true", help="the SM90 GEMM's tile heights x pipeline depths "
                       "at --m (default 512 1024) for --models")
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
        print("wrote", study.write_result(out, "gemm_stages"))
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
        print("wrote", study.write_result(out, "quantize_decoded"))
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
        print("wrote", study.write_result(out, name))


if __name__ == "__main__":
    main()
