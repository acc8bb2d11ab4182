"""Triton and Gluon kernels for NVFP4. They import nothing from ``diffusers_nvfp4_fast`` (a test enforces it) and
are installed as ``diffusers_nvfp4_fast.kernels``; ``diffusers_nvfp4_fast/ops/`` calls them."""

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
    "qwen_rotary_triton", "quantize_nvfp4_decoded", "quantize_nvfp4_triton", "resnorm_quantize_triton", "rotary_triton",
    "swiglu_gate_up_quantize_triton", "swiglu_quantize_triton", "token_cat_quantize_triton",
]
