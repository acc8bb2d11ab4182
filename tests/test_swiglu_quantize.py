"""The fused SwiGLU quantize kernel (``kernels/swiglu_quantize.py``): ``quantize(cat([attn, silu(gate) * up]))``
without writing the activation, byte for byte: under the Triton interpreter (CPU; the interpreter's exp is NumPy's,
so the reference there computes SiLU with NumPy's exp), compiled ahead of time for SM90 / SM100 / SM120 (CPU), and on
the GPU against diffusers' own torch ops (``gpu``), where both use CUDA's ``expf``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed, so the SwiGLU kernel tests did not run; they "
                                               "run wherever Triton is installed, as in CI (pip install -e '.[test]')")
from diffusers_nvfp4_fast.format import quantize_nvfp4 as reference_quantize  # noqa: E402
from diffusers_nvfp4_fast.ops.swiglu_quantize import (  # noqa: E402
    swiglu_gate_up_quantize_reference,
    swiglu_gate_up_reference,
    swiglu_quantize_reference,
)
from support.inputs import INPUT_KINDS, adversarial, global_scale_for, make_input, swiglu_adversarial  # noqa: E402
from support.interpreter import run_interpreted  # noqa: E402

WIDTHS = {"dev": (6144, 18432), "klein4b": (3072, 9216), "klein9b": (4096, 12288)}  # attention, SwiGLU output
ROWS = (1, 17, 512, 4608)


def _same(got, want) -> None:
    assert torch.equal(got[0], want[0]), f"packed: {(got[0] != want[0]).sum().item()} bytes differ"
    assert torch.equal(got[1], want[1]), f"scales: {(got[1] != want[1]).sum().item()} bytes differ"


def numpy_swiglu(hidden: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` with torch's rounding steps and NumPy's FP32 exp (the interpreter's)."""
    half = hidden.shape[-1] // 2
    gate = hidden[..., :half].float().numpy()
    with np.errstate(over="ignore", invalid="ignore"):
        silu = torch.from_numpy(gate / (np.float32(1.0) + np.exp(-gate))).to(hidden.dtype)
    return (silu.float() * hidden[..., half:].float()).to(hidden.dtype)


def _interpreted_cases(dtype: torch.dtype) -> list[bool]:
    from diffusers_nvfp4_fast.kernels import swiglu_gate_up_quantize_triton, swiglu_quantize_triton

    g = torch.tensor([2688 / 40.0])
    hidden = swiglu_adversarial(40, 96, device="cpu", seed=1).to(dtype)
    attn = adversarial(40, 48, device="cpu", seed=2).to(dtype)
    wide = torch.cat([torch.zeros(40, 32, dtype=dtype), hidden], -1)[:, 32:]  # a row-strided view
    equal = []
    for h, a, block_c in ((hidden, None, 16), (hidden, attn, 4), (hidden, attn, 16), (wide, attn, 8)):
        x = numpy_swiglu(h) if a is None else torch.cat([a, numpy_swiglu(h)], -1)
        # Precise quantizer only: the fast-math one's rcp.approx is inline PTX, which the interpreter cannot run.
        got = swiglu_quantize_triton(h, g, a, fast_math=False, block_c=block_c)
        want = reference_quantize(x, g[0], fast_math=False)
        equal.append(torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]))
    # Gate and up as two tensors (Qwen-Image 2.1's gate_layer and proj outputs), one of them row-strided.
    gate, up = hidden.chunk(2, dim=-1)
    for u in (up.contiguous(), up):
        got = swiglu_gate_up_quantize_triton(gate.contiguous(), u, g, fast_math=False, block_c=16)
        want = reference_quantize(numpy_swiglu(hidden), g[0], fast_math=False)
        equal.append(torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]))
    return equal


def interpreted_swiglu() -> dict:
    return {"bf16": _interpreted_cases(torch.bfloat16), "fp16": _interpreted_cases(torch.float16)}


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_interpreted_kernel_matches_swiglu_then_quantize(dtype):
    """One tensor [gate | up] (FLUX.2), with and without the attention part in front, and gate and up as two
    tensors (Qwen-Image 2.1), contiguous and row-strided."""
    result = run_interpreted(__name__, "interpreted_swiglu")[dtype]
    assert len(result) == 6 and all(result), result


def test_gate_up_reference_is_diffusers_qwen21_feed_forward():
    """The gate/up op's reference computes what diffusers' ``QwenImage21SwiGLUFeedForward`` computes between its
    projections (its ``activation_fn`` and the product), then the unfused quantize."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21SwiGLUFeedForward

    ff = QwenImage21SwiGLUFeedForward(32, 64).to(torch.bfloat16)
    hidden = swiglu_adversarial(8, 128, device="cpu")
    gate, up = hidden.chunk(2, dim=-1)
    module_out = ff.activation_fn(gate) * up
    g = global_scale_for(module_out)
    _same(swiglu_gate_up_quantize_reference(gate, up, g, False), reference_quantize(module_out, g, fast_math=False))


def test_reference_is_diffusers_swiglu():
    """The op's reference computes what diffusers' ``Flux2SwiGLU`` module computes, then the unfused quantize."""
    from diffusers.models.transformers.transformer_flux2 import Flux2SwiGLU

    hidden, attn = swiglu_adversarial(8, 64, device="cpu"), make_input("randn", 8, 32, device="cpu")
    g = global_scale_for(attn)
    module_out = torch.cat([attn, Flux2SwiGLU()(hidden)], -1)
    _same(swiglu_quantize_reference(hidden, attn, g, False), reference_quantize(module_out, g, fast_math=False))


@pytest.mark.parametrize("capability", [90, 100, 120])
@pytest.mark.parametrize("fast_math", [True, False])
def test_compiles_ahead_of_time(capability, fast_math):
    from support.sass_count import compile_kernel

    compiled = compile_kernel("swiglu", capability, fast_math, block_c=16)
    ptx = compiled.asm["ptx"]
    assert ("cvt.rn.satfinite.e2m1x2.f32" in ptx) == (capability >= 100)
    # libdevice's expf (its range reduction is the only FMA: contraction is off) and the IEEE division.
    assert "ex2.approx" in ptx and "fma.rn" in ptx and "div.rn.f32" in ptx
    assert len(compiled.asm["cubin"]) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("model", sorted(WIDTHS))
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("kind", [*INPUT_KINDS, "swiglu_adversarial"])
def test_gpu_equals_diffusers_swiglu_then_quantize(model, rows, kind):
    from diffusers_nvfp4_fast.kernels import swiglu_quantize_triton

    a_width, h_width = WIDTHS[model]
    if kind == "swiglu_adversarial":
        hidden = swiglu_adversarial(rows, h_width, seed=3)
    else:
        hidden = make_input(kind, rows, 2 * h_width, seed=3)
    attn = make_input("randn", rows, a_width, seed=4)
    g = global_scale_for(attn)
    for fast in (False, True):
        for a in (None, attn):
            _same(swiglu_quantize_triton(hidden, g, a, fast_math=fast), swiglu_quantize_reference(hidden, a, g, fast))


@pytest.mark.gpu
def test_gpu_strided_batched_and_fp16():
    """The single-stream layout (``hidden`` split from a wider projection, leading batch dims) and FP16."""
    from diffusers_nvfp4_fast.kernels import swiglu_quantize_triton

    a_width, h_width = WIDTHS["klein4b"]
    projected = swiglu_adversarial(2 * 1000, 3 * a_width // 2 + h_width, seed=5).reshape(2, 1000, -1)
    hidden = projected[..., -2 * h_width:]  # strided rows, as split from a fused projection
    attn = make_input("randn", 2000, a_width, seed=6).reshape(2, 1000, a_width)
    g = global_scale_for(attn)
    for fast in (False, True):
        _same(swiglu_quantize_triton(hidden, g, attn, fast_math=fast), swiglu_quantize_reference(hidden, attn, g, fast))
        half = hidden.half(), attn.half()
        _same(swiglu_quantize_triton(half[0], g, half[1], fast_math=fast),
              swiglu_quantize_reference(half[0], half[1], g, fast))


@pytest.mark.gpu
def test_gpu_fuzz_adversarial_rows():
    """2048 rows of FLUX.2-dev width, every SiLU edge case, both quantizer modes."""
    from diffusers_nvfp4_fast.kernels import swiglu_quantize_triton

    a_width, h_width = WIDTHS["dev"]
    hidden = swiglu_adversarial(2048, h_width, seed=7)
    attn = adversarial(2048, a_width, seed=8)
    g = torch.tensor([2688 / 5.0], device="cuda")
    for fast in (False, True):
        _same(swiglu_quantize_triton(hidden, g, attn, fast_math=fast), swiglu_quantize_reference(hidden, attn, g, fast))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", ROWS)
def test_gpu_gate_up_equals_diffusers_qwen21_feed_forward(rows):
    """Qwen-Image 2.1's feed-forward width (4096 x 3 = 12288): ``silu(gate) * up`` of two tensors, contiguous and as
    row-strided views, every SiLU edge case, both quantizer modes."""
    from diffusers_nvfp4_fast.kernels import swiglu_gate_up_quantize_triton

    hidden = swiglu_adversarial(rows, 12288, seed=9)
    gate, up = hidden.chunk(2, dim=-1)  # row-strided views
    g = global_scale_for(swiglu_gate_up_reference(gate, up))
    for fast in (False, True):
        for gt, u in ((gate, up), (gate.contiguous(), up.contiguous())):
            _same(swiglu_gate_up_quantize_triton(gt, u, g, fast_math=fast),
                  swiglu_gate_up_quantize_reference(gt, u, g, fast))
