"""Every fused op, each from its one declaration (``fused.FusedOp``): what the selftest, the ahead-of-time kernel
builds (``tests/support/sass_count.py``) and the registry test iterate. A new op adds one line to ``FUSED_OPS``
(``tests/test_fused_registry.py`` checks that every declared op is listed)."""

from __future__ import annotations

from . import fused, quantize
from .gelu_quantize import GELU_QUANTIZE
from .layer_norm_quantize import ADALN_QUANTIZE, RESNORM_QUANTIZE
from .qk_norm_rotary import FLUX2_QK_NORM_ROTARY, QK_NORM_ROTARY, QWEN_ROTARY
from .rotary import ROTARY
from .swiglu_quantize import SWIGLU_GATE_UP_QUANTIZE, SWIGLU_QUANTIZE
from .token_cat_quantize import TOKEN_CAT_QUANTIZE

# In the selftest's order: FLUX.2's and Qwen-Image's quantize fusions, the LayerNorm ones, the rotary ones.
FUSED_OPS: tuple[fused.FusedOp, ...] = (
    TOKEN_CAT_QUANTIZE, SWIGLU_QUANTIZE, SWIGLU_GATE_UP_QUANTIZE, GELU_QUANTIZE, RESNORM_QUANTIZE, ADALN_QUANTIZE,
    ROTARY, FLUX2_QK_NORM_ROTARY, QK_NORM_ROTARY, QWEN_ROTARY,
)


def forms() -> list[fused.Form]:
    """Every form of every fused op (packed, then decoded where it exists)."""
    return [form for op in FUSED_OPS for form in op.forms]


def aot_kernels() -> dict[str, fused.AotKernel]:
    """Every kernel build the ahead-of-time checks compile, by name: the standalone quantize's and the fused forms'."""
    declared = [*quantize.AOT_KERNELS, *(form.aot for form in forms() if form.aot is not None)]
    return {k.name: k for k in declared}
