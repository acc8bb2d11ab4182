"""Exact emulations of GPU arithmetic in numpy, for tests that compare kernels with torch's CUDA kernels."""

from __future__ import annotations

import numpy as np


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Exact FP32 fused multiply-add: a*b is exact in FP64; the FP64 sum is rounded to odd, then to FP32 (correct)."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c64 = c.astype(np.float64)
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)  # TwoSum: p + c == s + err exactly
    even = (s.view(np.int64) & 1) == 0
    odd_s = np.where((err != 0) & even, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return odd_s.astype(np.float32)
