"""NVFP4 x NVFP4 product of one activation row (M = 1) on SM80-SM90, in Triton, on the CUDA cores.

``out[0, n] = out_dtype((sum_k x[k] * w[n, k]) * alpha)`` (+ bias) with the exact values of both NVFP4 operands, as
``nvfp4_gemm`` computes it (docs/design.md §7), for the layers that see one row per call (the modulation Linears).
A tensor-core tile spends at least 16 rows on that one row, and the swap-AB kernel stayed far below the copy
bandwidth there whatever its tile or K split (docs/performance.md, "Measurements behind the kernels' design"). Here
each thread decodes
its share of the weight tile to FP16 (``value * scale * 2^-7``, exact), widens it to FP32 and adds its product with
the activation value by one FMA: both factors have at most 6 significant bits, so the product is exact and the FMA
rounds once, like the MMA's FP32 accumulation.

The summation order is part of the kernel, so the bytes depend on the shape (and the split count, a function of the
shape) only, and ``gemv_reference`` reproduces them on any device:
  * within a split, column ``j`` of the ``[BLOCK_N, BLOCK_K]`` accumulator adds the products of ``k = k_lo + j``,
    ``k_lo + BLOCK_K + j``, ... in K order, starting from +0;
  * the accumulator's columns are then added pairwise, adjacent columns first (``c[2j] + c[2j+1]``), log2(BLOCK_K)
    times;
  * split partial sums are added in split order, from the first (``nvfp4_decode.split_reduce_kernel``).
The activation arrives packed (+ 128x4 scales; ``nvfp4_gemm``'s one-row calls) or as its exact FP16 decode
(``quantize_nvfp4_decoded``; a layer's one-row calls), with the same FP32 values. Quantizing the BF16 row inside this
kernel instead would have every program redo its K steps' blocks (slower, measured: docs/performance.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .grid_dependency import wait_for_prior_grids
from .launch import DirectLaunch, cdiv, launch_by_site, pdl_options, site_binary, sm_count
from .nvfp4_decode import (
    linear_epilogue,
    load_decode,
    scale_words,
    split_reduce,
    swizzled_word_row,
    use_asm_split,
)

__all__ = ["GEMV_BLOCK_K", "GEMV_BLOCK_N", "GemvLaunch", "gemv_launch", "gemv_reference", "gemv_splits", "nvfp4_gemv"]

# The one configuration (the order of the sums depends on BLOCK_K only; docs/design.md §7); 8 warps were faster than
# 4 at the modulation shapes, with the same bytes (docs/performance.md, "Measurements behind the kernels' design").
GEMV_BLOCK_N = 64
GEMV_BLOCK_K = 128
GEMV_WARPS = 8
GEMV_STAGES = 3
# Programs per SM below which K is split (each split adds a partial-sum pass and a launch).
_SPLIT_BELOW_PROGRAMS_PER_SM = 2
_MIN_SPLIT_K = 1024


@triton.jit
def _x_values(x_ptr, xs_ptr, k0, K, Cp, X_PACKED: tl.constexpr, EVEN_K: tl.constexpr, USE_ASM: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """FP32 ``[BLOCK_K]``: the exact values (E2M1 x E4M3, global scale not applied) of ``x[k0:k0 + BLOCK_K]``, zero
    past K; from the packed row and its 128x4 scale words (X_PACKED) or from its exact FP16 decode."""
    if X_PACKED:
        NB: tl.constexpr = BLOCK_K // 16
        p_ptrs = x_ptr + (k0 // 2 + tl.arange(0, BLOCK_K // 2))[None, :]
        s_row = swizzled_word_row(tl.zeros((1,), tl.int32), Cp)
        s_ptrs = xs_ptr + s_row[:, None] + (k0 // 64 + tl.arange(0, NB // 4))[None, :] * 128
        v = load_decode(p_ptrs, s_ptrs, k0, K, Cp, 1, NB, EVEN_K, USE_ASM).to(tl.float32) * 128.0
        return tl.reshape(v, (BLOCK_K,))
    else:
        offs = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            return tl.load(x_ptr + offs).to(tl.float32)
        else:
            return tl.load(x_ptr + offs, mask=offs < K, other=0.0).to(tl.float32)


@triton.jit
def _pairwise_columns(acc, BLOCK_N: tl.constexpr, HALVINGS: tl.constexpr):
    """``[BLOCK_N, 2^HALVINGS]`` -> ``[BLOCK_N]``: adjacent columns added, HALVINGS times (a fixed order)."""
    s = acc
    for _ in tl.static_range(HALVINGS):
        even, odd = tl.split(tl.reshape(s, (BLOCK_N, s.shape[1] // 2, 2)))
        s = even + odd
    return tl.reshape(s, (BLOCK_N,))


@triton.jit
def _nvfp4_gemv_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, alpha_ptr, bias_ptr, out_ptr, N, K, stride_wn, Cp, k_chunk,
    X_PACKED: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, USE_ASM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HALVINGS: tl.constexpr, PDL: tl.constexpr,
):
    """Outputs ``[pid0 * BLOCK_N, +BLOCK_N)`` over K range ``[pid1 * k_chunk, +k_chunk)``.

    x_ptr: the activation row, packed uint8 ``[1, K/2]`` (X_PACKED, with xs_ptr its 128x4 scale words) or its FP16
    decode ``[1, K]``; w_ptr: packed uint8 ``[N, K/2]``; ws_ptr: W's 128x4 scales as int32 words; alpha_ptr:
    FP32 ``[1]``; bias_ptr: ``[N]`` in the output dtype (HAS_BIAS); out_ptr: ``[1, N]``, or with SPLIT the FP32
    workspace ``[splits, 1, N]``. Cp = round_up(K/16, 4); k_chunk is a multiple of BLOCK_K = 2^HALVINGS.
    """
    wait_for_prior_grids(PDL)
    NB: tl.constexpr = BLOCK_K // 16
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = tl.minimum(offs_n, N - 1)  # clamped, not masked: those rows feed only outputs that are not stored
    k_lo = tl.program_id(1) * k_chunk
    k_hi = min(K, k_lo + k_chunk)
    w_rows = w_ptr + rows_n.to(tl.int64)[:, None] * stride_wn
    ws_rows = ws_ptr + swizzled_word_row(rows_n, Cp)[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        w_ptrs = w_rows + (k0 // 2 + tl.arange(0, BLOCK_K // 2))[None, :]
        ws_ptrs = ws_rows + (k0 // 64 + tl.arange(0, NB // 4))[None, :] * 128
        w = load_decode(w_ptrs, ws_ptrs, k0, K, Cp, BLOCK_N, NB, EVEN_K, USE_ASM).to(tl.float32)  # * 2^-7
        x = _x_values(x_ptr, xs_ptr, k0, K, Cp, X_PACKED, EVEN_K, USE_ASM, BLOCK_K)
        acc = tl.fma(w, x[None, :], acc)  # the product is exact: one rounding, as a multiply then an add would
    sums = _pairwise_columns(acc, BLOCK_N, HALVINGS) * 128.0  # undo 2^-7 (exact)
    mask = offs_n < N
    if SPLIT:
        tl.store(out_ptr + tl.program_id(1).to(tl.int64) * N + offs_n, sums, mask=mask)
    else:
        out = linear_epilogue(sums[None, :], alpha_ptr, bias_ptr, offs_n, N, out_ptr.dtype.element_ty, HAS_BIAS)
        tl.store(out_ptr + offs_n[None, :], out, mask=mask[None, :])


def gemv_splits(n: int, k: int, sms: int, forced: int | None = None) -> tuple[int, int]:
    """(splits, K elements per split) for ``N x K``: split K in ranges of at least ``_MIN_SPLIT_K`` when the
    ``BLOCK_N`` tiles alone give fewer than ``_SPLIT_BELOW_PROGRAMS_PER_SM`` programs per SM, or in about ``forced``
    ranges (tests, benchmarks). A function of the shape and the SM count only, so it fixes the summation order."""
    if forced is None:
        splits = max(1, min(cdiv(_SPLIT_BELOW_PROGRAMS_PER_SM * sms, cdiv(n, GEMV_BLOCK_N)), k // _MIN_SPLIT_K))
        if splits == 1:
            return 1, k
    else:
        splits = max(1, forced)
    chunk = cdiv(cdiv(k, splits), GEMV_BLOCK_K) * GEMV_BLOCK_K
    return cdiv(k, chunk), chunk


def gemv_reference(
    x_values: torch.Tensor, w_values: torch.Tensor, alpha: torch.Tensor, out_dtype: torch.dtype,
    bias: torch.Tensor | None = None, splits: int | None = None, sms: int = 132,
) -> torch.Tensor:
    """The bytes of ``nvfp4_gemv`` in torch, on any device: its sums in its order (module docstring).

    x_values: FP32 ``[K]`` and w_values: FP32 ``[N, K]``, the operands' exact decoded values (E2M1 x E4M3, global
    scales not applied); alpha FP32 one element; bias ``[N]`` in ``out_dtype`` or None; ``splits`` as for
    ``nvfp4_gemv`` (default ``gemv_splits`` for ``sms`` SMs). Returns ``[1, N]`` in ``out_dtype``.
    """
    n, k = w_values.shape
    count, chunk = gemv_splits(n, k, sms, splits)
    total = None
    for split in range(count):
        acc = torch.zeros(n, GEMV_BLOCK_K, dtype=torch.float32, device=w_values.device)
        for lo in range(split * chunk, min(k, (split + 1) * chunk), GEMV_BLOCK_K):
            hi = min(k, lo + GEMV_BLOCK_K)
            step = torch.zeros_like(acc)
            step[:, : hi - lo] = w_values[:, lo:hi] * x_values[lo:hi]  # exact products
            acc = acc + step
        while acc.shape[1] > 1:
            acc = acc[:, 0::2] + acc[:, 1::2]
        total = acc[:, 0] if total is None else total + acc[:, 0]
    assert total is not None
    out = (total * alpha.reshape(())).to(out_dtype)[None, :]
    return out if bias is None else out + bias


def nvfp4_gemv(
    x: torch.Tensor, w_packed: torch.Tensor, w_scales: torch.Tensor, alpha: torch.Tensor,
    out_dtype: torch.dtype | None = None, *, x_scales: torch.Tensor | None = None,
    bias: torch.Tensor | None = None, splits: int | None = None, tile: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """The NVFP4 product of one activation row with a packed weight: ``[1, N]`` in ``out_dtype`` (default BF16).

    Args:
        x: the row as packed uint8 ``[1, K/2]`` (with ``x_scales``, 128x4) or as its exact FP16 decode ``[1, K]``
            (``quantize_nvfp4_decoded``); contiguous.
        w_packed: uint8 ``[N, K/2]``; w_scales: its 128x4 scales (uint8 or float8_e4m3fn, checked by the caller).
        alpha: FP32 one element; bias: ``[N]`` in ``out_dtype`` or None, added as torch's ``out + bias`` would.
        splits: force the K split count (tests, benchmarks); default ``gemv_splits``.
        tile: (BLOCK_N, BLOCK_K, warps, stages) instead of the module's (benchmarks). BLOCK_N, warps and stages do not
            change a byte; a BLOCK_K other than ``GEMV_BLOCK_K`` sums in another order (``gemv_reference`` then
            does not apply).
    Both forms give the same bytes; they are those of ``gemv_reference``.
    """
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    n, k = w_packed.shape[0], 2 * w_packed.shape[1]
    device = w_packed.device
    bias = None if bias is None else bias.contiguous()  # the kernel reads it at unit stride
    out = torch.empty((1, n), dtype=out_dtype, device=device)
    count, chunk = gemv_splits(n, k, sm_count(device) if device.type == "cuda" else 132, splits)
    target = torch.empty((count, 1, n), dtype=torch.float32, device=device) if count > 1 else out
    args, meta = _launch_arguments(x, x_scales, w_packed, w_scales, alpha, bias, target, chunk, tile)
    launch_by_site(_nvfp4_gemv_kernel, (cdiv(n, meta["BLOCK_N"]), count), *args, **meta)
    if count > 1:
        split_reduce(target, alpha, args[5], out, 1, n, count, bias is not None)
    return out


def _launch_arguments(x, x_scales, w_packed, w_scales, alpha, bias, target, chunk, tile=None):
    """(positional arguments, keyword arguments) of one ``_nvfp4_gemv_kernel`` launch into
    ``target`` (the output, or the split workspace)."""
    n, k = w_packed.shape[0], 2 * w_packed.shape[1]
    packed = x.dtype == torch.uint8
    w_words = scale_words(w_scales)
    xs_arg = scale_words(x_scales) if packed and x_scales is not None else w_words  # unread without X_PACKED
    bias_arg = alpha if bias is None else bias  # unread without HAS_BIAS
    args = (x, xs_arg, w_packed, w_words, alpha, bias_arg, target, n, k, w_packed.stride(0), w_scales.shape[1], chunk)
    block_n, block_k, warps, stages = tile or (GEMV_BLOCK_N, GEMV_BLOCK_K, GEMV_WARPS, GEMV_STAGES)
    meta = dict(X_PACKED=packed, SPLIT=target.dim() == 3, HAS_BIAS=bias is not None and target.dim() == 2,
                EVEN_K=k % block_k == 0, USE_ASM=use_asm_split(w_packed), BLOCK_N=block_n, BLOCK_K=block_k,
                HALVINGS=block_k.bit_length() - 1, num_warps=warps, num_stages=stages, enable_fp_fusion=False,
                **pdl_options(w_packed.device))
    return args, meta


class GemvLaunch:
    """``nvfp4_gemv`` on an FP16 row for one class of calls without split (a layer's tensors), launched without its
    wrapper (``launch.DirectLaunch``): ``run`` writes the bytes of the wrapper's call."""

    __slots__ = ("direct", "grid", "before_out_tail", "after_out", "n", "out_dtype", "device")

    def __init__(self, direct: DirectLaunch, tail: tuple, args: tuple, grid: tuple[int, int],
                 out_dtype: torch.dtype, device: torch.device) -> None:
        self.direct, self.grid = direct, grid
        self.before_out_tail = tuple(a.data_ptr() for a in args[1:6])
        self.after_out = (*args[7:], *tail)
        self.n, self.out_dtype, self.device = args[7], out_dtype, device

    def run(self, x_address: int, out: torch.Tensor, stream: int) -> torch.Tensor:
        """``out`` ``[1, N]`` = the product for the FP16 row at ``x_address``."""
        self.direct.run(self.grid, stream, x_address, *self.before_out_tail, out.data_ptr(), *self.after_out)
        return out


def gemv_launch(x16: torch.Tensor, w_packed: torch.Tensor, w_scales: torch.Tensor, alpha: torch.Tensor,
                out: torch.Tensor, bias: torch.Tensor | None) -> GemvLaunch | None:
    """The ``GemvLaunch`` of a call ``nvfp4_gemv(x16, ..., bias=bias)`` on an FP16 row (default split and tile) that
    just ran and wrote ``out``, or None where it split K or its binary cannot be launched directly."""
    n, k = w_packed.shape[0], 2 * w_packed.shape[1]
    count, chunk = gemv_splits(n, k, sm_count(out.device))
    if count > 1:
        return None
    args, meta = _launch_arguments(x16, None, w_packed, w_scales, alpha, bias, out, chunk)
    recorded = site_binary(_nvfp4_gemv_kernel, args, meta)
    if recorded is None or recorded[0].descriptor_meta is not None:
        return None
    return GemvLaunch(recorded[0], recorded[1], args, (cdiv(n, GEMV_BLOCK_N), 1), out.dtype, out.device)
