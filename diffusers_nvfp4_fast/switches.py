"""Every environment variable this package reads, declared once, and how it reads them (ground floor: imports only
the standard library).

The readers (``format``, ``ops/dispatch.py``, ``kernels/``) and the CUDA-graph runner's key (``graphs/keys.py``)
import the names from here. ``kernels/`` cannot import the package, so the three kernel modules that read a switch spell
it themselves and tests/test_switches.py ties each spelling to the name declared here.
"""

from __future__ import annotations

import functools
import os

# Precise quantize recipe when either is enabled (FlashInfer's and TensorRT-LLM's names; docs/design.md §3).
FAST_MATH_OFF_FLASHINFER = "FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH"
FAST_MATH_OFF_TRTLLM = "TRTLLM_DISABLE_FP4_QUANT_FAST_MATH"
FAST_MATH_OFF = (FAST_MATH_OFF_FLASHINFER, FAST_MATH_OFF_TRTLLM)
# FlashInfer's 4-over-6 scale search: not implemented here; enabling it only earns a warning (docs/design.md §3).
FOUR_OVER_SIX = "FLASHINFER_NVFP4_4OVER6"
# Forces a GEMM backend: flashinfer, triton, emulated or cublaslt (docs/design.md §7).
GEMM_BACKEND = "DIFFUSERS_NVFP4_GEMM_BACKEND"
# 1: the Hopper GEMM's decode without its one inline-PTX instruction (same values, slower); read by
# kernels/nvfp4_decode.py at each launch.
TRITON_NO_ASM = "DIFFUSERS_NVFP4_TRITON_NO_ASM"
# 1: the Triton GEMM times its candidate configs at the first call of each shape class (Triton's autotuner) instead of
# taking the shipped table's (docs/design.md §7); read by kernels/nvfp4_gemm.py at that first call. The config never
# changes a byte, so the graph runner need not key on it.
GEMM_AUTOTUNE = "DIFFUSERS_NVFP4_GEMM_AUTOTUNE"
# 0: no programmatic dependent launch (docs/design.md §7); read once, when kernels/launch.py is imported.
PDL = "DIFFUSERS_NVFP4_PDL"
# 0: no compile-only pass before a model's first call (docs/design.md §8, "Compile-only pass"); read at that call.
PARALLEL_COMPILE = "DIFFUSERS_NVFP4_PARALLEL_COMPILE"
# A count N > 0: the compile-only pass compiles in N worker processes instead of on threads (docs/design.md §8,
# "Preparation"); unset or 0: threads. Read at the pass.
COMPILE_WORKERS = "DIFFUSERS_NVFP4_COMPILE_WORKERS"
# 1 (the test suite sets it): every op call through the dispatcher checks that no output shares an input's storage;
# read when the ops are defined.
CHECK_OPS = "DIFFUSERS_NVFP4_CHECK_OPS"
# PyTorch's allocator settings (its newer name second); fit_to_budget reads whether segments map on demand
# (docs/budget.md, "The estimate"), and the budget benchmark's cases set the first.
ALLOC_CONF = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
EXPANDABLE_SEGMENTS = "expandable_segments:True"

# The switches read at every eager call, which pick kernels or change bytes: a captured CUDA graph keeps the values it
# saw, so the graph runner keys its graphs on them (docs/design.md §8, "CUDA graphs").
CALL_TIME_SWITCHES = (FAST_MATH_OFF_FLASHINFER, FAST_MATH_OFF_TRTLLM, GEMM_BACKEND, TRITON_NO_ASM)


@functools.cache
def _environ_key(name: str) -> str | bytes:  # bytes on POSIX, str on Windows
    return os.environ.encodekey(name)


def env_value(name: str) -> str | None:
    """``os.environ.get(name)``, read afresh at each call. For an unset name ``Mapping.get`` raises and catches a
    KeyError (about 1.3 µs); this reads os.environ's own dict instead (0.2 µs): the fast-math switches are read on
    every eager NVFP4 call, and the eager step is bound by host time (docs/profile.md)."""
    data = getattr(os.environ, "_data", None)
    if not isinstance(data, dict) or not hasattr(os.environ, "encodekey"):
        return os.environ.get(name)
    raw = data.get(_environ_key(name))
    return None if raw is None else os.environ.decodevalue(raw)


def env_enabled(name: str) -> bool:
    """FlashInfer's reading of a boolean variable: anything but '', '0', 'false', 'off', 'no' enables it."""
    value = env_value(name)
    return value is not None and value.strip().lower() not in ("", "0", "false", "off", "no")
