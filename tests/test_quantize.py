"""The standalone NVFP4 quantize kernel (``kernels/quantize_nvfp4.py``) and the shared E2M1 encoder, against the torch
reference ``format.quantize_nvfp4``: under the Triton interpreter (CPU, precise mode), compiled ahead of time for
SM90 / SM100 / SM120 (CPU), and on the GPU (``gpu``), byte for byte."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed, so the quantize kernel tests did not run; they "
                                               "run wherever Triton is installed, as in CI (pip install -e '.[test]')")
import triton.language as tl  # noqa: E402

from diffusers_nvfp4_fast.format import e2m1_round, pack_nibbles  # noqa: E402
from diffusers_nvfp4_fast.format import quantize_nvfp4 as reference_quantize  # noqa: E402
from diffusers_nvfp4_fast.kernels.nvfp4_epilogue import e2m1_value, e2m1_words  # noqa: E402
from support.inputs import INPUT_KINDS, adversarial, global_scale_for, make_input  # noqa: E402
from support.interpreter import run_interpreted  # noqa: E402

ROWS = (1, 17, 128, 512, 4096, 4608)


def quantize_cases() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Inputs for the interpreter: odd shapes, FP16, special values, every scale binade, a row-strided view."""
    torch.manual_seed(0)
    g = torch.tensor([2688 / 5.0])
    cases = []
    for m, k, dtype in [(1, 64, torch.bfloat16), (17, 48, torch.bfloat16), (130, 160, torch.bfloat16),
                        (33, 96, torch.float16)]:
        x = (torch.randn(m, k) * 3).to(dtype)
        x[0, :16] = 0
        if m > 3:
            x[1, 3] = float("nan")
            x[2, 5] = float("inf")
            x[2, 6] = -1e-30
            x[3, 16:32] = -0.0
        cases.append((x, g))
    # every scale binade, including E4M3 subnormals, saturation and underflow to 0
    x = (torch.rand(64, 512) * 2 ** torch.randint(-40, 12, (64, 512)).float()).bfloat16()
    cases.append((x, torch.tensor([1.0])))
    cases.append((torch.randn(20, 200).bfloat16()[:, 8:168], g))  # row-strided view
    return cases


def interpreted_quantize() -> dict:
    from diffusers_nvfp4_fast.kernels import quantize_nvfp4_triton

    results = []
    for x, g in quantize_cases():
        got, ref = quantize_nvfp4_triton(x, g, fast_math=False), reference_quantize(x, g[0], fast_math=False)
        results.append(torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]))
    x, g = quantize_cases()[0]
    got, ref = quantize_nvfp4_triton(x, g, fast_math=False), reference_quantize(x, g[0], fast_math=False)
    ref[0][0, 0] ^= 0x10  # a broken reference must be caught
    return {"equal": results, "canary_equal": torch.equal(got[0], ref[0])}


def interpreted_quantize_decoded() -> dict:
    """The fused quantize-to-FP16 kernel against decode(quantize(x)) on every case above (precise mode)."""
    from diffusers_nvfp4_fast.format import decode_nvfp4
    from diffusers_nvfp4_fast.kernels import quantize_nvfp4_decoded

    results = []
    for x, g in quantize_cases():
        want = decode_nvfp4(*reference_quantize(x, g[0], fast_math=False), dtype=torch.float16)
        got = quantize_nvfp4_decoded(x, g, fast_math=False)
        results.append(torch.equal(got.view(torch.int16), want.view(torch.int16)))
    return {"equal": results}


def test_interpreted_quantize_decoded_equals_decode_of_quantize():
    """Bit for bit (signed zeros included): the values the large-M GEMM would decode the packed activation to."""
    res = run_interpreted(__name__, "interpreted_quantize_decoded")
    assert len(res["equal"]) == len(quantize_cases()) and all(res["equal"]), res


def e2m1_boundary_values() -> torch.Tensor:
    """Every BF16 bit pattern (as FP32), the 4096 FP32 neighbours on each side of every rounding midpoint and code
    value, NaNs of both signs; each value appears once at every nibble position of an eight-value word."""
    points = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0])
    steps = torch.arange(-4096, 4097, dtype=torch.int32)
    near = (points.view(torch.int32)[:, None] + steps[None, :]).flatten()
    near = near[near >= 0].view(torch.float32)
    every_bf16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    nans = torch.tensor([0x7FC00000, 0x7F800001, -0x00400000, -0x00000001], dtype=torch.int32).view(torch.float32)
    x = torch.cat([near, -near, every_bf16, nans])
    x = torch.cat([x, torch.zeros((-x.numel()) % 8)])
    return torch.cat([torch.roll(x.view(-1, 8), shifts=k, dims=1).flatten() for k in range(8)])


@triton.jit
def _e2m1_probe(x_ptr, out_ptr, n_words, BLOCK: tl.constexpr):
    words = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + words[:, None] * 8 + tl.arange(0, 8)[None, :], mask=words[:, None] < n_words, other=0.0)
    tl.store(out_ptr + words, e2m1_words(x, False), mask=words < n_words)


def interpreted_e2m1_words() -> dict:
    x = e2m1_boundary_values()
    got = torch.empty(x.numel() // 8, dtype=torch.int32)
    _e2m1_probe[(triton.cdiv(got.numel(), 1024),)](x, got, got.numel(), BLOCK=1024)
    want = pack_nibbles(e2m1_round(x)).view(torch.int32)
    bad = (got != want).nonzero().flatten()
    return {"checked": x.numel(), "mismatches": bad.numel(), "first": x.view(-1, 8)[bad[:3]].tolist()}


@triton.jit
def _e2m1_value_probe(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, e2m1_value(tl.load(x_ptr + i, mask=i < n, other=0.0)), mask=i < n)


def interpreted_e2m1_values() -> dict:
    """The decoded quantize's rounding to E2M1 values (no codes) against the value of the reference's code."""
    x = e2m1_boundary_values()
    x = x[: x.numel() // 8]  # each value once: the eight rolled copies only move it inside an eight-value word
    got = torch.empty_like(x)
    _e2m1_value_probe[(triton.cdiv(x.numel(), 1024),)](x, got, x.numel(), BLOCK=1024)
    codes = e2m1_round(x).long()
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    want = torch.where(codes >= 8, -table[codes & 7], table[codes & 7])  # code 8 is -0.0
    bad = (got.view(torch.int32) != want.view(torch.int32)).nonzero().flatten()
    return {"checked": x.numel(), "mismatches": bad.numel(), "first": x[bad[:3]].tolist(),
            "negative_zeros": int((want.view(torch.int32) == -2**31).sum())}


def interpreted_fuzz() -> dict:
    from diffusers_nvfp4_fast.kernels import quantize_nvfp4_triton

    g = torch.tensor([2688 / 5.0])
    x = adversarial(96, 1024, device="cpu", seed=1)
    got, want = quantize_nvfp4_triton(x, g, fast_math=False), reference_quantize(x, g[0], fast_math=False)
    return {"elements": x.numel(), "equal": torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])}


def test_interpreted_fuzz_matches_reference():
    res = run_interpreted(__name__, "interpreted_fuzz")
    assert res["equal"], res


def test_interpreted_kernel_matches_reference():
    res = run_interpreted(__name__, "interpreted_quantize")
    assert all(res["equal"]), res
    assert not res["canary_equal"]


def test_e2m1_encoder_matches_reference_on_every_boundary():
    res = run_interpreted(__name__, "interpreted_e2m1_words")
    assert res["checked"] > 500_000 and res["mismatches"] == 0, res


def test_e2m1_values_match_the_reference_codes_on_every_boundary():
    """Bit for bit, signed zeros included: what ``quantize_nvfp4_decoded`` multiplies by the block scale."""
    res = run_interpreted(__name__, "interpreted_e2m1_values")
    assert res["checked"] > 300_000 and res["mismatches"] == 0 and res["negative_zeros"] > 0, res


@pytest.mark.parametrize("capability", [90, 100, 120])
@pytest.mark.parametrize("fast_math", [True, False])
def test_compiles_ahead_of_time(capability, fast_math):
    from support.sass_count import compile_kernel

    compiled = compile_kernel("quantize", capability, fast_math)
    assert ("cvt.rn.satfinite.e2m1x2.f32" in compiled.asm["ptx"]) == (capability >= 100)
    assert ("rcp.approx.ftz.f32" in compiled.asm["ptx"]) == fast_math
    assert len(compiled.asm["cubin"]) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("kind", INPUT_KINDS)
def test_gpu_equals_reference_precise(rows, kind):
    from diffusers_nvfp4_fast.kernels import quantize_nvfp4_triton

    x = make_input(kind, rows, 24576 if rows <= 512 else 6144 + 2048)
    g = global_scale_for(x)
    got, want = quantize_nvfp4_triton(x, g, fast_math=False), reference_quantize(x, g, fast_math=False)
    assert torch.equal(got[0], want[0]), f"packed: {(got[0] != want[0]).sum().item()} bytes differ"
    assert torch.equal(got[1], want[1]), f"scales: {(got[1] != want[1]).sum().item()} bytes differ"


@pytest.mark.gpu
def test_gpu_fast_math_differs_only_where_rcp_approx_does():
    """Fast-math vs the CPU's fast-math stand-in (correctly rounded reciprocal): the scales agree everywhere, and
    the few packed bytes that differ come from the 1-ulp approximate reciprocal (docs/design.md §3)."""
    from diffusers_nvfp4_fast.kernels import quantize_nvfp4_triton

    x = make_input("randn", 4096, 6144)
    g = global_scale_for(x)
    got = quantize_nvfp4_triton(x, g, fast_math=True)
    cpu = reference_quantize(x.cpu(), g.cpu(), fast_math=True)
    assert torch.equal(got[1].cpu(), cpu[1])
    mismatch = (got[0].cpu() != cpu[0]).float().mean().item()
    assert mismatch < 1e-3, f"{mismatch:.2e} of packed bytes differ from the CPU stand-in"


@pytest.mark.gpu
@pytest.mark.parametrize("fast_math", [False, True], ids=["precise", "fast"])
def test_gpu_fuzz_50m_adversarial_elements(fast_math):
    """4096 x 12288 = 50.3M adversarial values per mode against the torch reference (fast-math with the GPU's
    ``rcp.approx.ftz.f32`` in the reference, so both modes are compared byte for byte)."""
    from diffusers_nvfp4_fast.kernels import quantize_nvfp4_triton
    from support.rcp import exact_fast_math_reference

    x = adversarial(4096, 12288, seed=11)
    g = torch.tensor([2688 / 5.0], device="cuda")
    with exact_fast_math_reference():
        want = reference_quantize(x, g, fast_math=fast_math)
    got = quantize_nvfp4_triton(x, g, fast_math=fast_math)
    assert x.numel() >= 5e7
    assert torch.equal(got[0], want[0]), f"packed: {(got[0] != want[0]).sum().item()} bytes differ"
    assert torch.equal(got[1], want[1]), f"scales: {(got[1] != want[1]).sum().item()} bytes differ"


@pytest.mark.gpu
@pytest.mark.parametrize("rows,k", [(1, 64), (65, 3072), (4096, 3072), (512, 12288), (4608, 6144 + 2048)])
@pytest.mark.parametrize("fast_math", [False, True], ids=["precise", "fast"])
def test_gpu_quantize_decoded_equals_decode_of_quantize(rows, k, fast_math):
    """The fused kernel gives the bytes of the standalone quantize followed by the GEMM's standalone decode."""
    from diffusers_nvfp4_fast.kernels import quantize_nvfp4_decoded, quantize_nvfp4_triton
    from diffusers_nvfp4_fast.kernels.nvfp4_gemm import decode_nvfp4_rows

    x = adversarial(rows, k, seed=rows) if rows > 1 else make_input("randn", rows, k)
    g = torch.tensor([2688 / 5.0], device="cuda")
    want = decode_nvfp4_rows(*quantize_nvfp4_triton(x, g, fast_math=fast_math), torch.float16)
    got = quantize_nvfp4_decoded(x, g, fast_math=fast_math)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), \
        f"{(got.view(torch.int16) != want.view(torch.int16)).sum().item()} values differ"
