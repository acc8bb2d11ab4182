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


# The modules whose ``__all__`` this package exports (what ``diffusers_nvfp4_fast/ops/`` calls); each lists its own.
EXPORTING = ("gelu_quantize", "layer_norm_quantize", "linear_plan", "nvfp4_gemm", "nvfp4_gemv", "qk_norm_rotary",
             "quantize_nvfp4", "rotary", "swiglu_quantize", "token_cat_quantize")

if not _hub_package_in_our_place():
    from . import launch

    __all__ = ["launch"]
    for _name in EXPORTING:
        _module = importlib.import_module(f".{_name}", __name__)
        globals().update({name: getattr(_module, name) for name in _module.__all__})
        __all__ += _module.__all__
    del _name, _module
    # Every kernel's Triton cache key in one order, whatever the process launches first (triton_compat).
    from .triton_compat import settle_cache_keys

    settle_cache_keys(__name__)
