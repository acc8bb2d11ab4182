"""The fused (residual +) LayerNorm + modulate + NVFP4 quantize kernel (``kernels/layer_norm_quantize.py``).

CPU, under the Triton interpreter: torch's CPU LayerNorm is a different algorithm from its CUDA kernel, so the oracle
is an FP32 emulation (numpy) of torch's CUDA ``vectorized_layer_norm_kernel`` written from its source, thread by
thread: Welford per element with a correctly rounded ``1/count``, exact FMAs, ``WARP_SHFL_DOWN`` over offsets 16..1
on every lane, then the shared-memory merge of warps 2,3 into 0,1 and 1 into 0. The interpreter cannot run
``rsqrt.approx.f32``, so both the kernel (``approx_rsqrt=False``) and the emulation use a correctly rounded rsqrt,
and the kernel emulates the GPU's single-rounding FMA there (some Triton interpreters round ``tl.fma`` twice).
Compared byte for byte: residual_out (also against torch's eager chain), packed values and every scale byte
(against ``format.quantize_nvfp4`` of the emulated ``m``, precise mode), and the FP32 statistics; the decoded-output
and residual-free (adaptive LayerNorm) variants the same way.

CPU, ahead of time: the kernel builds for SM90 / SM100 / SM120, and its SM90 build keeps everything in registers.

GPU (``gpu``): the oracle is the eager chain on the GPU (``residual_norm_chain``: torch ops, each rounding to BF16,
torch's own CUDA LayerNorm) followed by a standalone quantize: ``format.quantize_nvfp4`` in precise mode, and the
standalone Triton quantize kernel in fast-math mode (the only place ``rcp.approx.ftz.f32`` runs the same way).
Outputs are allocated poisoned so that an unwritten byte cannot pass.
"""

from __future__ import annotations

import contextlib
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="Triton is not installed, so the Qwen kernel tests did not run; they run "
                                     "wherever Triton is installed, as in CI (pip install -e '.[test]')")
from diffusers_nvfp4_fast.format import decode_nvfp4  # noqa: E402
from diffusers_nvfp4_fast.format import quantize_nvfp4 as reference_quantize  # noqa: E402
from diffusers_nvfp4_fast.kernels import layer_norm_quantize as qmod  # noqa: E402
from diffusers_nvfp4_fast.kernels.quantize_nvfp4 import quantize_nvfp4_triton  # noqa: E402
from diffusers_nvfp4_fast.ops.layer_norm_quantize import ResNormInputs, modulate, residual_norm_chain  # noqa: E402
from support.emulation import fma32  # noqa: E402
from support.interpreter import run_interpreted  # noqa: E402

EPS = 1e-6  # Qwen-Image's LayerNorm eps
D = 3072  # Qwen-Image hidden size
DISTRIBUTIONS = ("randn", "activation-like", "large-offset", "edge-rows")


# ---------------------------------------------------------------------------------------------------------------
# CPU: ahead-of-time builds.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("capability,variant", [
    (90, "resnorm"), (90, "resnorm-decoded"), (90, "adaln"), (90, "adaln-decoded"), (100, "resnorm"),
    (100, "adaln-decoded"), (120, "resnorm"), (120, "adaln-decoded"), (90, "resnorm-noshift-decoded"),
    (100, "adaln-noshift"),
])
def test_compiles_ahead_of_time(capability, variant):
    """The fused Qwen kernel (whole-block and split-block quantize paths), with and without the residual add, packed
    or decoded, with or without the shift add (Qwen-Image 2.1), builds for Hopper and both Blackwell targets, with
    the hardware E2M1 conversion exactly on SM100+; it runs only where such a GPU exists."""
    from support.sass_count import compile_qwen_resnorm

    compiled = compile_qwen_resnorm(3072, capability, has_residual=variant.startswith("resnorm"),
                                    decoded=variant.endswith("decoded"), has_shift="noshift" not in variant)
    assert ("cvt.rn.satfinite.e2m1x2.f32" in compiled.asm["ptx"]) == (capability >= 100)
    assert len(compiled.asm["cubin"]) > 0


def test_sm90_build_prefetches_and_does_not_spill():
    """The fused Qwen kernel, compiled for sm_90 with its register cap, keeps every value in registers (no local
    memory) and issues the x/residual loads of several chunks before its first store (a load placed after a store
    that may alias it cannot be hoisted, which exposed one memory round trip per chunk)."""
    from support.sass_count import compile_qwen_resnorm, disassemble

    sass = disassemble(compile_qwen_resnorm(3072))
    ops = re.findall(r"\b(LDG|STG|LDL|STL)\.\S+", sass)
    assert "LDL" not in ops and "STL" not in ops, "the register cap made the compiler spill to local memory"
    loads_before_first_store = ops.index("STG")
    assert loads_before_first_store >= 8, f"only {loads_before_first_store} global loads before the first store"


# ---------------------------------------------------------------------------------------------------------------
# Emulation of torch's CUDA LayerNorm (bf16 in, FP32 statistics, bf16 out), independent of the kernel's code.
# ---------------------------------------------------------------------------------------------------------------


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
    """Eager chain with the emulated CUDA LayerNorm + precise standalone quantize (``shift`` None: no shift add)."""
    r, _ = residual_norm_chain(ResNormInputs(residual, x, bias, gate, scale, shift), eps)
    n = cuda_layer_norm_emulation(r.reshape(-1, r.shape[-1]), eps).reshape(r.shape)
    m = modulate(n, scale, shift)
    packed, scales = reference_quantize(m.reshape(-1, m.shape[-1]), g, scale_layout="128x4", fast_math=False)
    return r, packed, scales


def emulated_adaln_reference(x, scale, shift, g, eps):
    """norm1 + modulate with the emulated CUDA LayerNorm, then the precise standalone quantize."""
    n = cuda_layer_norm_emulation(x.reshape(-1, x.shape[-1]), eps).reshape(x.shape)
    m = modulate(n, scale, shift)
    return reference_quantize(m.reshape(-1, m.shape[-1]), g, scale_layout="128x4", fast_math=False)


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


def interpreted_qwen_resnorm() -> dict:
    import warnings

    from diffusers_nvfp4_fast.kernels.layer_norm_quantize import (
        adaln_quantize_triton,
        layer_norm_torch_exact,
        resnorm_quantize_triton,
    )

    def decoded(packed, scales):
        return decode_nvfp4(packed, scales, scale_layout="128x4", dtype=torch.float16).view(torch.int16)

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
        r, packed, scales = resnorm_quantize_triton(residual, x, bias, gate, scale, shift, g, eps=EPS,
                                                         fast_math=False)
        er, ep, es = emulated_reference(residual, x, bias, gate, scale, shift, g, EPS)
        eager_r, _ = residual_norm_chain(ResNormInputs(residual, x, bias, gate, scale, shift), EPS)
        results[name] = {
            "residual_vs_eager": torch.equal(r, eager_r),
            "residual": torch.equal(r, er),
            "packed": torch.equal(packed, ep),
            "scales": torch.equal(scales, es),
            "packed_mismatch": int((packed != ep).sum()) if packed.shape == ep.shape else -1,
            "scale_shape": list(scales.shape),
        }
        if name not in VARIANT_CASES:
            continue
        # The same kernel writing FC1's input as FP16 values: the decode of the packed result, residual unchanged.
        r16, x16 = resnorm_quantize_triton(residual, x, bias, gate, scale, shift, g, eps=EPS, fast_math=False,
                                                decoded=True)
        results[name]["decoded"] = torch.equal(r16, r) and torch.equal(x16.view(torch.int16), decoded(packed, scales))
        # Without the residual add (adaptive LayerNorm): the LayerNorm reads the residual stream itself.
        ap, ascales = adaln_quantize_triton(residual, scale, shift, g, eps=EPS, fast_math=False)
        ref_p, ref_s = emulated_adaln_reference(residual, scale, shift, g, EPS)
        (a16,) = adaln_quantize_triton(residual, scale, shift, g, eps=EPS, fast_math=False, decoded=True)
        results[name]["adaln"] = torch.equal(ap, ref_p) and torch.equal(ascales, ref_s)
        results[name]["adaln_decoded"] = torch.equal(a16.view(torch.int16), decoded(ap, ascales))

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
    return run_interpreted(__name__, "interpreted_qwen_resnorm")


def test_fma32_is_exact():
    a = np.array([1.0 + 2.0**-12], np.float32)  # a * a = 1 + 2^-11 + 2^-24: exactly halfway between two FP32 values
    assert fma32(a, a, np.array([-1.0], np.float32))[0] == np.float32(2.0**-11 + 2.0**-24)  # one rounding, not two
    # A tiny addend decides the tie; a plain FP64 a*b+c would round to the tie and then to even (1 + 2^-11) both times.
    assert fma32(a, a, np.array([2.0**-60], np.float32))[0] == np.float32(1.0 + 2.0**-11 + 2.0**-23)
    assert fma32(a, a, np.array([-(2.0**-60)], np.float32))[0] == np.float32(1.0 + 2.0**-11)


# The decoded and adaptive-LayerNorm variants run on cases that reach every pass-2 path (4 threads per block at
# D = 512, 8 at D = 1024, whole blocks then 4 at D = 2560), with strided rows, per-token parameters and scale padding
# rows (the interpreter is slow: the other cases add time, not paths).
VARIANT_CASES = ["b2-activation-strided", "b1-large-offset-nobias-pertoken-d1024", "b1-activation-pertoken-d2560"]
INTERPRETED_CASES = [
    "b2-randn-bias", "b1-large-offset-nobias-pertoken-d1024", "b2-activation-strided", "b1-129rows-two-scale-tiles",
    "b2-edge-rows-pertoken", "b2-edge-rows-d3072", "b1-activation-pertoken-d2560",
]


@pytest.mark.parametrize("case", INTERPRETED_CASES)
def test_fused_kernel_matches_cuda_emulation(interpreter_results, case):
    res = interpreter_results[case]
    assert res["residual_vs_eager"], res
    assert res["residual"], res
    assert res["packed"], res
    assert res["scales"], res


@pytest.mark.parametrize("case", VARIANT_CASES)
def test_decoded_and_adaln_variants_match(interpreter_results, case):
    """The same kernel writing FP16 values (the decode of its packed result), and without the residual add (norm1
    of the residual stream itself, against the emulated chain), packed and decoded."""
    res = interpreter_results[case]
    assert res["decoded"] and res["adaln"] and res["adaln_decoded"], res


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


# ---------------------------------------------------------------------------------------------------------------
# Without a shift (Qwen-Image 2.1's x * (1 + scale)): its own interpreter run, so that the run above stays in budget.
# ---------------------------------------------------------------------------------------------------------------


def signed_zero_case(b: int, l_len: int, d: int, per_token: bool, seed: int):
    """(residual, x, gate, scale) where products of exactly zero reach the quantizer with both signs: row 0 of
    every sample is constant after the residual add (its LayerNorm output is +0), and every 7th column of ``scale``
    is -2 (``1 + scale = -1``), so ``n * (1 + scale)`` is -0 there and +0 elsewhere in that row. Parameters are
    chunk views of one modulation tensor, as diffusers slices them."""
    residual, x, _bias, gate, _scale, _shift = make_inputs(b, l_len, d, "randn", per_token, seed)
    residual[:, 0] = 1.5
    x[:, 0] = 0.0  # gate * 0 is +-0 and 1.5 + +-0 = 1.5: the residual-norm kernel's row 0 is constant too
    mod = (torch.randn(b, *((l_len,) if per_token else ()), 2 * d, generator=torch.Generator().manual_seed(seed))
           * 0.5).bfloat16()
    mod[..., : d : 7] = -2.0
    scale, gate2 = mod.chunk(2, dim=-1)
    return residual, x, gate2 if per_token else gate, scale


def interpreted_no_shift() -> dict:
    import warnings

    from diffusers_nvfp4_fast.kernels.layer_norm_quantize import adaln_quantize_triton, resnorm_quantize_triton

    warnings.filterwarnings("ignore", category=RuntimeWarning)
    g = torch.tensor([2688.0 / 5.0])
    results = {}

    def same(a, b) -> bool:
        return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

    # name, B, L, D, per-token: D = 512 splits each 16-block over 4 threads, 1024 over 2, 2560 takes whole blocks
    # per thread first (every pass-2 path of the kernel)
    for name, b, l_len, d, per_token in (("adaln-b2-d512", 2, 2, 512, False),
                                         ("adaln-b1-pertoken-d2560", 1, 2, 2560, True),
                                         ("resnorm-b2-pertoken-d512", 2, 2, 512, True),
                                         ("resnorm-b1-d1024", 1, 2, 1024, False)):
        residual, x, gate, scale = signed_zero_case(b, l_len, d, per_token, seed=len(results))
        zero = torch.zeros_like(scale)
        residual_equal = True
        if name.startswith("adaln"):
            got = adaln_quantize_triton(residual, scale, None, g, eps=EPS, fast_math=False)
            want = emulated_adaln_reference(residual, scale, None, g, EPS)
            plus_zero = adaln_quantize_triton(residual, scale, zero, g, eps=EPS, fast_math=False)
            minus_zero = adaln_quantize_triton(residual, scale, -zero, g, eps=EPS, fast_math=False)
            (x16,) = adaln_quantize_triton(residual, scale, None, g, eps=EPS, fast_math=False, decoded=True)
        else:
            r, *got = resnorm_quantize_triton(residual, x, None, gate, scale, None, g, eps=EPS, fast_math=False)
            want_r, *want = emulated_reference(residual, x, None, gate, scale, None, g, EPS)
            plus_zero = resnorm_quantize_triton(residual, x, None, gate, scale, zero, g, eps=EPS, fast_math=False)[1:]
            minus_zero = resnorm_quantize_triton(residual, x, None, gate, scale, -zero, g, eps=EPS,
                                                 fast_math=False)[1:]
            r16, x16 = resnorm_quantize_triton(residual, x, None, gate, scale, None, g, eps=EPS, fast_math=False,
                                               decoded=True)
            residual_equal = torch.equal(r.view(torch.int16), want_r.view(torch.int16)) and torch.equal(r16, r)
        decoded = decode_nvfp4(*got, scale_layout="128x4", dtype=torch.float16)
        results[name] = {
            "equal": same(got, want) and residual_equal,
            "decoded": torch.equal(x16.view(torch.int16), decoded.view(torch.int16)),
            "plus_zero_shift_differs": not same(plus_zero, want),  # the case can tell: an add of +0.0 is wrong
            "minus_zero_shift_equal": same(minus_zero, want),  # and -0.0 would be the identity
            # -0 codes (0x8) in the constant rows, whose values are all zeros: the signed zeros reached the quantizer
            "negative_zero_codes": int(sum(((got[0][i * l_len] >> k) & 0xF == 0x8).sum() for i in range(b)
                                           for k in (0, 4))),
        }
    return results


NO_SHIFT_CASES = ["adaln-b2-d512", "adaln-b1-pertoken-d2560", "resnorm-b2-pertoken-d512", "resnorm-b1-d1024"]


@pytest.mark.parametrize("case", NO_SHIFT_CASES)
def test_no_shift_variant_matches_emulation_with_signed_zeros(case):
    """``HAS_SHIFT=False`` (Qwen-Image 2.1's ``norm(x) * (1 + scale)``) against the emulated chain without the add,
    packed and decoded, on rows whose products are zeros of both signs; an explicit +0.0 shift gives other bytes on
    the same rows (so the comparison can fail), an explicit -0.0 shift the same ones."""
    res = run_interpreted(__name__, "interpreted_no_shift")[case]
    assert res["negative_zero_codes"] > 0, res
    assert res["equal"] and res["decoded"], res
    assert res["plus_zero_shift_differs"] and res["minus_zero_shift_equal"], res


# ---------------------------------------------------------------------------------------------------------------
# GPU: against diffusers' eager ops.
# ---------------------------------------------------------------------------------------------------------------


def make_residual(rows: int, d: int, dist: str, gen: torch.Generator) -> torch.Tensor:
    """``[rows, d]`` bf16 residual stream values."""
    x = torch.randn(rows, d, device="cuda", generator=gen)
    if dist == "activation-like":  # per-channel scales and offsets, a few large channels
        x = x * torch.rand(d, device="cuda", generator=gen) * 10 + torch.randn(d, device="cuda", generator=gen) * 3
        x[:, :: max(d // 8, 1)] *= 40
    elif dist == "large-offset":
        x = x * 30 + 5
    elif dist == "edge-rows":  # rows that stress the statistics: zero, constant, tiny, huge, one spike
        x = x * 2
        pattern = torch.arange(rows, device="cuda") % 6
        x[pattern == 0] = 0.0
        x[pattern == 1] = 3.140625
        x[pattern == 2] *= 1e-30
        x[pattern == 3] *= 1e15
        x[pattern == 4] = 0.0
        x[pattern == 4, d // 3] = 1000.0
    return x.to(torch.bfloat16)


def make_case(
    b: int, l_len: int, d: int = D, dist: str = "randn", per_token: bool = False, bias: bool = True,
    strided: bool = False, seed: int = 0,
):
    """Inputs shaped and strided as diffusers' QwenImageTransformerBlock passes them."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    residual = make_residual(b * l_len, d, dist, gen).reshape(b, l_len, d)
    attn = (torch.randn(b, l_len, d, device="cuda", generator=gen) * 0.7).to(torch.bfloat16)
    bias_t = (torch.randn(d, device="cuda", generator=gen) * 0.1).to(torch.bfloat16)
    if strided:
        # The image stream of a joint [B, txt + img, D] tensor, and a residual living in a wider buffer.
        joint = torch.randn(b, l_len + 37, d, device="cuda", generator=gen).to(torch.bfloat16)
        joint[:, 37:] = attn
        attn = joint[:, 37:]
        wide = torch.zeros(b, l_len, 2 * d, device="cuda", dtype=torch.bfloat16)
        wide[..., :d] = residual
        residual = wide[..., :d]
    if not bias:
        attn = attn + bias_t  # the Linear already added it
        bias_t = None
    # mod_params = img_mod(temb): [B, 6D] -> chunk(2) -> chunk(3) = shift, scale, gate views with row stride 6D.
    shape = (b, l_len, 6 * d) if per_token else (b, 6 * d)
    mod = (torch.randn(shape, device="cuda", generator=gen) * 0.3).to(torch.bfloat16)
    _, mod2 = mod.chunk(2, dim=-1)
    shift, scale, gate = mod2.chunk(3, dim=-1)
    return residual, attn, bias_t, gate, scale, shift


def global_scale(*tensors_for_amax: torch.Tensor) -> torch.Tensor:
    amax = max(t.float().abs().max().item() for t in tensors_for_amax)
    return torch.tensor([448.0 * 6.0 / max(amax, 1e-12)], dtype=torch.float32, device="cuda")


@contextlib.contextmanager
def poisoned_outputs():
    """Make ``torch.empty`` inside the kernel wrapper return 0x5A-filled memory (every byte must be written)."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.numel():
            t.view(torch.uint8).fill_(0x5A)
        return t

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real_empty


def run_kernel(case, g, fast_math):
    with poisoned_outputs():
        return qmod.resnorm_quantize_triton(*case, g, eps=EPS, fast_math=fast_math)


def run_reference(case, g, fast_math):
    r, m = residual_norm_chain(ResNormInputs(*case), EPS)
    m2d = m.reshape(-1, m.shape[-1])
    if fast_math:
        packed, scales = quantize_nvfp4_triton(m2d, g, fast_math=True)
    else:
        packed, scales = reference_quantize(m2d, g, scale_layout="128x4", fast_math=False)
    return r, packed, scales


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits (so -0.0 vs 0.0 and NaN payloads count as differences)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def assert_identical(got, ref):
    for name, a, b in zip(("residual_out", "packed", "scales"), got, ref, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{name}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
        if not torch.equal(bits(a), bits(b)):
            diff = bits(a) != bits(b)
            raise AssertionError(f"{name}: {int(diff.sum())} of {a.numel()} differ, "
                                 f"first at {diff.nonzero()[:4].tolist()}")


def check(case, fast_math):
    g = global_scale(residual_norm_chain(ResNormInputs(*case), EPS)[1])
    assert_identical(run_kernel(case, g, fast_math), run_reference(case, g, fast_math))


# ---------------------------------------------------------------------------------------------------------------
# Fused kernel vs eager chain + standalone quantize.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fast_math", [False, True], ids=["precise", "fast"])
@pytest.mark.parametrize(
    "rows,dist",
    [(1, "randn"), (17, "activation-like"), (1024, "large-offset"), (4096, "activation-like"), (4608, "edge-rows"),
     (70_000, "activation-like")],
)
def test_gpu_rows(rows, dist, fast_math):
    check(make_case(1, rows, dist=dist, seed=rows), fast_math)


@pytest.mark.gpu
@pytest.mark.parametrize("fast_math", [False, True], ids=["precise", "fast"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "prebiased"])
@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_gpu_distributions_and_bias(dist, bias, fast_math):
    check(make_case(1, 4608, dist=dist, bias=bias, seed=11), fast_math)


@pytest.mark.gpu
@pytest.mark.parametrize("fast_math", [False, True], ids=["precise", "fast"])
def test_gpu_cfg_batch2_per_sample_params(fast_math):
    case = make_case(2, 4096, dist="activation-like", seed=3)
    gate = case[3]
    assert not torch.equal(gate[0], gate[1])
    check(case, fast_math)
    # The per-sample rows matter: swapping the two samples' parameters changes the result.
    swapped = case[:3] + tuple(p.flip(0) for p in case[3:])
    g = global_scale(residual_norm_chain(ResNormInputs(*case), EPS)[1])
    assert not torch.equal(run_kernel(case, g, fast_math)[1], run_kernel(swapped, g, fast_math)[1])


@pytest.mark.gpu
@pytest.mark.parametrize("fast_math", [False, True], ids=["precise", "fast"])
@pytest.mark.parametrize("b,l_len", [(1, 4608), (2, 1024)])
def test_gpu_per_token_params(b, l_len, fast_math):
    """modulate_index (edit models): per-token [B, L, D] shift/scale/gate, as strided views and contiguous."""
    case = make_case(b, l_len, dist="randn", per_token=True, seed=5)
    check(case, fast_math)
    check(case[:3] + tuple(p.contiguous() for p in case[3:]), fast_math)


@pytest.mark.gpu
@pytest.mark.parametrize("fast_math", [False, True], ids=["precise", "fast"])
def test_gpu_strided_rows(fast_math):
    check(make_case(2, 4096, dist="large-offset", strided=True, seed=9), fast_math)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [512, 1024, 1536, 2560, 6144])
def test_gpu_other_hidden_sizes(d):
    for fast_math in (False, True):
        check(make_case(2, 300, d=d, dist="activation-like", seed=d), fast_math)


@pytest.mark.gpu
def test_gpu_text_stream_shapes():
    # Text stream: a few hundred rows; batch 2 with per-sample params.
    for rows in (7, 512):
        check(make_case(2, rows, dist="randn", seed=rows), True)


@pytest.mark.gpu
def test_gpu_unsupported_hidden_sizes_are_refused():
    assert qmod.unsupported_hidden_size(3072) is None
    for d in (3000, 256, 20992):
        assert qmod.unsupported_hidden_size(d) is not None
    case = make_case(1, 4, d=512)
    bad = tuple(t[..., :256] if t is not None else None for t in case)
    with pytest.raises(ValueError):
        qmod.resnorm_quantize_triton(*bad, global_scale(case[0]), eps=EPS)


# ---------------------------------------------------------------------------------------------------------------
# LayerNorm alone vs F.layer_norm (>= 10^7 elements per distribution), statistics included.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_gpu_layer_norm_bit_exact(dist):
    gen = torch.Generator(device="cuda").manual_seed(21)
    x = make_residual(4608, D, dist, gen)  # 14.2 million elements
    y, mean, rstd = qmod.layer_norm_torch_exact(x, EPS, return_stats=True)
    ref, ref_mean, ref_rstd = torch.native_layer_norm(x, (D,), None, None, EPS)
    assert x.numel() >= 10**7
    mismatch = int((bits(y) != bits(ref)).sum())
    assert mismatch == 0, f"{mismatch} of {x.numel()} elements differ from F.layer_norm"
    assert torch.equal(bits(y), bits(F.layer_norm(x, (D,), eps=EPS)))
    assert torch.equal(mean.view(torch.int32), ref_mean.reshape(-1).view(torch.int32)), "mean differs"
    assert torch.equal(rstd.view(torch.int32), ref_rstd.reshape(-1).view(torch.int32)), "rstd differs"


@pytest.mark.gpu
@pytest.mark.parametrize("d,eps", [(512, 1e-6), (1024, 1e-5), (6144, 1e-6), (3072, 1e-5)])
def test_gpu_layer_norm_other_sizes_and_eps(d, eps):
    gen = torch.Generator(device="cuda").manual_seed(d)
    x = make_residual(max(10**7 // d, 1), d, "activation-like", gen)
    y, mean, rstd = qmod.layer_norm_torch_exact(x, eps, return_stats=True)
    ref, ref_mean, ref_rstd = torch.native_layer_norm(x, (d,), None, None, eps)
    assert int((bits(y) != bits(ref)).sum()) == 0
    assert torch.equal(mean.view(torch.int32), ref_mean.reshape(-1).view(torch.int32))
    assert torch.equal(rstd.view(torch.int32), ref_rstd.reshape(-1).view(torch.int32))


@pytest.mark.gpu
def test_gpu_layer_norm_subnormal_means():
    """Rows of BF16 subnormals: their means are subnormal, the only case where the rounding of torch's combined mean
    (``nA*mean_A + nB*mean_B``, contracted into an FMA by nvcc or not) is visible. On failure the message names the
    variant (``TORCH_MEAN_FMA`` in the kernel module) that reproduces this torch build."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = (torch.randn(4096, D, device="cuda", generator=gen) * 1e-39).to(torch.bfloat16)
    ref, ref_mean, ref_rstd = torch.native_layer_norm(x, (D,), None, None, EPS)

    def mismatches(variant):
        y, mean, rstd = qmod.layer_norm_torch_exact(x, EPS, return_stats=True, mean_fma=variant)
        return (int((bits(y) != bits(ref)).sum()),
                int((mean.view(torch.int32) != ref_mean.reshape(-1).view(torch.int32)).sum()),
                int((rstd.view(torch.int32) != ref_rstd.reshape(-1).view(torch.int32)).sum()))

    used = mismatches(qmod.TORCH_MEAN_FMA)
    if used != (0, 0, 0):
        others = {v: mismatches(v) for v in (0, 1, 2)}
        matching = [v for v, m in others.items() if m == (0, 0, 0)]
        raise AssertionError(f"TORCH_MEAN_FMA={qmod.TORCH_MEAN_FMA}: (output, mean, rstd) mismatches {used}; "
                             f"all variants {others}; variants matching torch: {matching}")


@pytest.mark.gpu
@pytest.mark.parametrize("fast_math", [False, True], ids=["precise", "fast"])
def test_gpu_fuzz_50m_adversarial_elements(fast_math):
    """4 x 4608 x 3072 = 56.6M adversarial values per mode (residual, attention output and modulation all
    adversarial: ties, E4M3 boundaries, saturation, subnormal scales, zeros, -0, NaN of either sign, +-Inf) against
    diffusers' eager chain + ``format.quantize_nvfp4`` (fast-math with the GPU's ``rcp.approx.ftz.f32``)."""
    from support.inputs import adversarial
    from support.rcp import exact_fast_math_reference

    elements = 0
    for seed in range(4):
        residual, attn = adversarial(4608, D, seed=20 + seed), adversarial(4608, D, seed=30 + seed)
        mod = adversarial(1, 3 * D, seed=40 + seed) * 0.01
        shift, scale, gate = mod.chunk(3, dim=-1)
        bias = adversarial(1, D, seed=50 + seed)[0] * 0.01
        case = (residual[None], attn[None], bias, gate, scale, shift)
        g = torch.tensor([2688 / 5.0], device="cuda")
        r, m = residual_norm_chain(ResNormInputs(*case), EPS)
        with exact_fast_math_reference():
            packed, scales = reference_quantize(m.reshape(-1, D), g, fast_math=fast_math)
        got = run_kernel(case, g, fast_math)
        assert torch.equal(got[0].view(torch.int16), r.view(torch.int16)), f"seed {seed}: residual_out differs"
        assert torch.equal(got[1], packed), f"seed {seed}: {(got[1] != packed).sum().item()} packed bytes differ"
        assert torch.equal(got[2], scales), f"seed {seed}: {(got[2] != scales).sum().item()} scale bytes differ"
        elements += residual.numel()
    assert elements >= 5e7
