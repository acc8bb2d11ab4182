"""Triton and Gluon kernels for NVFP4. They import nothing from ``diffusers_nvfp4_fast`` (a test enforces it) and
are installed as ``diffusers_nvfp4_fast.kernels``; ``diffusers_nvfp4_fast/ops/`` calls them."""

from .nvfp4_gemm import nvfp4_gemm
from .quantize_nvfp4 import quantize_nvfp4_triton
from .qwen_resnorm_quantize import qwen_resnorm_quantize_triton
from .rotary import rotary_triton
from .swiglu_quantize import swiglu_quantize_triton
from .token_cat_quantize import token_cat_quantize_triton

__all__ = ["nvfp4_gemm", "quantize_nvfp4_triton", "qwen_resnorm_quantize_triton", "rotary_triton",
           "swiglu_quantize_triton", "token_cat_quantize_triton"]
