"""The fused inputs (``linear.FusedInput``) that the sites hand their NVFP4 consumers: each names its fused op and
the tensors it reads; the consumer's call runs the op with its own input scale, packed or decoded as it takes it.

``TokenCatOperand`` (``flux2_token_cat``), ``SwiGLUOperand`` (``flux2_swiglu``, ``flux2_token_cat_swiglu``),
``GeluOperand`` (``qwen_gelu``), ``ResNormOperand`` (``qwen_resnorm``, ``flux2_resnorm``) and ``AdaLNOperand``
(``qwen_adaln``, ``flux2_adaln``). docs/design.md §5 says why the kernel must run inside the consumer's call.
"""

from __future__ import annotations

import torch

from ..ops.gelu_quantize import gelu_quantize, gelu_quantize_decoded
from ..ops.layer_norm_quantize import (
    AdaLNInputs,
    ResNormInputs,
    adaln_quantize,
    adaln_quantize_decoded,
    resnorm_quantize,
    resnorm_quantize_decoded,
)
from ..ops.site import Site
from ..ops.swiglu_quantize import swiglu_quantize
from ..ops.token_cat_quantize import token_cat_quantize


class _Operand:
    """What every operand derives from ``lead``, the input tensor whose leading dimensions (the rows) the
    consumer's output keeps: rows, dtype, device, the output's shape; and the refusal of ``decode`` for ops that
    write packed values only (``decodes`` False, so ``NVFP4Linear`` never asks)."""

    __slots__ = ("lead",)
    decodes = False

    def __init__(self, lead: torch.Tensor):
        self.lead = lead

    @property
    def rows(self) -> int:
        return self.lead.numel() // self.lead.shape[-1]

    @property
    def dtype(self) -> torch.dtype:
        return self.lead.dtype

    @property
    def device(self) -> torch.device:
        return self.lead.device

    def decode(self, input_scale_inv: torch.Tensor, fast_math: bool) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__}: its fused op writes packed values only")

    def output(self, y: torch.Tensor) -> torch.Tensor:
        return y.reshape(*self.lead.shape[:-1], y.shape[-1])


class TokenCatOperand(_Operand):
    """``cat([attn, mlp], -1)`` ``[..., A+B]``, never built: the kernel reads both halves."""

    __slots__ = ("attn", "mlp", "site")

    def __init__(self, attn: torch.Tensor, mlp: torch.Tensor, site: Site):
        super().__init__(attn)
        self.attn, self.mlp, self.site = attn, mlp, site

    def quantize(self, input_scale_inv: torch.Tensor, fast_math: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return token_cat_quantize.checked(self.site, self.attn, self.mlp, input_scale_inv, fast_math)



class SwiGLUOperand(_Operand):
    """``cat([attn, swiglu(hidden)], -1)`` (``attn`` None: ``swiglu(hidden)``), hidden ``[..., 2H]``."""

    __slots__ = ("hidden", "attn", "site")

    def __init__(self, hidden: torch.Tensor, attn: torch.Tensor | None, site: Site):
        super().__init__(hidden)
        self.hidden, self.attn, self.site = hidden, attn, site

    def quantize(self, input_scale_inv: torch.Tensor, fast_math: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return swiglu_quantize.checked(self.site, self.hidden, self.attn, input_scale_inv, fast_math)



class GeluOperand(_Operand):
    """``gelu(hidden, approximate="tanh")``, hidden ``[..., K]`` (FC1's output)."""

    __slots__ = ("hidden", "site")
    decodes = True

    def __init__(self, hidden: torch.Tensor, site: Site):
        super().__init__(hidden)
        self.hidden, self.site = hidden, site

    def _rows2d(self) -> torch.Tensor:
        return self.hidden.reshape(-1, self.hidden.shape[-1])

    def quantize(self, input_scale_inv: torch.Tensor, fast_math: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return gelu_quantize.checked(self.site, self._rows2d(), input_scale_inv, fast_math)

    def decode(self, input_scale_inv: torch.Tensor, fast_math: bool) -> torch.Tensor:
        return gelu_quantize_decoded.checked(self.site, self._rows2d(), input_scale_inv, fast_math)


class ResNormOperand(_Operand):
    """The modulated LayerNorm of ``residual + gate * (x + bias)``; the layer's call returns ``(residual_out
    [B, L, D], its output [B, L, N])``: the kernel computes the new residual on the way."""

    __slots__ = ("inputs", "eps", "site", "_residual_out")
    decodes = True

    def __init__(self, inputs: ResNormInputs, eps: float, site: Site):
        super().__init__(inputs.residual)
        self.inputs, self.eps, self.site = inputs, eps, site
        self._residual_out: torch.Tensor | None = None

    def quantize(self, input_scale_inv: torch.Tensor, fast_math: bool) -> tuple[torch.Tensor, torch.Tensor]:
        self._residual_out, packed, scales = resnorm_quantize.checked(
            self.site, *self.inputs, input_scale_inv, self.eps, fast_math)
        return packed, scales

    def decode(self, input_scale_inv: torch.Tensor, fast_math: bool) -> torch.Tensor:
        self._residual_out, x16 = resnorm_quantize_decoded.checked(
            self.site, *self.inputs, input_scale_inv, self.eps, fast_math)
        return x16

    def output(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        assert self._residual_out is not None  # quantize or decode ran first (NVFP4Linear.forward)
        return self._residual_out, super().output(y)


class AdaLNOperand(_Operand):
    """What the attention receives in place of the modulated norm1 output ``LayerNorm(x) * (1 + scale) + shift``.
    ``shape``, ``dtype`` and ``device`` are the modulated tensor's; only the site's projections read its values,
    through their calls. The first projection runs the kernel with its input scale (equal for every projection of
    the site: ``adaln.AdaLNConsumers``); the others reuse that operand."""

    __slots__ = ("inputs", "eps", "site", "_packed", "_decoded")
    decodes = True

    def __init__(self, inputs: AdaLNInputs, eps: float, site: Site):
        super().__init__(inputs.x)
        self.inputs, self.eps, self.site = inputs, eps, site
        self._packed: tuple[torch.Tensor, torch.Tensor] | None = None
        self._decoded: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.inputs.x.shape

    def _one_form(self, other: object) -> None:
        if other is not None:
            raise RuntimeError(f"{self.site.kind}: the projections after norm1 take different activation forms "
                               "(packed and decoded); the site's gate should have kept it unfused")

    def quantize(self, input_scale_inv: torch.Tensor, fast_math: bool) -> tuple[torch.Tensor, torch.Tensor]:
        self._one_form(self._decoded)
        if self._packed is None:
            self._packed = adaln_quantize.checked(self.site, *self.inputs, input_scale_inv, self.eps, fast_math)
        return self._packed

    def decode(self, input_scale_inv: torch.Tensor, fast_math: bool) -> torch.Tensor:
        self._one_form(self._packed)
        if self._decoded is None:
            self._decoded = adaln_quantize_decoded.checked(self.site, *self.inputs, input_scale_inv, self.eps,
                                                           fast_math)
        return self._decoded
