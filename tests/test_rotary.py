"""The rotary-embedding kernel (``kernels/rotary.py``) against diffusers' ``apply_rotary_emb``: under the Triton
interpreter (CPU; the FP32 products and sums are IEEE operations on both sides, so every non-NaN byte must match, and
NaN stays NaN: the CPU keeps NaN payloads that the GPU's conversion canonicalizes), compiled ahead of time for SM90 /
SM100 / SM120 (CPU, no FMA in the PTX), and on the GPU byte for byte, NaN payloads included (``gpu``)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed, so the rotary kernel tests did not run; they "
                                               "run wherever Triton is installed, as in CI (pip install -e '.[test]')")
from diffusers_nvfp4_fast.ops.rotary import rotary_reference  # noqa: E402
from support.interpreter import run_interpreted  # noqa: E402

HEADS = {"dev": 48, "klein4b": 24, "klein9b": 32}


def rotary_inputs(batch: int, seq: int, heads: int, dim: int, device="cuda", dtype=torch.bfloat16, seed: int = 0):
    """x with specials (NaN of both signs, +-Inf, subnormals, huge values) and FLUX-like tables: angles repeated
    per pair, from positions up to 4096 (large angles, so cos/sin take every sign and magnitude)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(batch, seq, heads, dim, device=device, generator=gen) * 3
    flat = x.view(-1)
    # 0.0 last again: pairs (-0, +0) and (+0, +0), where only a sign-bit negation gives torch's -0
    for start, value in enumerate((float("nan"), float("inf"), float("-inf"), 1e-40, -3e38, 0.0, -0.0, 0.0)):
        flat[start::101] = value
    x = x.to(dtype)
    if dtype == torch.bfloat16:
        x.view(torch.int16).view(-1)[50::211] = -64  # NaN with the sign bit set (0xFFC0)
    pos = torch.randint(0, 4096, (seq, 1), device=device, generator=gen).float()
    freqs = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=device).float() / dim))
    angles = (pos * freqs).repeat_interleave(2, dim=1)
    return x, angles.cos().float(), angles.sin().float()


def _agree(got: torch.Tensor, want: torch.Tensor, *, nan_payloads: bool) -> bool:
    g, w = got.view(torch.int16), want.view(torch.int16)
    if nan_payloads:
        return torch.equal(g, w)
    nan = want.isnan()
    return torch.equal(got.isnan(), nan) and torch.equal(g[~nan], w[~nan])


def interpreted_rotary() -> dict:
    from diffusers_nvfp4_fast.kernels import rotary_triton

    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        x, cos, sin = rotary_inputs(2, 37, 3, 64, device="cpu", dtype=dtype)
        for block_r in (4, 16):
            got = rotary_triton(x, cos, sin, block_r=block_r)
            out[f"{dtype}-{block_r}"] = _agree(got, rotary_reference(x, cos, sin), nan_payloads=False)
    return out


def test_interpreted_kernel_matches_diffusers():
    result = run_interpreted(__name__, "interpreted_rotary")
    assert len(result) == 4 and all(result.values()), result


@pytest.mark.parametrize("capability", [90, 100, 120])
def test_compiles_ahead_of_time_without_fma(capability):
    from support.sass_count import compile_rotary

    ptx = compile_rotary(capability).asm["ptx"]
    assert "fma" not in ptx and "mul.rn.f32" in ptx and "cvt.rn.bf16" in ptx


@pytest.mark.gpu
@pytest.mark.parametrize("model", sorted(HEADS))
@pytest.mark.parametrize("seq", [1, 17, 512, 4608])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_equals_diffusers(model, seq, dtype):
    from diffusers_nvfp4_fast.kernels import rotary_triton

    for batch in (1, 2):
        x, cos, sin = rotary_inputs(batch, seq, HEADS[model], 128, dtype=dtype, seed=seq)
        assert _agree(rotary_triton(x, cos, sin), rotary_reference(x, cos, sin), nan_payloads=True)


@pytest.mark.gpu
def test_gpu_non_contiguous_query():
    """A query that is a view of a wider tensor (the kernel makes it contiguous first)."""
    from diffusers_nvfp4_fast.kernels import rotary_triton

    x, cos, sin = rotary_inputs(1, 4608, 48, 128, seed=3)
    wide = torch.cat([x, x], dim=2)[:, :, 24:72]
    assert _agree(rotary_triton(wide, cos, sin), rotary_reference(wide, cos, sin), nan_payloads=True)
