"""GPU: the standalone and token-cat quantize kernels against the torch reference, byte for byte."""

import pytest
import torch

from diffusers_nvfp4_fast import kernels
from diffusers_nvfp4_fast.format import quantize_nvfp4 as reference_quantize
from tests.gpu.inputs import INPUT_KINDS, make_input

pytestmark = pytest.mark.gpu

WIDTHS = {"dev": (6144, 18432), "klein4b": (3072, 9216), "klein9b": (4096, 12288)}
ROWS = (1, 17, 128, 512, 4096, 4608)


def _g(x: torch.Tensor) -> torch.Tensor:
    amax = x.float().abs().nan_to_num(0.0, 0.0, 0.0).max().clamp(min=1e-12)
    return (448.0 * 6.0 / amax).reshape(1).to(torch.float32)


def _assert_same(got, ref):
    assert torch.equal(got[0], ref[0]), f"packed: {(got[0] != ref[0]).sum().item()} bytes differ"
    assert torch.equal(got[1], ref[1]), f"scales: {(got[1] != ref[1]).sum().item()} bytes differ"


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("kind", INPUT_KINDS)
def test_standalone_equals_reference_precise(rows, kind):
    x = make_input(kind, rows, 24576 if rows <= 512 else 6144 + 2048)
    g = _g(x)
    _assert_same(kernels.quantize_nvfp4(x, g, fast_math=False), reference_quantize(x, g, fast_math=False))


@pytest.mark.parametrize("model", sorted(WIDTHS))
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("kind", INPUT_KINDS)
def test_token_cat_equals_quantize_of_cat(model, rows, kind):
    a_width, b_width = WIDTHS[model]
    attn = make_input(kind, rows, a_width, seed=1)
    mlp = make_input(kind, rows, b_width, seed=2) * 0.5
    g = _g(torch.cat([attn, mlp], -1))
    cat = torch.cat([attn, mlp], -1)
    for fast in (False, True):
        fused = kernels.token_cat_quantize(attn, mlp, g, fast_math=fast)
        _assert_same(fused, kernels.quantize_nvfp4(cat, g, fast_math=fast))
    _assert_same(kernels.token_cat_quantize(attn, mlp, g, fast_math=False), reference_quantize(cat, g, fast_math=False))


def test_token_cat_70000_rows_batch2_and_strided():
    a_width, b_width = WIDTHS["klein4b"]
    attn = make_input("randn", 70_000, a_width)
    mlp = make_input("randn", 70_000, b_width, seed=3)
    g = _g(mlp)
    ref = reference_quantize(torch.cat([attn, mlp], -1), g, fast_math=False)
    _assert_same(kernels.token_cat_quantize(attn, mlp, g, fast_math=False), ref)
    # batch 2, leading dims flattened
    a3, m3 = attn[:4608 * 2].reshape(2, 4608, a_width), mlp[:4608 * 2].reshape(2, 4608, b_width)
    _assert_same(kernels.token_cat_quantize(a3, m3, g, fast_math=True),
                 kernels.quantize_nvfp4(torch.cat([a3, m3], -1).reshape(-1, a_width + b_width), g, fast_math=True))
    # row-strided inputs (views into a wider buffer)
    wide = make_input("randn", 1000, a_width + 64, seed=4)
    view = wide[:, 32:32 + a_width]
    _assert_same(kernels.token_cat_quantize(view, mlp[:1000], g, fast_math=False),
                 reference_quantize(torch.cat([view, mlp[:1000]], -1), g, fast_math=False))


def test_fast_math_differs_only_where_rcp_approx_does():
    """Fast-math standalone vs the CPU's fast-math stand-in: any difference must be a 1-ulp reciprocal effect,
    i.e. the scales agree everywhere (they do not depend on the approximate reciprocal except through g)."""
    x = make_input("randn", 4096, 6144)
    g = _g(x)
    got = kernels.quantize_nvfp4(x, g, fast_math=True)
    cpu = reference_quantize(x.cpu(), g.cpu(), fast_math=True)
    assert torch.equal(got[1].cpu(), cpu[1])
    mismatch = (got[0].cpu() != cpu[0]).float().mean().item()
    assert mismatch < 1e-3, f"{mismatch:.2e} of packed bytes differ from the CPU stand-in"
