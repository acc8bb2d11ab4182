"""Where one denoising step's GPU time goes: a torch-profiler pass over one eager step of the full-size FLUX.2-dev or
Qwen-Image transformer, NVFP4 with fast paths on (the model is built as ``bench_transformer_step.py`` builds it).

    python benchmarks/profile_step.py --model flux2-dev      # or qwen-image; --tiny: CPU dry run of the logic
    python benchmarks/profile_step.py --model qwen-image --compile blocks   # blocks compiled, in exact_inductor
    python benchmarks/profile_step.py --model qwen-image --host             # where the eager step's host time goes
    python benchmarks/profile_step.py --model qwen-image --compile blocks --bf16   # the BF16 model, for comparison

Kernels are grouped into classes (NVFP4 GEMM, BF16 GEMM, attention, fused kernels, quantize, activation decode,
LayerNorm, inductor kernels, other elementwise, copies, other); NVFP4 GEMM time is also split by shape (M, N, K), each
NVFP4 layer call being wrapped in a profiler range for this pass. Host gap = step wall time minus the summed kernel
time. Writes benchmarks/results/profile_step-<model>-<device>.json and prints the tables that docs/profile.md holds.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import re
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

CLASSES = (  # first match wins
    ("inductor kernels", r"^triton_(poi|red|per)_"),  # torch.compile's own; names list the ops they fused
    ("fused kernels", r"token_cat|qwen_resnorm|layer_norm_kernel_exact|gelu_quantize|swiglu|rotary"),
    ("NVFP4 GEMM", r"nvfp4_gemm|nvfp4_gemv|split_reduce"),
    ("activation decode", r"decode_rows"),
    ("quantize", r"quantize_nvfp4"),
    ("attention", r"flash|fmha|attention|sdpa|cudnn"),
    ("BF16 GEMM", r"gemm|sm90_xmma|cutlass|ampere_|nvjet|gemv"),
    ("LayerNorm", r"layer_norm|LayerNorm"),
    ("copies", r"copy|Memcpy|memcpy|cat_"),
    ("other elementwise", r"elementwise|vectorized|reduce|unrolled|pointwise|triton_"),
)


def kernel_class(name: str) -> str:
    for label, pattern in CLASSES:
        if re.search(pattern, name):
            return label
    return "other"


@contextlib.contextmanager
def gemm_ranges():
    """Wrap every ``NVFP4Linear`` GEMM in a profiler range named by its shape, for the per-shape split."""
    from diffusers_nvfp4_fast.linear import NVFP4Linear

    original = NVFP4Linear.forward_prequantized, NVFP4Linear._forward, NVFP4Linear.forward_decoded

    def prequantized(self, x_packed, x_scales, out_dtype=torch.bfloat16):
        with torch.profiler.record_function(f"gemm M={x_packed.shape[0]} N={self.out_features} K={self.in_features}"):
            return original[0](self, x_packed, x_scales, out_dtype)

    def plain(self, x, *rest):  # the range holds the activation quantize too
        rows = x.numel() // x.shape[-1]
        with torch.profiler.record_function(f"gemm M={rows} N={self.out_features} K={self.in_features}"):
            return original[1](self, x, *rest)

    def decoded(self, x16, out_dtype=torch.bfloat16):  # fused producers that hand over FP16 values (§6)
        with torch.profiler.record_function(f"gemm M={x16.shape[0]} N={self.out_features} K={self.in_features}"):
            return original[2](self, x16, out_dtype)

    NVFP4Linear.forward_prequantized, NVFP4Linear._forward, NVFP4Linear.forward_decoded = prequantized, plain, decoded
    try:
        yield
    finally:
        NVFP4Linear.forward_prequantized, NVFP4Linear._forward, NVFP4Linear.forward_decoded = original


def kernel_time_in_ranges(events) -> Counter:
    """ms of GPU kernels inside each ``gemm M=...`` range's GPU-side span, summed per range name.

    Kernel time, not the span's length (which includes the GPU's idle time in an eager step), and each range counted
    once: before 2026-12-01 the span and the CPU range's own device total were added together (docs/profile.md).
    Triton launches are not tied to the CPU range, so kernels are matched to the span by their time on the GPU."""
    cuda = torch.autograd.DeviceType.CUDA
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                   if e.device_type == cuda and e.name.startswith("gemm M="))
    kernel_list = sorted((e.time_range.start, e.time_range.end) for e in events
                         if e.device_type == cuda and not e.name.startswith("gemm M="))
    starts = [k[0] for k in kernel_list]
    shapes: Counter = Counter()
    for start, end, name in spans:
        i = bisect.bisect_left(starts, start)
        while i < len(kernel_list) and kernel_list[i][1] <= end:
            shapes[name] += (kernel_list[i][1] - kernel_list[i][0]) / 1e3
            i += 1
    return shapes


def gpu_idle(events) -> dict:
    """The GPU's own timeline: kernels launched, span from the first kernel's start to the last one's end, and the
    idle time inside it (no kernel running) attributed to the class of the kernel that ends each idle stretch, so
    that the wall time that is neither kernel time nor the host's can be located."""
    cuda = torch.autograd.DeviceType.CUDA
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                   if e.device_type == cuda and not e.name.startswith("gemm M="))
    idle: Counter = Counter()
    stretches: Counter = Counter()
    busy_until = spans[0][1] if spans else 0.0
    for start, end, name in spans[1:]:
        if start > busy_until:
            idle[kernel_class(name)] += (start - busy_until) / 1e3
            stretches[kernel_class(name)] += 1
        busy_until = max(busy_until, end)
    span_ms = (busy_until - spans[0][0]) / 1e3 if spans else 0.0
    return {"kernels": len(spans), "span_ms": round(span_ms, 2), "idle_ms": round(sum(idle.values()), 2),
            "idle_before_class_ms": {k: round(v, 2) for k, v in idle.most_common()},
            "idle_stretches_before_class": dict(stretches.most_common())}


def host_profile(model, inputs, device, top: int = 40) -> dict:
    """cProfile over one eager step (after two warm-ups): the Python functions by own time and by cumulative time.
    The eager step is bound by host time (docs/profile.md), so this says where it goes; cProfile slows Python
    calls, so the shares matter, not the absolute times."""
    import cProfile
    import pstats

    from bench_transformer_step import forward

    for _ in range(2):
        forward(model, inputs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    forward(model, inputs)
    prof.disable()
    wall_ms = (time.perf_counter() - start) * 1e3
    stats = pstats.Stats(prof)
    rows = []
    for (path, line, name), (_, calls, own, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{Path(path).name}:{line} {name}" if line else name
        rows.append({"function": where, "calls": calls, "own_ms": round(own * 1e3, 3),
                     "cumulative_ms": round(cumulative * 1e3, 3)})
    return {"wall_ms_under_cprofile": round(wall_ms, 2),
            "by_own_time": sorted(rows, key=lambda r: -r["own_ms"])[:top],
            "by_cumulative_time": sorted(rows, key=lambda r: -r["cumulative_ms"])[:top]}


def profile(model, inputs, device, warmups: int = 2) -> dict:
    from bench_transformer_step import forward

    for _ in range(warmups):
        forward(model, inputs)
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with gemm_ranges(), torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        forward(model, inputs)
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3
    kernels: Counter = Counter()
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", 0.0)
        if event.key.startswith("gemm M=") or event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if device_us > 0:
            kernels[event.key] += device_us / 1e3
    shapes = kernel_time_in_ranges(prof.events())
    classes: Counter = Counter()
    for name, ms in kernels.items():
        classes[kernel_class(name)] += ms
    kernel_ms = sum(kernels.values())
    return {
        "wall_ms": round(wall_ms, 2), "kernel_ms": round(kernel_ms, 2), "host_gap_ms": round(wall_ms - kernel_ms, 2),
        "classes": {k: round(v, 2) for k, v in classes.most_common()},
        "top_kernels": [{"name": n[:120], "ms": round(ms, 3), "share": round(ms / max(kernel_ms, 1e-9), 4),
                         "class": kernel_class(n)} for n, ms in kernels.most_common(15)],
        "nvfp4_gemm_by_shape": {k: round(v, 3) for k, v in shapes.most_common()},
        "gpu_timeline": gpu_idle(prof.events()),
    }


def main() -> None:
    import bench_transformer_step as step

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(step.MODELS), default="flux2-dev")
    ap.add_argument("--height", type=int, default=1024)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--text-tokens", type=int, default=512)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--compile", choices=["blocks"], help="compile_repeated_blocks(fullgraph=True) after enabling, "
                    "inside exact_inductor (as bench_transformer_step.py --compile blocks)")
    ap.add_argument("--host", action="store_true", help="cProfile the step's Python instead (with --compile: of the "
                    "compiled step)")
    ap.add_argument("--bf16", action="store_true", help="profile the BF16 model (no NVFP4 layers, no fast paths), "
                    "the baseline of the NVFP4 profile; written with the suffix -bf16")
    args = ap.parse_args()
    from diffusers_nvfp4_fast import enable_fast_paths, exact_inductor

    device = torch.device("cpu" if args.tiny else "cuda")
    model = step.empty_model(args.model, args.tiny)
    step.materialize(model, args.model, device, nvfp4=not args.bf16)
    if not args.bf16:
        enable_fast_paths(model)
    inputs = step.make_inputs(args.model, model, args.height, args.width, args.text_tokens, device)
    if args.host and args.compile:  # where the compiled step's host time goes
        with exact_inductor():
            result = host_profile(step.compiled(model, args.compile), inputs, device)
        result["dynamo_counters"] = {k: dict(v) for k, v in torch._dynamo.utils.counters.items()}
        mode = "compile_repeated_blocks(fullgraph=True) in exact_inductor, fast paths on, cProfile of one step"
        name = "profile_host_compiled"
    elif args.host:
        result = host_profile(model, inputs, device)
        mode, name = "eager, fast paths on, cProfile of one step after two warm-ups", "profile_host"
    elif args.compile:
        with exact_inductor():
            result = profile(step.compiled(model, args.compile), inputs, device, warmups=3)
        mode, name = "compile_repeated_blocks(fullgraph=True) in exact_inductor, fast paths on", "profile_step_compiled"
    else:
        result = profile(model, inputs, device)
        mode, name = "eager, fast paths on, one step after two warm-ups", "profile_step"
    if not args.tiny:
        import common

        if args.compile:
            result["shared_quantize_nodes"] = common.shared_quantize_nodes()

        if args.bf16:
            mode = mode.replace("fast paths on", "the BF16 model")
        out = common.header(name, common.copy_bandwidth_gbps())
        out.update(model=args.model, inputs=vars(args), mode=mode, **result)
        print("wrote", common.write_result(out, f"{name}-{args.model}" + ("-bf16" if args.bf16 else "")))
    if args.host:
        print(f"{args.model}: wall under cProfile {result['wall_ms_under_cprofile']} ms")
        for row in result["by_own_time"][:25]:
            print(f"  {row['own_ms']:9.2f} own {row['cumulative_ms']:9.2f} cum {row['calls']:7d}  {row['function']}")
        return
    print(f"{args.model}: wall {result['wall_ms']} ms, kernels {result['kernel_ms']} ms, host gap "
          f"{result['host_gap_ms']} ms")
    print("GPU timeline:", result.get("gpu_timeline"))
    for label, ms in result["classes"].items():
        print(f"  {label:<20} {ms:9.2f} ms")
    for label, ms in list(result["nvfp4_gemm_by_shape"].items())[:12]:
        print(f"  {label:<28} {ms:9.3f} ms")


if __name__ == "__main__":
    main()
