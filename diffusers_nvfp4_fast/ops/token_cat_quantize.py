"""FLUX.2 token-cat quantize: ``quantize(cat([attn, mlp], -1))`` without building the concatenation.

Reference: ``token_cat_quantize_reference`` (docs/design.md §6). Kernel: ``kernels.token_cat_quantize_triton``.
"""

from __future__ import annotations

from types import ModuleType
from typing import cast

import torch

from .dispatch import call_op, custom_op_pair, kernels, triton_runs_on
from .quantize import empty_quantized, quantize
from .verify import run_checked

KIND = "flux2_token_cat"


def token_cat_quantize_reference(
    attn: torch.Tensor, mlp: torch.Tensor, global_scale: torch.Tensor, fast_math: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize(cat([attn, mlp], -1))``: attn ``[..., A]``, mlp ``[..., B]`` -> packed ``[R, (A+B)/2]``, 128x4
    scales."""
    x = torch.cat([attn, mlp], dim=-1)
    return quantize(x.reshape(-1, x.shape[-1]), global_scale, fast_math)


def _token_cat_impl(
    attn: torch.Tensor, mlp: torch.Tensor, global_scale: torch.Tensor, fast_math: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if triton_runs_on(attn):
        return cast(ModuleType, kernels).token_cat_quantize_triton(attn, mlp, global_scale, fast_math=fast_math)
    return token_cat_quantize_reference(attn, mlp, global_scale, fast_math)


def _token_cat_fake(attn, mlp, global_scale, fast_math, *_):
    return empty_quantized(attn, attn.numel() // attn.shape[-1], attn.shape[-1] + mlp.shape[-1])


def _token_cat_checked_impl(
    attn: torch.Tensor, mlp: torch.Tensor, global_scale: torch.Tensor, fast_math: bool, stats_id: int, shape_class: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return cast("tuple[torch.Tensor, torch.Tensor]", run_checked(
        stats_id, KIND, shape_class, ("packed", "scales"),
        lambda: _token_cat_impl(attn, mlp, global_scale, fast_math),
        lambda: token_cat_quantize_reference(attn, mlp, global_scale, fast_math),
    ))


_token_cat_op, _token_cat_checked_op = custom_op_pair("token_cat_quantize", _token_cat_impl, _token_cat_checked_impl,
                                                      _token_cat_fake)


def token_cat_quantize(
    attn: torch.Tensor, mlp: torch.Tensor, global_scale: torch.Tensor, fast_math: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """attn ``[..., A]``, mlp ``[..., B]`` (same leading dims, BF16/FP16, A and B multiples of 16) -> packed uint8
    ``[R, (A+B)/2]``, 128x4 scales uint8 ``[round_up(R,128), round_up((A+B)/16,4)]``."""
    return call_op(_token_cat_op, _token_cat_impl, attn, mlp, global_scale, fast_math)


def token_cat_quantize_checked(
    attn: torch.Tensor, mlp: torch.Tensor, global_scale: torch.Tensor, fast_math: bool, stats_id: int, shape_class: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_cat_quantize`` with first-use byte verification against the reference (``verify.run_checked``)."""
    return call_op(_token_cat_checked_op, _token_cat_checked_impl, attn, mlp, global_scale, fast_math, stats_id,
                   shape_class)
