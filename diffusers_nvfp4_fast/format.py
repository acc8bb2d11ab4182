"""The NVFP4 format in pure torch: the reference every kernel in this project is tested against.

NVFP4 stores a tensor as 4-bit E2M1 values, one E4M3 scale per 16 consecutive values of a row, and one FP32
scale per tensor. This module implements docs/design.md §3 exactly, on any device torch supports:

* ``quantize_nvfp4(x, global_scale)``: BF16/FP16/FP32 ``[..., K]`` -> packed uint8 ``[M, K/2]`` + uint8 block
  scales (128x4 swizzled ``[round_up(M,128), round_up(K/16,4)]`` or linear ``[M, K/16]``).
* ``decode_nvfp4`` / ``dequantize_nvfp4``: back to numbers (``decode`` is ``e2m1 * e4m3`` exactly, in BF16;
  ``dequantize_nvfp4`` takes the per-tensor scale by name, ``weight_scale_2=`` or ``global_scale=``).
* ``swizzle_scales`` / ``unswizzle_scales``: the 128x4 block-scale layout every FP4 GEMM wants.
* ``swap_nibbles``: convert between low-nibble-first (ours, ModelOpt) and high-nibble-first packing.

Special values (the same in every kernel of this project):

* NaN inputs are skipped by the block maximum (like ``fmaxf``), and a NaN product encodes as ``0x7`` (+6, the
  largest E2M1 magnitude; E2M1 has no NaN). In fast-math mode a block whose scale underflows to 0 computes
  ``0 * inf``; that NaN also encodes as ``0x7``. The block's scale byte is 0, so it dequantizes to 0 either way.
* +-Inf inputs saturate the block scale at 448 and encode as +-6.
* The sign is kept: a small negative value encodes as -0 (``0x8``).

Fast-math mode uses ``rcp.approx.ftz.f32`` on NVIDIA GPUs, which is not correctly rounded. The torch code here
runs it with a correctly rounded ``1/x`` plus flush-to-zero, so on the CPU fast-math results equal the GPU's only
where the approximate reciprocal happens to be exact (most, not all, blocks). The precise mode is exact everywhere.
"""

from __future__ import annotations

import functools
import warnings
from typing import Literal

import torch

from .switches import FAST_MATH_OFF, FOUR_OVER_SIX, env_enabled

BLOCK_SIZE = 16
E4M3_MAX = 448.0
E2M1_MAX = 6.0
FLT_MAX = torch.finfo(torch.float32).max
FLT_MIN_NORMAL = torch.finfo(torch.float32).tiny

# Index = 4-bit code (sign in bit 3).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Rounding thresholds between neighbouring magnitudes; `True` means a tie rounds up (to the even code).
_E2M1_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))

ScaleLayout = Literal["128x4", "linear"]


def round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def padded_scale_shape(rows: int, k: int) -> tuple[int, int]:
    """Shape of the 128x4 block scales of a ``[rows, k]`` matrix: ``(round_up(rows, 128), round_up(k / 16, 4))``."""
    return round_up(rows, 128), round_up(k // BLOCK_SIZE, 4)


@torch.compiler.assume_constant_result
def fast_math_from_env() -> bool:
    """True (fast-math) unless FLASHINFER_/TRTLLM_DISABLE_FP4_QUANT_FAST_MATH is enabled.

    Read at every eager call; a compiled graph reads it when it is traced.
    """
    if env_enabled(FOUR_OVER_SIX):
        _warn_four_over_six()
    return not (env_enabled(FAST_MATH_OFF[0]) or env_enabled(FAST_MATH_OFF[1]))


@functools.cache
def _warn_four_over_six() -> None:
    warnings.warn(
        f"{FOUR_OVER_SIX} is set, but diffusers-nvfp4-fast does not implement the 4-over-6 scale search; "
        "activations are quantized with the standard NVFP4 recipe.",
        stacklevel=3,
    )


def _f32(value: float, device: torch.device) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=device)


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """Non-negative FP32 -> E4M3 byte (uint8), round to nearest even, saturating at 448."""
    return torch.clamp(x, max=E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_value(byte: torch.Tensor) -> torch.Tensor:
    return byte.view(torch.float8_e4m3fn).to(torch.float32)


def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """FP32 -> 4-bit E2M1 code (uint8 in 0..15): round to nearest, ties to the even code, saturate at 6."""
    a = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for threshold, tie_up in _E2M1_THRESHOLDS:
        code += (a >= threshold) if tie_up else (a > threshold)
    sign = (v.view(torch.int32) < 0).to(torch.uint8) << 3  # the sign bit, so -0.0 keeps it
    code = code | sign
    return torch.where(torch.isnan(v), torch.full_like(code, 0x7), code)


def _nan_skipping_block_max(blocks: torch.Tensor) -> torch.Tensor:
    a = blocks.abs()
    return torch.where(torch.isnan(a), torch.zeros_like(a), a).amax(-1)


def _ftz(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x.abs() < FLT_MIN_NORMAL, torch.zeros_like(x), x)


def _rcp_approx(x: torch.Tensor) -> torch.Tensor:
    # Stand-in for rcp.approx.ftz.f32: correctly rounded, with subnormal inputs and outputs flushed.
    return _ftz(1.0 / _ftz(x))


def block_scales_and_factors(
    vec_max: torch.Tensor, global_scale: torch.Tensor, fast_math: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block E4M3 scale byte and the FP32 factor each value is multiplied by before E2M1 rounding.

    vec_max: FP32 block maxima (any shape); global_scale: FP32 0-d. Returns (uint8 bytes, FP32 factors).
    """
    g = global_scale.to(torch.float32)
    zero = torch.zeros_like(vec_max)
    if fast_math:
        sf = g * (vec_max * _rcp_approx(_f32(E2M1_MAX, vec_max.device)))
        sf_byte = e4m3_round(sf)
        factor = _rcp_approx(e4m3_value(sf_byte) * _rcp_approx(g))
    else:
        sf = torch.where(vec_max != 0, vec_max * (g * _f32(1.0 / 6.0, vec_max.device)), zero)
        sf_byte = e4m3_round(sf)
        factor = torch.clamp(1.0 / (e4m3_value(sf_byte) * (1.0 / g)), max=FLT_MAX)
    return sf_byte, torch.where(vec_max != 0, factor, zero)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] -> packed [..., K/2]: element 2j in the low nibble of byte j, 2j+1 in the high."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def swap_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Convert between low-nibble-first and high-nibble-first packing (its own inverse)."""
    p = packed.view(torch.uint8)
    return (p >> 4) | (p << 4)


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """Linear block scales [M, C] -> 128x4 layout [round_up(M,128), round_up(C,4)] (uint8), padding zeroed.

    Element (m, k) lands at flat offset (m//128)*(round_up(C,4)*128) + (k//4)*512 + (m%32)*16 + ((m%128)//32)*4 + k%4.
    """
    if scales.dim() != 2:
        raise ValueError(f"swizzle_scales expects a 2-D [M, K/16] tensor, got shape {tuple(scales.shape)}")
    s = scales.view(torch.uint8)
    m, c = s.shape
    mp, cp = round_up(m, 128), round_up(c, 4)
    padded = torch.zeros(mp, cp, dtype=torch.uint8, device=s.device)
    padded[:m, :c] = s
    return padded.reshape(mp // 128, 4, 32, cp // 4, 4).permute(0, 3, 2, 1, 4).reshape(mp, cp).contiguous()


def unswizzle_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of ``swizzle_scales``: 128x4 layout -> linear [rows, cols] (uint8)."""
    s = swizzled.view(torch.uint8)
    mp, cp = round_up(rows, 128), round_up(cols, 4)
    if s.numel() != mp * cp:
        raise ValueError(
            f"a 128x4 scale tensor for {rows}x{cols} scales must hold {mp}x{cp} bytes, got shape {tuple(s.shape)}"
        )
    linear = s.reshape(mp // 128, cp // 4, 32, 4, 4).permute(0, 3, 2, 1, 4).reshape(mp, cp)
    return linear[:rows, :cols].contiguous()


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    if x.dim() < 2:
        raise ValueError(f"NVFP4 quantization needs a 2-D or larger input, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"NVFP4 quantization takes bfloat16/float16/float32 input, got {x.dtype}")
    if x.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"the last dimension ({x.shape[-1]}) must be a multiple of {BLOCK_SIZE}")
    return x.reshape(-1, x.shape[-1])


def _as_global_scale(global_scale: torch.Tensor | float, device: torch.device, name: str = "global_scale"
                     ) -> torch.Tensor:
    if not torch.is_tensor(global_scale):
        return _f32(float(global_scale), device)
    if global_scale.numel() != 1:
        raise ValueError(f"{name} must hold one value, got shape {tuple(global_scale.shape)}")
    return global_scale.reshape(()).to(device=device, dtype=torch.float32)


def quantize_nvfp4(
    x: torch.Tensor,
    global_scale: torch.Tensor | float,
    *,
    scale_layout: ScaleLayout = "128x4",
    fast_math: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to NVFP4 (pure torch; docs/design.md §3).

    Args:
        x: ``[..., K]`` bfloat16/float16/float32, K a multiple of 16; leading dims are flattened to M rows.
        global_scale: FP32 scalar ``g`` (``1 / input_scale`` for activations, ``1 / weight_scale_2`` for weights).
        scale_layout: ``"128x4"`` (swizzled, zero-padded) or ``"linear"``.
        fast_math: ``None`` reads the FlashInfer/TRT-LLM environment variables (default fast-math).

    Returns:
        ``(packed, scales)``: packed uint8 ``[M, K/2]`` (low nibble first); scales uint8 E4M3 bytes,
        ``[round_up(M,128), round_up(K/16,4)]`` for "128x4" or ``[M, K/16]`` for "linear".
    """
    if scale_layout not in ("128x4", "linear"):
        raise ValueError(f"scale_layout must be '128x4' or 'linear', got {scale_layout!r}")
    rows = _as_rows(x)
    if fast_math is None:
        fast_math = fast_math_from_env()
    g = _as_global_scale(global_scale, rows.device)
    m, k = rows.shape
    blocks = rows.reshape(m, k // BLOCK_SIZE, BLOCK_SIZE).to(torch.float32)
    sf_byte, factor = block_scales_and_factors(_nan_skipping_block_max(blocks), g, fast_math)
    codes = e2m1_round(blocks * factor.unsqueeze(-1)).reshape(m, k)
    packed = pack_nibbles(codes)
    scales = swizzle_scales(sf_byte) if scale_layout == "128x4" else sf_byte
    return packed, scales


def quantize_nvfp4_weight(
    weight: torch.Tensor, weight_scale_2: torch.Tensor | float, *, scale_layout: ScaleLayout = "linear"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight as ModelOpt's exporter does (ModelOpt 0.47 ``NVFP4QTensor.get_weights_scaling_factor`` and
    ``quantize``): block scale ``max|w| / (6 * weight_scale_2)`` in FP32 (an all-zero block 1.0, clamped to
    [2^-9, 448]) rounded to E4M3, then each value divided in FP32 by ``block_scale * weight_scale_2`` and rounded to
    E2M1 (nearest, ties to even). The activation recipe (``quantize_nvfp4``) multiplies by reciprocals, gives an
    all-zero block scale 0 and does not clamp, so a tie can round the other way (docs/format.md).

    Returns ``(packed, scales)`` as ``quantize_nvfp4``: packed uint8 ``[M, K/2]``, E4M3 bytes in ``scale_layout``
    (``"linear"`` ``[M, K/16]`` by default, as checkpoints store them).
    """
    if scale_layout not in ("128x4", "linear"):
        raise ValueError(f"scale_layout must be '128x4' or 'linear', got {scale_layout!r}")
    rows = _as_rows(weight)
    ws2 = _as_global_scale(weight_scale_2, rows.device, "weight_scale_2")
    m, k = rows.shape
    blocks = rows.reshape(m, k // BLOCK_SIZE, BLOCK_SIZE).to(torch.float32)
    scale = _nan_skipping_block_max(blocks) / (E2M1_MAX * ws2)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale).clamp(min=2.0**-9, max=E4M3_MAX)
    sf_byte = e4m3_round(scale)
    codes = e2m1_round(blocks / (e4m3_value(sf_byte) * ws2).unsqueeze(-1))
    packed = pack_nibbles(codes.reshape(m, k))
    return packed, swizzle_scales(sf_byte) if scale_layout == "128x4" else sf_byte


def decode_nvfp4(
    packed: torch.Tensor, scales: torch.Tensor, *, scale_layout: ScaleLayout = "128x4", dtype=torch.bfloat16,
    nibble_order: Literal["lo_first", "hi_first"] = "lo_first",
) -> torch.Tensor:
    """``e2m1 * e4m3`` per element, without the global scale: ``[M, K/2]`` -> ``[M, K]``.

    Exact in BF16: an E2M1 value has 2 significant bits and an E4M3 scale 4, so the product fits BF16's 8.
    ``nibble_order="hi_first"`` reads ComfyUI's packing (element ``2j`` in the high nibble).
    """
    m, half_k = packed.shape
    k = half_k * 2
    sf = _linear_scales(scales, m, k, scale_layout)
    values = _e2m1_blocks(packed, nibble_order, torch.float32)
    return (values * e4m3_value(sf).unsqueeze(-1)).reshape(m, k).to(dtype)


def _e2m1_blocks(packed: torch.Tensor, nibble_order: str, dtype: torch.dtype) -> torch.Tensor:
    """The E2M1 values of packed ``[M, K/2]`` in ``dtype``, as ``[M, K/16, 16]`` blocks."""
    if nibble_order not in ("lo_first", "hi_first"):
        raise ValueError(f"nibble_order must be 'lo_first' or 'hi_first', got {nibble_order!r}")
    p = packed.view(torch.uint8)
    codes = unpack_nibbles(swap_nibbles(p) if nibble_order == "hi_first" else p)
    lut = torch.tensor(E2M1_VALUES, dtype=dtype, device=packed.device)
    return lut[codes.long()].reshape(p.shape[0], -1, BLOCK_SIZE)


def _linear_scales(scales: torch.Tensor, m: int, k: int, scale_layout: str) -> torch.Tensor:
    if scale_layout == "128x4":
        return unswizzle_scales(scales, m, k // BLOCK_SIZE)
    sf = scales.view(torch.uint8)
    if tuple(sf.shape) != (m, k // BLOCK_SIZE):
        raise ValueError(f"linear scales for packed {(m, k // 2)} must be {(m, k // 16)}, got {tuple(sf.shape)}")
    return sf


def dequantize_nvfp4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    *ambiguous: object,
    weight_scale_2: torch.Tensor | float | None = None,
    global_scale: torch.Tensor | float | None = None,
    scale_layout: ScaleLayout = "128x4",
    nibble_order: Literal["lo_first", "hi_first"] = "lo_first",
    dtype=torch.float32,
) -> torch.Tensor:
    """NVFP4 -> numbers, ``[M, K/2]`` -> ``[M, K]`` in ``dtype``. The per-tensor scale is passed by name, one of:

    * ``weight_scale_2=``: the checkpoint's own scalar (ModelOpt, ComfyUI, diffusers' BFL files; ``amax / 2688``):
      ``e2m1 * (e4m3 * weight_scale_2)``, the product rounded in FP32 (FP64 for ``dtype=torch.float64``, where it is
      exact). Byte for byte comfy-kitchen 0.2.40's ``dequantize_nvfp4`` for FP32 output (with
      ``nibble_order="hi_first"``, its packing) and diffusers' BFL ``dequantize_nvfp4`` (linear scales); for BF16
      output this rounds once, comfy-kitchen rounds ``weight_scale_2`` to BF16 first.
    * ``global_scale=``: the encode scale ``g = 1 / weight_scale_2`` that ``quantize_nvfp4`` takes:
      ``e2m1 * e4m3 / g``.

    A third positional argument is refused: the two scales are each other's inverse, and a wrong guess is off by a
    factor of about ``2688**2 / amax**2``, silently.
    """
    if ambiguous:
        raise TypeError(
            "dequantize_nvfp4() takes the per-tensor scale by name: weight_scale_2=<the checkpoint's weight_scale_2> "
            "(values = e2m1 * e4m3 * weight_scale_2) or global_scale=<1 / weight_scale_2> (the g quantize_nvfp4 "
            f"takes); got {len(ambiguous)} more positional argument(s)"
        )
    if (weight_scale_2 is None) == (global_scale is None):
        raise TypeError("dequantize_nvfp4() needs exactly one of weight_scale_2= (the checkpoint's scalar) and "
                        "global_scale= (1 / weight_scale_2)")
    if global_scale is not None:
        g = _as_global_scale(global_scale, packed.device)
        decoded = decode_nvfp4(packed, scales, scale_layout=scale_layout, dtype=torch.float32,
                               nibble_order=nibble_order)
        return (decoded / g).to(dtype)
    assert weight_scale_2 is not None
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    m, k = packed.shape[0], packed.shape[1] * 2
    sf = e4m3_value(_linear_scales(scales, m, k, scale_layout)).to(compute)
    scale = sf * _as_global_scale(weight_scale_2, packed.device, "weight_scale_2").to(compute)
    return (_e2m1_blocks(packed, nibble_order, compute) * scale.unsqueeze(-1)).reshape(m, k).to(dtype)
