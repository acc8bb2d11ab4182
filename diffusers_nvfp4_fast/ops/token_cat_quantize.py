"""FLUX.2 token-cat quantize: ``quantize(cat([attn, mlp], -1))`` without building the concatenation.

Reference: ``token_cat_quantize_reference`` (docs/design.md §6). Kernel: ``kernels.token_cat_quantize_triton``.
"""

from __future__ import annotations

from types import ModuleType
from typing import cast

import torch

from .dispatch import kernels, triton_runs_on
from .fused import FusedOp
from .quantize import empty_quantized, quantize


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


def _token_cat_fake(attn, mlp, global_scale, fast_math):
    return empty_quantized(attn, attn.numel() // attn.shape[-1], attn.shape[-1] + mlp.shape[-1])


# attn [..., A], mlp [..., B] (same leading dims, BF16/FP16, A and B multiples of 16), global_scale, fast_math ->
# packed uint8 [R, (A+B)/2], 128x4 scales uint8 [round_up(R,128), round_up((A+B)/16,4)].
token_cat_quantize = FusedOp("token_cat_quantize", _token_cat_impl, token_cat_quantize_reference, _token_cat_fake,
                             ("packed", "scales"))
