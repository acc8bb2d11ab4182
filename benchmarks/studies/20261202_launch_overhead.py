"""Study, last run 2026-12-02: host time per call of the kernel wrappers (GPU), what an eager, host-bound step pays
for each launch (docs/performance.md, "Host cost of eager steps"; docs/history.md).

Eager NVFP4 steps launch a few thousand kernels, and on the H200 machine the Qwen-Image step is bound by host time
rather than GPU time (README, "Measured"). This measures, in microseconds of host time per call (best of three runs
of back-to-back calls, the queue kept from filling by a sync between runs):

* Triton's own launch path ``kernel[grid](...)`` vs ``kernels.launch`` (Triton's binder, then the compiled binary
  launched directly), for the standalone quantize kernel (9 runtime arguments) and the fused Qwen-Image kernel (24);
* the public wrappers (argument checks, output allocation, launch): ``quantize_nvfp4``, ``qwen_resnorm_quantize``,
  ``decode_nvfp4_rows``, the SM90 GEMM and the whole ``nvfp4_gemm`` (decode + GEMM);
* a few torch operations for scale (``torch.empty``, an add, ``chunk``).

Usage: ``python benchmarks/studies/20261202_launch_overhead.py`` -> ``results/launch_overhead-<device>.json`` (in
this folder).
"""

from __future__ import annotations

import importlib
import time

import common
import study  # this folder's shared helpers; puts benchmarks/ on the path
import torch

launch_mod = importlib.import_module("diffusers_nvfp4_fast.kernels.launch")
quantize_mod = importlib.import_module("diffusers_nvfp4_fast.kernels.quantize_nvfp4")
qwen_mod = importlib.import_module("diffusers_nvfp4_fast.kernels.layer_norm_quantize")
gemm_mod = importlib.import_module("diffusers_nvfp4_fast.kernels.nvfp4_gemm")


def host_us(fn, calls: int = 2000) -> float:
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return round(best, 2)


def captured_launch(module, fn):
    """(kernel, grid, args, kwargs) of the ``launch`` call that ``fn()`` makes through ``module.launch``."""
    seen = {}
    original = module.launch

    def capture(kernel, grid, *args, **kwargs):
        seen.update(kernel=kernel, grid=grid, args=args, kwargs=kwargs)
        return original(kernel, grid, *args, **kwargs)

    module.launch = capture
    try:
        fn()
    finally:
        module.launch = original
    return seen["kernel"], seen["grid"], seen["args"], seen["kwargs"]


def main() -> None:
    result = common.header("launch_overhead", common.copy_bandwidth_gbps())
    dev = torch.device("cuda")
    d, rows = 3072, 512
    g = torch.tensor([0.5], device=dev)
    x = torch.randn(rows, d, device=dev, dtype=torch.bfloat16)
    residual = torch.randn(1, rows, d, device=dev, dtype=torch.bfloat16)
    attn = torch.randn_like(residual)
    bias = torch.randn(d, device=dev, dtype=torch.bfloat16)
    mod = torch.randn(1, 3 * d, device=dev, dtype=torch.bfloat16)
    shift, scale, gate = mod.chunk(3, dim=-1)
    w_packed, w_scales = quantize_mod.quantize_nvfp4_triton(torch.randn(d, d, device=dev, dtype=torch.bfloat16), g)
    x_packed, x_scales = quantize_mod.quantize_nvfp4_triton(x, g)
    alpha = torch.tensor(1e-3, device=dev)
    x16 = gemm_mod.decode_nvfp4_rows(x_packed, x_scales)
    out = torch.empty(rows, d, device=dev, dtype=torch.bfloat16)
    sm90 = gemm_mod.sm90_kernel_for(rows, d, w_packed, w_scales)

    def quantize():
        return quantize_mod.quantize_nvfp4_triton(x, g)

    def qwen():
        return qwen_mod.resnorm_quantize_triton(residual, attn, bias, gate, scale, shift, g, eps=1e-6)

    figures = {}
    for name, module, fn in (("quantize", quantize_mod, quantize), ("qwen_resnorm_quantize", qwen_mod, qwen)):
        kernel, grid, args, kwargs = captured_launch(module, fn)
        figures[name] = {
            "runtime_and_constexpr_arguments": len(args) + len(kwargs),
            "triton_launch_us": host_us(lambda: kernel[grid](*args, **kwargs)),
            "direct_launch_us": host_us(lambda: launch_mod.launch(kernel, grid, *args, **kwargs)),
            "wrapper_us": host_us(fn),
        }
    figures["decode_nvfp4_rows"] = {"wrapper_us": host_us(lambda: gemm_mod.decode_nvfp4_rows(x_packed, x_scales))}
    if sm90 is not None:
        figures["nvfp4_gemm_sm90"] = {
            "wrapper_us": host_us(lambda: sm90.nvfp4_gemm_sm90(x16, w_packed, w_scales, alpha, out)),
        }
    figures["nvfp4_gemm"] = {
        "wrapper_us": host_us(lambda: gemm_mod.nvfp4_gemm(x_packed, x_scales, w_packed, w_scales, alpha)),
        "kernel": "sm90" if sm90 is not None else "triton",
    }
    figures["torch"] = {
        "empty_us": host_us(lambda: torch.empty((rows, d), dtype=torch.bfloat16, device=dev)),
        "add_us": host_us(lambda: residual + attn),
        "chunk3_us": host_us(lambda: mod.chunk(3, dim=-1)),
    }
    result.update(shape={"rows": rows, "hidden": d}, host_us=figures,
                  timing="host microseconds per call: best of 3 runs of 2,000 back-to-back calls "
                         "after 100 warm-up calls")
    print(figures)
    print("wrote", study.write_result(result))


if __name__ == "__main__":
    main()
