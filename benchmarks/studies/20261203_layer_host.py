"""Study, last run 2026-12-03: host time per NVFP4 layer call and per fused site (GPU), launch plans on vs off, side
by side in one process (docs/performance.md, "Launch plans"; docs/history.md).

An eager step is bound by host time where its kernels are short (Qwen-Image: 784 NVFP4 layer calls a step). This
times, in microseconds of host time per call, what a transformer block's Python pays for each NVFP4 layer, with
``kernels.launch.DIRECT_LAUNCH`` True (launch plans and direct launches, the default) and False (every launch
through the kernel wrappers and Triton's launcher, as before plans existed), alternating modes round by round:

* plain layer calls ``layer(x)`` (activation quantize + GEMM) at the shapes of Qwen-Image and FLUX.2-dev;
* fused-site calls: ``fc2(GeluOperand(y))`` (GELU + quantize kernel, then the GEMM on its FP16 decode) and one
  full-size Qwen-Image block forward with every fused site (per block and per NVFP4 layer call in it);
* the op call a compiled graph makes per NVFP4 layer, as registered (``dispatch.define_op``), against the same
  implementation registered with ``torch.library.custom_op`` and called directly.

Each figure is the best of 5 runs of ``--calls`` back-to-back calls (host clock from the first call to the return of
the last; few enough calls that the GPU's launch queue never fills, synchronized between runs). The outputs of both
modes are compared byte for byte. Writes ``results/layer_host-<device>.json`` (in this folder).

    python benchmarks/studies/20261203_layer_host.py
"""

from __future__ import annotations

import argparse
import importlib
import time

import common
import study  # this folder's shared helpers; puts benchmarks/ on the path
import torch

from diffusers_nvfp4_fast import NVFP4Linear

launch_mod = importlib.import_module("diffusers_nvfp4_fast.kernels.launch")
LAYERS = {  # name: (in, out, bias, rows)
    "qwen image to_out 4096x3072x3072": (3072, 3072, True, 4096),
    "qwen text to_out 512x3072x3072": (3072, 3072, True, 512),
    "qwen image FC1 4096x12288x3072": (3072, 12288, True, 4096),
    "flux2 single to_out 4608x6144x24576": (24576, 6144, False, 4608),
    "qwen modulation 1x18432x3072 (one row)": (3072, 18432, True, 1),
}


def host_us(fn, calls: int) -> float:
    """Best of 5 runs: host microseconds per call of ``calls`` back-to-back calls."""
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return best


def side_by_side(fn, calls: int, rounds: int = 3) -> dict:
    """{"plans": us, "before": us, "ratio": before/plans, "same_bytes": bool}, modes alternating per round."""
    figures: dict[str, list[float]] = {"plans": [], "before": []}
    outputs = {}
    for _ in range(rounds):
        for mode, direct in (("before", False), ("plans", True)):
            launch_mod.DIRECT_LAUNCH = direct
            for _ in range(3):  # a plan is built at the second normal call of its class
                outputs[mode] = fn()
            figures[mode].append(host_us(fn, calls))
    launch_mod.DIRECT_LAUNCH = True
    same = all(_same(a, b) for a, b in zip(_flat(outputs["before"]), _flat(outputs["plans"])))
    plans, before = min(figures["plans"]), min(figures["before"])
    return {"plans_us": round(plans, 2), "before_us": round(before, 2), "before_over_plans": round(before / plans, 2),
            "same_bytes": same}


def _flat(out):
    return out if isinstance(out, (tuple, list)) else (out,)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                       b.reshape(-1).view(torch.uint8))


def layer_cases(calls: int) -> list[dict]:
    cases = []
    for name, (k, n, bias, rows) in LAYERS.items():
        torch.manual_seed(0)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
        layer = NVFP4Linear.from_weight(w, b, 8.0 / 2688)
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        with torch.inference_mode():
            case = {"case": name, "kind": "layer(x)", **side_by_side(lambda: layer(x), calls)}
        cases.append(case)
        print(case, flush=True)
    return cases


def gelu_site_case(calls: int) -> dict:
    from diffusers_nvfp4_fast.ops.site import Site
    from diffusers_nvfp4_fast.ops.verify import new_stats
    from diffusers_nvfp4_fast.patches.operands import GeluOperand

    torch.manual_seed(0)
    fc2 = NVFP4Linear.from_weight(torch.randn(3072, 12288, device="cuda", dtype=torch.bfloat16) * 0.02,
                                  torch.randn(3072, device="cuda", dtype=torch.bfloat16), 8.0 / 2688)
    y = torch.randn(1, 4096, 12288, device="cuda", dtype=torch.bfloat16)
    site = Site(new_stats("off")[0], "qwen_gelu")
    with torch.inference_mode():
        case = {"case": "qwen image FC2 with its GELU quantize site 4096x3072x12288", "kind": "fc2(GeluOperand(y))",
                **side_by_side(lambda: fc2(GeluOperand(y, site)), calls)}
    print(case, flush=True)
    return case


def qwen_block_case(calls: int) -> dict:
    """One full-size Qwen-Image block, NVFP4 with every fused site (as benchmarks/bench_transformer_step.py builds
    the model's blocks), per block call and per NVFP4 layer call in it."""
    _block = study.load("compile_repeatability")._block

    from diffusers_nvfp4_fast import enable_fast_paths

    block, args, kwargs = _block("qwen-image", nvfp4=True)
    holder = torch.nn.Module()
    holder.transformer_blocks = torch.nn.ModuleList([block])
    report = enable_fast_paths(holder, verify="off")
    layers = sum(isinstance(m, NVFP4Linear) for m in block.modules())
    with torch.inference_mode():
        case = {"case": "qwen image block 4096 + 512 tokens", "kind": "block(...), every fused site",
                "nvfp4_layers": layers, **side_by_side(lambda: block(*args, **kwargs), calls)}
    case["plans_us_per_layer_call"] = round(case["plans_us"] / layers, 2)
    case["before_us_per_layer_call"] = round(case["before_us"] / layers, 2)
    case["sites"] = report
    print({k: v for k, v in case.items() if k != "sites"}, flush=True)
    return case


def op_call_cases(calls: int) -> list[dict]:
    """The call a compiled graph makes for an NVFP4 layer (``torch.ops.nvfp4_fast.quantized_linear``, launch plan
    built), against the same implementation registered with ``torch.library.custom_op`` (this package's registration
    before ``dispatch.define_op``) and called directly, modes alternating per round; plus a BF16 ``aten.addmm``."""
    from diffusers_nvfp4_fast.ops import linear

    custom = torch.library.custom_op("bench_layer_host::quantized_linear", mutates_args=())(
        linear.quantized_linear_impl)
    custom.register_fake(lambda x, g, f, w, ws, a, b, dt, sw: x.new_empty((x.shape[0], w.shape[0]), dtype=dt))
    modes = {"plain registration": torch.ops.nvfp4_fast.quantized_linear.default,
             "custom_op": torch.ops.bench_layer_host.quantized_linear.default,
             "implementation": linear.quantized_linear_impl}
    cases = []
    for rows in (512, 4096):
        torch.manual_seed(0)
        w = torch.randn(3072, 3072, device="cuda", dtype=torch.bfloat16) * 0.02
        b = torch.randn(3072, device="cuda", dtype=torch.bfloat16)
        layer = NVFP4Linear.from_weight(w, b, 8.0 / 2688)
        x = torch.randn(rows, 3072, device="cuda", dtype=torch.bfloat16)
        args = (x, layer.input_scale_inv, False, layer.weight, layer.weight_scale, layer.alpha, layer.bias,
                torch.bfloat16, True)
        figures: dict[str, list[float]] = {mode: [] for mode in modes}
        with torch.no_grad():
            outs = [op(*args) for op in modes.values() for _ in range(4)]
            for _ in range(3):
                for mode, op in modes.items():
                    figures[mode].append(host_us(lambda op=op: op(*args), calls))
            addmm = host_us(lambda: torch.ops.aten.addmm.default(b, x, w.t()), calls)
        case = {"case": f"compiled graph's call, qwen to_out {rows}x3072x3072", "kind": "torch.ops call",
                **{f"{mode}_us": round(min(v), 2) for mode, v in figures.items()}, "bf16_addmm_us": addmm,
                "same_bytes": all(_same(o, outs[0]) for o in outs)}
        cases.append(case)
        print(case, flush=True)
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=100, help="back-to-back calls per timed run")
    args = ap.parse_args()
    result = common.header("layer_host", common.copy_bandwidth_gbps())
    cases = layer_cases(args.calls) + [gelu_site_case(args.calls), qwen_block_case(max(args.calls // 20, 3))]
    op_calls = op_call_cases(args.calls)
    result.update(cases=cases, timing="host microseconds per call: best of 5 runs of back-to-back calls, modes "
                                      "alternating over 3 rounds; 'before' = kernels.launch.DIRECT_LAUNCH False")
    print(f"{'case':58s} {'plans us':>9s} {'before us':>10s} {'ratio':>6s} same")
    for c in cases:
        print(f"{c['case'][:58]:58s} {c['plans_us']:9.1f} {c['before_us']:10.1f} {c['before_over_plans']:6.2f} "
              f"{c['same_bytes']}")
    result["cases"] += op_calls
    print("wrote", study.write_result(result))


if __name__ == "__main__":
    main()
