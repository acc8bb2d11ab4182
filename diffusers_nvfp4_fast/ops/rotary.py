"""Rotary position embedding on FLUX.2 query / key: diffusers' ``apply_rotary_emb`` (``use_real=True``, interleaved
pairs, ``sequence_dim=1``) in one kernel instead of seven torch ops over FP32 copies.

Reference: ``rotary_reference`` (diffusers' function itself). Kernel: ``kernels.rotary_triton``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, cast

import torch
from diffusers.models.embeddings import apply_rotary_emb

from .dispatch import kernels, triton_runs_on
from .fused import FusedOp


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers 0.42.1 ``apply_rotary_emb(x, (cos, sin), sequence_dim=1)``: x ``[B, S, H, D]``, cos/sin ``[S, D]``."""
    # cast: diffusers annotates the pair as tuple[Tensor] and the result as a tuple; it returns one tensor.
    return cast(torch.Tensor, apply_rotary_emb(x, cast(Any, (cos, sin)), sequence_dim=1))


def _rotary_impl(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if triton_runs_on(x):
        return cast(ModuleType, kernels).rotary_triton(x, cos, sin)
    return rotary_reference(x, cos, sin)


def _rotary_fake(x, cos, sin):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# x [B, S, H, D] BF16/FP16 (D a power of two), cos / sin FP32 [S, D] -> [B, S, H, D] in x's dtype.
rotary = FusedOp("rotary", _rotary_impl, rotary_reference, _rotary_fake, ("out",))
