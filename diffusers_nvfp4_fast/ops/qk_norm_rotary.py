"""Query/key RMSNorm + rotary embedding in one kernel: Qwen-Image (diffusers' ``RMSNorm`` with a BF16 weight, then
``apply_rotary_emb_qwen(..., use_real=False)``: ten torch ops over FP32 copies; site ``qwen_qk_rotary``) and FLUX.2
(torch's ``F.rms_norm``, then ``apply_rotary_emb``; site ``flux2_qk_rotary``). Compiled Qwen-Image models, where
inductor computes the norm, take the rotary embedding alone (``qwen_rotary``, same site).

Reference: ``qk_norm_rotary_reference`` (diffusers' chain on the same device). Kernel: ``kernels.qk_norm_rotary_triton``
(docs/design.md §6, "Qwen-Image QK norm and rotary"). The kernel's arithmetic is what torch 2.11's CUDA build
compiles (read off its machine code); the warp tree changed between torch versions, so ``tree_match`` picks the
kernel's tree against torch once per process and GPU before the kernel runs there
(``benchmarks/bench_qk_norm_rotary.py`` says which stage differs if none matches).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import ModuleType
from typing import cast

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

from .. import caches
from .dispatch import kernels, triton_runs_on
from .fused import FusedOp
from .rotary import rotary_reference

EPS = 1e-6  # Qwen-Image's


@dataclass(frozen=True)
class TreeMatch:
    """The kernel's warp-reduction ``tree`` whose bytes equal torch's on a device (1: lanes added at offsets 16, 8,
    ..., 1; 0: at 1, 2, ..., 16), or None and the ``reason`` the kernel is not used there."""

    tree: int | None
    reason: str | None = None


# device -> its match (computed once per process and device)
_TREE: dict[str, TreeMatch] = caches.register("ops.qk_norm_rotary.tree", {},
                                              "one entry per device; kept for the process")
_lock = threading.Lock()


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """diffusers 0.42.1 ``RMSNorm.forward`` (non-NPU path) with a BF16/FP16 weight and no bias, op for op."""
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    hidden = x * torch.rsqrt(variance + eps)
    return hidden.to(weight.dtype) * weight


def qk_norm_rotary_reference(x: torch.Tensor, weight: torch.Tensor, freqs: torch.Tensor, eps: float) -> torch.Tensor:
    """x ``[B, S, H, D]``, weight ``[D]``, freqs complex64 ``[S, D/2]`` -> diffusers' chain, in x's dtype."""
    # cast: diffusers annotates the result as a tuple; with use_real=False it returns one tensor.
    return cast(torch.Tensor, apply_rotary_emb_qwen(rms_norm_reference(x, weight, eps), freqs, use_real=False))


def probe_inputs(batch: int, seq: int, heads: int, device: torch.device | str = "cpu", seed: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query-like BF16 ``[batch, seq, heads, 128]`` with row magnitudes from 2^-20 to 2^20, one all-zero row and some
    subnormals, a BF16 RMSNorm weight near 1 and Qwen-like rotary factors (complex64 ``[seq, 64]``, positions up to
    4096): with a few thousand rows, a wrong summation tree or FMA form changes some output bytes."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(batch, seq, heads, 128, device=device, generator=gen)
    x = x * torch.exp2(torch.randint(-20, 20, (batch, seq, heads, 1), device=device, generator=gen).float())
    x.view(-1, 128)[0] = 0.0
    x.view(-1)[7::97] = 1e-39
    weight = (1 + 0.2 * torch.randn(128, device=device, generator=gen)).to(torch.bfloat16)
    pos = torch.randint(0, 4096, (seq, 1), device=device, generator=gen).float()
    angles = pos / (10000 ** (torch.arange(0, 128, 2, device=device).float() / 128))
    return x.to(torch.bfloat16), weight, torch.polar(torch.ones_like(angles), angles)


def flux2_tables(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FLUX.2's FP32 ``(cos, sin)`` ``[S, 2 * F]`` (each angle repeated for its pair) for the angles of complex
    ``freqs`` ``[S, F]``, e.g. those of ``probe_inputs``."""
    angles = freqs.angle().repeat_interleave(2, dim=1)
    return angles.cos(), angles.sin()


def tree_match(device: torch.device) -> TreeMatch:
    """The kernel's tree whose output equals diffusers' chain on this GPU for ``probe_inputs(1, 2048, 24)``, or why
    none does. torch's warp reduction adds lanes at offsets 16, 8, ..., 1 in torch 2.11's CUDA builds (PR #164790)
    and at 1, 2, ..., 16 before it, so both are tried. Computed once per process and device; while a CUDA graph is
    being captured, before that check, it cannot run and says so (the caller falls back)."""
    key = str(device)
    if key not in _TREE:
        if torch.cuda.is_current_stream_capturing():
            return TreeMatch(None, "kernel not yet checked against torch's ops when captured into a CUDA graph")
        x, weight, freqs = probe_inputs(1, 2048, 24, device)
        want = qk_norm_rotary_reference(x, weight, freqs, EPS).view(torch.int16)
        differing = {}
        for tree in (1, 0):
            got = cast(ModuleType, kernels).qk_norm_rotary_triton(x, weight, freqs, EPS, tree=tree)
            differing[tree] = int((got.view(torch.int16) != want).sum())
            if not differing[tree]:
                break
        counts = ", ".join(f"tree {t}: {n}" for t, n in differing.items())
        with _lock:
            _TREE[key] = TreeMatch(tree) if not differing[tree] else TreeMatch(None, (
                f"kernel arithmetic differs from torch's on this GPU ({counts} of {want.numel()} probe values; "
                "benchmarks/bench_qk_norm_rotary.py tells which stage)"))
    return _TREE[key]


def flux2_qk_norm_rotary_reference(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> torch.Tensor:
    """FLUX.2's query/key path in diffusers 0.42.1: ``torch.nn.RMSNorm`` (``F.rms_norm``) with a BF16 weight, then
    ``apply_rotary_emb(..., (cos, sin), sequence_dim=1)``; x ``[B, S, H, D]``, cos / sin FP32 ``[S, D]``."""
    return rotary_reference(F.rms_norm(x, (x.shape[-1],), weight, eps), cos, sin)


def _flux2_impl(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> torch.Tensor:
    if triton_runs_on(x):
        return cast(ModuleType, kernels).flux2_qk_norm_rotary_triton(x, weight, cos, sin, eps)
    return flux2_qk_norm_rotary_reference(x, weight, cos, sin, eps)


def _contiguous_like_x(x, *_):  # both ops' shape function: the kernels write a contiguous tensor shaped like x
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# x BF16 [B, S, H, 128], weight BF16 [128], cos / sin FP32 [S, 128], eps -> [B, S, H, 128] BF16: the FLUX.2 kernel
# where Triton runs, flux2_qk_norm_rotary_reference elsewhere (the same bytes, GPU-tested).
flux2_qk_norm_rotary = FusedOp("flux2_qk_norm_rotary", _flux2_impl, flux2_qk_norm_rotary_reference,
                               _contiguous_like_x, ("out",))


def _qk_norm_rotary_impl(x: torch.Tensor, weight: torch.Tensor, freqs: torch.Tensor, eps: float) -> torch.Tensor:
    tree = tree_match(x.device).tree if triton_runs_on(x) else None
    if tree is not None:
        return cast(ModuleType, kernels).qk_norm_rotary_triton(x, weight, freqs, eps, tree=tree)
    return qk_norm_rotary_reference(x, weight, freqs, eps)  # CPU, or no tree equals torch's here (same bytes)


# x [B, S, H, 128] BF16, weight BF16 [128], freqs complex64 [S, 64], eps -> [B, S, H, 128] BF16: the kernel where
# Triton runs, diffusers' chain elsewhere.
qk_norm_rotary = FusedOp("qk_norm_rotary", _qk_norm_rotary_impl, qk_norm_rotary_reference, _contiguous_like_x,
                         ("out",))


def qwen_rotary_reference(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """diffusers 0.42.1 ``apply_rotary_emb_qwen(x, freqs, use_real=False)``: x ``[B, S, H, D]``, freqs complex64
    ``[S, D/2]``."""
    return cast(torch.Tensor, apply_rotary_emb_qwen(x, freqs, use_real=False))


def _qwen_rotary_impl(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    if triton_runs_on(x):
        return cast(ModuleType, kernels).qwen_rotary_triton(x, freqs)
    return qwen_rotary_reference(x, freqs)


# x [B, S, H, 128] BF16, freqs complex64 [S, 64] -> [B, S, H, 128] BF16: the kernel's complex product (torch 2.11's
# FMA forms; the first call of each class is checked against diffusers' ops) where Triton runs, diffusers' op
# elsewhere. Under torch.compile it replaces diffusers' complex multiply, which inductor leaves to an eager kernel
# over FP32 copies, with one pass over the BF16 rows.
qwen_rotary = FusedOp("qwen_rotary", _qwen_rotary_impl, qwen_rotary_reference, _contiguous_like_x, ("out",))
