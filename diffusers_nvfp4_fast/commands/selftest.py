"""``diffusers-nvfp4-fast selftest``: run every kernel this device would use against its torch reference, byte for
byte, before trusting the device with a real model.

It reports the device, its capability, the torch / Triton / FlashInfer / diffusers versions and the GEMM backend
with the reason it was chosen; then it checks
- on a GPU with Triton: the activation quantize in both recipes (fast-math against a reference that uses the GPU's
  own approximate reciprocal, docs/design.md §3), each fused kernel against the unfused path it replaces, and on
  SM80-SM90 the variants that write decoded FP16 operands;
- everywhere: the NVFP4 GEMM (whichever backend runs here: cuBLASLt, or FlashInfer where forced, on Blackwell,
  Triton / Gluon on Hopper, the torch emulation on a CPU) at a small and at real FLUX.2 / Qwen-Image shapes, on
  operands built so that every partial sum is exact in FP32 whatever the summation order: the only correct output is
  then one set of bytes, computed here in float64 from the values the operands were built from (no decoder involved);
- a tiny FLUX.2 pipeline with fast paths off and on: the same PNG bytes;
- on SM100+, the GEMM checks again with FlashInfer, the other Blackwell backend, where it is installed (reported, not
  counted; without flashinfer-jit-cache its first call compiles with nvcc).
Each line gives microseconds per call (median of a few, after a warm-up). The exit status is 1 if anything differs
or fails to run; ``--json`` prints the whole record for a bug report.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from .. import format as nvfp4
from ..ops import dispatch
from ..ops.verify import bytes_equal, describe_mismatch, exact_fast_math_reference
from ..utils import check_device

Outputs = tuple[torch.Tensor, ...]
REPEATS = 5
# Real layer shapes (M rows, N outputs, K inputs) at 1024x1024: FLUX.2-dev's single-block output projection over
# 4096 image + 512 text tokens, Qwen-Image's image-stream FC2, and its text-stream query projection.
GPU_GEMM_SHAPES = {"small, 1 row": (1, 256, 512), "small, unaligned N and K": (17, 200, 176),
                   "FLUX.2-dev single-block to_out": (4608, 6144, 24576), "Qwen-Image img FC2": (4096, 3072, 12288),
                   "Qwen-Image txt to_q": (512, 3072, 3072)}
CPU_GEMM_SHAPES = {"small, 1 row": (1, 256, 512), "small, unaligned N and K": (17, 200, 176),
                   "Qwen-Image to_q, 8 rows": (8, 3072, 3072)}


# ----------------------------------------------------------------------------------------------------------------
# Running and timing one check.
# ----------------------------------------------------------------------------------------------------------------


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _microseconds(fn: Callable[[], Any], device: torch.device) -> float:
    times = []
    for _ in range(REPEATS):
        _synchronize(device)
        start = time.perf_counter()
        fn()
        _synchronize(device)
        times.append((time.perf_counter() - start) * 1e6)
    return round(statistics.median(times), 1)


def _as_outputs(value: Any) -> Outputs:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _call(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    return lambda: fn(*args)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def run_check(name: str, implementation: Callable[[], Any], reference: Callable[[], Any], device: torch.device,
              what: str) -> dict[str, Any]:
    """Compare every output byte of ``implementation()`` with ``reference()``; time the implementation."""
    record: dict[str, Any] = {"name": name, "compared": what}
    try:
        got, want = _as_outputs(implementation()), _as_outputs(reference())
        equal = len(got) == len(want) and all(bytes_equal(a, b) for a, b in zip(got, want))
        record.update(equal=equal, bytes=sum(t.numel() * t.element_size() for t in want),
                      us=_microseconds(implementation, device))
        if not equal:
            record["detail"] = describe_mismatch(tuple(f"output {i}" for i in range(len(got))), got, want)
    except Exception as error:  # reported, so that one broken kernel does not hide the others
        record.update(equal=False, detail=f"{type(error).__name__}: {error}")
    return record


# ----------------------------------------------------------------------------------------------------------------
# The fused and quantize kernels (GPUs with Triton).
# ----------------------------------------------------------------------------------------------------------------


def _randn(gen: torch.Generator, device: torch.device, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, device=device) * scale).to(torch.bfloat16)


def _global_scale(x: torch.Tensor) -> torch.Tensor:
    return (448.0 * 6.0 / x.float().abs().amax()).reshape(1)


@contextlib.contextmanager
def _reference_recipe(fast_math: bool, device: torch.device) -> Iterator[None]:
    """The torch reference of the recipe the kernels run: for fast-math on a GPU, with the GPU's reciprocal."""
    if fast_math and device.type == "cuda":
        with exact_fast_math_reference():
            yield
    else:
        yield


def _quantize_reference(x: torch.Tensor, g: torch.Tensor, fast_math: bool, device: torch.device) -> Outputs:
    from ..ops.quantize import quantize_reference

    with _reference_recipe(fast_math, device):
        return quantize_reference(x, g, fast_math)


def _quantize_checks(device: torch.device, gen: torch.Generator) -> list[dict[str, Any]]:
    from ..ops.quantize import quantize

    x = _randn(gen, device, 4096, 6144, scale=3.0)
    g = _global_scale(x)
    checks = []
    for fast_math in (False, True):
        recipe = "fast-math" if fast_math else "precise"
        checks.append(run_check(f"quantize {recipe} 4096x6144", _call(quantize, x, g, fast_math),
                                _call(_quantize_reference, x, g, fast_math, device), device,
                                "Triton kernel vs format.quantize_nvfp4"))
    return checks


def _decoded_quantize_check(device: torch.device, gen: torch.Generator, fast_math: bool) -> list[dict[str, Any]]:
    """The standalone quantize that writes the decoded FP16 operand of the SM80-SM90 GEMM (only where it runs)."""
    from ..ops.quantize import quantize

    k = dispatch.kernels
    assert k is not None
    x = _randn(gen, device, 512, 3072, scale=2.0)
    g = _global_scale(x)
    recipe = "fast-math" if fast_math else "precise"
    return [run_check(f"quantize to FP16 512x3072 ({recipe})",
                      lambda: k.quantize_nvfp4_decoded(x, g, fast_math=fast_math),
                      lambda: nvfp4.decode_nvfp4(*quantize(x, g, fast_math), dtype=torch.float16), device,
                      "fused kernel vs the unfused path")]


def fused_checks(device: torch.device, gen: torch.Generator, fast_math: bool) -> list[dict[str, Any]]:
    """Every form of every registered fused op (``ops/registry.py``) on its probe calls at FLUX.2-dev / Qwen-Image
    widths, against the unfused torch path it replaces; the decoded forms only where the GEMM that multiplies their
    FP16 values runs; an op whose sites this GPU keeps on diffusers' ops (``unused_here``) is named, not compared."""
    from ..ops.fused import Probe
    from ..ops.registry import FUSED_OPS

    recipe = "fast-math" if fast_math else "precise"
    decoded_here = dispatch.gemm_backend(device) == "triton"
    checks = []
    for op in FUSED_OPS:
        reason = op.unused_here(device)
        forms = [(op.packed, "")] + ([(op.decoded, " to FP16")] if op.decoded is not None and decoded_here else [])
        for case in op.probe(Probe(device, gen, fast_math)):
            for form, suffix in forms:
                name = f"{case.title}{suffix} {case.shape} ({recipe})"
                if reason is not None:
                    checks.append({"name": name, "equal": None, "detail": f"not used here: {reason}"})
                    continue
                checks.append(run_check(name, _call(form, *case.args), _call(form.reference, *case.args), device,
                                        "fused kernel vs the unfused path"))
    return checks


def kernel_checks(device: torch.device) -> list[dict[str, Any]]:
    """The quantize kernel in both recipes and every fused kernel, where Triton runs on ``device`` (else none: there
    the torch references are the implementation)."""
    if not dispatch.triton_runs_on(torch.empty(0, device=device)):
        return []
    gen = torch.Generator(device=device).manual_seed(0)
    fast_math = nvfp4.fast_math_from_env()
    checks = _quantize_checks(device, gen)
    if dispatch.gemm_backend(device) == "triton":
        checks += _decoded_quantize_check(device, gen, fast_math)
    return checks + fused_checks(device, gen, fast_math)


# ----------------------------------------------------------------------------------------------------------------
# The GEMM on operands whose sums are exact in any order.
# ----------------------------------------------------------------------------------------------------------------

_SCALE_BYTES = torch.tensor([0x30, 0x38, 0x40], dtype=torch.uint8)  # E4M3 0.5, 1, 2
_SCALE_VALUES = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
ALPHA = 2.0 ** -3  # a power of two: the alpha multiply is exact too


def exact_operand(rows: int, k: int, gen: torch.Generator, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random E2M1 codes (all 16) with block scales 0.5 / 1 / 2: (packed ``[rows, K/2]``, 128x4 scales, the values
    as float64 ``[rows, K]`` from the generating codes and scales)."""
    codes = torch.randint(0, 16, (rows, k), generator=gen, device=device, dtype=torch.uint8)
    pick = torch.randint(0, 3, (rows, k // nvfp4.BLOCK_SIZE), generator=gen, device=device)
    table = torch.tensor(nvfp4.E2M1_VALUES, dtype=torch.float64, device=device)
    values = table[codes.long()] * _SCALE_VALUES.to(device)[pick].repeat_interleave(nvfp4.BLOCK_SIZE, dim=1)
    return nvfp4.pack_nibbles(codes), nvfp4.swizzle_scales(_SCALE_BYTES.to(device)[pick]), values


def _exact_expected(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """``bf16(fp32(x @ w^T) * ALPHA)`` when every partial sum of every order is exact in FP32 (all products are
    multiples of 2^-4, so it suffices that the sum of their magnitudes stays below 2^20); None otherwise."""
    if float((x.abs() @ w.abs().t()).max()) >= 2.0 ** 20:
        return None
    return ((x @ w.t()).to(torch.float32) * ALPHA).to(torch.bfloat16)


def gemm_checks(device: torch.device) -> list[dict[str, Any]]:
    """The NVFP4 GEMM of the backend that runs on ``device`` (the M > 64 FP16-operand entry too, on SM80-SM90)."""
    from ..ops.linear import linear_fp16_x, nvfp4_linear

    backend = dispatch.gemm_backend(device)  # raises for a forced backend that cannot run here
    shapes = GPU_GEMM_SHAPES if device.type == "cuda" else CPU_GEMM_SHAPES
    gen = torch.Generator(device=device).manual_seed(1)
    alpha = torch.tensor(ALPHA, dtype=torch.float32, device=device)
    checks = []
    with _no_tf32():
        for label, (m, n, k) in shapes.items():
            xp, xs, xv = exact_operand(m, k, gen, device)
            wp, ws, wv = exact_operand(n, k, gen, device)
            want = _exact_expected(xv, wv)
            name = f"GEMM {label} {m}x{n}x{k}"
            if want is None:
                checks.append({"name": name, "equal": None, "detail": "operands not exact in FP32; not compared"})
                continue
            checks.append(run_check(name, _call(nvfp4_linear, xp, xs, wp, ws, alpha, None, torch.bfloat16),
                                    _call(_same, want), device, f"{backend} GEMM vs float64 sums"))
            if backend == "triton" and m > 64:
                x16 = xv.to(torch.float16)  # exact: at most 6 significant bits
                checks.append(run_check(f"{name} (FP16 activation)",
                                        _call(linear_fp16_x, x16, wp, ws, alpha, None, torch.bfloat16),
                                        _call(_same, want), device, "Triton GEMM vs float64 sums"))
            del xv, wv
    return checks


OPTIONAL_BACKEND = "flashinfer"  # the Blackwell backend that runs only when forced (docs/blackwell.md)


def optional_backend_checks(device: torch.device) -> list[dict[str, Any]]:
    """On SM100+ GPUs, the GEMM checks once more with FlashInfer (forced only), marked optional: they decide whether
    it computes the recipe on this GPU (docs/blackwell.md), without failing the self-test. Where it is not installed
    one line says so; without flashinfer-jit-cache its first call compiles with nvcc (minutes, or an error)."""
    capability = dispatch.gemm_device_capability(device)
    if capability is None or capability[0] < 10 or dispatch.forced_gemm_backend() is not None:
        return []
    with _forced_backend(OPTIONAL_BACKEND):
        try:
            checks = gemm_checks(device)
        except dispatch.BackendUnavailableError as error:
            checks = [{"name": f"GEMM ({OPTIONAL_BACKEND})", "equal": None, "detail": str(error)}]
    return [{**check, "name": f"{check['name']} [{OPTIONAL_BACKEND}, optional]", "optional": True}
            for check in checks]


@contextlib.contextmanager
def _forced_backend(backend: str) -> Iterator[None]:
    previous = os.environ.get(dispatch.GEMM_BACKEND_VAR)
    os.environ[dispatch.GEMM_BACKEND_VAR] = backend
    try:
        yield
    finally:
        if previous is None:
            del os.environ[dispatch.GEMM_BACKEND_VAR]
        else:
            os.environ[dispatch.GEMM_BACKEND_VAR] = previous


@contextlib.contextmanager
def _no_tf32() -> Iterator[None]:
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


# ----------------------------------------------------------------------------------------------------------------
# A tiny pipeline, fast paths off and on.
# ----------------------------------------------------------------------------------------------------------------


def pipeline_check(device: torch.device) -> dict[str, Any]:
    """The tiny FLUX.2 pipeline (quantized here to NVFP4, loaded back) with fast paths off and on: same PNG."""
    from ..api import disable_fast_paths, enable_fast_paths, fast_path_report
    from ..loaders import load_nvfp4_transformer
    from ..testing.export import quantize_tiny_pipeline
    from ..testing.tiny import TINY_PIPELINES
    from ..utils import png_sha256, run_pipeline

    size, steps = (64, 2) if device.type == "cuda" else (32, 1)
    record: dict[str, Any] = {"name": f"tiny FLUX.2 pipeline {size}x{size}, {steps} step(s)",
                              "compared": "PNG with fast paths on vs off"}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = quantize_tiny_pipeline("flux2", Path(tmp) / "flux2", steps=1)
            pipe, kwargs = TINY_PIPELINES["flux2"](load_nvfp4_transformer(checkpoint, device=device))
        pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        off = png_sha256(run_pipeline(pipe, kwargs, size=size, steps=steps))
        enable_fast_paths(pipe)
        start = time.perf_counter()
        on = png_sha256(run_pipeline(pipe, kwargs, size=size, steps=steps))
        seconds = time.perf_counter() - start
        entry = fast_path_report(pipe)["Flux2Transformer2DModel"]
        disable_fast_paths(pipe)
        record.update(equal=on == off, seconds=round(seconds, 3), sha256=on,
                      detail=f"fused calls {sum(entry['fused_calls'].values())}, fallbacks {entry['fallbacks']}, "
                             f"verifications failed {entry['verifications']['failed']}")
        if on != off:
            record["detail"] += f"; off {off}"
    except Exception as error:
        record.update(equal=False, detail=f"{type(error).__name__}: {error}")
    return record


# ----------------------------------------------------------------------------------------------------------------
# The environment, the whole run, the report.
# ----------------------------------------------------------------------------------------------------------------


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def launch_path(device: torch.device) -> str:
    """How the Triton kernels are launched on ``device``: through Triton's C launcher directly (launch plans), or
    through Triton's own path and why (same bytes either way; docs/performance.md, "Host time per call")."""
    if device.type != "cuda" or dispatch.kernels is None:
        return "no Triton kernels run on this device"
    reason = dispatch.kernels.launch.direct_launch_unavailable()
    return "direct, through Triton's C launcher (launch plans)" if reason is None else f"Triton's own path: {reason}"


def environment(device: torch.device) -> dict[str, Any]:
    """What the report says about the machine and the software."""
    backend, why = dispatch.backend_choice(device)
    info: dict[str, Any] = {"device": str(device), "name": "CPU", "capability": None}
    if device.type == "cuda":
        info.update(name=torch.cuda.get_device_name(device), capability=list(torch.cuda.get_device_capability(device)))
    info.update(
        torch=torch.__version__, cuda=torch.version.cuda, triton=_version("triton"),
        flashinfer=_version("flashinfer-python"), flashinfer_jit_cache=dispatch.flashinfer_prebuilt(),
        diffusers=_version("diffusers"),
        diffusers_nvfp4_fast=_version("diffusers-nvfp4-fast"), gemm_backend=backend, gemm_backend_why=why,
        launch=launch_path(device),
        activation_recipe="fast-math" if nvfp4.fast_math_from_env() else "precise",
    )
    return info


def run_selftest(device: torch.device | str | None = None) -> dict[str, Any]:
    """Every check for ``device`` (default: the current CUDA device, else the CPU); ``passed`` is True when every
    compared output was equal and nothing failed to run."""
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    result: dict[str, Any] = {"environment": environment(device)}
    checks = kernel_checks(device) + gemm_checks(device) + [pipeline_check(device)] + optional_backend_checks(device)
    result["checks"] = checks
    required = [c for c in checks if not c.get("optional")]
    result["passed"] = all(c["equal"] is not False for c in required) and any(c["equal"] for c in required)
    return result


def format_report(result: dict[str, Any]) -> str:
    """The human-readable report."""
    env = result["environment"]
    capability = f", SM{env['capability'][0]}{env['capability'][1]}" if env["capability"] else ""
    lines = [
        "diffusers-nvfp4-fast selftest",
        f"  device    {env['name']} ({env['device']}{capability})",
        f"  versions  torch {env['torch']} (CUDA {env['cuda']}), triton {env['triton']}, flashinfer "
        f"{env['flashinfer']}, diffusers {env['diffusers']}, diffusers-nvfp4-fast {env['diffusers_nvfp4_fast']}",
        f"  GEMM      {env['gemm_backend']}: {env['gemm_backend_why']}",
        f"  launches  {env['launch']}",
        f"  recipe    activations quantized {env['activation_recipe']}",
    ]
    for check in result["checks"]:
        status = {True: "ok  ", False: "FAIL", None: "n/a "}[check["equal"]]
        timing = (f"{check['us']:>12.1f} us" if "us" in check
                  else f"{check['seconds']:>13.2f} s" if "seconds" in check else " " * 15)
        lines.append(f"  {status} {timing}  {check['name']}" + (f"  [{check['compared']}]" if "compared" in check
                                                                  else ""))
        if check.get("detail"):
            lines.append(f"                         {check['detail']}")
    failed = sum(c["equal"] is False and not c.get("optional") for c in result["checks"])
    lines.append(f"result: {'PASSED' if result['passed'] else 'FAILED'} ({len(result['checks'])} checks, "
                 f"{failed} failed)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``diffusers-nvfp4-fast selftest [--device D] [--json]``: 0 when every check passed, 1 otherwise, 2 for a device
    this machine does not have."""
    parser = argparse.ArgumentParser(prog="diffusers-nvfp4-fast selftest", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    parser.add_argument("--json", action="store_true", help="machine-readable output (attach it to bug reports)")
    args = parser.parse_args(argv)
    if args.device is not None:
        try:
            check_device(args.device)
        except ValueError as e:
            print(f"diffusers-nvfp4-fast selftest: {e}", file=sys.stderr)
            return 2
    result = run_selftest(args.device)
    print(json.dumps(result, indent=1) if args.json else format_report(result))
    return 0 if result["passed"] else 1
