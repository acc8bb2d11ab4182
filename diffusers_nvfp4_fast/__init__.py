"""diffusers-nvfp4-fast: byte-identical fast paths for NVFP4 FLUX.2 and Qwen-Image transformers in diffusers."""

from . import gates, ops  # noqa: F401  (submodules tests and advanced users reach through the package)
from .api import disable_fast_paths, enable_fast_paths, fast_path_report, fast_paths
from .format import dequantize_nvfp4, quantize_nvfp4, swap_nibbles, swizzle_scales, unswizzle_scales
from .linear import NVFP4Linear
from .loading import NVFP4CheckpointError, load_nvfp4_transformer

__all__ = [
    "NVFP4CheckpointError",
    "NVFP4Linear",
    "dequantize_nvfp4",
    "disable_fast_paths",
    "enable_fast_paths",
    "fast_path_report",
    "fast_paths",
    "load_nvfp4_transformer",
    "quantize_nvfp4",
    "swap_nibbles",
    "swizzle_scales",
    "unswizzle_scales",
]
__version__ = "0.1.0"
