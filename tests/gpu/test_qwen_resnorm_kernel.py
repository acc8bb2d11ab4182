"""GPU: the fused Qwen-Image residual + LayerNorm + modulate + NVFP4 quantize kernel against diffusers' eager ops.

The oracle is the eager chain on the GPU (``fused_reference.qwen_residual_chain``: torch ops, each rounding to BF16,
torch's own CUDA LayerNorm) followed by a standalone quantize: the pure-torch ``format.quantize_nvfp4`` in precise
mode (independent of every Triton kernel), and the standalone Triton quantize kernel in fast-math mode (the only
place ``rcp.approx.ftz.f32`` runs the same way). Exactness is ``torch.equal`` on residual_out, packed bytes and every
scale byte, padding included; outputs are allocated poisoned so that an unwritten byte cannot pass by luck.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="Triton is not installed, so the Qwen kernel GPU tests did not run; CI installs it with .[test]")
if not torch.cuda.is_available():
    pytest.skip("Qwen kernel GPU tests not run: no CUDA GPU here; they run on the GPU machine: "
                "pytest -m gpu tests/gpu/test_qwen_resnorm_kernel.py", allow_module_level=True)

import importlib  # noqa: E402

from diffusers_nvfp4_fast import kernels  # noqa: E402
from diffusers_nvfp4_fast.format import quantize_nvfp4 as reference_quantize  # noqa: E402
from diffusers_nvfp4_fast.fused_reference import qwen_residual_chain  # noqa: E402

# The module itself (the package re-exports a function of the same name).
qmod = importlib.import_module("diffusers_nvfp4_fast.kernels.qwen_resnorm_quantize")

pytestmark = pytest.mark.gpu

EPS = 1e-6  # Qwen-Image's LayerNorm eps
D = 3072  # Qwen-Image hidden size
DISTRIBUTIONS = ("randn", "activation-like", "large-offset", "edge-rows")


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
        return qmod.qwen_resnorm_quantize(*case, g, eps=EPS, fast_math=fast_math)


def run_reference(case, g, fast_math):
    r, m = qwen_residual_chain(*case, EPS)
    m2d = m.reshape(-1, m.shape[-1])
    if fast_math:
        packed, scales = kernels.quantize_nvfp4(m2d, g, fast_math=True)
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
            raise AssertionError(f"{name}: {int(diff.sum())} of {a.numel()} differ, first at {diff.nonzero()[:4].tolist()}")


def check(case, fast_math):
    g = global_scale(qwen_residual_chain(*case, EPS)[1])
    assert_identical(run_kernel(case, g, fast_math), run_reference(case, g, fast_math))


# ---------------------------------------------------------------------------------------------------------------
# Fused kernel vs eager chain + standalone quantize.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fast_math", [False, True], ids=["precise", "fast"])
@pytest.mark.parametrize(
    "rows,dist",
    [(1, "randn"), (17, "activation-like"), (1024, "large-offset"), (4096, "activation-like"), (4608, "edge-rows"),
     (70_000, "activation-like")],
)
def test_rows(rows, dist, fast_math):
    check(make_case(1, rows, dist=dist, seed=rows), fast_math)


@pytest.mark.parametrize("fast_math", [False, True], ids=["precise", "fast"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "prebiased"])
@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_distributions_and_bias(dist, bias, fast_math):
    check(make_case(1, 4608, dist=dist, bias=bias, seed=11), fast_math)


@pytest.mark.parametrize("fast_math", [False, True], ids=["precise", "fast"])
def test_cfg_batch2_per_sample_params(fast_math):
    case = make_case(2, 4096, dist="activation-like", seed=3)
    gate = case[3]
    assert not torch.equal(gate[0], gate[1])
    check(case, fast_math)
    # The per-sample rows matter: swapping the two samples' parameters changes the result.
    swapped = case[:3] + tuple(p.flip(0) for p in case[3:])
    g = global_scale(qwen_residual_chain(*case, EPS)[1])
    assert not torch.equal(run_kernel(case, g, fast_math)[1], run_kernel(swapped, g, fast_math)[1])


@pytest.mark.parametrize("fast_math", [False, True], ids=["precise", "fast"])
@pytest.mark.parametrize("b,l_len", [(1, 4608), (2, 1024)])
def test_per_token_params(b, l_len, fast_math):
    """modulate_index (edit models): per-token [B, L, D] shift/scale/gate, as strided views and contiguous."""
    case = make_case(b, l_len, dist="randn", per_token=True, seed=5)
    check(case, fast_math)
    check(case[:3] + tuple(p.contiguous() for p in case[3:]), fast_math)


@pytest.mark.parametrize("fast_math", [False, True], ids=["precise", "fast"])
def test_strided_rows(fast_math):
    check(make_case(2, 4096, dist="large-offset", strided=True, seed=9), fast_math)


@pytest.mark.parametrize("d", [512, 1024, 1536, 2560, 6144])
def test_other_hidden_sizes(d):
    for fast_math in (False, True):
        check(make_case(2, 300, d=d, dist="activation-like", seed=d), fast_math)


def test_text_stream_shapes():
    # Text stream: a few hundred rows; batch 2 with per-sample params.
    for rows in (7, 512):
        check(make_case(2, rows, dist="randn", seed=rows), True)


def test_unsupported_hidden_sizes_are_refused():
    assert qmod.unsupported_hidden_size(3072) is None
    for d in (3000, 256, 20992):
        assert qmod.unsupported_hidden_size(d) is not None
    case = make_case(1, 4, d=512)
    bad = tuple(t[..., :256] if t is not None else None for t in case)
    with pytest.raises(ValueError):
        qmod.qwen_resnorm_quantize(*bad, global_scale(case[0]), eps=EPS)


# ---------------------------------------------------------------------------------------------------------------
# LayerNorm alone vs F.layer_norm (>= 10^7 elements per distribution), statistics included.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_layer_norm_bit_exact(dist):
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


@pytest.mark.parametrize("d,eps", [(512, 1e-6), (1024, 1e-5), (6144, 1e-6), (3072, 1e-5)])
def test_layer_norm_other_sizes_and_eps(d, eps):
    gen = torch.Generator(device="cuda").manual_seed(d)
    x = make_residual(max(10**7 // d, 1), d, "activation-like", gen)
    y, mean, rstd = qmod.layer_norm_torch_exact(x, eps, return_stats=True)
    ref, ref_mean, ref_rstd = torch.native_layer_norm(x, (d,), None, None, eps)
    assert int((bits(y) != bits(ref)).sum()) == 0
    assert torch.equal(mean.view(torch.int32), ref_mean.reshape(-1).view(torch.int32))
    assert torch.equal(rstd.view(torch.int32), ref_rstd.reshape(-1).view(torch.int32))


def test_layer_norm_subnormal_means():
    """Rows of BF16 subnormals: their means are subnormal, the only case where the rounding of torch's combined mean
    (``nA*mean_A + nB*mean_B``, contracted into an FMA by nvcc or not) is visible. On failure the message names the
    variant (``TORCH_MEAN_FMA`` in the kernel module) that reproduces this torch build."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = (torch.randn(4096, D, device="cuda", generator=gen) * 1e-39).to(torch.bfloat16)
    ref, ref_mean, ref_rstd = torch.native_layer_norm(x, (D,), None, None, EPS)

    def mismatches(variant):
        y, mean, rstd = qmod.layer_norm_torch_exact(x, EPS, return_stats=True, mean_fma=variant)
        return (int((bits(y) != bits(ref)).sum()), int((mean.view(torch.int32) != ref_mean.reshape(-1).view(torch.int32)).sum()),
                int((rstd.view(torch.int32) != ref_rstd.reshape(-1).view(torch.int32)).sum()))

    used = mismatches(qmod.TORCH_MEAN_FMA)
    if used != (0, 0, 0):
        others = {v: mismatches(v) for v in (0, 1, 2)}
        matching = [v for v, m in others.items() if m == (0, 0, 0)]
        raise AssertionError(f"TORCH_MEAN_FMA={qmod.TORCH_MEAN_FMA}: (output, mean, rstd) mismatches {used}; "
                             f"all variants {others}; variants matching torch: {matching}")
