"""The Qwen-Image QK-norm + rotary kernel (``kernels/qk_norm_rotary.py``): its torch reference against diffusers'
modules (CPU), the kernel under the Triton interpreter against a numpy emulation of torch's CUDA ops (every FMA form
of the complex product; rsqrt correctly rounded there, as the interpreter's stand-in), compiled ahead of time for
SM90 / SM100 / SM120, and on the GPU byte for byte against diffusers' chain (``gpu``)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed, so the QK-norm + rotary kernel tests did not "
                                               "run; they run wherever Triton is installed, as in CI")
from diffusers_nvfp4_fast.kernels.qk_norm_rotary import FMA_FORMS  # noqa: E402
from diffusers_nvfp4_fast.ops.qk_norm_rotary import (  # noqa: E402
    EPS,
    flux2_qk_norm_rotary_reference,
    flux2_tables,
    qk_norm_rotary,
    qk_norm_rotary_reference,
    qwen_rotary,
    qwen_rotary_reference,
    rms_norm_reference,
    tree_match,
)
from diffusers_nvfp4_fast.ops.qk_norm_rotary import probe_inputs as qk_inputs  # noqa: E402
from support.emulation import fma32  # noqa: E402
from support.interpreter import run_interpreted  # noqa: E402


def _bf16(a: np.ndarray) -> np.ndarray:
    """FP32 -> BF16 (nearest, ties to even) -> FP32, as torch's conversion."""
    return torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(torch.bfloat16).float().numpy()


def mean_of_squares_emulation(x: torch.Tensor, tree: int | str = 1) -> np.ndarray:
    """torch's CUDA ``x.float().pow(2).mean(-1)`` over rows of 128, FP32 ``[rows]``: 32 threads each sum 4 adjacent
    squares in order, then a shuffle-down tree adds the thread sums: ``tree`` 1 = offsets 16, 8, ..., 1 (torch
    2.11's CUDA build), 0 = offsets 1, 2, ..., 16 (earlier builds); "sequential" = left to right (a wrong order, for
    the test that the inputs tell orders apart)."""
    sq = x.float().numpy().reshape(-1, 128) ** 2
    if tree == "sequential":
        total = np.zeros(sq.shape[0], np.float32)
        for i in range(128):
            total = total + sq[:, i]
    else:
        t = sq.reshape(-1, 32, 4)
        t = ((t[..., 0] + t[..., 1]) + t[..., 2]) + t[..., 3]
        while t.shape[-1] > 1:
            half = t.shape[-1] // 2
            t = t[..., :half] + t[..., half:] if tree == 1 else t[..., 0::2] + t[..., 1::2]
        total = t[..., 0]
    return total * np.float32(1 / 128)


def cuda_chain_emulation(x, weight, freqs, eps=EPS, real_fma=1, imag_fma=1, tree: int | str = 1) -> torch.Tensor:
    """diffusers' chain as torch's CUDA kernels compute it (numpy FP32, independent of the kernel's code); rsqrt
    correctly rounded (the interpreter's stand-in for ``rsqrt.approx.f32``). tree: see ``mean_of_squares_emulation``."""
    mean = mean_of_squares_emulation(x, tree)
    xf = x.float().numpy().reshape(-1, 128)
    rstd = (1.0 / np.sqrt((mean + np.float32(eps)).astype(np.float64))).astype(np.float32)
    y = _bf16(_bf16(xf * rstd[:, None]) * weight.float().numpy()[None, :])
    return rotary_emulation(y, x.shape, freqs, real_fma, imag_fma)


def rotary_emulation(y: np.ndarray, shape, freqs: torch.Tensor, real_fma: int = 1, imag_fma: int = 1) -> torch.Tensor:
    """``apply_rotary_emb_qwen`` on FP32 rows ``y`` ``[rows, 128]`` of a ``[B, S, H, 128]`` tensor as torch's CUDA
    complex product computes it (FMA forms as ``_complex_product``), rounded to BF16."""
    b, s, h, _ = shape
    table = torch.view_as_real(freqs).numpy()  # [S, 64, 2]
    pos = (np.arange(b * s * h) // h) % s
    c, d = table[pos, :, 0], table[pos, :, 1]
    a, bi = y[:, 0::2], y[:, 1::2]
    real = {0: a * c - bi * d, 1: fma32(a, c, -(bi * d)), 2: fma32(-bi, d, a * c)}[real_fma]
    imag = {0: a * d + bi * c, 1: fma32(a, d, bi * c), 2: fma32(bi, c, a * d)}[imag_fma]
    out = np.stack([real, imag], axis=-1).reshape(b, s, h, 128)
    return torch.from_numpy(np.ascontiguousarray(out, np.float32)).to(torch.bfloat16)


def flux2_chain_emulation(x, weight, cos, sin, eps=EPS, tree: int | str = 1) -> torch.Tensor:
    """torch's fused RMSNorm (``bf16(fl(w * fl(rstd * x)))``) and diffusers' real rotary embedding (three FP32 ops
    per value) as the GPU computes them; rsqrt correctly rounded (the interpreter's stand-in)."""
    mean = mean_of_squares_emulation(x, tree)
    xf = x.float().numpy().reshape(-1, 128)
    rstd = (1.0 / np.sqrt((mean + np.float32(eps)).astype(np.float64))).astype(np.float32)
    y = _bf16(weight.float().numpy()[None, :] * (rstd[:, None] * xf))
    b, s, h, _ = x.shape
    pos = (np.arange(b * s * h) // h) % s
    c, sn = cos.numpy()[pos], sin.numpy()[pos]
    out = np.empty_like(y)
    out[:, 0::2] = y[:, 0::2] * c[:, 0::2] + (-y[:, 1::2]) * sn[:, 0::2]
    out[:, 1::2] = y[:, 1::2] * c[:, 1::2] + y[:, 0::2] * sn[:, 1::2]
    return torch.from_numpy(np.ascontiguousarray(out, np.float32)).to(torch.bfloat16).reshape(b, s, h, 128)


def _agree(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Byte equality, NaN positions equal (the interpreter's NaN payloads are not the GPU's)."""
    nan = want.isnan()
    return torch.equal(got.isnan(), nan) and torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


def interpreted_qk_norm_rotary() -> dict:
    from diffusers_nvfp4_fast.kernels import flux2_qk_norm_rotary_triton, qk_norm_rotary_triton, qwen_rotary_triton

    x, weight, freqs = qk_inputs(2, 9, 3)
    out: dict = {}
    for real_fma, imag_fma in FMA_FORMS:
        got = qk_norm_rotary_triton(x, weight, freqs, EPS, real_fma=real_fma, imag_fma=imag_fma, block_r=4)
        out[f"{real_fma}{imag_fma}"] = _agree(got, cuda_chain_emulation(x, weight, freqs, EPS, real_fma, imag_fma))
    out["block_r=16"] = _agree(qk_norm_rotary_triton(x, weight, freqs, EPS, block_r=16),
                               cuda_chain_emulation(x, weight, freqs))
    out["tree 0"] = _agree(qk_norm_rotary_triton(x, weight, freqs, EPS, tree=0),
                           cuda_chain_emulation(x, weight, freqs, tree=0))
    cos, sin = flux2_tables(freqs)
    for tree in (0, 1):
        out[f"flux2 tree {tree}"] = _agree(flux2_qk_norm_rotary_triton(x, weight, cos, sin, EPS, tree=tree),
                                           flux2_chain_emulation(x, weight, cos, sin, tree=tree))
    for real_fma, imag_fma in FMA_FORMS:
        out[f"rotary {real_fma}{imag_fma}"] = _agree(
            qwen_rotary_triton(x, freqs, real_fma=real_fma, imag_fma=imag_fma),
            rotary_emulation(x.float().numpy().reshape(-1, 128), x.shape, freqs, real_fma, imag_fma))
    mean = torch.empty(x.numel() // 128)
    for tree in (0, 1):
        qk_norm_rotary_triton(x, weight, freqs, EPS, mean_out=mean, tree=tree)
        for other in (0, 1, "sequential"):  # the mean equals its own tree's emulation only
            out[f"mean {tree} == {other}"] = np.array_equal(mean.numpy(), mean_of_squares_emulation(x, other))
    return out


def test_interpreted_kernel_matches_cuda_emulation_for_every_fma_form():
    result = run_interpreted(__name__, "interpreted_qk_norm_rotary")
    means = {f"mean {tree} == {other}": tree == other for tree in (0, 1) for other in (0, 1, "sequential")}
    assert result == {**{f"{r}{i}": True for r, i in FMA_FORMS}, **{f"rotary {r}{i}": True for r, i in FMA_FORMS},
                      "block_r=16": True, "tree 0": True,
                      "flux2 tree 0": True, "flux2 tree 1": True, **means}, result


def test_inputs_tell_the_summation_orders_and_fma_forms_apart():
    """Otherwise the interpreter and GPU tests could not see a wrong tree or a wrong FMA form."""
    x, weight, freqs = qk_inputs(1, 512, 24)  # a wrong tree moves a row's mean by an ulp: it shows in many rows
    want = cuda_chain_emulation(x, weight, freqs)
    for tree in (0, "sequential"):
        assert not _agree(cuda_chain_emulation(x, weight, freqs, tree=tree), want), tree
    for real_fma, imag_fma in FMA_FORMS[1:]:
        other = cuda_chain_emulation(x, weight, freqs, real_fma=real_fma, imag_fma=imag_fma)
        assert (real_fma, imag_fma) == (1, 1) or not _agree(other, want), (real_fma, imag_fma)


def test_reference_is_diffusers_modules():
    """The functional reference equals diffusers' own ``RMSNorm`` module and rotary function, byte for byte."""
    from diffusers.models.normalization import RMSNorm
    from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

    x, weight, freqs = qk_inputs(1, 5, 2)
    norm = RMSNorm(128, eps=EPS).to(torch.bfloat16)
    norm.weight.data.copy_(weight)
    want = apply_rotary_emb_qwen(norm(x), freqs, use_real=False)
    assert torch.equal(rms_norm_reference(x, weight, EPS).view(torch.int16), norm(x).view(torch.int16))
    assert torch.equal(qk_norm_rotary_reference(x, weight, freqs, EPS).view(torch.int16), want.view(torch.int16))


def test_flux2_reference_is_torch_rms_norm_and_diffusers_rotary():
    from diffusers.models.embeddings import apply_rotary_emb

    x, weight, freqs = qk_inputs(1, 5, 2)
    cos, sin = flux2_tables(freqs)
    norm = torch.nn.RMSNorm(128, eps=EPS).to(torch.bfloat16)
    norm.weight.data.copy_(weight)
    want = apply_rotary_emb(norm(x), (cos, sin), sequence_dim=1)
    got = flux2_qk_norm_rotary_reference(x, weight, cos, sin, EPS)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("capability", [90, 100, 120])
def test_flux2_kernel_compiles_ahead_of_time_without_fma(capability):
    from support.sass_count import compile_flux2_qk_norm_rotary

    ptx = compile_flux2_qk_norm_rotary(capability).asm["ptx"]
    assert "rsqrt.approx.f32" in ptx and "cvt.rn.bf16" in ptx and "fma" not in ptx


@pytest.mark.parametrize("capability", [90, 100, 120])
@pytest.mark.parametrize("forms", [(0, 0, 0), (1, 1, 1), (2, 1, 0)], ids=["no-fma", "default", "fma21-tree0"])
def test_compiles_ahead_of_time(capability, forms):
    from support.sass_count import compile_qk_norm_rotary

    ptx = compile_qk_norm_rotary(capability, *forms).asm["ptx"]
    assert "rsqrt.approx.f32" in ptx and "cvt.rn.bf16.f32" in ptx
    assert ("fma.rn.f32" in ptx) == (forms[:2] != (0, 0))  # contraction off: only the FMA the form asks for


@pytest.mark.parametrize("capability", [90, 100])
def test_rotary_alone_compiles_ahead_of_time(capability):
    """The kernel without its norm (``qwen_rotary_triton``): no rsqrt, and FMAs only where the form asks for them."""
    from support.sass_count import compile_qk_norm_rotary

    ptx = compile_qk_norm_rotary(capability, norm=False).asm["ptx"]
    assert "rsqrt" not in ptx and "cvt.rn.bf16" in ptx and "fma.rn.f32" in ptx
    assert "fma.rn.f32" not in compile_qk_norm_rotary(capability, 0, 0, norm=False).asm["ptx"]


def test_rotary_alone_op_equals_diffusers_on_cpu():
    """Off the GPU the op is diffusers' own ``apply_rotary_emb_qwen`` (the kernel's forms: the interpreted test)."""
    x, _, freqs = qk_inputs(2, 24, 3)
    assert torch.equal(qwen_rotary(x, freqs).view(torch.int16), qwen_rotary_reference(x, freqs).view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("seq", [1, 17, 512, 4096])
def test_gpu_rotary_alone_equals_diffusers(seq, monkeypatch):
    """The rotary embedding alone (what compiled Qwen-Image models run) against diffusers' op on the GPU, over
    repeated calls: Triton's path, then the keyed launch, which must run the binder's binary."""
    from support.launch_sites import check_sites_against_binder

    kernel_module = importlib.import_module("diffusers_nvfp4_fast.kernels.qk_norm_rotary")
    checked = check_sites_against_binder(kernel_module, monkeypatch)
    x, weight, freqs = qk_inputs(2, seq, 24, device="cuda", seed=seq)
    normed = qk_norm_rotary_reference(x, weight, torch.ones_like(freqs), EPS)  # a normed query, unrotated
    for rows in (x, normed):
        want = qwen_rotary_reference(rows, freqs).view(torch.int16)
        for _ in range(4):
            assert torch.equal(qwen_rotary(rows, freqs).view(torch.int16), want)
    assert checked, "no keyed launch ran"


@pytest.mark.gpu
@pytest.mark.parametrize("seq", [1, 17, 512, 4096])
def test_gpu_equals_diffusers(seq):
    """The op (the kernel with the tree ``tree_match`` found for this GPU's torch) against diffusers' chain."""
    x, weight, freqs = qk_inputs(1, seq, 24, device="cuda", seed=seq)
    match = tree_match(x.device)
    assert match.tree is not None, match.reason  # otherwise the op would run diffusers' chain and prove nothing
    for batch in (1, 2):
        x, weight, freqs = qk_inputs(batch, seq, 24, device="cuda", seed=seq)
        got = qk_norm_rotary(x, weight, freqs, EPS)
        want = qk_norm_rotary_reference(x, weight, freqs, EPS)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (got != want).sum().item()


@pytest.mark.gpu
@pytest.mark.parametrize("seq", [1, 17, 512, 4608])
def test_gpu_flux2_kernel_equals_torch_and_diffusers(seq):
    """torch 2.11's fused RMSNorm shuffles at offsets 16..1 (tree 1) in every build (layer_norm_kernel.cu)."""
    from diffusers_nvfp4_fast.kernels import flux2_qk_norm_rotary_triton

    for batch in (1, 2):
        x, weight, freqs = qk_inputs(batch, seq, 48, device="cuda", seed=seq)
        cos, sin = flux2_tables(freqs)
        got = flux2_qk_norm_rotary_triton(x, weight, cos, sin, EPS)
        want = flux2_qk_norm_rotary_reference(x, weight, cos, sin, EPS)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (got != want).sum().item()
