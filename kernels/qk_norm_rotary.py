"""Qwen-Image query/key RMSNorm and rotary embedding in one pass, with the bytes of diffusers' eager CUDA ops.

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

import torch
import triton
import triton.language as tl

from .launch import INTERPRETING, cdiv, launch
from .rounding import SOFT_CONVERT, narrow_bf16, rsqrt_like_torch, sum_of_products, widen_bf16

HEAD_DIM = 128
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
def _complex_product(a, b, c, d, REAL_FMA: tl.constexpr, IMAG_FMA: tl.constexpr):
    """``(a + bi) * (c + di)`` as c10::complex<float> computes ``(a*c - b*d, a*d + b*c)``; REAL_FMA / IMAG_FMA: 0 = no
    contraction, 1 = the first product fused (``fma(a, c, -(b*d))``, ``fma(a, d, b*c)``), 2 = the second."""
    # a*c - b*d == a*c + (-b)*d in every rounding: negation is exact
    return sum_of_products(a, c, -b, d, REAL_FMA), sum_of_products(a, d, b, c, IMAG_FMA)


@triton.jit
def _qk_norm_rotary_kernel(
    x_ptr, w_ptr, freqs_ptr, out_ptr, mean_ptr, rows, S, H, eps,
    BLOCK_R: tl.constexpr, APPROX_RSQRT: tl.constexpr, REAL_FMA: tl.constexpr, IMAG_FMA: tl.constexpr,
    SOFT_BF16: tl.constexpr, WRITE_MEAN: tl.constexpr, TREE: tl.constexpr,
):
    D: tl.constexpr = 128
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # row = (batch, position, head)
    pos = (r // H) % S
    cols = tl.arange(0, D)
    ok = (r < rows)[:, None]
    offs = r[:, None].to(tl.int64) * D + cols[None, :]
    x = widen_bf16(tl.load(x_ptr + offs, mask=ok, other=0.0), SOFT_BF16)
    mean = _sum_of_squares(x, BLOCK_R, TREE) * 0.0078125  # MeanOps: the sum times 1/128 (exact)
    if WRITE_MEAN:  # tests: the reduction tree, seen directly
        tl.store(mean_ptr + r, mean, mask=r < rows)
    rstd = rsqrt_like_torch(mean + eps, APPROX_RSQRT)
    n = widen_bf16(narrow_bf16(x * rstd[:, None], SOFT_BF16), SOFT_BF16)
    w = widen_bf16(tl.load(w_ptr + cols), SOFT_BF16)
    y = widen_bf16(narrow_bf16(n * w[None, :], SOFT_BF16), SOFT_BF16)
    a, b = tl.split(tl.reshape(y, [BLOCK_R, D // 2, 2]))
    f_offs = pos[:, None].to(tl.int64) * D + cols[None, :]  # freqs as FP32 [S, D/2, 2] (cos, sin)
    f = tl.load(freqs_ptr + f_offs, mask=ok, other=0.0)
    c, d = tl.split(tl.reshape(f, [BLOCK_R, D // 2, 2]))
    real, imag = _complex_product(a, b, c, d, REAL_FMA, IMAG_FMA)
    out = tl.reshape(tl.join(narrow_bf16(real, SOFT_BF16), narrow_bf16(imag, SOFT_BF16)), [BLOCK_R, D])
    tl.store(out_ptr + offs, out.to(tl.int16, bitcast=True), mask=ok)  # bits: the interpreter's BF16 stores differ


def qk_norm_rotary_triton(
    x: torch.Tensor, weight: torch.Tensor, freqs: torch.Tensor, eps: float, *, real_fma: int = 1, imag_fma: int = 1,
    tree: int = 1, approx_rsqrt: bool | None = None, block_r: int = 16, num_warps: int = 4,
    mean_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x ``[B, S, H, 128]`` BF16 (rows contiguous), weight BF16 ``[128]``, freqs complex64 ``[S, 64]`` ->
    ``[B, S, H, 128]`` BF16: ``apply_rotary_emb_qwen(RMSNorm(x), freqs, use_real=False)`` (module docstring).

    real_fma / imag_fma: the complex product's FMA forms (``_complex_product``; torch 2.11: 1 and 1); tree: the
    shuffle tree of the mean (``_pair_sums``; torch 2.11's CUDA build: 1, earlier builds: 0); approx_rsqrt: None =
    ``rsqrt.approx.f32`` except under ``TRITON_INTERPRET=1``, where inline PTX cannot run; mean_out: FP32
    ``[B * S * H]`` that receives each row's mean of squares (tests).
    """
    if x.dim() != 4 or x.shape[-1] != HEAD_DIM or x.dtype != torch.bfloat16:
        raise ValueError(f"qk_norm_rotary_triton: x must be [B, S, H, 128] bf16, got {tuple(x.shape)} {x.dtype}")
    b, seq, heads, d = x.shape
    if weight.shape != (d,) or weight.dtype != torch.bfloat16:
        raise ValueError(f"qk_norm_rotary_triton: weight must be bf16 [{d}], got {tuple(weight.shape)} {weight.dtype}")
    if freqs.shape != (seq, d // 2) or freqs.dtype != torch.complex64:
        raise ValueError(f"qk_norm_rotary_triton: freqs must be complex64 [{seq}, {d // 2}], got "
                         f"{tuple(freqs.shape)} {freqs.dtype}")
    x, table = x.contiguous(), torch.view_as_real(freqs.contiguous())
    out = torch.empty_like(x)
    rows = b * seq * heads
    launch(
        _qk_norm_rotary_kernel, (cdiv(rows, block_r),),
        x, weight.contiguous(), table, out.view(torch.int16), out if mean_out is None else mean_out, rows, seq, heads,
        eps, BLOCK_R=block_r, APPROX_RSQRT=not INTERPRETING if approx_rsqrt is None else approx_rsqrt,
        REAL_FMA=real_fma, IMAG_FMA=imag_fma, SOFT_BF16=bool(SOFT_CONVERT), WRITE_MEAN=mean_out is not None, TREE=tree,
        num_warps=num_warps, enable_fp_fusion=False,
    )
    return out
