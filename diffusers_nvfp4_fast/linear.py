"""``NVFP4Linear``: a W4A4 NVFP4 linear layer that diffusers' model code calls like ``nn.Linear``."""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch
from torch import nn

from .format import (
    BLOCK_SIZE,
    ScaleLayout,
    fast_math_from_env,
    padded_scale_shape,
    quantize_nvfp4_weight,
    swizzle_scales,
)
from .ops.linear import linear_fp16_x, nvfp4_linear, quantized_linear, takes_decoded_activation


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def _keeps_identity(t: torch.Tensor, device: torch.device) -> bool:
    # An inference-mode tensor cannot be updated in place outside inference mode, nor can a tensor's data move to or
    # from the meta device: such a buffer is replaced instead.
    if "meta" in (t.device.type, device.type):
        return False
    return not t.is_inference() or torch.is_inference_mode_enabled()


class FusedInput(Protocol):
    """What a fused site hands an ``NVFP4Linear`` in place of its BF16 input ``[rows, K]`` (docs/design.md §5): the
    producer's kernel runs inside the layer's call, with the layer's own ``input_scale_inv``, after every hook on the
    call has run (offloading hooks bring the layer's tensors to the GPU first). The layer picks the form.

    ``decodes``: the producer can also write the decoded FP16 values that a GEMM on SM80-SM90 with more than 64 rows
    multiplies (``NVFP4Linear.takes_decoded_rows``); ``output`` turns the layer's ``[rows, N]`` into the call's result.
    """

    @property
    def rows(self) -> int: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def decodes(self) -> bool: ...

    def quantize(self, input_scale_inv: torch.Tensor, fast_math: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (packed uint8 ``[rows, K/2]``, 128x4 scales uint8)."""
        ...

    def decode(self, input_scale_inv: torch.Tensor, fast_math: bool) -> torch.Tensor:
        """-> FP16 ``[rows, K]``, the exact values of ``quantize``'s result."""
        ...

    def output(self, y: torch.Tensor) -> Any:
        """The call's result from the layer's output ``y`` ``[rows, N]``."""
        ...

    def linear(self, layer: NVFP4Linear, fast_math: bool) -> torch.Tensor | None:
        """The layer's output ``[rows, N]`` from one op that runs the producer and the layer's GEMM (one launch plan
        for both), or None where the producer has no such op and the layer asks for ``quantize`` or ``decode``."""
        ...


class NVFP4Linear(nn.Module):
    """``y = bf16(fp4_gemm(quantize(x, 1/input_scale), W) * alpha) (+ bias)``, docs/design.md §3.

    Deliberately not an ``nn.Linear`` subclass: nothing may call ``F.linear`` on packed bytes.

    Parameters (frozen, so offloading hooks move and offload them like any weight):
        weight: uint8 ``[N, K/2]``, low nibble first.
        weight_scale: uint8 E4M3 bytes, ``[round_up(N,128), round_up(K/16,4)]`` (128x4) or ``[N, K/16]`` (linear);
            ``scale_layout`` says which, and only ``swizzle_weight_scales_`` changes it (once).
    Buffers:
        weight_scale_2, input_scale: FP32 0-d (they stay FP32 through ``model.to(dtype)``).
        bias: ``[N]`` in the model dtype, or absent.
        alpha (= input_scale * weight_scale_2), input_scale_inv (= 1 / input_scale): derived, not saved.

    ``compute_dtype`` is the model dtype; LoRA adapters on this layer run in it.

    ``dynamic_input_scale`` (attribute, default False): when True, ``forward`` ignores ``input_scale`` and uses
    ``amax(|x|) / (448 * 6)`` of each call's whole input instead. That is NOT the checkpoint's recipe (the result
    depends on what else is in the batch); it exists for checkpoints that ship no ``input_scale`` for a layer and is
    only ever switched on by an explicit user choice (``load_nvfp4_transformer(..., dynamic_input_scale=True)``).
    Such a layer refuses pre-quantized input: a fused path must check the flag in its gate.
    """

    _FP32_BUFFERS = ("weight_scale_2", "input_scale", "alpha", "input_scale_inv")

    # Declared for the type checker only (no values): nn.Module's __getattr__ would type them as Tensor | Module.
    weight: nn.Parameter
    weight_scale: nn.Parameter
    weight_scale_2: torch.Tensor
    input_scale: torch.Tensor
    bias: torch.Tensor | None
    alpha: torch.Tensor
    input_scale_inv: torch.Tensor
    in_features: int
    out_features: int
    scale_layout: ScaleLayout
    compute_dtype: torch.dtype
    dynamic_input_scale: bool
    input_scale_source: str  # set by the loaders ("checkpoint", "modelopt", "dynamic", ...); absent otherwise
    scale_version: int  # bumped at every (re)load of the scales: a fused path relying on their values re-checks

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        scale_layout: ScaleLayout = "128x4",
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.scale_version = 0
        if in_features % BLOCK_SIZE:
            raise ValueError(f"NVFP4Linear needs in_features divisible by {BLOCK_SIZE}, got {in_features}")
        self.in_features = in_features
        self.out_features = out_features
        self.scale_layout = scale_layout
        self.compute_dtype = dtype
        if scale_layout == "128x4":
            scale_shape = padded_scale_shape(out_features, in_features)
        else:
            scale_shape = (out_features, in_features // BLOCK_SIZE)
        self.weight = _frozen(torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.weight_scale = _frozen(torch.zeros(scale_shape, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale_2", torch.ones((), dtype=torch.float32, device=device))
        self.register_buffer("input_scale", torch.ones((), dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)
        self.register_buffer("alpha", torch.ones((), dtype=torch.float32, device=device), persistent=False)
        self.register_buffer("input_scale_inv", torch.ones((), dtype=torch.float32, device=device), persistent=False)
        self.register_load_state_dict_post_hook(NVFP4Linear._after_load_state_dict)
        self.dynamic_input_scale = False

    @staticmethod
    def _after_load_state_dict(module: NVFP4Linear, incompatible_keys) -> None:
        # torch asserts that these hooks return nothing.
        module.refresh_derived_scales_()

    def _apply(self, fn, recurse=True):
        # `model.to(torch.bfloat16)` casts every floating buffer; the per-tensor scales must stay FP32 (rounding
        # them to BF16 would change every output), so they only follow the device. They keep their tensor objects,
        # as parameters do, because offloading hooks hold on to them.
        saved = {name: self._buffers[name] for name in self._FP32_BUFFERS}
        for name in saved:
            self._buffers[name] = None
        try:
            super()._apply(fn, recurse)
        finally:
            device = self.weight.device
            for name, tensor in saved.items():
                if tensor.device != device:
                    if _keeps_identity(tensor, device):
                        tensor.data = tensor.data.to(device)
                    else:
                        tensor = tensor.to(device)
                self._buffers[name] = tensor
        return self

    @classmethod
    @torch.no_grad()
    def from_weight(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, input_scale: torch.Tensor | float
    ) -> NVFP4Linear:
        """Quantize a BF16 ``[N, K]`` weight the way ModelOpt does (``weight_scale_2 = amax / (448 * 6)``,
        ``format.quantize_nvfp4_weight``) into a new layer on the weight's device; ``input_scale`` is the activation
        scale (FP32 scalar)."""
        n, k = weight.shape
        weight_scale_2 = (weight.abs().max().float() / (448.0 * 6.0)).reshape(())
        packed, scales = quantize_nvfp4_weight(weight.to(torch.bfloat16), weight_scale_2, scale_layout="128x4")
        layer = cls(k, n, bias=bias is not None, device=weight.device)
        return layer.load_nvfp4(packed, scales, weight_scale_2, torch.as_tensor(input_scale, dtype=torch.float32), bias,
                                scale_layout="128x4")

    @torch.no_grad()
    def load_nvfp4(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        weight_scale_2: torch.Tensor,
        input_scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        scale_layout: ScaleLayout,
    ) -> NVFP4Linear:
        """Take checkpoint tensors (shapes already checked by the caller) and record their scale layout."""
        device = self.weight.device
        self.weight = _frozen(weight.view(torch.uint8).to(device).contiguous())
        self.weight_scale = _frozen(weight_scale.view(torch.uint8).to(device).contiguous())
        self.scale_layout = scale_layout
        # Copies: the parts of a fused checkpoint tensor (q/k/v) must not share one scalar, or safetensors refuses to
        # save the model.
        self.weight_scale_2 = weight_scale_2.reshape(()).to(device=device, dtype=torch.float32, copy=True)
        self.input_scale = input_scale.reshape(()).to(device=device, dtype=torch.float32, copy=True)
        if bias is not None:
            self.bias = bias.to(device=device, dtype=self.bias.dtype if self.bias is not None else bias.dtype)
        self.alpha = torch.empty((), dtype=torch.float32, device=device)
        self.input_scale_inv = torch.empty((), dtype=torch.float32, device=device)
        return self.refresh_derived_scales_()

    @torch.no_grad()
    def refresh_derived_scales_(self) -> NVFP4Linear:
        """Recompute ``alpha`` and ``input_scale_inv`` in place (their tensor objects stay, for offloading hooks)."""
        self.scale_version += 1
        derived = {"alpha": self.input_scale * self.weight_scale_2, "input_scale_inv": 1.0 / self.input_scale}
        for name, value in derived.items():
            current = cast(torch.Tensor, self._buffers[name])  # registered in __init__, never None here
            if current.device == value.device and _keeps_identity(current, value.device):
                current.copy_(value)
            else:
                self._buffers[name] = value
        return self

    @torch.no_grad()
    def swizzle_weight_scales_(self) -> bool:
        """Convert linear block scales to the 128x4 layout. Returns False (and does nothing) if already 128x4."""
        if self.scale_layout == "128x4":
            return False
        self.weight_scale = _frozen(swizzle_scales(self.weight_scale.data))
        self.scale_layout = "128x4"
        return True

    def forward(self, x):  # x: torch.Tensor | FusedInput (left unannotated: callers replace forward)
        """x: ``[..., K]`` BF16/FP16 -> ``[..., N]`` in x's dtype.

        A fused path passes a ``FusedInput`` instead (``patches/operands.py``): its kernel runs here with this layer's
        scales, packed or decoded as this layer's GEMM takes it. Reading the layer's tensors only here, after the
        hooks on the call have run, keeps it right under offloading, where the hooks bring them to the GPU
        (docs/design.md §5)."""
        fast_math = fast_math_from_env()  # the one read of the activation recipe (docs/design.md §3)
        if isinstance(x, torch.Tensor):
            return self._forward(x, self.bias, fast_math)
        return self._forward_fused(x, fast_math)

    def _forward_fused(self, x: FusedInput, fast_math: bool) -> Any:
        y = None if self.dynamic_input_scale else x.linear(self, fast_math)
        if y is not None:
            return x.output(y)
        if x.decodes and self.takes_decoded_rows(x.rows, x.device, x.dtype):  # the GEMM multiplies FP16 values
            y = self.forward_decoded(x.decode(self.input_scale_inv, fast_math), x.dtype)
        else:
            y = self.forward_prequantized(*x.quantize(self.input_scale_inv, fast_math), x.dtype)
        return x.output(y)

    def forward_without_bias(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` without the bias add, for a caller that adds ``self.bias`` itself (a fused kernel).

        ``forward(x)`` equals ``forward_without_bias(x) + self.bias`` byte for byte: the bias is always added to the
        output already rounded to x's dtype, in one correctly rounded add.
        """
        return self._forward(x, None, fast_math_from_env())

    def _forward(self, x: torch.Tensor, bias: torch.Tensor | None, fast_math: bool) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"NVFP4Linear expected input [..., {self.in_features}], got {tuple(x.shape)}")
        if self.dynamic_input_scale:
            return self._forward_dynamic(x, bias, fast_math)
        y = quantized_linear(x.reshape(-1, self.in_features), self.input_scale_inv, fast_math, self.weight,
                             self.weight_scale, self.alpha, bias, x.dtype, self.scale_layout == "128x4")
        return y.reshape(*x.shape[:-1], self.out_features)

    def _forward_dynamic(self, x: torch.Tensor, bias: torch.Tensor | None, fast_math: bool) -> torch.Tensor:
        # Per-call activation global scale. Computed on the device without a host sync (CUDA graphs); an all-zero
        # or NaN amax falls back to 1.0, where any scale quantizes the same (zeros stay 0, NaN encodes as +6).
        rows = x.reshape(-1, self.in_features)
        amax = rows.abs().amax().to(torch.float32)
        input_scale = torch.where(amax > 0, amax / (448.0 * 6.0), torch.ones_like(amax))
        y = quantized_linear(rows, 1.0 / input_scale, fast_math, self.weight, self.weight_scale,
                             input_scale * self.weight_scale_2, bias, x.dtype, self.scale_layout == "128x4")
        return y.reshape(*x.shape[:-1], self.out_features)

    def forward_prequantized(
        self, x_packed: torch.Tensor, x_scales: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
    ) -> torch.Tensor:
        """x_packed: uint8 ``[M, K/2]``; x_scales: uint8 128x4 ``[round_up(M,128), round_up(K/16,4)]`` -> ``[M, N]``.

        Fused paths reach it through the module's call (see ``forward``), so that hooks on the layer run."""
        if self.dynamic_input_scale:
            raise RuntimeError(
                "this NVFP4Linear uses dynamic_input_scale (no checkpoint input_scale), so input quantized with its "
                "static input_scale_inv would be wrong; fused paths must fall back for it (check `dynamic_input_scale` "
                "in the gate)"
            )
        return nvfp4_linear(
            x_packed, x_scales, self.weight, self.weight_scale, self.alpha, self.bias, out_dtype,
            self.scale_layout == "128x4",
        )

    def takes_decoded_rows(self, rows: int, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether this layer's GEMM for an activation of ``rows`` rows of ``dtype`` on ``device`` multiplies its
        decoded FP16 values, so a fused producer may hand them over (``forward_decoded``) instead of packed bytes."""
        return not self.dynamic_input_scale and takes_decoded_activation(
            rows, device, self.bias, dtype, self.scale_layout == "128x4")

    def forward_decoded(self, x16: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """x16: FP16 ``[M, K]``, the exact decoded values of an activation quantized with this layer's
        ``input_scale_inv`` (only where ``takes_decoded_rows``) -> ``[M, N]``, the bytes ``forward_prequantized``
        gives for the packed form."""
        return linear_fp16_x(x16, self.weight, self.weight_scale, self.alpha, self.bias, out_dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"scale_layout={self.scale_layout}" + (", dynamic_input_scale=True" if self.dynamic_input_scale else "")
        )
