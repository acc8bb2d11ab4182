"""The GPU's fast-math reciprocal in the torch reference (``ops.verify.exact_fast_math_reference``), for tests that
compare fast-math kernel outputs byte for byte."""

from __future__ import annotations

from diffusers_nvfp4_fast.kernels.rcp_approx import rcp_approx_cuda
from diffusers_nvfp4_fast.ops.verify import exact_fast_math_reference

__all__ = ["exact_fast_math_reference", "rcp_approx_cuda"]
