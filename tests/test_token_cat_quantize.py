"""The fused FLUX.2 token-cat quantize kernel (``kernels/token_cat_quantize.py``): ``quantize(cat([attn, mlp]))``
without the concatenation, byte for byte, under the Triton interpreter (CPU), compiled ahead of time for SM90 /
SM100 / SM120 (CPU), and on the GPU (``gpu``)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed, so the token-cat kernel tests did not run; "
                                               "they run wherever Triton is installed, as in CI")
from diffusers_nvfp4_fast.format import quantize_nvfp4 as reference_quantize  # noqa: E402
from support.inputs import INPUT_KINDS, adversarial, global_scale_for, make_input  # noqa: E402
from support.interpreter import run_interpreted  # noqa: E402

WIDTHS = {"dev": (6144, 18432), "klein4b": (3072, 9216), "klein9b": (4096, 12288)}
ROWS = (1, 17, 128, 512, 4096, 4608)


def _same(got, want) -> None:
    assert torch.equal(got[0], want[0]), f"packed: {(got[0] != want[0]).sum().item()} bytes differ"
    assert torch.equal(got[1], want[1]), f"scales: {(got[1] != want[1]).sum().item()} bytes differ"


def interpreted_token_cat() -> dict:
    from diffusers_nvfp4_fast.kernels import token_cat_quantize_triton

    torch.manual_seed(0)
    g = torch.tensor([2688 / 5.0])
    a, b = torch.randn(3, 5, 48).bfloat16(), torch.randn(3, 5, 80).bfloat16() * 0.01
    equal = []
    for block_c in (4, 8):  # column tiles that straddle the attn / mlp boundary and tiles that do not
        got = token_cat_quantize_triton(a, b, g, fast_math=False, block_c=block_c)
        ref = reference_quantize(torch.cat([a, b], -1), g[0], fast_math=False)
        equal.append(torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]))
    return {"equal": equal}


def interpreted_fuzz() -> dict:
    from diffusers_nvfp4_fast.kernels import token_cat_quantize_triton

    g = torch.tensor([2688 / 5.0])
    attn, mlp = adversarial(40, 384, device="cpu", seed=2), adversarial(40, 640, device="cpu", seed=3)
    got = token_cat_quantize_triton(attn, mlp, g, fast_math=False)
    want = reference_quantize(torch.cat([attn, mlp], -1), g[0], fast_math=False)
    equal = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    return {"elements": attn.numel() + mlp.numel(), "equal": equal}


def test_interpreted_fuzz_matches_quantize_of_cat():
    res = run_interpreted(__name__, "interpreted_fuzz")
    assert res["equal"], res


def test_interpreted_kernel_matches_quantize_of_cat():
    assert all(run_interpreted(__name__, "interpreted_token_cat")["equal"])


@pytest.mark.parametrize("capability", [90, 100, 120])
@pytest.mark.parametrize("fast_math", [True, False])
def test_compiles_ahead_of_time(capability, fast_math):
    from support.sass_count import compile_kernel

    compiled = compile_kernel("token_cat", capability, fast_math)
    assert ("cvt.rn.satfinite.e2m1x2.f32" in compiled.asm["ptx"]) == (capability >= 100)
    assert ("rcp.approx.ftz.f32" in compiled.asm["ptx"]) == fast_math
    assert len(compiled.asm["cubin"]) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("model", sorted(WIDTHS))
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("kind", INPUT_KINDS)
def test_gpu_equals_quantize_of_cat(model, rows, kind):
    from diffusers_nvfp4_fast.kernels import quantize_nvfp4_triton, token_cat_quantize_triton

    a_width, b_width = WIDTHS[model]
    attn = make_input(kind, rows, a_width, seed=1)
    mlp = make_input(kind, rows, b_width, seed=2) * 0.5
    cat = torch.cat([attn, mlp], -1)
    g = global_scale_for(cat)
    for fast in (False, True):
        _same(token_cat_quantize_triton(attn, mlp, g, fast_math=fast), quantize_nvfp4_triton(cat, g, fast_math=fast))
    _same(token_cat_quantize_triton(attn, mlp, g, fast_math=False), reference_quantize(cat, g, fast_math=False))


@pytest.mark.gpu
def test_gpu_70000_rows_batch2_and_strided():
    from diffusers_nvfp4_fast.kernels import quantize_nvfp4_triton, token_cat_quantize_triton

    a_width, b_width = WIDTHS["klein4b"]
    attn = make_input("randn", 70_000, a_width)
    mlp = make_input("randn", 70_000, b_width, seed=3)
    g = global_scale_for(mlp)
    _same(token_cat_quantize_triton(attn, mlp, g, fast_math=False),
          reference_quantize(torch.cat([attn, mlp], -1), g, fast_math=False))
    a3, m3 = attn[:4608 * 2].reshape(2, 4608, a_width), mlp[:4608 * 2].reshape(2, 4608, b_width)  # leading dims
    _same(token_cat_quantize_triton(a3, m3, g, fast_math=True),
          quantize_nvfp4_triton(torch.cat([a3, m3], -1).reshape(-1, a_width + b_width), g, fast_math=True))
    wide = make_input("randn", 1000, a_width + 64, seed=4)  # row-strided views into a wider buffer
    view = wide[:, 32:32 + a_width]
    _same(token_cat_quantize_triton(view, mlp[:1000], g, fast_math=False),
          reference_quantize(torch.cat([view, mlp[:1000]], -1), g, fast_math=False))


@pytest.mark.gpu
@pytest.mark.parametrize("fast_math", [False, True], ids=["precise", "fast"])
def test_gpu_fuzz_50m_adversarial_elements(fast_math):
    """2048 rows x (6144 + 18432) = 50.3M adversarial values per mode against ``format.quantize_nvfp4`` of the
    concatenation (fast-math with the GPU's ``rcp.approx.ftz.f32`` in the reference)."""
    from diffusers_nvfp4_fast.kernels import token_cat_quantize_triton
    from support.rcp import exact_fast_math_reference

    attn, mlp = adversarial(2048, 6144, seed=12), adversarial(2048, 18432, seed=13)
    g = torch.tensor([2688 / 5.0], device="cuda")
    with exact_fast_math_reference():
        want = reference_quantize(torch.cat([attn, mlp], -1), g, fast_math=fast_math)
    assert attn.numel() + mlp.numel() >= 5e7
    _same(token_cat_quantize_triton(attn, mlp, g, fast_math=fast_math), want)
