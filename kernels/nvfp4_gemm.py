"""NVFP4 x NVFP4 GEMM for GPUs without FP4 tensor cores (SM80-SM90), in Triton.

``out[M, N] = out_dtype((sum_k x[m, k] * w[n, k]) * alpha)`` where ``x`` and ``w`` are NVFP4 (E2M1 values, one E4M3
scale per 16 values of a row, 128x4-swizzled scales; docs/design.md §3) and ``alpha`` is an FP32 scalar tensor.

Why it is exact: an E2M1 value (<= 2 significant bits) times an E4M3 scale (<= 4 significant bits) has at most 6
significant bits and lies in [2^-10, 2688], so it is exact in FP16 (and BF16), and the product of two such numbers
is exact in FP32. Decoding both operands to 16-bit floats and running a tensor-core MMA with FP32 accumulation
therefore adds exactly the terms of the torch emulation (``ops.emulated_nvfp4_gemm``); only the FP32 summation
order differs. The MMA runs in FP16 rather than BF16: same exactness, same tensor-core rate, FP16 multiplies can
apply the scale to a decoded pair in one instruction, and Triton's interpreter (CPU tests) computes BF16 dots
wrongly (triton 3.9) but FP16 dots correctly.

Shape of the work:

* The weight stays packed in memory (N*K/2 bytes + scales); each K step decodes a ``[BLOCK_N, BLOCK_K]`` tile in
  registers. No BF16/FP16 weight copy exists at any time.
* Large M (``M > PREDECODE_MAX_M``): X is decoded once per call into an FP16 ``[M, K]`` scratch (a memory-bound
  pass, a small fraction of the GEMM) and the GEMM loads it like a dense operand. Decoding X inside the GEMM instead
  would redo it for every one of the N/BLOCK_N weight tiles and double the ALU work per MMA. The scratch has the size
  the activation had in BF16 before it was quantized; it is never the weight.
  On SM90 this GEMM is ``nvfp4_gemm_sm90`` (Gluon, warp-specialized), which overlaps the weight decode with
  asynchronous wgmma, the decode of X included about as fast as cuBLAS BF16.
  The Triton kernel below serves SM80/SM89, K % 32 != 0 and misaligned operands, with identical output bytes: its
  decoded tile is either the MMA's register A operand of ``W @ X^T`` (``W_IN_REGS``, 256 tokens per tile) or the
  shared-memory B operand of ``X @ W^T``; in both, Triton (3.6, SM90 SASS) waits for each wgmma before the next
  tile is decoded, so decode and MMA do not overlap. Figures: docs/performance.md, "Measurements behind the
  kernels' design".
* One row: ``nvfp4_gemv`` (CUDA cores, its own fixed summation order; ``kernel="triton"`` keeps this module's).
* Small M (``M <= PREDECODE_MAX_M``): X is decoded in the kernel too, and the kernel computes the transposed tile
  ``W @ X^T`` so that weight rows fill the MMA's 64-row side and the few tokens its cheap N side ("swap AB").
  When there are too few weight tiles to fill the GPU, K is split over a second grid axis; the FP32 partial sums
  go to a workspace and a second kernel adds them in split order (deterministic, no atomics).
* Deterministic: the result depends only on (M, N, K) and the device. Every config walks K in the same order in
  16-wide MMA steps, and the split count is a function of the shape, not of the config; the GPU tests check that
  all configs give identical bytes.

Configs (tile sizes, warps, pipeline depth of the Triton kernel) are data: ``gemm_configs.json``, per GPU
architecture and shape class (variant ``packed`` or ``fp16_x``, M bucket, N, K), written offline by
``benchmarks/tune_gemm_configs.py`` and looked up at the first call of each key (``gemm_config_table``). A class
without an entry takes the default rule, a function of the variant and the M bucket only: among the candidates whose
tile is no taller than ``max(16, M bucket)`` (else the first shortest), the first of the tallest. Nothing is timed on
the user's machine; ``DIFFUSERS_NVFP4_GEMM_AUTOTUNE=1`` runs Triton's autotuner over the candidates at the first call
of each key instead. The config never changes a byte, only the speed. Under the interpreter (CPU) the kernel runs
the variant's smallest tile.

Decoding (integer arithmetic and one FP16 multiply; no lookup table, no FP8 cast, so the interpreter runs it):
* E2M1 code ``s eem`` -> FP16 bits ``s<<15 | eem<<9`` = ``value * 2^-14`` (codes 0/1 land on FP16 subnormals,
  mirroring E2M1's own subnormal). Both nibbles of a byte ``b`` are built at once in one 32-bit word:
  ``(b * 0x00200200) & 0x0E000E00`` places the magnitudes, ``(b * 0x01001000) & 0x80008000`` the signs.
* E4M3 byte ``s eeee mmm`` -> FP16 bits ``s<<15 | eeeemmm<<7`` = ``scale * 2^-8``, times 2^15 -> ``scale * 2^7``
  (exact, <= 57344). One FP16 multiply gives ``value * scale * 2^-7`` exactly (magnitude in [2^-17, 21]; the
  2^-7 keeps the scale operand below FP16's maximum). The epilogue multiplies the FP32 accumulator by 2^7 per
  decoded operand (exact) and then by alpha (one rounding, like the emulation's ``result * alpha``).
* E4M3 NaN bytes (0x7F/0xFF) decode to NaN, as in torch; quantizers never write them. Scale padding (rows past
  M/N, columns past K/16) is never read into the result, so its bytes do not matter.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch
import triton
import triton.language as tl

from .caches import declare
from .gemm_config_table import arch_name, gemm_configs, m_bucket, prune, shipped_config
from .launch import INTERPRETING, cdiv, cuda_capability, launch, launch_by_site, sm_count
from .nvfp4_decode import (
    linear_epilogue,
    load_decode,
    scale_words,
    split_reduce,
    swizzled_word_row,
    use_asm_split,
)
from .nvfp4_gemv import nvfp4_gemv
from .tiling import grouped_tile

__all__ = ["nvfp4_gemm", "nvfp4_gemm_fp16_x", "decode_nvfp4_rows", "gemm_configs", "launch_config", "split_k_for",
           "PREDECODE_MAX_M"]

# Up to this many rows X is decoded inside the GEMM ("swap AB" kernel); above, once per call into FP16 scratch.
PREDECODE_MAX_M = 64
# Split-K granularity: a multiple of every config's BLOCK_K, so split boundaries never cut a K step.
_SPLIT_QUANTUM = 256
# Smallest K range worth a split of its own.
_MIN_SPLIT_K = 1024


# ---------------------------------------------------------------------------------------------------------------
# The GEMM kernel.
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _nvfp4_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, alpha_ptr, bias_ptr, out_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, Cp, k_chunk, m_bucket,
    X_PACKED: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr, USE_ASM: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr, W_IN_REGS: tl.constexpr,
):
    """One ``[BLOCK_M, BLOCK_N]`` output tile over K range ``[pid1 * k_chunk, (pid1 + 1) * k_chunk)``.

    x_ptr: packed uint8 ``[M, K/2]`` (X_PACKED) or exact FP16 ``[M, K]``; xs_ptr: X's 128x4 scales as int32 words
    (X_PACKED only); w_ptr: packed uint8 ``[N, K/2]``; ws_ptr: W's 128x4 scales as int32 words; alpha_ptr: FP32
    ``[1]``; bias_ptr: ``[N]`` in the output dtype (HAS_BIAS; added after SPLIT's reduce); out_ptr: ``[M, N]`` (or,
    with SPLIT, the FP32 workspace ``[splits, M, N]`` of unscaled partial sums).
    Cp = round_up(K/16, 4); k_chunk is a multiple of 256. m_bucket only keys the (opt-in) autotuner.
    W_IN_REGS (FP16-X variant): the decoded weight tile is the MMA's register A operand and the transposed tile
    ``W @ X^T`` is accumulated (the packed-X variant always works this way); otherwise it is the shared-memory B
    operand of ``X @ W^T``.
    """
    SWAP: tl.constexpr = X_PACKED or W_IN_REGS
    NB: tl.constexpr = BLOCK_K // 16  # scale blocks per K step (a multiple of 4)
    HALF_K: tl.constexpr = BLOCK_K // 2  # packed bytes per row per K step

    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_N)
    k_lo = tl.program_id(1) * k_chunk
    k_hi = min(K, k_lo + k_chunk)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    # Rows past the end of X or W are clamped to the last row instead of masked: they only feed output rows and
    # columns that are never stored, and unmasked loads need no per-iteration predicates.
    rows_n = tl.minimum(offs_n, N - 1)
    rows_m = tl.minimum(offs_m, M - 1)
    kbytes = k_lo // 2 + tl.arange(0, HALF_K)
    kwords = k_lo // 64 + tl.arange(0, NB // 4)

    w_ptrs = w_ptr + rows_n.to(tl.int64)[:, None] * stride_wn + kbytes[None, :]
    ws_ptrs = ws_ptr + swizzled_word_row(rows_n, Cp)[:, None] + kwords[None, :] * 128
    if X_PACKED:
        x_ptrs = x_ptr + rows_m.to(tl.int64)[:, None] * stride_xm + kbytes[None, :]
        xs_ptrs = xs_ptr + swizzled_word_row(rows_m, Cp)[:, None] + kwords[None, :] * 128
    else:
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rows_m.to(tl.int64)[:, None] * stride_xm + (k_lo + offs_k)[None, :]
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # transposed tile ("swap AB")
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    for k0 in range(k_lo, k_hi, BLOCK_K):
        w_tile = load_decode(w_ptrs, ws_ptrs, k0, K, Cp, BLOCK_N, NB, EVEN_K, USE_ASM)  # [BN, BK] * 2^-7
        if X_PACKED:
            x_tile = load_decode(x_ptrs, xs_ptrs, k0, K, Cp, BLOCK_M, NB, EVEN_K, USE_ASM)  # [BM, BK] * 2^-7
            acc = tl.dot(w_tile, tl.trans(x_tile), acc)
            x_ptrs += HALF_K
            xs_ptrs += NB * 32
        else:
            if EVEN_K:
                x_tile = tl.load(x_ptrs)
            else:
                x_tile = tl.load(x_ptrs, mask=((k0 + offs_k) < K)[None, :], other=0.0)
            if W_IN_REGS:
                # Register A operand: the decoded tile goes straight from the decode into the MMA, no shared-memory
                # round trip; X streams through shared memory as B.
                acc = tl.dot(w_tile, tl.trans(x_tile), acc)
            else:
                # Shared-memory B operand: both operands come from shared memory and wgmma runs asynchronously.
                acc = tl.dot(x_tile, tl.trans(w_tile), acc)
            x_ptrs += BLOCK_K
        w_ptrs += HALF_K
        ws_ptrs += NB * 32  # NB/4 word columns of 128 words each

    # Undo 2^-7 per decoded operand (exact power-of-two scaling).
    acc = acc * (16384.0 if X_PACKED else 128.0)
    if SWAP:
        acc = tl.trans(acc)  # [BM, BN]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT:
        part_ptrs = out_ptr + tl.program_id(1).to(tl.int64) * M * N + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(part_ptrs, acc, mask=mask)
    else:
        out = linear_epilogue(acc, alpha_ptr, bias_ptr, offs_n, N, out_ptr.dtype.element_ty, HAS_BIAS)
        tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :], out, mask=mask)


# ---------------------------------------------------------------------------------------------------------------
# Standalone decode (large-M activations; also a GPU decode_nvfp4).
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _decode_rows_kernel(
    p_ptr, s_ptr, out_ptr, R, K, stride_pr, stride_or, Cp,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr,
):
    """packed uint8 ``[R, K/2]`` + 128x4 scales (int32 words) -> ``[R, K]`` = e2m1 * e4m3 exactly."""
    NB: tl.constexpr = BLOCK_K // 16
    k0 = tl.program_id(1) * BLOCK_K
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ld_rows = tl.minimum(rows, R - 1)
    p_ptrs = p_ptr + ld_rows.to(tl.int64)[:, None] * stride_pr + (k0 // 2 + tl.arange(0, BLOCK_K // 2))[None, :]
    s_ptrs = s_ptr + swizzled_word_row(ld_rows, Cp)[:, None] + (k0 // 64 + tl.arange(0, NB // 4))[None, :] * 128
    v = load_decode(p_ptrs, s_ptrs, k0, K, Cp, BLOCK_R, NB, False, USE_ASM) * 128.0  # exact: undo the 2^-7
    cols = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_or + cols[None, :], v.to(out_ptr.dtype.element_ty),
             mask=(rows < R)[:, None] & (cols < K)[None, :])


def _check_scales(scales: torch.Tensor, rows: int, k: int, name: str) -> None:
    want = (cdiv(rows, 128) * 128, cdiv(k // 16, 4) * 4)
    if (scales.dtype not in (torch.uint8, torch.float8_e4m3fn) or tuple(scales.shape) != want
            or not scales.is_contiguous()):
        raise ValueError(f"{name}: expected contiguous uint8/e4m3 128x4 scales of shape {want}, "
                         f"got {scales.dtype} {tuple(scales.shape)}")


def decode_nvfp4_rows(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """GPU ``format.decode_nvfp4``: packed uint8 ``[R, K/2]`` + 128x4 scales uint8 ``[round_up(R,128),
    round_up(K/16,4)]`` -> ``[R, K]`` ``e2m1 * e4m3`` in ``dtype`` (FP16 default, BF16 or FP32).

    Exact, so byte-identical to ``format.decode_nvfp4(packed, scales, scale_layout="128x4", dtype=dtype)``.
    """
    dtype = torch.float16 if dtype is None else dtype
    rows, half_k = packed.shape
    k = 2 * half_k
    _check_scales(scales, rows, k, "scales")
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"decode_nvfp4_rows: unsupported dtype {dtype}")
    packed = packed if packed.stride(1) == 1 else packed.contiguous()
    out = torch.empty((rows, k), dtype=dtype, device=packed.device)
    if rows == 0 or k == 0:
        return out
    block_r, block_k = 32, 256
    grid = (cdiv(rows, block_r), cdiv(k, block_k))
    launch(_decode_rows_kernel, grid, packed, scale_words(scales), out, rows, k, packed.stride(0), out.stride(0),
           scales.shape[1], BLOCK_R=block_r, BLOCK_K=block_k, USE_ASM=use_asm_split(packed), num_warps=4)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Configs and autotuning.
# ---------------------------------------------------------------------------------------------------------------


# Candidates, buckets and the shipped table: gemm_config_table.py. The autotuner below runs only where
# DIFFUSERS_NVFP4_GEMM_AUTOTUNE is enabled (module docstring, "Configs").
AUTOTUNE_VAR = "DIFFUSERS_NVFP4_GEMM_AUTOTUNE"


def _fast_bench(fn, quantiles=None):
    # Short timing runs keep autotuning of all benchmark shapes within a minute or two.
    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)


def _even_k(args) -> bool:
    return args["K"] % args["BLOCK_K"] == 0


def _make_tuned(x_packed: bool):
    fn = triton.heuristics({"EVEN_K": _even_k})(_nvfp4_gemm_kernel)
    return triton.autotune(
        configs=gemm_configs(x_packed), key=["m_bucket", "N", "K"],
        prune_configs_by={"early_config_prune": prune}, do_bench=_fast_bench,
    )(fn)


_tuned_packed = _make_tuned(True)
_tuned_fp16_x = _make_tuned(False)


@functools.cache
def sm90_kernel_module():
    """The Gluon SM90 kernel module, or None (with one warning) when this Triton lacks the Gluon Hopper API.

    Without it large-M GEMMs run the Triton kernel: same bytes, slower (docs/performance.md, "Measurements behind
    the kernels' design").
    """
    try:
        from . import nvfp4_gemm_sm90
    except (ImportError, AttributeError) as exc:
        warnings.warn(f"diffusers-nvfp4-fast: the SM90 Gluon GEMM is unavailable with triton {triton.__version__} "
                      f"({exc}); large-M NVFP4 GEMMs use the slower Triton kernel (same output bytes)", stacklevel=3)
        return None
    return nvfp4_gemm_sm90


def sm90_kernel_for(m: int, k: int, w_packed: torch.Tensor, w_scales: torch.Tensor, x_decode: str = "auto",
                    kernel: str = "auto", config: triton.Config | None = None):
    """The Gluon SM90 kernel module ``nvfp4_gemm`` runs for a call with these arguments, or None when it runs the
    Triton kernel (M rows, K columns)."""
    predecode = x_decode == "predecode" or (x_decode == "auto" and m > PREDECODE_MAX_M)
    if not predecode or kernel == "triton" or config is not None or (kernel == "auto" and INTERPRETING):
        return None
    sm90 = sm90_kernel_module()
    return sm90 if sm90 is not None and sm90.sm90_supported(k, w_packed, w_scales) else None


def split_k_for(m: int, n: int, k: int, sm_count: int) -> tuple[int, int]:
    """(splits, K elements per split) for the small-M kernel; (1, K) when splitting would not help.

    A function of the shape and the SM count only (never of the config), so the summation order and hence the
    output bytes do not depend on which config runs. Aims at ~2 CTAs per SM counting
    128-row weight tiles, with at least 1024 K elements per split.
    """
    if m > PREDECODE_MAX_M:
        return 1, k
    tiles = cdiv(n, 128)
    splits = max(1, min((2 * sm_count) // tiles, k // _MIN_SPLIT_K))
    if splits == 1:
        return 1, k
    chunk = cdiv(cdiv(k, splits), _SPLIT_QUANTUM) * _SPLIT_QUANTUM
    splits = cdiv(k, chunk)
    return (splits, chunk) if splits > 1 else (1, k)


# ---------------------------------------------------------------------------------------------------------------
# Host entry point.
# ---------------------------------------------------------------------------------------------------------------


def _check_gemm_args(x_packed, x_scales, w_packed, w_scales, alpha, out_dtype, x_decode, config, kernel):
    """Refuse bad operands and options with a message naming them; returns (M, N, K)."""
    if x_packed.dim() != 2 or w_packed.dim() != 2 or x_packed.shape[1] != w_packed.shape[1]:
        raise ValueError(f"nvfp4_gemm: packed operands must be [M, K/2] and [N, K/2], got "
                         f"{tuple(x_packed.shape)} and {tuple(w_packed.shape)}")
    if x_packed.dtype != torch.uint8 or w_packed.dtype != torch.uint8:
        raise TypeError("nvfp4_gemm: packed operands must be uint8")
    _check_out_and_alpha("nvfp4_gemm", out_dtype, alpha, x_packed.device)
    if x_decode not in ("auto", "in_kernel", "predecode"):
        raise ValueError(f"nvfp4_gemm: x_decode must be 'auto', 'in_kernel' or 'predecode', got {x_decode!r}")
    if kernel not in ("auto", "triton", "sm90", "gemv"):
        raise ValueError(f"nvfp4_gemm: kernel must be 'auto', 'triton', 'sm90' or 'gemv', got {kernel!r}")
    if kernel == "sm90" and config is not None:
        raise ValueError("nvfp4_gemm: config is a Triton-kernel config; it cannot be combined with kernel='sm90'")
    m, half_k = x_packed.shape
    n = w_packed.shape[0]
    k = 2 * half_k
    if k % 16:
        raise ValueError(f"nvfp4_gemm: K={k} is not a multiple of 16")
    _check_scales(x_scales, m, k, "x_scales")
    _check_scales(w_scales, n, k, "w_scales")
    if not (x_scales.device == w_packed.device == w_scales.device == x_packed.device):
        raise ValueError("nvfp4_gemm: all operands must be on the same device")
    return m, n, k


def _check_out_and_alpha(fn: str, out_dtype: torch.dtype, alpha: torch.Tensor, device: torch.device) -> None:
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{fn}: unsupported out_dtype {out_dtype}")
    if alpha.numel() != 1 or alpha.dtype != torch.float32 or alpha.device != device:
        raise ValueError(f"{fn}: alpha must be a one-element float32 tensor on {device}, got "
                         f"{alpha.dtype} {tuple(alpha.shape)} on {alpha.device}")


def check_bias(bias: torch.Tensor | None, n: int, out_dtype: torch.dtype, device: torch.device) -> None:
    """Refuse a bias the epilogue cannot add as torch's ``out + bias`` would (shape, dtype, device named)."""
    if bias is None:
        return
    if bias.shape != (n,) or bias.dtype != out_dtype or bias.device != device:
        raise ValueError(f"nvfp4_gemm: bias must be [{n}] {out_dtype} on {device} (the output's dtype, so that the "
                         f"add rounds as torch's does), got {tuple(bias.shape)} {bias.dtype} on {bias.device}")


def _triton_gemm(x_packed, x_scales, w_packed, w_scales, alpha, bias, out, x16, predecode, split_k, config):
    """The Triton kernel (X decoded in the kernel, or pre-decoded ``x16``), split K where it pays, into ``out``.
    ``x_packed`` may be None when ``x16`` is given (its scales are then unused)."""
    args, flags, grid, target, splits = _kernel_call(x_packed, x_scales, w_packed, w_scales, alpha, bias, out, x16,
                                                     predecode, split_k)
    if config is None and (INTERPRETING or not w_packed.is_cuda):
        # The interpreter: the smallest tile of the variant (the fastest to interpret; the bytes are the same).
        config = min(gemm_configs(not predecode), key=lambda c: (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]))
    if config is None:
        _configured_launch(predecode, grid, args, flags)
    else:
        kw = dict(config.kwargs)
        _nvfp4_gemm_kernel[grid](*args, **flags, EVEN_K=args[9] % kw["BLOCK_K"] == 0, **kw,
                                 num_warps=config.num_warps, num_stages=config.num_stages)
    if splits > 1:
        split_reduce(target, alpha, args[5], out, args[7], args[8], splits, bias is not None)
    return out


def _kernel_call(x_packed, x_scales, w_packed, w_scales, alpha, bias, out, x16, predecode, split_k):
    """(the kernel's runtime arguments, its flags, its grid of a config's meta, the tensor it writes: ``out`` or the
    split-K workspace, the split count) for ``_triton_gemm``'s call."""
    m, k = x16.shape if predecode else (x_packed.shape[0], 2 * x_packed.shape[1])
    n, device, cp = w_packed.shape[0], w_packed.device, w_scales.shape[1]
    use_asm = use_asm_split(w_packed)
    w_words = scale_words(w_scales)
    if predecode:
        x_arg, xs_arg, stride_x = x16, w_words, x16.stride(0)  # xs_ptr is unused by this variant
        splits, chunk = 1, k
    else:
        x_arg, xs_arg, stride_x = x_packed, scale_words(x_scales), x_packed.stride(0)
        sms = sm_count(device) if device.type == "cuda" else 132
        splits, chunk = split_k_for(m, n, k, sms)
        if split_k is not None:
            chunk = cdiv(cdiv(k, max(1, split_k)), _SPLIT_QUANTUM) * _SPLIT_QUANTUM
            splits = cdiv(k, chunk)
    target = torch.empty((splits, m, n), dtype=torch.float32, device=device) if splits > 1 else out
    bias_arg = alpha if bias is None else bias  # unread without HAS_BIAS
    args = (x_arg, xs_arg, w_packed, w_words, alpha, bias_arg, target,
            m, n, k, stride_x, w_packed.stride(0), out.stride(0), cp, chunk, m_bucket(m))
    flags = dict(X_PACKED=not predecode, SPLIT=splits > 1, USE_ASM=use_asm, HAS_BIAS=bias is not None and splits == 1)

    def grid(meta):
        return (cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]), splits)

    return args, flags, grid, target, splits


# (variant, M bucket, N, K, the dtypes that vary, device index) -> the config launched for that key.
_CHOSEN: dict[tuple, triton.Config] = declare("kernels.nvfp4_gemm.chosen_configs", {}, "one entry per launch key "
                                              "(shipped, default rule or autotuned); kept for the process")


def gpu_arch(device: torch.device) -> str:
    """The shipped table's architecture key of a CUDA device (``sm_90``)."""
    return arch_name(cuda_capability(device))


def autotune_enabled() -> bool:
    """``DIFFUSERS_NVFP4_GEMM_AUTOTUNE`` (declared in diffusers_nvfp4_fast/switches.py): time the candidates on this
    machine at the first call of each key instead of reading the shipped table. Read at that first call."""
    return os.environ.get(AUTOTUNE_VAR, "").strip().lower() not in ("", "0", "false", "off", "no")


def launch_config(x_packed: bool, m: int, n: int, k: int, device: torch.device) -> triton.Config:
    """The config the Triton kernel launches for an (M, N, K) call on a CUDA ``device`` without the autotuner: the
    shipped table's entry for the shape class, else the default rule (``gemm_config_table``). Times nothing."""
    return shipped_config(gpu_arch(device), x_packed, m_bucket(m), n, k)[0]


def _configured_launch(predecode: bool, grid, args: tuple, flags: dict) -> None:
    """The kernel with the config of its key: looked up at the first call of the key (``launch_config``; with
    ``DIFFUSERS_NVFP4_GEMM_AUTOTUNE`` the autotuner times the candidates instead and launches the best), then
    launched by specialization key (``launch.launch_by_site``), past the autotuner's and the heuristics' per-call
    Python. Same kernel, same config: the same binary and bytes."""
    x_arg, bias_arg, target = args[0], args[5], args[6]
    n, k, bucket = args[8], args[9], args[15]
    choice_key = (predecode, bucket, n, k, x_arg.dtype, bias_arg.dtype, target.dtype, x_arg.device.index)
    config = _CHOSEN.get(choice_key)
    if config is None:
        if autotune_enabled():
            tuned = _tuned_fp16_x if predecode else _tuned_packed
            tuned[grid](*args, **flags)
            best = getattr(tuned, "best_config", None)
            if isinstance(best, triton.Config) and best.pre_hook is None:
                _CHOSEN[choice_key] = best
            return
        config = shipped_config(gpu_arch(x_arg.device), not predecode, bucket, n, k)[0]
        _CHOSEN[choice_key] = config
    meta = config.all_kwargs()
    launch_by_site(_nvfp4_gemm_kernel, grid(meta), *args, **flags, EVEN_K=k % meta["BLOCK_K"] == 0, **meta)


def nvfp4_gemm(
    x_packed: torch.Tensor,
    x_scales: torch.Tensor,
    w_packed: torch.Tensor,
    w_scales: torch.Tensor,
    alpha: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    *,
    x_decode: str = "auto",
    split_k: int | None = None,
    config: triton.Config | None = None,
    kernel: str = "auto",
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """NVFP4 W4A4 GEMM: ``out_dtype((decode(x) @ decode(w).T) * alpha)`` (+ bias), with ``decode = e2m1 * e4m3``.

    Args:
        x_packed: uint8 ``[M, K/2]``, low nibble first (element 2j in the low nibble of byte j); K % 16 == 0.
        x_scales: uint8 (or float8_e4m3fn) 128x4-swizzled ``[round_up(M,128), round_up(K/16,4)]``.
        w_packed: uint8 ``[N, K/2]``.
        w_scales: uint8 (or float8_e4m3fn) 128x4-swizzled ``[round_up(N,128), round_up(K/16,4)]``.
        alpha: FP32 tensor with one element, read inside the kernel (no host sync; CUDA-graph safe).
        out_dtype: ``torch.bfloat16`` (default), ``torch.float16`` or ``torch.float32``.
        x_decode: ``"auto"`` (in the GEMM when ``M <= PREDECODE_MAX_M``, else once into an FP16 scratch),
            ``"in_kernel"`` or ``"predecode"``.
        split_k: force the number of K splits of the in-kernel-X variant (tests); default ``split_k_for(...)``.
        config: run this ``triton.Config`` instead of the shape class's (tests, ``benchmarks/tune_gemm_configs.py``).
        kernel: ``"auto"`` (one row: ``nvfp4_gemv``; else the SM90 Gluon kernel for pre-decoded X where it applies,
            else the Triton kernel), ``"triton"`` (always the Triton kernel), ``"sm90"`` (the Gluon kernel, or
            ``ValueError``) or ``"gemv"`` (``nvfp4_gemv``, one row only). The tensor-core kernels give the same bytes
            as each other; the one-row kernel sums in its own fixed order (``nvfp4_gemv``), so ``"auto"`` depends on
            the shape only.
        bias: ``[N]`` in ``out_dtype``, or None. Added in the epilogue with the bytes of torch's ``out + bias``.

    Returns:
        ``[M, N]`` in ``out_dtype``: the FP32 sum equals ``ops.emulated_nvfp4_gemm`` up to summation order, then one
        rounding for alpha and one for ``out_dtype``. Same bytes on every call for the same inputs and device.
    """
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    m, n, k = _check_gemm_args(x_packed, x_scales, w_packed, w_scales, alpha, out_dtype, x_decode, config, kernel)
    check_bias(bias, n, out_dtype, x_packed.device)
    x_packed = x_packed if x_packed.stride(1) == 1 else x_packed.contiguous()
    w_packed = w_packed if w_packed.stride(1) == 1 else w_packed.contiguous()

    out = torch.empty((m, n), dtype=out_dtype, device=x_packed.device)
    if m == 0 or n == 0 or k == 0:
        return _empty_product(out, bias)
    device = x_packed.device
    predecode = x_decode == "predecode" or (x_decode == "auto" and m > PREDECODE_MAX_M)
    if kernel == "sm90" and not predecode:
        raise ValueError(f"nvfp4_gemm: kernel='sm90' needs the pre-decoded X path (M > {PREDECODE_MAX_M} or "
                         f"x_decode='predecode'), got M={m}, x_decode={x_decode!r}")
    if kernel == "gemv" or (m == 1 and kernel == "auto" and x_decode == "auto" and config is None and split_k is None):
        if m != 1 or config is not None or x_decode != "auto":
            raise ValueError(f"nvfp4_gemm: kernel='gemv' takes one row and no config or x_decode, got M={m}")
        fused = bias.contiguous() if bias is not None else None
        return nvfp4_gemv(x_packed, w_packed, w_scales, alpha, out_dtype, x_scales=x_scales, bias=fused,
                          splits=split_k)
    sm90 = sm90_kernel_for(m, k, w_packed, w_scales, x_decode, kernel, config)
    if kernel == "sm90" and sm90 is None:
        raise ValueError(f"nvfp4_gemm: kernel='sm90' does not take these operands (needs an SM90 GPU, "
                         f"K % 32 == 0 and 16-byte aligned tensors; got K={k} on {device})")
    # Exact FP16 values of X, decoded once (memory-bound) instead of once per weight tile.
    x16 = decode_nvfp4_rows(x_packed, x_scales, torch.float16) if predecode else None
    return _run(sm90, x_packed, x_scales, w_packed, w_scales, alpha, bias, out, x16, predecode, split_k, config)


def _empty_product(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The result of an empty GEMM (M, N or K zero): zeros, plus the bias as torch adds it."""
    return out.zero_() if bias is None or out.numel() == 0 else out.zero_() + bias


def _run(sm90, x_packed, x_scales, w_packed, w_scales, alpha, bias, out, x16, predecode, split_k, config):
    """The chosen kernel into ``out``, the bias in its epilogue where it is 16-bit. With FP32 output the compiler
    would contract ``sums * alpha + bias`` into one FMA (no rounding between), so torch adds that bias after."""
    fused = bias.contiguous() if bias is not None and out.dtype != torch.float32 else None
    if sm90 is not None:
        out = sm90.nvfp4_gemm_sm90(x16, w_packed, w_scales, alpha, out, bias=fused)
    else:
        out = _triton_gemm(x_packed, x_scales, w_packed, w_scales, alpha, fused, out, x16, predecode, split_k, config)
    return out if bias is None or fused is not None else out.add_(bias)


def nvfp4_gemm_fp16_x(
    x16: torch.Tensor, w_packed: torch.Tensor, w_scales: torch.Tensor, alpha: torch.Tensor,
    out_dtype: torch.dtype | None = None, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``nvfp4_gemm`` on an activation already decoded to its exact FP16 values (``decode_nvfp4_rows``, or the
    fused ``quantize_nvfp4_decoded``): the pre-decoded kernels of ``nvfp4_gemm``, so the bytes equal
    ``nvfp4_gemm(x_packed, x_scales, ..., x_decode="predecode")``.

    Args:
        x16: FP16 ``[M, K]``, contiguous, every value an exact E2M1 x E4M3 product; K % 16 == 0.
        w_packed, w_scales, alpha, out_dtype, bias: as for ``nvfp4_gemm``.
    Returns:
        ``[M, N]`` in ``out_dtype``.
    """
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    if x16.dim() != 2 or x16.dtype != torch.float16 or not x16.is_contiguous():
        raise ValueError(f"nvfp4_gemm_fp16_x: x16 must be a contiguous 2-D float16 tensor, got "
                         f"{tuple(x16.shape)} {x16.dtype}")
    m, k = x16.shape
    if w_packed.dim() != 2 or w_packed.dtype != torch.uint8 or 2 * w_packed.shape[1] != k or k % 16:
        raise ValueError(f"nvfp4_gemm_fp16_x: w_packed must be uint8 [N, K/2] with K={k} a multiple of 16, got "
                         f"{tuple(w_packed.shape)} {w_packed.dtype}")
    n = w_packed.shape[0]
    _check_scales(w_scales, n, k, "w_scales")
    _check_out_and_alpha("nvfp4_gemm_fp16_x", out_dtype, alpha, x16.device)
    check_bias(bias, n, out_dtype, x16.device)
    w_packed = w_packed if w_packed.stride(1) == 1 else w_packed.contiguous()
    out = torch.empty((m, n), dtype=out_dtype, device=x16.device)
    if m == 0 or n == 0 or k == 0:
        return _empty_product(out, bias)
    sm90 = sm90_kernel_for(m, k, w_packed, w_scales, "predecode")
    return _run(sm90, None, None, w_packed, w_scales, alpha, bias, out, x16, True, None, None)
