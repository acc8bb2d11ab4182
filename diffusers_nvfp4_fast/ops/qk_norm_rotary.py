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
from .dispatch import compiling_only, kernels
from .fused import AotKernel, Case, Form, FusedOp, Probe
from .rotary import contiguous_like_x, flux2_tables, probe_inputs, rotary_reference

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


def tree_match(device: torch.device) -> TreeMatch:
    """The kernel's tree whose output equals diffusers' chain on this GPU for ``probe_inputs(1, 2048, 24)``, or why
    none does. torch's warp reduction adds lanes at offsets 16, 8, ..., 1 in torch 2.11's CUDA builds (PR #164790)
    and at 1, 2, ..., 16 before it, so both are tried. Computed once per process and device; while a CUDA graph is
    being captured, before that check, it cannot run and says so (the caller falls back)."""
    key = str(device)
    if key not in _TREE:
        if compiling_only():  # both trees' kernels compile now; the check itself runs at the next call
            probe = probe_inputs(1, 2048, 24, device)
            for tree in (1, 0):
                cast(ModuleType, kernels).qk_norm_rotary_triton(*probe, EPS, tree=tree)
            return TreeMatch(1)
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


_QK_SIGNATURE = {"x_ptr": "*bf16", "w_ptr": "*bf16", "freqs_ptr": "*fp32", "out_ptr": "*i16", "mean_ptr": "*bf16",
                 "rows": "i32", "S": "i32", "H": "i32", "eps": "fp32"}
# x BF16 [B, S, H, 128], weight BF16 [128], cos / sin FP32 [S, 128], eps -> [B, S, H, 128] BF16: the FLUX.2 kernel
# where Triton runs, flux2_qk_norm_rotary_reference elsewhere (the same bytes, GPU-tested).
flux2_qk_norm_rotary = Form(
    "flux2_qk_norm_rotary", flux2_qk_norm_rotary_reference,
    lambda k, x, weight, cos, sin, eps: k.flux2_qk_norm_rotary_triton(x, weight, cos, sin, eps),
    contiguous_like_x, ("out",),
    aot=AotKernel("flux2_qk_norm_rotary", "qk_norm_rotary", "_flux2_qk_norm_rotary_kernel", {
        "x_ptr": "*bf16", "w_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "out_ptr": "*i16", "rows": "i32",
        "S": "i32", "H": "i32", "eps": "fp32"}))


def _qk_norm_rotary_kernel(k, x: torch.Tensor, weight: torch.Tensor, freqs: torch.Tensor, eps: float) -> torch.Tensor:
    """The kernel with the tree that equals torch's on x's GPU (one lookup per call; off the GPU, the Triton
    interpreter in CPU tests, torch 2.11's tree 1), diffusers' chain where no tree does."""
    tree = tree_match(x.device).tree if x.is_cuda else 1
    if tree is None:
        return qk_norm_rotary_reference(x, weight, freqs, eps)
    return k.qk_norm_rotary_triton(x, weight, freqs, eps, tree=tree)


# x [B, S, H, 128] BF16, weight BF16 [128], freqs complex64 [S, 64], eps -> [B, S, H, 128] BF16: the kernel where
# Triton runs and its tree equals torch's, diffusers' chain elsewhere (the same bytes).
qk_norm_rotary = Form(
    "qk_norm_rotary", qk_norm_rotary_reference, _qk_norm_rotary_kernel, contiguous_like_x, ("out",),
    aot=AotKernel("qk_norm_rotary", "qk_norm_rotary", "_qk_norm_rotary_kernel", _QK_SIGNATURE))


def qwen_rotary_reference(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """diffusers 0.42.1 ``apply_rotary_emb_qwen(x, freqs, use_real=False)``: x ``[B, S, H, D]``, freqs complex64
    ``[S, D/2]``."""
    return cast(torch.Tensor, apply_rotary_emb_qwen(x, freqs, use_real=False))


# x [B, S, H, 128] BF16, freqs complex64 [S, 64] -> [B, S, H, 128] BF16: the kernel's complex product (torch 2.11's
# FMA forms; the first call of each class is checked against diffusers' ops) where Triton runs, diffusers' op
# elsewhere. Under torch.compile it replaces diffusers' complex multiply, which inductor leaves to an eager kernel
# over FP32 copies, with one pass over the BF16 rows. Its kernel is qk_norm_rotary's without the norm (NORM=False).
qwen_rotary = Form("qwen_rotary", qwen_rotary_reference, lambda k, x, freqs: k.qwen_rotary_triton(x, freqs),
                   contiguous_like_x, ("out",))


def _cases(p: Probe) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    q, weight, freqs = probe_inputs(1, p.rows, p.pick(24, 2), device=p.device)
    return q, weight, freqs, f"{p.rows}x{q.shape[2]}x128"


def _flux2_probe(p: Probe) -> list[Case]:
    """FLUX.2-dev's query: 24 heads of 128 per token, its RMSNorm weight and rotary tables."""
    q, weight, freqs, shape = _cases(p)
    return [Case("FLUX.2 QK RMSNorm + rotary", shape, (q, weight, *flux2_tables(freqs), EPS))]


def _qwen_probe(p: Probe) -> list[Case]:
    """Qwen-Image's query: 24 heads of 128 per token, its RMSNorm weight and complex rotary factors."""
    q, weight, freqs, shape = _cases(p)
    return [Case("Qwen-Image QK RMSNorm + rotary", shape, (q, weight, freqs, EPS))]


def _qwen_rotary_probe(p: Probe) -> list[Case]:
    """Qwen-Image's query under torch.compile: the rotary embedding alone."""
    q, _, freqs, shape = _cases(p)
    return [Case("Qwen-Image rotary", shape, (q, freqs))]


FLUX2_QK_NORM_ROTARY = FusedOp(flux2_qk_norm_rotary, _flux2_probe)
# A GPU where no tree gives torch's bytes keeps diffusers' chain at the Qwen-Image QK sites (patches/qwen_attention.py).
QK_NORM_ROTARY = FusedOp(qk_norm_rotary, _qwen_probe, unused_here=lambda device: tree_match(device).reason)
QWEN_ROTARY = FusedOp(qwen_rotary, _qwen_rotary_probe)
