"""The fused inputs (``linear.FusedInput``) that the sites hand their NVFP4 consumers: each names its fused op and
the tensors it reads; the consumer's call runs the op with its own input scale, packed or decoded as it takes it.

``TokenCatOperand`` (``flux2_token_cat``), ``SwiGLUOperand`` (``flux2_swiglu``, ``flux2_token_cat_swiglu``),
``SwiGLUGateUpOperand`` (``qwen21_swiglu``), ``GeluOperand`` (``qwen_gelu``), ``ResNormOperand`` (``qwen_resnorm``,
``flux2_resnorm``), ``SharedResNormOperand`` (``qwen21_resnorm``) and ``AdaLNOperand`` (``qwen_adaln``,
``flux2_adaln``, ``qwen21_adaln``). docs/design.md §5 says why the kernel must run inside the consumer's call.
"""

from __future__ import annotations

import torch

from ..linear import NVFP4Linear
from ..ops.gelu_quantize import gelu_linear, gelu_quantize, gelu_quantize_decoded
from ..ops.layer_norm_quantize import (
    AdaLNInputs,
    ResNormInputs,
    adaln_quantize,
    adaln_quantize_decoded,
    resnorm_quantize,
    resnorm_quantize_decoded,
)
from ..ops.site import Site
from ..ops.swiglu_quantize import swiglu_gate_up_quantize, swiglu_quantize
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

    def linear(self, layer: NVFP4Linear, fast_math: bool) -> torch.Tensor | None:
        return None  # the layer quantizes through quantize or decode


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



class SwiGLUGateUpOperand(_Operand):
    """``silu(gate) * up`` ``[..., H]`` of two tensors (Qwen-Image 2.1's ``gate_layer`` and ``proj`` outputs)."""

    __slots__ = ("gate", "up", "site")

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, site: Site):
        super().__init__(gate)
        self.gate, self.up, self.site = gate, up, site

    def quantize(self, input_scale_inv: torch.Tensor, fast_math: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return swiglu_gate_up_quantize.checked(self.site, self.gate, self.up, input_scale_inv, fast_math)


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

    def linear(self, layer: NVFP4Linear, fast_math: bool) -> torch.Tensor:
        return gelu_linear(self.site, self._rows2d(), layer.input_scale_inv, fast_math, layer.weight,
                           layer.weight_scale, layer.alpha, layer.bias, self.dtype, layer.scale_layout == "128x4")


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


class _SharedOperand(_Operand):
    """An operand that several projections read through their calls (each with the same input scale: checked by
    ``adaln.SharedInputConsumers``): the first call runs the op, the others reuse its result. All of them must take
    one form (packed or decoded); the site's gate checks that."""

    __slots__ = ("site", "_packed", "_decoded")
    decodes = True

    def __init__(self, lead: torch.Tensor, site: Site):
        super().__init__(lead)
        self.site = site
        self._packed: tuple[torch.Tensor, torch.Tensor] | None = None
        self._decoded: torch.Tensor | None = None

    def _one_form(self, other: object) -> None:
        if other is not None:
            raise RuntimeError(f"{self.site.kind}: the projections sharing this input take different activation forms "
                               "(packed and decoded); the site's gate should have kept it unfused")

    def _run(self, input_scale_inv: torch.Tensor, fast_math: bool) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _run_decoded(self, input_scale_inv: torch.Tensor, fast_math: bool) -> torch.Tensor:
        raise NotImplementedError

    def quantize(self, input_scale_inv: torch.Tensor, fast_math: bool) -> tuple[torch.Tensor, torch.Tensor]:
        self._one_form(self._decoded)
        if self._packed is None:
            self._packed = self._run(input_scale_inv, fast_math)
        return self._packed

    def decode(self, input_scale_inv: torch.Tensor, fast_math: bool) -> torch.Tensor:
        self._one_form(self._packed)
        if self._decoded is None:
            self._decoded = self._run_decoded(input_scale_inv, fast_math)
        return self._decoded


class AdaLNOperand(_SharedOperand):
    """What the attention receives in place of the modulated norm1 output ``LayerNorm(x) * (1 + scale) + shift``
    (``shift`` None: ``LayerNorm(x) * (1 + scale)``, Qwen-Image 2.1). ``shape``, ``dtype`` and ``device`` are the
    modulated tensor's; only the site's projections read its values, through their calls. The first projection runs
    the kernel with its input scale (equal for every projection of the site: ``adaln.SharedInputConsumers``); the
    others reuse that operand."""

    __slots__ = ("inputs", "eps")

    def __init__(self, inputs: AdaLNInputs, eps: float, site: Site):
        super().__init__(inputs.x, site)
        self.inputs, self.eps = inputs, eps

    @property
    def shape(self) -> torch.Size:
        return self.inputs.x.shape

    def _run(self, input_scale_inv: torch.Tensor, fast_math: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return adaln_quantize.checked(self.site, *self.inputs, input_scale_inv, self.eps, fast_math)

    def _run_decoded(self, input_scale_inv: torch.Tensor, fast_math: bool) -> torch.Tensor:
        return adaln_quantize_decoded.checked(self.site, *self.inputs, input_scale_inv, self.eps, fast_math)


class SharedResNormOperand(_SharedOperand):
    """The modulated LayerNorm of ``residual + gate * x`` for two projections that read the same input (Qwen-Image
    2.1's ``gate_layer`` and ``proj``): each call returns its projection's output; the new residual, computed on the
    way by the first call, is ``residual_out``."""

    __slots__ = ("inputs", "eps", "_residual_out")

    def __init__(self, inputs: ResNormInputs, eps: float, site: Site):
        super().__init__(inputs.residual, site)
        self.inputs, self.eps = inputs, eps
        self._residual_out: torch.Tensor | None = None

    @property
    def residual_out(self) -> torch.Tensor:
        assert self._residual_out is not None, "read after a projection's call ran the op"
        return self._residual_out

    def _run(self, input_scale_inv: torch.Tensor, fast_math: bool) -> tuple[torch.Tensor, torch.Tensor]:
        self._residual_out, packed, scales = resnorm_quantize.checked(
            self.site, *self.inputs, input_scale_inv, self.eps, fast_math)
        return packed, scales

    def _run_decoded(self, input_scale_inv: torch.Tensor, fast_math: bool) -> torch.Tensor:
        self._residual_out, x16 = resnorm_quantize_decoded.checked(
            self.site, *self.inputs, input_scale_inv, self.eps, fast_math)
        return x16
