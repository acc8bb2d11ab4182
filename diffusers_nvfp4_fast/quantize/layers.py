"""One Linear's NVFP4 tensors as a ModelOpt export stores them, computed with the package's precise quantizer.

``scale = amax / (448 * 6)`` for both ``weight_scale_2`` (amax of the weight) and ``input_scale`` (amax of the
layer's calibrated input): docs/design.md §3 and §4. q/k/v projections fed by one input share both scales (the max
of their amaxes), as ModelOpt exports do.
"""

from __future__ import annotations

import torch

from ..format import E2M1_MAX, E4M3_MAX, quantize_nvfp4_weight

NVFP4_AMAX_DIVISOR = E4M3_MAX * E2M1_MAX  # 2688: amax -> FP32 per-tensor scale


def scale_from_amax(amax: float) -> torch.Tensor:
    """FP32 0-d per-tensor scale ``amax / 2688`` (rounded once, from a Python float)."""
    return torch.tensor(amax / NVFP4_AMAX_DIVISOR, dtype=torch.float32)


def weight_amax(weight: torch.Tensor) -> float:
    """``max |w|`` of a weight as a Python float (exact: ``max(max w, -min w)``, without an ``abs`` copy)."""
    low, high = weight.detach().aminmax()
    return max(float(high), -float(low))


def nvfp4_layer_tensors(weight: torch.Tensor, group_weight_amax: float,
                        input_amax: float | None) -> dict[str, torch.Tensor]:
    """The four NVFP4 tensors of one Linear, on the weight's device.

    Args:
        weight: ``[N, K]`` BF16/FP16/FP32, K a multiple of 16.
        group_weight_amax: max |w| over the layer's q/k/v group (its own for other layers); > 0.
        input_amax: calibrated max |input| (over the group), > 0; None for a layer that computes its activation
            scale per call: ``input_scale`` is then 1.0, a placeholder the loader never reads (the checkpoint
            config lists the layer under ``dynamic_input_scale``).

    Returns:
        ``weight`` packed uint8 ``[N, K/2]`` (low nibble first), ``weight_scale`` float8_e4m3fn ``[N, K/16]``
        (linear layout), ``weight_scale_2`` and ``input_scale`` FP32 0-d.
    """
    weight_scale_2 = scale_from_amax(group_weight_amax)
    packed, scales = quantize_nvfp4_weight(weight, weight_scale_2)  # ModelOpt's rounding (docs/format.md)
    return {"weight": packed, "weight_scale": scales.view(torch.float8_e4m3fn),
            "weight_scale_2": weight_scale_2,
            "input_scale": torch.ones((), dtype=torch.float32) if input_amax is None else scale_from_amax(input_amax)}


