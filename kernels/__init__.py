"""Triton kernels for NVFP4 (no diffusers import). Installed as ``diffusers_nvfp4_fast.kernels``."""

from .nvfp4_gemm import nvfp4_gemm  # noqa: F401
from .quantize_nvfp4 import quantize_nvfp4  # noqa: F401
from .qwen_resnorm_quantize import qwen_resnorm_quantize  # noqa: F401
from .token_cat_quantize import token_cat_quantize  # noqa: F401
