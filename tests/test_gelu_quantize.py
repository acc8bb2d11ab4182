"""The fused GELU (tanh) quantize kernel (``kernels/gelu_quantize.py``): ``quantize(gelu(h, approximate="tanh"))``
without writing the activation, byte for byte: under the Triton interpreter (CPU; it has no libdevice, so the kernel's
tanh there is ``1 - 2 / (exp(2x) + 1)`` and the reference repeats that arithmetic in NumPy), compiled ahead of time for
SM90 / SM100 / SM120 (CPU), and on the GPU against diffusers' own torch op (``gpu``)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed, so the GELU kernel tests did not run; they "
                                               "run wherever Triton is installed, as in CI (pip install -e '.[test]')")
from diffusers_nvfp4_fast import caches  # noqa: E402
from diffusers_nvfp4_fast.format import quantize_nvfp4 as reference_quantize  # noqa: E402
from diffusers_nvfp4_fast.ops.gelu_quantize import gelu_quantize_reference  # noqa: E402
from support.inputs import INPUT_KINDS, gelu_adversarial, global_scale_for, make_input  # noqa: E402
from support.interpreter import run_interpreted  # noqa: E402

WIDTHS = (12288, 3072)  # Qwen-Image's FC2 input; a narrower one
ROWS = (1, 17, 512, 4096)


def _same(got, want) -> None:
    assert torch.equal(got[0], want[0]), f"packed: {(got[0] != want[0]).sum().item()} bytes differ"
    assert torch.equal(got[1], want[1]), f"scales: {(got[1] != want[1]).sum().item()} bytes differ"


def interpreter_gelu(h: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic under the interpreter, in NumPy FP32: torch's rounding steps, the interpreter's
    ``tl.fma`` (a product and a sum, each rounded) and its tanh stand-in."""
    from diffusers_nvfp4_fast.kernels.gelu_quantize import GELU_BETA, GELU_KAPPA

    x = h.float().numpy()
    f = np.float32
    with np.errstate(over="ignore", invalid="ignore"):
        inner = f(GELU_BETA.value) * (f(GELU_KAPPA.value) * ((x * x) * x) + x)
        t = f(1) - f(2) / (np.exp(f(2) * inner) + f(1))
        y = (f(0.5) * x) * (f(1) + t)
    return torch.from_numpy(y.astype(np.float32)).to(h.dtype)


def interpreted_gelu() -> dict:
    from diffusers_nvfp4_fast.format import decode_nvfp4
    from diffusers_nvfp4_fast.kernels import gelu_quantize_decoded_triton, gelu_quantize_triton

    result = {}
    g = torch.tensor([2688 / 40.0])
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        h = gelu_adversarial(40, 96, device="cpu", seed=1).to(dtype)
        wide = torch.cat([torch.zeros(40, 32, dtype=dtype), h], -1)[:, 32:]  # a row-strided view
        equal = []
        for x, block_c in ((h, 16), (h, 4), (wide, 8), (h[:3], 16)):
            # Precise quantizer only: the fast-math one's rcp.approx is inline PTX, which the interpreter cannot run.
            got = gelu_quantize_triton(x, g, fast_math=False, block_c=block_c)
            want = reference_quantize(interpreter_gelu(x), g[0], fast_math=False)
            equal.append(torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]))
            decoded = gelu_quantize_decoded_triton(x, g, fast_math=False, block_c=block_c)
            equal.append(torch.equal(decoded.view(torch.int16),
                                     decode_nvfp4(*want, dtype=torch.float16).view(torch.int16)))
        result[name] = equal
    return result


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_interpreted_kernel_matches_gelu_then_quantize(dtype):
    """Packed bytes and scales, and the FP16 values of the decoded variant (signed zeros included)."""
    result = run_interpreted(__name__, "interpreted_gelu")[dtype]
    assert len(result) == 8 and all(result), result


def test_reference_is_diffusers_gelu():
    """The op's reference computes what diffusers' ``GELU`` module (tanh) computes after its projection, then the
    unfused quantize."""
    from diffusers.models.activations import GELU

    h = gelu_adversarial(8, 64, device="cpu")
    g = global_scale_for(make_input("randn", 8, 64, device="cpu"))
    module_out = GELU(64, 64, approximate="tanh").gelu(h)
    _same(gelu_quantize_reference(h, g, False), reference_quantize(module_out, g, fast_math=False))


@pytest.mark.parametrize("capability", [90, 100, 120])
@pytest.mark.parametrize("fast_math", [True, False])
def test_compiles_ahead_of_time(capability, fast_math):
    from support.sass_count import compile_kernel

    compiled = compile_kernel("gelu", capability, fast_math, block_c=16)
    ptx = compiled.asm["ptx"]
    assert ("cvt.rn.satfinite.e2m1x2.f32" in ptx) == (capability >= 100)
    # libdevice's tanhf is linked in (no tanh.approx), and the one FMA torch's nvcc build contracts is there.
    assert "tanh.approx" not in ptx and "fma.rn.f32" in ptx
    assert len(compiled.asm["cubin"]) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("kind", [*INPUT_KINDS, "gelu_adversarial"])
def test_gpu_equals_diffusers_gelu_then_quantize(width, rows, kind):
    from diffusers_nvfp4_fast.kernels import gelu_quantize_triton

    h = gelu_adversarial(rows, width, seed=3) if kind == "gelu_adversarial" else make_input(kind, rows, width, seed=3)
    g = global_scale_for(make_input("randn", rows, width, seed=4))
    for fast in (False, True):
        _same(gelu_quantize_triton(h, g, fast_math=fast), gelu_quantize_reference(h, g, fast))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_gelu_equals_torch_on_every_value(dtype):
    """All 65,536 bit patterns through the kernel's GELU alone against torch's CUDA GELU (before the quantize, so a
    single differing value cannot hide in a block's rounding): what ``gelu_mismatch`` checks at run time. NaN outputs
    must be NaN on both sides; their payloads are compared too (both round with ``cvt.rn``)."""
    from diffusers_nvfp4_fast.kernels import gelu_triton
    from diffusers_nvfp4_fast.ops.gelu_quantize import gelu_mismatch

    assert gelu_mismatch(torch.device("cuda"), dtype) is None
    x = torch.arange(65536, dtype=torch.int32, device="cuda").to(torch.int16).view(dtype)
    got, want = gelu_triton(x).view(torch.int16), torch.nn.functional.gelu(x, approximate="tanh").view(torch.int16)
    differ = (got != want).nonzero().flatten()
    assert differ.numel() == 0, f"{differ.numel()} values differ, e.g. inputs {x[differ[:8]].float().tolist()}"


@pytest.mark.gpu
def test_gpu_inductors_gelu_equals_torchs_on_every_value(monkeypatch):
    """What lets compiled graphs run the GELU site: inside ``exact_inductor`` inductor's GELU (tanh) gives torch's
    bytes on all 65,536 BF16 and FP16 values (``check_compiled_gelu``, run by entering the block)."""
    from diffusers_nvfp4_fast import exact_inductor
    from diffusers_nvfp4_fast.ops import gelu_quantize

    caches.reset("ops.gelu_quantize.compiled_mismatch")
    with exact_inductor():
        pass
    device = f"cuda:{torch.cuda.current_device()}"
    assert gelu_quantize.compiled_gelu_reason(device, True) == ""
    assert gelu_quantize.compiled_gelu_reason(device, False) == ""


def interpreted_mismatch() -> dict:
    """``gelu_mismatch`` on the CPU under the interpreter, where the kernel's tanh is a stand-in: it must notice."""
    from diffusers_nvfp4_fast.ops import gelu_quantize

    return {"bf16": gelu_quantize.gelu_mismatch(torch.device("cpu"), torch.bfloat16)}


def test_gelu_mismatch_reports_a_kernel_that_differs():
    """The run-time check is not vacuous: with the interpreter's tanh stand-in the kernel's GELU differs from torch's
    CPU GELU on some values, and the check says how many, with examples."""
    reason = run_interpreted(__name__, "interpreted_mismatch")["bf16"]
    assert reason is not None and "of 65536 torch.bfloat16 values differ from torch's GELU, e.g. [" in reason, reason


@pytest.mark.gpu
def test_gpu_strided_batched_and_fp16():
    from diffusers_nvfp4_fast.kernels import gelu_quantize_triton

    wide = gelu_adversarial(2 * 500, 12288 + 64, seed=5).reshape(2, 500, -1)
    h = wide[..., 64:]  # strided rows
    g = torch.tensor([2688 / 5.0], device="cuda")
    for fast in (False, True):
        _same(gelu_quantize_triton(h, g, fast_math=fast), gelu_quantize_reference(h, g, fast))
        _same(gelu_quantize_triton(h.half(), g, fast_math=fast), gelu_quantize_reference(h.half(), g, fast))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [65, 512, 4096])
def test_gpu_decoded_variant_equals_decode_of_the_packed_result(rows):
    """The variant for a GEMM that multiplies FP16 values gives ``decode(gelu_quantize(h))``, bit for bit."""
    from diffusers_nvfp4_fast.kernels import gelu_quantize_decoded_triton, gelu_quantize_triton
    from diffusers_nvfp4_fast.kernels.nvfp4_gemm import decode_nvfp4_rows

    h = gelu_adversarial(rows, 12288, seed=rows)
    g = torch.tensor([2688 / 5.0], device="cuda")
    for fast in (False, True):
        want = decode_nvfp4_rows(*gelu_quantize_triton(h, g, fast_math=fast), torch.float16)
        got = gelu_quantize_decoded_triton(h, g, fast_math=fast)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [64, 512, 4096])
@pytest.mark.parametrize("verify", ["first", "always"])
def test_gpu_fc2_on_gelu_gives_the_unfused_bytes_through_its_plan(rows, verify):
    """FC2 called on a ``GeluOperand`` (one op: the GELU quantize, then the GEMM) equals FC2 on torch's GELU output
    at every call; with verification "first", the class gets a launch plan (the GELU kernel and the GEMM launched
    directly) after its verified call, and every call counts as fused; with "always" no plan skips the check."""
    from diffusers_nvfp4_fast import NVFP4Linear
    from diffusers_nvfp4_fast.ops import linear
    from diffusers_nvfp4_fast.ops.site import Site
    from diffusers_nvfp4_fast.ops.verify import drop_stats, new_stats, reset_verification
    from diffusers_nvfp4_fast.patches.operands import GeluOperand

    linear.forget_plans()
    reset_verification()  # a verdict is per call class, and rows are not part of the class
    stats_id, stats = new_stats(verify)
    torch.manual_seed(rows)
    fc2 = NVFP4Linear.from_weight(torch.randn(3072, 12288, device="cuda", dtype=torch.bfloat16) * 0.02,
                                  torch.randn(3072, device="cuda", dtype=torch.bfloat16), 6.0 / 2688)
    y = torch.randn(1, rows, 12288, device="cuda", dtype=torch.bfloat16) * 3
    want = fc2(torch.nn.functional.gelu(y, approximate="tanh"))
    try:
        for call in range(5):
            got = fc2(GeluOperand(y, Site(stats_id, "qwen_gelu")))
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), call
        planned = [plan for plan in linear.planned() if hasattr(plan, "call_class")]  # FC2-on-GELU plans
    finally:
        drop_stats(stats_id)
        linear.forget_plans()
    assert stats.fused_calls["qwen_gelu"] == 5 and not stats.fallbacks and not stats.verify_failed
    assert stats.verified["qwen_gelu"] == (1 if verify == "first" else 5)
    direct = importlib.import_module("diffusers_nvfp4_fast.kernels.launch").direct_launch_unavailable() is None
    assert len(planned) == (1 if rows > 64 and direct else 0), planned  # 64 rows: packed activation, no plan
    assert all(plan.call_class for plan in planned)  # each plan carries the verification key it runs under
