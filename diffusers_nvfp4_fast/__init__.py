"""diffusers-nvfp4-fast: byte-identical fast paths for NVFP4 FLUX.2 and Qwen-Image transformers in diffusers."""

from .format import dequantize_nvfp4, quantize_nvfp4, swap_nibbles, swizzle_scales, unswizzle_scales
from .linear import NVFP4Linear

__all__ = [
    "NVFP4Linear",
    "dequantize_nvfp4",
    "quantize_nvfp4",
    "swap_nibbles",
    "swizzle_scales",
    "unswizzle_scales",
]
__version__ = "0.1.0"
