"""Triton and Gluon kernels for NVFP4. They import nothing from ``diffusers_nvfp4_fast`` (a test enforces it) and
are installed as ``diffusers_nvfp4_fast.kernels``; ``diffusers_nvfp4_fast/ops/`` calls them."""

import importlib.machinery
import importlib.util
import os
import sys


def _hub_package_in_our_place() -> bool:
    """Run from a checkout's root (``python -m``/``-c`` put it first on sys.path), this folder is found as the
    top-level ``kernels`` that transformers imports from the hub package of that name: put that one in sys.modules
    instead (docs/design.md §2). True where it did."""
    if __name__ != "kernels":
        return False
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", path)
    if spec is None or spec.loader is None:
        return False
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    spec.loader.exec_module(module)
    return True


if not _hub_package_in_our_place():
    from . import launch
    from .gelu_quantize import gelu_decoded_launch, gelu_quantize_decoded_triton, gelu_quantize_triton, gelu_triton
    from .layer_norm_quantize import adaln_quantize_triton, resnorm_quantize_triton
    from .linear_plan import LinearPlan, RowPlan, linear_plan, row_plan
    from .nvfp4_gemm import PREDECODE_MAX_M, nvfp4_gemm, nvfp4_gemm_fp16_x
    from .nvfp4_gemv import nvfp4_gemv
    from .qk_norm_rotary import flux2_qk_norm_rotary_triton, qk_norm_rotary_triton, qwen_rotary_triton
    from .quantize_nvfp4 import quantize_nvfp4_decoded, quantize_nvfp4_triton
    from .rotary import rotary_triton
    from .swiglu_quantize import swiglu_gate_up_quantize_triton, swiglu_quantize_triton
    from .token_cat_quantize import token_cat_quantize_triton

    __all__ = [
        "LinearPlan", "PREDECODE_MAX_M", "RowPlan", "launch", "linear_plan", "nvfp4_gemv", "row_plan",
        "adaln_quantize_triton", "flux2_qk_norm_rotary_triton", "gelu_decoded_launch", "gelu_quantize_decoded_triton",
        "gelu_quantize_triton", "gelu_triton", "nvfp4_gemm", "nvfp4_gemm_fp16_x", "qk_norm_rotary_triton",
        "qwen_rotary_triton", "quantize_nvfp4_decoded", "quantize_nvfp4_triton", "resnorm_quantize_triton",
        "rotary_triton", "swiglu_gate_up_quantize_triton", "swiglu_quantize_triton", "token_cat_quantize_triton",
    ]
