"""The one-row NVFP4 product (``kernels/nvfp4_gemv.py``), the kernel of every NVFP4 layer call with one activation row
on SM80-SM90 (the modulation Linears).

Its summation order is part of the kernel, so ``gemv_reference`` (torch, the same sums in the same order) gives its
bytes on any device, and the tests compare with ``torch.equal``. CPU, under the Triton interpreter: the three forms of
the activation (packed, FP16 decode) against the reference for odd shapes, split K,
random bytes, bias and every output dtype; ``nvfp4_gemm`` routes one row to it. CPU, ahead of time: it compiles for
SM80 and SM90 without spilling. GPU (``gpu``): the model shapes against the reference, every form, repeat runs, and
``NVFP4Linear`` / ``quantized_linear`` calls (their launch plans, CUDA graphs) against the packed path.
"""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed, so the one-row product tests did not run; they run "
                                     "wherever Triton is installed, as in CI (pip install -e '.[test]')")
from diffusers_nvfp4_fast.format import decode_nvfp4, swizzle_scales  # noqa: E402
from diffusers_nvfp4_fast.format import quantize_nvfp4 as reference_quantize  # noqa: E402
from support.gpus import skip_unless_sm80_to_sm90  # noqa: E402
from support.interpreter import run_interpreted  # noqa: E402

gemv_mod = importlib.import_module("diffusers_nvfp4_fast.kernels.nvfp4_gemv")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _operands(n: int, k: int, seed: int, device: str = "cpu", random_bytes: bool = False):
    """(x BF16 [1, K], its global scale, W packed, W scales, alpha, x's exact values FP32 [K], W's FP32 [N, K]); with
    ``random_bytes`` W holds every code and scale byte (0..0x7E)."""
    from diffusers_nvfp4_fast import kernels

    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(1, k, generator=gen) * 3).to(torch.bfloat16).to(device)
    gx = (2688.0 / x.float().abs().amax()).reshape(1)
    if random_bytes:
        wp = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8).to(device)
        ws = swizzle_scales(torch.randint(0, 0x7F, (n, k // 16), generator=gen, dtype=torch.uint8)).to(device)
        gw = torch.tensor(1.0, device=device)
    else:
        w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16).to(device)
        gw = 2688.0 / w.float().abs().amax()
        wp, ws = reference_quantize(w, gw, fast_math=False)
    alpha = ((1 / gx) * (1 / gw)).reshape(1).float().to(device)
    xp, xs = kernels.quantize_nvfp4_triton(x, gx, fast_math=False)
    xv = decode_nvfp4(xp, xs, dtype=torch.float32)[0]
    wv = decode_nvfp4(wp, ws, dtype=torch.float32)
    return x, gx, wp, ws, alpha, xv, wv


def _forms(x, gx, wp, ws, alpha, dtype, bias=None, splits=None) -> dict[str, torch.Tensor]:
    """The product in each activation form (the quantizer's precise recipe)."""
    from diffusers_nvfp4_fast import kernels

    xp, xs = kernels.quantize_nvfp4_triton(x, gx, fast_math=False)
    x16 = kernels.quantize_nvfp4_decoded(x, gx, fast_math=False)
    return {
        "packed": gemv_mod.nvfp4_gemv(xp, wp, ws, alpha, dtype, x_scales=xs, bias=bias, splits=splits),
        "fp16": gemv_mod.nvfp4_gemv(x16, wp, ws, alpha, dtype, bias=bias, splits=splits),
    }


# ---------------------------------------------------------------------------------------------------------------
# CPU: the interpreter.
# ---------------------------------------------------------------------------------------------------------------


def interpreted_gemv() -> list[dict]:
    """Each case: its name and the forms whose bytes differ from ``gemv_reference`` (empty when all equal)."""
    gemm = importlib.import_module("diffusers_nvfp4_fast.kernels.nvfp4_gemm")
    results = []
    cases = [(70, 176, None, "float32", False), (72, 512, 2, "float32", False), (130, 384, 3, "float16", False),
             (64, 528, 2, "bfloat16", False), (72, 256, None, "float32", True), (66, 400, 2, "bfloat16", True)]
    for i, (n, k, splits, dtype_name, random_bytes) in enumerate(cases):
        x, gx, wp, ws, alpha, xv, wv = _operands(n, k, n + k, random_bytes=random_bytes)
        dtype = DTYPES[dtype_name]
        bias = (torch.randn(n, generator=torch.Generator().manual_seed(k)) * 0.3).to(dtype) if i % 2 else None
        want = gemv_mod.gemv_reference(xv, wv, alpha, dtype, bias, splits)
        got = _forms(x, gx, wp, ws, alpha, dtype, bias, splits)
        exact = gemv_mod.gemv_reference(xv, wv, alpha, torch.float32, None, splits)[0]
        emulated = (wv @ xv) * alpha
        results.append({"name": f"{n}x{k} splits={splits} {dtype_name} bias={bias is not None} random={random_bytes}",
                        "differing": [f for f, out in got.items() if not torch.equal(out, want)],
                        "emulation_rel": ((exact - emulated).norm() / emulated.norm()).item()})
    # A bias that is a strided view (every other element of a longer tensor) is read at its stride.
    x, gx, wp, ws, alpha, xv, wv = _operands(64, 256, 4)
    strided = torch.randn(128, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)[::2]
    want = gemv_mod.gemv_reference(xv, wv, alpha, torch.bfloat16, strided.contiguous())
    got = _forms(x, gx, wp, ws, alpha, torch.bfloat16, strided)
    results.append({"name": "strided bias", "differing": [f for f, out in got.items() if not torch.equal(out, want)]})
    # nvfp4_gemm routes one row here; kernel="gemv" refuses more rows.
    x, gx, wp, ws, alpha, xv, wv = _operands(96, 512, 3)
    xp, xs = importlib.import_module("diffusers_nvfp4_fast.kernels").quantize_nvfp4_triton(x, gx, fast_math=False)
    results.append({"name": "nvfp4_gemm one row", "differing": [] if torch.equal(
        gemm.nvfp4_gemm(xp, xs, wp, ws, alpha, torch.float32),
        gemv_mod.gemv_reference(xv, wv, alpha, torch.float32)) else ["nvfp4_gemm"]})
    two = torch.cat([x, x])
    tp, ts = importlib.import_module("diffusers_nvfp4_fast.kernels").quantize_nvfp4_triton(two, gx, fast_math=False)
    try:
        gemm.nvfp4_gemm(tp, ts, wp, ws, alpha, torch.float32, kernel="gemv")
        results.append({"name": "gemv with two rows", "error": None})
    except ValueError as exc:
        results.append({"name": "gemv with two rows", "error": str(exc)})
    return results


@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreted("test_gemv", "interpreted_gemv")


def test_interpreted_forms_equal_the_ordered_reference(interpreter_results):
    """Packed and FP16-decoded activations give the reference's bytes: odd N, K not a multiple
    of the K step, split K, random weight bytes, bias, FP32/FP16/BF16 outputs; and the reference is the emulation's
    value up to the summation order."""
    cases = [r for r in interpreter_results if "emulation_rel" in r]
    assert len(cases) == 6
    for r in cases:
        assert r["differing"] == [], r
        assert r["emulation_rel"] < 1e-5, r  # the emulation's terms, summed in another order


def test_interpreted_nvfp4_gemm_routes_one_row_to_the_gemv(interpreter_results):
    by_name = {r["name"]: r for r in interpreter_results}
    assert by_name["nvfp4_gemm one row"]["differing"] == []
    assert by_name["strided bias"]["differing"] == []
    assert "M=2" in by_name["gemv with two rows"]["error"]


def test_reference_order_is_not_the_plain_sum():
    """The reference sums in the kernel's order, which differs from a plain FP32 dot product: a case where the two
    orders round differently (so the equality tests above can fail)."""
    k = gemv_mod.GEMV_BLOCK_K * 2
    x = torch.zeros(k)
    x[0], x[1], x[gemv_mod.GEMV_BLOCK_K] = 1.0, 2.0 ** -24, -1.0
    w = torch.ones(1, k)
    ordered = gemv_mod.gemv_reference(x, w, torch.tensor([1.0]), torch.float32)
    left_to_right = torch.zeros(())
    for value in x:
        left_to_right = left_to_right + value
    # Column 0 adds 1 then -1 (= 0), column 1 holds 2^-24: the tree gives 2^-24; left to right 1 + 2^-24 rounds to 1.
    assert ordered.item() == 2.0 ** -24
    assert left_to_right.item() == 0.0


@pytest.mark.parametrize("arch", [80, 90])
def test_gemv_compiles_without_spills(arch):
    """Both activation forms compile for SM80 and SM90 ahead of time (no GPU needed) and keeps its accumulator in
    registers: no local-memory loads or stores in the SASS."""
    from support.sass_count import compile_gemv, disassemble

    for packed in (True, False):
        sass = disassemble(compile_gemv(packed, arch))
        assert "FFMA" in sass, packed
        assert "LDL" not in sass and "STL" not in sass, f"X_PACKED={packed} spills on sm_{arch}"


# ---------------------------------------------------------------------------------------------------------------
# GPU.
# ---------------------------------------------------------------------------------------------------------------


def _skip_unless_sm80_to_sm90():
    skip_unless_sm80_to_sm90("one-row product GPU test")


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(18432, 3072), (36864, 6144), (18432, 6144), (200, 176), (3072, 12288)])
def test_gpu_forms_equal_the_ordered_reference(n, k):
    """The modulation shapes of both models (and odd ones): every form, default and forced K splits, BF16 output
    with bias and FP32 output, equal to ``gemv_reference`` computed on the GPU; three repeat runs give the bytes."""
    _skip_unless_sm80_to_sm90()
    x, gx, wp, ws, alpha, xv, wv = _operands(n, k, seed=n % 97, device="cuda")
    xv, wv = xv.cuda(), wv.cuda()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bias = torch.randn(n, device="cuda").bfloat16()
    for splits in (None, 1, 3):
        for dtype, b in ((torch.bfloat16, bias), (torch.float32, None)):
            want = gemv_mod.gemv_reference(xv, wv, alpha, dtype, b, splits, sms)
            for _ in range(3):
                got = _forms(x, gx, wp, ws, alpha, dtype, b, splits)
                differing = [f for f, out in got.items() if not torch.equal(out, want)]
                assert differing == [], (n, k, splits, dtype)


@pytest.mark.gpu
def test_gpu_random_weight_bytes_equal_the_reference():
    _skip_unless_sm80_to_sm90()
    x, gx, wp, ws, alpha, xv, wv = _operands(384, 2048, 5, device="cuda", random_bytes=True)
    want = gemv_mod.gemv_reference(xv.cuda(), wv.cuda(), alpha, torch.float32)
    assert all(torch.equal(out, want) for out in _forms(x, gx, wp, ws, alpha, torch.float32).values())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_one_row_layer_calls_and_plans_give_the_packed_paths_bytes(dtype):
    """``NVFP4Linear`` with one row: through the kernel wrappers, through its launch plan (built at the second call),
    and captured in a CUDA graph, the bytes of quantize-then-``nvfp4_linear`` (the packed row, ``nvfp4_gemm``)."""
    from diffusers_nvfp4_fast import kernels
    from diffusers_nvfp4_fast.format import fast_math_from_env
    from diffusers_nvfp4_fast.linear import NVFP4Linear
    from diffusers_nvfp4_fast.ops import linear
    from diffusers_nvfp4_fast.ops.quantize import quantize

    _skip_unless_sm80_to_sm90()
    launch_mod = importlib.import_module("diffusers_nvfp4_fast.kernels.launch")
    linear.forget_plans()
    torch.manual_seed(0)
    for k, n, has_bias in ((3072, 18432, True), (1024, 640, False)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None
        layer = NVFP4Linear.from_weight(w, b, 6.0 / 2688)
        layer = layer.to(dtype) if dtype != torch.bfloat16 else layer
        x = torch.randn(1, k, device="cuda", dtype=dtype) * 2
        packed = quantize(x, layer.input_scale_inv, fast_math_from_env())
        want = kernels.nvfp4_gemm(*packed, layer.weight, layer.weight_scale, layer.alpha, dtype, bias=layer.bias)
        launch_mod.DIRECT_LAUNCH = False
        try:
            assert torch.equal(layer(x).view(torch.int16), want.view(torch.int16)), (k, n, "wrappers")
        finally:
            launch_mod.DIRECT_LAUNCH = True
        for call in range(4):
            assert torch.equal(layer(x).view(torch.int16), want.view(torch.int16)), (k, n, call)
        planned = any(isinstance(p, kernels.RowPlan) for p in linear.planned())
        assert planned == (launch_mod.direct_launch_unavailable() is None)  # no plans with Triton 3.7+
        static = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(static)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), want.view(torch.int16)), (k, n, "graph")


@pytest.mark.gpu
def test_gpu_gemv_sites_run_the_binders_binary(monkeypatch):
    """Keyed launches of the one-row kernel run the binary Triton's binder picks, for both row forms with and
    without bias (four sites: the rows come from the quantizers, always 16-byte aligned), with the first call's
    bytes."""
    from support.launch_sites import check_sites_against_binder

    _skip_unless_sm80_to_sm90()
    checked = check_sites_against_binder(gemv_mod, monkeypatch)
    x, gx, wp, ws, alpha, *_ = _operands(640, 1024, 1, device="cuda")
    bias = torch.randn(640, device="cuda").bfloat16()
    for b in (None, bias):
        want = _forms(x, gx, wp, ws, alpha, torch.bfloat16, b)
        for _ in range(3):
            got = _forms(x, gx, wp, ws, alpha, torch.bfloat16, b)
            assert all(torch.equal(got[f], want[f]) for f in want)
    assert len(set(checked)) == 4, set(checked)
