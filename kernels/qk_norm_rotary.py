"""Query/key RMSNorm and rotary embedding in one pass, with the bytes of diffusers' eager CUDA ops: Qwen-Image
(``qk_norm_rotary_triton``) and FLUX.2 (``flux2_qk_norm_rotary_triton``, torch's fused RMSNorm and the real-valued
rotary embedding; same reduction).

diffusers 0.42.1 (``RMSNorm`` with a BF16 weight, then ``apply_rotary_emb_qwen(x, freqs, use_real=False)``) runs ten
torch kernels over FP32 copies of each query and key. Per row of D = 128 values (one head of one token), the rounding
points are (docs/design.md §6, "Qwen-Image QK norm and rotary"):
```
s   = sum of fl(x_i * x_i)          # torch's mean(-1): per thread ((s0 + s1) + s2) + s3 over 4 adjacent values,
                                    # then the 32 thread sums in a tree (TREE 1: halves, shuffle offsets 16..1,
                                    # torch 2.11; TREE 0: adjacent pairs, offsets 1..16, torch before PR #164790)
r   = rsqrtf(fl(s * 2^-7) + eps)    # rsqrt.approx.f32, as torch.rsqrt
n   = bf16(x * r)                    # FP32 product, rounded by .to(bf16)
y   = bf16(n * w)                    # BF16 weight
out = bf16(complex(y0, y1) * complex(cos, sin))   # c10::complex<float> product, FMA forms per REAL_FMA / IMAG_FMA
```
The tree and the FMA forms were read off the sm_90 machine code of torch 2.11.0+cu130 (``FFMA re, a, c, -(b*d)``,
``FFMA im, a, d, b*c``; ``SHFL.DOWN`` at offsets 16 to 1); ``benchmarks/bench_qk_norm_rotary.py`` checks each stage
against torch on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import INTERPRETING, cdiv, launch, launch_by_site
from .rounding import SOFT_CONVERT, narrow_bf16, negate, rsqrt_like_torch, sum_of_products, widen_bf16

__all__ = ["flux2_qk_norm_rotary_triton", "qk_norm_rotary_triton", "qwen_rotary_triton"]

HEAD_DIM = 128
# Rows and warps per program of the norm kernels (the tile measured on the GPU). Triton keeps the reduction tree in
# every thread's registers, so a smaller tile repeats less work and compiles faster with the same bytes; which tile
# runs fastest is for `bench_qk_norm_rotary.py --tiles` to say (docs/performance.md, "Cheaper compiles").
NORM_BLOCK_R, NORM_WARPS = 16, 4
FMA_FORMS = [(real, imag) for real in range(3) for imag in range(3)]  # (REAL_FMA, IMAG_FMA) of _complex_product


@triton.jit
def _pair_sums(t, ROWS: tl.constexpr, N: tl.constexpr, TREE: tl.constexpr):
    """[ROWS, N] -> [ROWS, N // 2], one level of a shuffle-down tree: element j is t[2j] + t[2j + 1] (TREE 0: offsets
    1, 2, ..., 16) or t[j] + t[j + N/2] (TREE 1: offsets 16, 8, ..., 1)."""
    if TREE == 0:
        first, second = tl.split(tl.reshape(t, [ROWS, N // 2, 2]))
    else:
        first, second = tl.split(tl.permute(tl.reshape(t, [ROWS, 2, N // 2]), (0, 2, 1)))
    return first + second


@triton.jit
def _sum_of_squares(x, BLOCK_R: tl.constexpr, TREE: tl.constexpr):
    """Row sums of ``fl(x * x)`` over 128 columns in torch's CUDA reduction order (module docstring)."""
    sq = x * x
    lo, hi = tl.split(tl.reshape(sq, [BLOCK_R, 32, 2, 2]))  # lo: values 0 and 2 of each thread, hi: 1 and 3
    v0, v2 = tl.split(lo)
    v1, v3 = tl.split(hi)
    t = ((v0 + v1) + v2) + v3  # [BLOCK_R, 32]: one sum per thread
    t = _pair_sums(t, BLOCK_R, 32, TREE)
    t = _pair_sums(t, BLOCK_R, 16, TREE)
    t = _pair_sums(t, BLOCK_R, 8, TREE)
    t = _pair_sums(t, BLOCK_R, 4, TREE)
    return tl.reshape(_pair_sums(t, BLOCK_R, 2, TREE), [BLOCK_R])


@triton.jit
def _load_rows(x_ptr, rows, S, H, BLOCK_R: tl.constexpr, SOFT_BF16: tl.constexpr):
    """This program's BLOCK_R rows of 128 (row = (batch, position, head)): (row, position, column, row mask, element
    offsets, the rows widened to FP32)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    pos = (r // H) % S
    cols = tl.arange(0, 128)
    ok = (r < rows)[:, None]
    offs = r[:, None].to(tl.int64) * 128 + cols[None, :]
    return r, pos, cols, ok, offs, widen_bf16(tl.load(x_ptr + offs, mask=ok, other=0.0), SOFT_BF16)


@triton.jit
def _complex_product(a, b, c, d, REAL_FMA: tl.constexpr, IMAG_FMA: tl.constexpr):
    """``(a + bi) * (c + di)`` as c10::complex<float> computes ``(a*c - b*d, a*d + b*c)``; REAL_FMA / IMAG_FMA: 0 = no
    contraction, 1 = the first product fused (``fma(a, c, -(b*d))``, ``fma(a, d, b*c)``), 2 = the second."""
    # a*c - b*d == a*c + (-b)*d in every rounding, signed zeros included: negation is exact
    return sum_of_products(a, c, negate(b), d, REAL_FMA), sum_of_products(a, d, b, c, IMAG_FMA)


# One binary for row counts divisible by 16 and not (Qwen-Image's image and text streams): the hint changes
# no code of this kernel (tests/test_specialization.py; docs/performance.md, "First image").
@triton.jit(do_not_specialize_on_alignment=["S"])
def _qk_norm_rotary_kernel(
    x_ptr, w_ptr, freqs_ptr, out_ptr, mean_ptr, rows, S, H, eps,
    BLOCK_R: tl.constexpr, APPROX_RSQRT: tl.constexpr, REAL_FMA: tl.constexpr, IMAG_FMA: tl.constexpr,
    SOFT_BF16: tl.constexpr, WRITE_MEAN: tl.constexpr, TREE: tl.constexpr, NORM: tl.constexpr = True,
):
    D: tl.constexpr = 128
    r, pos, cols, ok, offs, x = _load_rows(x_ptr, rows, S, H, BLOCK_R, SOFT_BF16)
    if NORM:
        mean = _sum_of_squares(x, BLOCK_R, TREE) * 0.0078125  # MeanOps: the sum times 1/128 (exact)
        if WRITE_MEAN:  # tests: the reduction tree, seen directly
            tl.store(mean_ptr + r, mean, mask=r < rows)
        rstd = rsqrt_like_torch(mean + eps, APPROX_RSQRT)
        n = widen_bf16(narrow_bf16(x * rstd[:, None], SOFT_BF16), SOFT_BF16)
        w = widen_bf16(tl.load(w_ptr + cols), SOFT_BF16)
        y = widen_bf16(narrow_bf16(n * w[None, :], SOFT_BF16), SOFT_BF16)
    else:  # the rotary embedding alone, of an already normed x (compiled models: inductor computes the norm)
        y = x
    a, b = tl.split(tl.reshape(y, [BLOCK_R, D // 2, 2]))
    f_offs = pos[:, None].to(tl.int64) * D + cols[None, :]  # freqs as FP32 [S, D/2, 2] (cos, sin)
    f = tl.load(freqs_ptr + f_offs, mask=ok, other=0.0)
    c, d = tl.split(tl.reshape(f, [BLOCK_R, D // 2, 2]))
    real, imag = _complex_product(a, b, c, d, REAL_FMA, IMAG_FMA)
    out = tl.reshape(tl.join(narrow_bf16(real, SOFT_BF16), narrow_bf16(imag, SOFT_BF16)), [BLOCK_R, D])
    tl.store(out_ptr + offs, out.to(tl.int16, bitcast=True), mask=ok)  # bits: the interpreter's BF16 stores differ


@triton.jit
def _flux2_qk_norm_rotary_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, rows, S, H, eps,
    BLOCK_R: tl.constexpr, APPROX_RSQRT: tl.constexpr, SOFT_BF16: tl.constexpr, TREE: tl.constexpr,
):
    """FLUX.2: torch's fused ``F.rms_norm`` (``out = bf16(fl(w * fl(rstd * x)))``, no rounding between) and
    diffusers' ``apply_rotary_emb(..., sequence_dim=1)`` (interleaved pairs, FP32 ``cos`` / ``sin`` ``[S, 128]``)."""
    D: tl.constexpr = 128
    r, pos, cols, ok, offs, x = _load_rows(x_ptr, rows, S, H, BLOCK_R, SOFT_BF16)
    rstd = rsqrt_like_torch(_sum_of_squares(x, BLOCK_R, TREE) * 0.0078125 + eps, APPROX_RSQRT)  # S / 128: exact
    w = widen_bf16(tl.load(w_ptr + cols), SOFT_BF16)
    y = widen_bf16(narrow_bf16(w[None, :] * (rstd[:, None] * x), SOFT_BF16), SOFT_BF16)
    t_offs = pos[:, None].to(tl.int64) * D + cols[None, :]
    c = tl.load(cos_ptr + t_offs, mask=ok, other=0.0)
    s = tl.load(sin_ptr + t_offs, mask=ok, other=0.0)
    y0, y1 = tl.split(tl.reshape(y, [BLOCK_R, D // 2, 2]))
    c0, c1 = tl.split(tl.reshape(c, [BLOCK_R, D // 2, 2]))
    s0, s1 = tl.split(tl.reshape(s, [BLOCK_R, D // 2, 2]))
    out0 = narrow_bf16(y0 * c0 + negate(y1) * s0, SOFT_BF16)  # three torch ops, three roundings (no contraction)
    out1 = narrow_bf16(y1 * c1 + y0 * s1, SOFT_BF16)
    out = tl.reshape(tl.join(out0, out1), [BLOCK_R, D])
    tl.store(out_ptr + offs, out.to(tl.int16, bitcast=True), mask=ok)


def _check_rows(name: str, x: torch.Tensor, weight: torch.Tensor | None) -> None:
    if x.dim() != 4 or x.shape[-1] != HEAD_DIM or x.dtype != torch.bfloat16:
        raise ValueError(f"{name}: x must be [B, S, H, 128] bf16, got {tuple(x.shape)} {x.dtype}")
    if weight is not None and (weight.shape != (HEAD_DIM,) or weight.dtype != torch.bfloat16):
        raise ValueError(f"{name}: weight must be bf16 [128], got {tuple(weight.shape)} {weight.dtype}")


def _qwen_operands(name: str, x: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(contiguous x, freqs as an FP32 ``[S, 64, 2]`` table, the fresh output) of a Qwen-Image kernel call, after
    checking that freqs is complex64 ``[S, 64]`` for x ``[B, S, H, 128]`` (checked by ``_check_rows``)."""
    seq, d = x.shape[1], x.shape[-1]
    if freqs.shape != (seq, d // 2) or freqs.dtype != torch.complex64:
        raise ValueError(f"{name}: freqs must be complex64 [{seq}, {d // 2}], got {tuple(freqs.shape)} {freqs.dtype}")
    x = x.contiguous()
    return x, torch.view_as_real(freqs.contiguous()), torch.empty_like(x)


def flux2_qk_norm_rotary_triton(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float, *, tree: int = 1,
    approx_rsqrt: bool | None = None, block_r: int = NORM_BLOCK_R, num_warps: int = NORM_WARPS,
) -> torch.Tensor:
    """x ``[B, S, H, 128]`` BF16, weight BF16 ``[128]``, cos / sin FP32 ``[S, 128]`` -> ``[B, S, H, 128]`` BF16:
    ``apply_rotary_emb(F.rms_norm(x, (128,), weight, eps), (cos, sin), sequence_dim=1)`` as torch 2.11 computes it on
    the GPU (its vectorized RMSNorm kernel: the sum of squares of ``qk_norm_rotary_triton``, tree included)."""
    _check_rows("flux2_qk_norm_rotary_triton", x, weight)
    b, seq, heads, d = x.shape
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (seq, d) or t.dtype != torch.float32:
            raise ValueError(f"flux2_qk_norm_rotary_triton: {name} must be FP32 [{seq}, {d}], got {tuple(t.shape)} "
                             f"{t.dtype}")
    x = x.contiguous()
    out = torch.empty_like(x)
    rows = b * seq * heads
    launch(
        _flux2_qk_norm_rotary_kernel, (cdiv(rows, block_r),),
        x, weight.contiguous(), cos.contiguous(), sin.contiguous(), out.view(torch.int16), rows, seq, heads, eps,
        BLOCK_R=block_r, APPROX_RSQRT=not INTERPRETING if approx_rsqrt is None else approx_rsqrt,
        SOFT_BF16=bool(SOFT_CONVERT), TREE=tree, num_warps=num_warps, enable_fp_fusion=False,
    )
    return out


def qk_norm_rotary_triton(
    x: torch.Tensor, weight: torch.Tensor, freqs: torch.Tensor, eps: float, *, real_fma: int = 1, imag_fma: int = 1,
    tree: int = 1, approx_rsqrt: bool | None = None, block_r: int = NORM_BLOCK_R, num_warps: int = NORM_WARPS,
    mean_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x ``[B, S, H, 128]`` BF16 (rows contiguous), weight BF16 ``[128]``, freqs complex64 ``[S, 64]`` ->
    ``[B, S, H, 128]`` BF16: ``apply_rotary_emb_qwen(RMSNorm(x), freqs, use_real=False)`` (module docstring).

    real_fma / imag_fma: the complex product's FMA forms (``_complex_product``; torch 2.11: 1 and 1); tree: the
    shuffle tree of the mean (``_pair_sums``; torch 2.11's CUDA build: 1, earlier builds: 0); approx_rsqrt: None =
    ``rsqrt.approx.f32`` except under ``TRITON_INTERPRET=1``, where inline PTX cannot run; mean_out: FP32
    ``[B * S * H]`` that receives each row's mean of squares (tests).
    """
    _check_rows("qk_norm_rotary_triton", x, weight)
    x, table, out = _qwen_operands("qk_norm_rotary_triton", x, freqs)
    b, seq, heads, _ = x.shape
    rows = b * seq * heads
    launch(
        _qk_norm_rotary_kernel, (cdiv(rows, block_r),),
        x, weight.contiguous(), table, out.view(torch.int16), out if mean_out is None else mean_out, rows, seq, heads,
        eps, BLOCK_R=block_r, APPROX_RSQRT=not INTERPRETING if approx_rsqrt is None else approx_rsqrt,
        REAL_FMA=real_fma, IMAG_FMA=imag_fma, SOFT_BF16=bool(SOFT_CONVERT), WRITE_MEAN=mean_out is not None, TREE=tree,
        num_warps=num_warps, enable_fp_fusion=False,
    )
    return out


def qwen_rotary_triton(x: torch.Tensor, freqs: torch.Tensor, *, real_fma: int = 1, imag_fma: int = 1,
                       block_r: int = 16, num_warps: int = 4) -> torch.Tensor:
    """x ``[B, S, H, 128]`` BF16, freqs complex64 ``[S, 64]`` -> ``[B, S, H, 128]`` BF16:
    ``apply_rotary_emb_qwen(x, freqs, use_real=False)`` (the last line of the module docstring's chain, alone)."""
    _check_rows("qwen_rotary_triton", x, None)
    x, table, out = _qwen_operands("qwen_rotary_triton", x, freqs)
    b, seq, heads, _ = x.shape
    rows = b * seq * heads
    # Keyed launch (a compiled Qwen-Image step makes 112 of these).
    launch_by_site(
        _qk_norm_rotary_kernel, (cdiv(rows, block_r),),
        x, x, table, out.view(torch.int16), out, rows, seq, heads, 0.0, BLOCK_R=block_r, APPROX_RSQRT=False,
        REAL_FMA=real_fma, IMAG_FMA=imag_fma, SOFT_BF16=bool(SOFT_CONVERT), WRITE_MEAN=False, TREE=1, NORM=False,
        num_warps=num_warps, enable_fp_fusion=False,
    )
    return out
