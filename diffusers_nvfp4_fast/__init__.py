"""diffusers-nvfp4-fast: byte-identical fast paths for NVFP4 FLUX.2 and Qwen-Image transformers in diffusers.

The public names are imported on first use, so the command line (``diffusers-nvfp4-fast --help``) starts without
importing torch or diffusers. Importing the package registers it with diffusers as the quantization backend of its
checkpoints, at once if diffusers is imported, else when diffusers is (``registration.py``, docs/design.md §2).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from . import registration

__version__ = "0.1.0"

_PUBLIC = {
    "enable_fast_paths": "api", "disable_fast_paths": "api", "fast_paths": "api", "fast_path_report": "api",
    "NVFP4Linear": "linear", "fit_to_budget": "budget",
    "load_nvfp4_transformer": "loaders", "load_nvfp4_text_encoder": "loaders", "load_summary": "loaders",
    "NVFP4CheckpointError": "loaders",
    "quantize_nvfp4": "format", "dequantize_nvfp4": "format", "swizzle_scales": "format", "unswizzle_scales": "format",
    "swap_nibbles": "format", "exact_inductor": "inductor",
    "quantize_transformer": "quantize", "quantize_text_encoder": "quantize", "QuantizedCheckpoint": "quantize",
    "NVFP4FastConfig": "diffusers_backend",
    "capture_cuda_graphs": "graphs", "release_cuda_graphs": "graphs",
}
__all__ = [
    "NVFP4CheckpointError", "NVFP4FastConfig", "NVFP4Linear", "QuantizedCheckpoint", "capture_cuda_graphs",
    "dequantize_nvfp4", "disable_fast_paths", "enable_fast_paths", "exact_inductor", "fast_path_report", "fast_paths",
    "fit_to_budget", "load_nvfp4_text_encoder", "load_nvfp4_transformer", "load_summary", "quantize_nvfp4",
    "quantize_text_encoder", "quantize_transformer", "release_cuda_graphs", "swap_nibbles", "swizzle_scales",
    "unswizzle_scales",
]

if TYPE_CHECKING:
    from .api import disable_fast_paths, enable_fast_paths, fast_path_report, fast_paths
    from .budget import fit_to_budget
    from .diffusers_backend import NVFP4FastConfig
    from .format import dequantize_nvfp4, quantize_nvfp4, swap_nibbles, swizzle_scales, unswizzle_scales
    from .graphs import capture_cuda_graphs, release_cuda_graphs
    from .inductor import exact_inductor
    from .linear import NVFP4Linear
    from .loaders import NVFP4CheckpointError, load_nvfp4_text_encoder, load_nvfp4_transformer, load_summary
    from .quantize import QuantizedCheckpoint, quantize_text_encoder, quantize_transformer


registration.install()


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
