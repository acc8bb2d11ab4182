"""CPU check of the fused Qwen-Image residual-norm-quantize kernel under the Triton interpreter.

torch's CPU LayerNorm is a different algorithm from its CUDA kernel, so it is not the oracle here. The oracle is an
FP32 emulation (numpy) of torch's CUDA ``vectorized_layer_norm_kernel`` written from its source, thread by thread:
Welford per element with a correctly rounded ``1/count``, exact FMAs, ``WARP_SHFL_DOWN`` over offsets 16..1 on every
lane, then the shared-memory merge of warps 2,3 into 0,1 and 1 into 0. The interpreter cannot run
``rsqrt.approx.f32``, so both the kernel (``approx_rsqrt=False``) and the emulation use a correctly rounded rsqrt;
everything else is the GPU kernel's arithmetic. Compared byte for byte: residual_out (also against torch's eager
chain), packed values and every scale byte (against ``format.quantize_nvfp4`` of the emulated ``m``, precise mode).

The kernel runs in a subprocess because TRITON_INTERPRET must be set before triton is imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed, so the Qwen kernel interpreter tests did not run; "
                             "CI installs it with .[test]")

EPS = 1e-6


# ---------------------------------------------------------------------------------------------------------------
# Emulation of torch's CUDA LayerNorm (bf16 in, FP32 statistics, bf16 out), independent of the kernel's code.
# ---------------------------------------------------------------------------------------------------------------


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Exact FP32 fused multiply-add: a*b is exact in FP64; the FP64 sum is rounded to odd, then to FP32 (correct)."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c64 = c.astype(np.float64)
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)  # TwoSum: p + c == s + err exactly
    even = (s.view(np.int64) & 1) == 0
    odd_s = np.where((err != 0) & even, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return odd_s.astype(np.float32)


def _combine(own, other, mean_fma=0):
    """cuWelfordCombine(dataB=own, dataA=other); each side is (mean, sigma2, count) FP32 arrays.

    mean_fma: 0 = ``nA*mean_A + nB*mean_B`` without FMA, 1 = fma(nA, mean_A, nB*mean_B), 2 = fma(nB, mean_B, nA*mean_A).
    """
    m_b, s_b, c_b = own
    m_a, s_a, c_a = other
    delta = m_b - m_a
    count = c_a + c_b
    coef = np.float32(1.0) / count
    n_a = c_a * coef
    n_b = c_b * coef
    if mean_fma == 1:
        mean = fma32(n_a, m_a, n_b * m_b)
    elif mean_fma == 2:
        mean = fma32(n_b, m_b, n_a * m_a)
    else:
        mean = n_a * m_a + n_b * m_b
    sigma2 = fma32((delta * delta) * c_a, n_b, s_a + s_b)
    return mean, sigma2, count


def cuda_layer_norm_stats(
    x: torch.Tensor, eps: float, thread_order: str = "torch", mean_fma: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """x: ``[M, D]`` bfloat16, D % 512 == 0 -> FP32 (mean, rstd) ``[M]`` as torch's CUDA kernel computes them.

    ``thread_order="blocked"`` gives thread t the contiguous elements ``[t*D/128, (t+1)*D/128)`` instead: a wrong
    kernel, used to show that the comparison can fail.
    """
    xf = x.float().numpy()
    rows, d = xf.shape
    threads = np.arange(128)
    per_thread = d // 128
    mean = np.zeros((rows, 128), np.float32)
    m2 = np.zeros((rows, 128), np.float32)
    count = np.zeros((rows, 128), np.float32)
    for k in range(per_thread):
        if thread_order == "torch":
            idx = 4 * (threads + 128 * (k // 4)) + k % 4  # thread t reads vectors t, t+128, ... of 4 elements
        else:
            idx = threads * per_thread + k
        v = xf[:, idx]
        delta = v - mean
        count = count + np.float32(1.0)
        new_mean = fma32(delta, np.float32(1.0) / count, mean)
        m2 = fma32(delta, v - new_mean, m2)
        mean = new_mean
    state = [a.reshape(rows, 4, 32) for a in (mean, m2, count)]  # thread t = (warp t // 32, lane t % 32)
    lanes = np.arange(32)
    for offset in (16, 8, 4, 2, 1):
        src = np.where(lanes + offset < 32, lanes + offset, lanes)  # __shfl_down_sync keeps the own value past 31
        state = list(_combine(tuple(state), tuple(a[:, :, src] for a in state), mean_fma))
    warps = [tuple(a[:, w, 0] for a in state) for w in range(4)]  # lane 0 of each warp
    for offset in (2, 1):
        for w in range(offset):
            warps[w] = _combine(warps[w], warps[w + offset], mean_fma)
    row_mean, sigma2, _ = warps[0]
    var = sigma2 / np.float32(d)
    rstd = (1.0 / np.sqrt((var + np.float32(eps)).astype(np.float64))).astype(np.float32)  # correctly rounded
    return row_mean, rstd


def cuda_layer_norm_emulation(x: torch.Tensor, eps: float, thread_order: str = "torch") -> torch.Tensor:
    """``F.layer_norm(x, (D,), eps=eps)`` (no affine) as torch's CUDA kernel computes it, x ``[M, D]`` bfloat16."""
    row_mean, rstd = cuda_layer_norm_stats(x, eps, thread_order)
    y = rstd[:, None] * (x.float().numpy() - row_mean[:, None])
    return torch.from_numpy(y).to(torch.bfloat16)


def emulated_reference(residual, x, bias, gate, scale, shift, g, eps):
    """Eager chain with the emulated CUDA LayerNorm + precise standalone quantize."""
    from diffusers_nvfp4_fast.format import quantize_nvfp4
    from diffusers_nvfp4_fast.fused_reference import broadcast_rows, qwen_residual_chain

    r, _ = qwen_residual_chain(residual, x, bias, gate, scale, shift, eps)
    n = cuda_layer_norm_emulation(r.reshape(-1, r.shape[-1]), eps).reshape(r.shape)
    m = n * (1 + broadcast_rows(scale, n)) + broadcast_rows(shift, n)
    packed, scales = quantize_nvfp4(m.reshape(-1, m.shape[-1]), g, scale_layout="128x4", fast_math=False)
    return r, packed, scales


def edge_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows that stress the statistics: zero, constant, tiny, huge, a single spike, BF16 subnormals."""
    x = x.clone()
    pattern = torch.arange(x.shape[0]) % 6
    x[pattern == 0] = 0.0
    x[pattern == 1] = 3.140625
    x[pattern == 2] *= 1e-30
    x[pattern == 3] *= 1e15
    x[pattern == 4] = 0.0
    x[pattern == 4, x.shape[1] // 3] = 1000.0
    x[pattern == 5] *= 1e-39
    return x


def make_inputs(b, l_len, d, dist, per_token, seed):
    gen = torch.Generator().manual_seed(seed)
    residual = torch.randn(b, l_len, d, generator=gen)
    if dist == "large-offset":
        residual = residual * 30 + 5
    elif dist == "activation-like":
        residual = residual * torch.rand(d, generator=gen) * 10 + torch.randn(d, generator=gen) * 3
    elif dist == "edge-rows":
        residual = edge_rows(residual.reshape(-1, d)).reshape(b, l_len, d)
    x = torch.randn(b, l_len, d, generator=gen).bfloat16()
    bias = torch.randn(d, generator=gen).bfloat16()
    # Modulation params as diffusers makes them: chunks (views) of one mod_params tensor; different per sample.
    mod = (torch.randn(b, l_len if per_token else 1, 3 * d, generator=gen) * 0.5).bfloat16()
    if not per_token:
        mod = mod[:, 0]
    shift, scale, gate = mod.chunk(3, dim=-1)
    return residual.bfloat16(), x, bias, gate, scale, shift


# ---------------------------------------------------------------------------------------------------------------
# Worker: runs in a subprocess with TRITON_INTERPRET=1.
# ---------------------------------------------------------------------------------------------------------------


def _worker() -> dict:
    import warnings

    from diffusers_nvfp4_fast.kernels.qwen_resnorm_quantize import layer_norm_torch_exact, qwen_resnorm_quantize

    from diffusers_nvfp4_fast.fused_reference import qwen_residual_chain

    warnings.filterwarnings("ignore", category=RuntimeWarning)  # 1/0 on all-zero blocks, masked by the epilogue

    # Poison every output allocation so that a byte the kernel forgets to write (scale padding included) shows up.
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.numel():
            t.view(torch.uint8).fill_(0x5A)
        return t

    torch.empty = poisoned_empty
    results = {}
    g = torch.tensor([2688.0 / 5.0])  # 448 * 6 / amax with amax = 5
    cases = [
        # name, B, L, D, distribution, per-token params, bias, strided rows
        ("b2-randn-bias", 2, 3, 512, "randn", False, True, False),
        ("b1-large-offset-nobias-pertoken-d1024", 1, 5, 1024, "large-offset", True, False, False),
        ("b2-activation-strided", 2, 2, 512, "activation-like", False, True, True),
        ("b1-129rows-two-scale-tiles", 1, 129, 512, "randn", False, True, False),
        ("b2-edge-rows-pertoken", 2, 6, 512, "edge-rows", True, True, False),
        # D >= 2048: whole 16-blocks per thread, then the rest split 8 (D=3072) or 4 (D=2560) elements per thread.
        ("b2-edge-rows-d3072", 2, 2, 3072, "edge-rows", False, True, False),
        ("b1-activation-pertoken-d2560", 1, 3, 2560, "activation-like", True, True, False),
    ]
    for name, b, l_len, d, dist, per_token, with_bias, strided in cases:
        residual, x, bias, gate, scale, shift = make_inputs(b, l_len, d, dist, per_token, seed=len(results))
        if not with_bias:
            x = (x + bias)  # already biased
            bias = None
        if strided:  # rows of a wider buffer, as a [B, L, 2D] tensor sliced to D columns would give
            residual = torch.cat([residual, residual], dim=-1)[..., :d]
            x = torch.cat([x, x], dim=-1)[..., d:]
        r, packed, scales = qwen_resnorm_quantize(residual, x, bias, gate, scale, shift, g, eps=EPS, fast_math=False)
        er, ep, es = emulated_reference(residual, x, bias, gate, scale, shift, g, EPS)
        eager_r, _ = qwen_residual_chain(residual, x, bias, gate, scale, shift, EPS)
        results[name] = {
            "residual_vs_eager": torch.equal(r, eager_r),
            "residual": torch.equal(r, er),
            "packed": torch.equal(packed, ep),
            "scales": torch.equal(scales, es),
            "packed_mismatch": int((packed != ep).sum()) if packed.shape == ep.shape else -1,
            "scale_shape": list(scales.shape),
        }

    gen = torch.Generator().manual_seed(7)
    ln_in = {
        "randn": torch.randn(24, 1536, generator=gen),
        "large-offset": torch.randn(24, 1536, generator=gen) * 30 + 5,
        "edge-rows": edge_rows(torch.randn(24, 1536, generator=gen)),
    }
    for name, xin in ln_in.items():
        xin = xin.bfloat16()
        y, mean, rstd = layer_norm_torch_exact(xin, EPS, return_stats=True)
        ref = cuda_layer_norm_emulation(xin, EPS)
        ref_mean, ref_rstd = cuda_layer_norm_stats(xin, EPS)
        wrong_mean, wrong_rstd = cuda_layer_norm_stats(xin, EPS, thread_order="blocked")
        results[f"ln-{name}"] = {
            "equal": torch.equal(y.view(torch.int16), ref.view(torch.int16)),
            "mismatch": int((y.view(torch.int16) != ref.view(torch.int16)).sum()),
            "stats_mismatch": int((mean.numpy() != ref_mean).sum() + (rstd.numpy() != ref_rstd).sum()),
            "wrong_order_stats_mismatch": int((wrong_mean != ref_mean).sum() + (wrong_rstd != ref_rstd).sum()),
        }
    # The three ways nvcc may have rounded the combined mean: the kernel's variants against the emulation's, on rows of
    # BF16 subnormals whose means are subnormal and off the BF16 grid (D/128 = 12 is not a power of two).
    xin = (torch.randn(16, 1536, generator=gen) * 1e-39).bfloat16()
    variant_means = []
    for variant in (0, 1, 2):
        _, mean, rstd = layer_norm_torch_exact(xin, EPS, return_stats=True, mean_fma=variant)
        ref_mean, ref_rstd = cuda_layer_norm_stats(xin, EPS, mean_fma=variant)
        mismatch = int((mean.numpy() != ref_mean).sum() + (rstd.numpy() != ref_rstd).sum())
        results[f"mean-fma-{variant}"] = {"stats_mismatch": mismatch}
        variant_means.append(ref_mean)
    results["mean-fma-variants-differ"] = bool(
        (variant_means[0] != variant_means[1]).any() and (variant_means[0] != variant_means[2]).any()
        and (variant_means[1] != variant_means[2]).any()
    )
    return results


@pytest.fixture(scope="module")
def interpreter_results():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--worker"], env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_fma32_is_exact():
    a = np.array([1.0 + 2.0**-12], np.float32)  # a * a = 1 + 2^-11 + 2^-24: exactly halfway between two FP32 values
    assert fma32(a, a, np.array([-1.0], np.float32))[0] == np.float32(2.0**-11 + 2.0**-24)  # one rounding, not two
    # A tiny addend decides the tie; a plain FP64 a*b+c would round to the tie and then to even (1 + 2^-11) both times.
    assert fma32(a, a, np.array([2.0**-60], np.float32))[0] == np.float32(1.0 + 2.0**-11 + 2.0**-23)
    assert fma32(a, a, np.array([-(2.0**-60)], np.float32))[0] == np.float32(1.0 + 2.0**-11)


@pytest.mark.parametrize(
    "case",
    [
        "b2-randn-bias", "b1-large-offset-nobias-pertoken-d1024", "b2-activation-strided", "b1-129rows-two-scale-tiles",
        "b2-edge-rows-pertoken", "b2-edge-rows-d3072", "b1-activation-pertoken-d2560",
    ],
)
def test_fused_kernel_matches_cuda_emulation(interpreter_results, case):
    res = interpreter_results[case]
    assert res["residual_vs_eager"], res
    assert res["residual"], res
    assert res["packed"], res
    assert res["scales"], res


@pytest.mark.parametrize("dist", ["randn", "large-offset", "edge-rows"])
def test_layer_norm_matches_cuda_emulation(interpreter_results, dist):
    res = interpreter_results[f"ln-{dist}"]
    assert res["equal"], res
    assert res["stats_mismatch"] == 0, res  # FP32 mean and rstd bit for bit, not only the BF16 output


@pytest.mark.parametrize("variant", [0, 1, 2])
def test_mean_contraction_variants_match_emulation(interpreter_results, variant):
    # The GPU test uses these variants to find out how torch's binary rounds the combined mean.
    assert interpreter_results[f"mean-fma-{variant}"]["stats_mismatch"] == 0


def test_subnormal_rows_tell_the_mean_variants_apart(interpreter_results):
    assert interpreter_results["mean-fma-variants-differ"]


@pytest.mark.parametrize("dist", ["randn", "large-offset"])
def test_comparison_detects_a_wrong_reduction_order(interpreter_results, dist):
    # The same statistics accumulated in another order (each thread reading a contiguous run) change FP32 mean/rstd
    # bits in many rows, so the statistics comparison above can fail. (BF16 outputs hide most of it.)
    assert interpreter_results[f"ln-{dist}"]["wrong_order_stats_mismatch"] > 0


if __name__ == "__main__" and "--worker" in sys.argv:
    print(json.dumps(_worker()))
