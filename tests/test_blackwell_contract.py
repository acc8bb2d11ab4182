"""The Blackwell GEMM path, proven on a CPU: ``NVFP4Linear`` -> ``ops/linear.py`` -> ``ops/blackwell.py`` ->
``flashinfer.mm_fp4(..., backend="cutlass")`` (or torch's cuBLASLt ``scaled_mm``), as ``ops/dispatch.py`` picks it on
SM100+.

What runs where. The ``blackwell`` fixture makes the GEMM dispatch believe it is on an SM100 / SM120 GPU while the
tensors stay on the CPU: it replaces ``dispatch.gemm_device_capability`` (the one question the GEMM dispatch asks; in
production it answers None for CPU tensors, so nothing there is weakened) and puts ``support.blackwell_fakes``'s
``FakeFlashInfer`` into ``sys.modules``. Everything else takes its CPU path, because it asks about the tensors, not
about the GEMM: the activation quantize and the fused sites run their torch references (on a real Blackwell GPU they
are Triton kernels with the hardware E2M1 conversion, which a CPU cannot run; they are compiled ahead of time for
sm_100 / sm_103 / sm_110 / sm_120 / sm_121 at the end of this file and in the kernels' own test files). The Hopper
GEMM kernels are made to fail if anything calls them. So each test here runs the real call path into a stand-in that
checks every ``mm_fp4`` call against FlashInfer 0.7.2.post1's contract (support/blackwell_fakes.py says which source
line each check comes from) and computes the result with its own decoder from docs/design.md §3.

Not proven here (docs/blackwell.md): that FlashInfer's kernel computes what its contract says, its FP32 summation
order, and the Triton kernels' results on SM100+; ``diffusers-nvfp4-fast selftest`` checks those on a Blackwell GPU.
"""

from __future__ import annotations

import importlib.util
import logging
import sys

import pytest
import torch
from torch import nn

from diffusers_nvfp4_fast import disable_fast_paths, enable_fast_paths, fast_path_report, load_nvfp4_transformer
from diffusers_nvfp4_fast.format import fast_math_from_env, quantize_nvfp4, swap_nibbles, swizzle_scales
from diffusers_nvfp4_fast.linear import NVFP4Linear
from diffusers_nvfp4_fast.ops import dispatch
from diffusers_nvfp4_fast.ops.blackwell import GemmSetupError, padded_operands
from diffusers_nvfp4_fast.ops.linear import linear_reference
from diffusers_nvfp4_fast.testing import tiny
from diffusers_nvfp4_fast.testing.export import quantize_tiny_pipeline
from diffusers_nvfp4_fast.utils import png_sha256, run_pipeline
from support import blackwell_fakes as fakes

SM100, SM120 = (10, 0), (12, 0)


@pytest.fixture
def blackwell(monkeypatch):
    """``install(capability, backend)`` -> the stand-in GEMM ('flashinfer': FakeFlashInfer, 'cublaslt':
    FakeScaledMM); the Hopper GEMM kernels raise if called."""

    def install(capability=SM100, backend="flashinfer", version="0.7.2.post1"):
        monkeypatch.setattr(dispatch, "gemm_device_capability", lambda device: capability)
        if dispatch.kernels is not None:
            for name in ("nvfp4_gemm", "nvfp4_gemm_fp16_x", "quantize_nvfp4_decoded"):
                monkeypatch.setattr(dispatch.kernels, name, _no_hopper_gemm)
        if backend == "cublaslt":
            monkeypatch.setenv(dispatch.GEMM_BACKEND_VAR, "cublaslt")
            fake: fakes._LayerContract = fakes.FakeScaledMM(capability)
            monkeypatch.setattr(torch.nn.functional, "scaled_mm", fake)
        else:
            fake = fakes.FakeFlashInfer(capability, version)
            monkeypatch.setitem(sys.modules, "flashinfer", fake)
        dispatch.reset_backend_choice()
        return fake

    yield install
    dispatch.reset_backend_choice()


def _no_hopper_gemm(*args, **kwargs):
    raise AssertionError("a Hopper GEMM kernel was called on the Blackwell path")


def _layer(n, k, *, seed=0, bias=False, dtype=torch.bfloat16, weight_scale_2=0.37, input_scale=0.011):
    """An ``NVFP4Linear`` of random codes and random finite block scales (E4M3 subnormals included); also returns
    the packed weight and the linear scale bytes it was built from."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    scales = torch.randint(1, 0x7F, (n, k // 16), generator=gen, dtype=torch.uint8)
    layer = NVFP4Linear(k, n, bias=bias, dtype=dtype)
    b = (torch.randn(n, generator=gen) * 0.5).to(dtype) if bias else None
    layer.load_nvfp4(packed, swizzle_scales(scales), torch.tensor(weight_scale_2), torch.tensor(input_scale), b,
                     scale_layout="128x4")
    return layer, packed, scales


def _input(m, k, *, seed=1, dtype=torch.bfloat16, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    magnitudes = torch.exp2(torch.randint(-6, 6, (m, k), generator=gen).float())
    return (torch.randn(m, k, generator=gen) * magnitudes * scale).to(dtype)


def _truth(layer, packed, scales, x, alpha=None, global_scale=None):
    """The layer's recipe from the test's own operands: the weight decoded from its *linear* scales (independent of
    any 128x4 code), the activation quantized with ``global_scale`` (default the layer's ``1 / input_scale``)."""
    g = layer.input_scale_inv if global_scale is None else global_scale
    xq, xs = quantize_nvfp4(x.reshape(-1, x.shape[-1]), g, fast_math=fast_math_from_env())
    a = fakes.decode_swizzled(xq, xs)
    w = fakes.decode(packed, scales)
    out = fakes.emulated_result(a, w, layer.alpha if alpha is None else alpha, x.dtype)
    return out if layer.bias is None else out + layer.bias


def _reference(layer, x):
    xq, xs = quantize_nvfp4(x, layer.input_scale_inv, fast_math=fast_math_from_env())
    return linear_reference(xq, xs, layer.weight, layer.weight_scale, layer.alpha, layer.bias, x.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Dispatch, versions, signature.
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("capability", [(10, 0), (10, 3), (11, 0), (12, 0), (12, 1)])
def test_blackwell_dispatch_picks_flashinfer(blackwell, capability):
    blackwell(capability)
    cpu = torch.device("cpu")
    assert dispatch.gemm_backend(cpu) == "flashinfer"
    assert dispatch.backend_choice(cpu)[0] == "flashinfer"


@pytest.mark.parametrize("capability,version,floor", [((12, 0), "0.3.0", "0.3.1"), ((11, 0), "0.5.2", "0.5.3"),
                                                      ((10, 0), "0.2.8", "0.2.9")])
def test_flashinfer_older_than_the_family_floor_is_refused_with_the_version(blackwell, monkeypatch, caplog,
                                                                             capability, version, floor):
    blackwell(capability, version=version)
    with caplog.at_level(logging.WARNING, logger="diffusers_nvfp4_fast"):
        assert dispatch.gemm_backend(torch.device("cpu")) == "emulated"
    assert f"FlashInfer {version} predates {floor}" in caplog.text and "emulation" in caplog.text
    monkeypatch.setenv(dispatch.GEMM_BACKEND_VAR, "flashinfer")
    with pytest.raises(dispatch.BackendUnavailableError, match=f"flashinfer-python>={floor}"):
        dispatch.gemm_backend(torch.device("cpu"))


def test_production_dispatch_never_sends_cpu_tensors_to_flashinfer(monkeypatch):
    """Without the seam, CPU tensors get the emulation even with a FlashInfer importable."""
    monkeypatch.setitem(sys.modules, "flashinfer", fakes.FakeFlashInfer(SM100))
    dispatch.reset_backend_choice()
    try:
        assert dispatch.gemm_backend(torch.device("cpu")) == "emulated"
        monkeypatch.setenv(dispatch.GEMM_BACKEND_VAR, "flashinfer")
        with pytest.raises(dispatch.BackendUnavailableError, match="the tensors are on cpu"):
            dispatch.gemm_backend(torch.device("cpu"))
    finally:
        dispatch.reset_backend_choice()


def test_stand_in_has_flashinfers_signature_where_flashinfer_imports():
    """The drift guard: where the real package imports (a Blackwell CI machine), the stand-in's ``mm_fp4`` must have
    its parameter names, kinds and defaults; a FlashInfer release that changes them fails here first."""
    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer is not installed here, so the stand-in's mm_fp4 signature was not compared with the "
                    f"real one ({fakes.MM_FP4_SOURCE}); it is compared wherever flashinfer-python is installed")
    try:
        import flashinfer
    except Exception as error:  # its import needs CUDA libraries that a CPU machine may lack
        pytest.skip(f"flashinfer is installed but does not import here ({type(error).__name__}: {error}), so the "
                    "signature was not compared")
    fake = fakes.FakeFlashInfer(SM100)
    assert fakes.signature_problems(fake.mm_fp4, flashinfer.mm_fp4) == []


def test_signature_guard_finds_a_drift():
    fake = fakes.FakeFlashInfer(SM100)

    def drifted(a, b, a_descale, b_descale, alpha=None, out_dtype=torch.bfloat16, out=None, block_size=32,
                use_8x4_sf_layout=False, backend="cutlass", use_nvfp4=True, enable_pdl=True):
        raise NotImplementedError

    problems = fakes.signature_problems(fake.mm_fp4, drifted)
    assert any(p.startswith("block_size") for p in problems) and any(p.startswith("backend") for p in problems)


# ----------------------------------------------------------------------------------------------------------------
# The call contract and the values.
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("capability", [SM100, SM120])
@pytest.mark.parametrize("dtype,bias", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float16, True)])
def test_pass_through_equals_linear_reference(blackwell, capability, dtype, bias):
    fake = blackwell(capability)
    layer, packed, scales = _layer(96, 160, bias=bias, dtype=dtype)
    fake.register(layer)
    x = _input(15, 160, dtype=dtype).reshape(3, 5, 160)
    out = layer(x)
    assert len(fake.calls) == 1 and fake.calls[0].layer is layer and fake.calls[0].out_dtype == dtype
    assert out.shape == (3, 5, 96) and out.dtype == dtype
    assert torch.equal(out.reshape(15, 96), _reference(layer, x.reshape(15, 160)))
    assert torch.equal(out.reshape(15, 96), _truth(layer, packed, scales, x))


def test_semantic_probes_with_scales_far_from_one(blackwell):
    """input_scale 2^-13-ish, weight_scale_2 ~ 2^6: every plausible mistake in alpha or in the activation's global
    scale gives other bytes than the recipe, and the recipe is what comes out."""
    fake = blackwell(SM100)
    layer, packed, scales = _layer(64, 128, weight_scale_2=71.3, input_scale=1.3e-4)
    fake.register(layer)
    x = _input(9, 128, scale=0.2)
    out = layer(x)
    assert torch.equal(out, _truth(layer, packed, scales, x))
    mistakes = {
        "alpha = input_scale": {"alpha": layer.input_scale},
        "alpha = weight_scale_2": {"alpha": layer.weight_scale_2},
        "alpha = 1 / alpha": {"alpha": 1.0 / layer.alpha},
        "no alpha": {"alpha": torch.tensor(1.0)},
        "global scale = input_scale": {"global_scale": layer.input_scale},
        "global scale = 1": {"global_scale": torch.tensor(1.0)},
    }
    for name, mistake in mistakes.items():
        assert not torch.equal(out, _truth(layer, packed, scales, x, **mistake)), name


def test_nibble_probes_one_nonzero_per_row(blackwell):
    """Row r of the activation holds one nonzero value, at column r: even columns sit in a byte's low nibble. Any
    nibble-order mistake on either operand moves the product onto the neighbouring column's weights."""
    fake = blackwell(SM100)
    k = 64
    layer, packed, scales = _layer(32, k, seed=3)
    fake.register(layer)
    x = torch.diag(torch.linspace(0.5, 3.0, k)).to(torch.bfloat16)
    out = layer(x)
    assert torch.equal(out, _truth(layer, packed, scales, x))
    swapped, _, _ = _layer(32, k, seed=3)
    swapped.weight.data = swap_nibbles(swapped.weight.data)
    fake.register(swapped)
    even, odd = out[0::2], out[1::2]
    wrong = swapped(x)
    assert not torch.equal(wrong[0::2], even) and not torch.equal(wrong[1::2], odd)


@pytest.mark.parametrize("n,k", [(n, k) for n in (32, 160, 3072) for k in (32, 96, 3072)])
def test_layout_probes(blackwell, n, k):
    """M in {1, 7, 129, 300} (one, under, just over and well over a 128-row scale tile), a distinct random scale per
    block: the 128x4 reading of both scale operands and the transposed weight view."""
    fake = blackwell(SM100)
    layer, packed, scales = _layer(n, k, seed=n + k)
    fake.register(layer)
    w_values = fakes.decode(packed, scales)
    for m in (1, 7, 129, 300):
        x = _input(m, k, seed=m)
        xq, xs = quantize_nvfp4(x, layer.input_scale_inv, fast_math=fast_math_from_env())
        want = fakes.emulated_result(fakes.decode_swizzled(xq, xs), w_values, layer.alpha, x.dtype)
        assert torch.equal(layer(x), want), (m, n, k)
    assert [c.m for c in fake.calls] == [1, 7, 129, 300] and all(c.layer is layer for c in fake.calls)


def test_dynamic_input_scale_alpha_is_computed_per_call(blackwell):
    fake = blackwell(SM100)
    layer, _, _ = _layer(32, 64)
    layer.dynamic_input_scale = True
    fake.register(layer)
    for scale in (1.0, 37.0):
        x = _input(4, 64, scale=scale)
        layer(x)
        amax = x.abs().amax().float()
        input_scale = torch.where(amax > 0, amax / (448.0 * 6.0), torch.ones_like(amax))
        want = (input_scale * layer.weight_scale_2).reshape(())
        got = fake.calls[-1].alpha.reshape(())
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (got, want)
    assert not torch.equal(fake.calls[0].alpha, fake.calls[1].alpha)


def test_fp32_output_is_computed_by_the_reference(blackwell):
    """FlashInfer writes BF16/FP16 only; an FP32 request never reaches it."""
    fake = blackwell(SM100)
    layer, _, _ = _layer(32, 64)
    fake.register(layer)
    xq, xs = quantize_nvfp4(_input(5, 64), layer.input_scale_inv, fast_math=True)
    out = layer.forward_prequantized(xq, xs, torch.float32)
    assert fake.calls == [] and out.dtype == torch.float32
    assert torch.equal(out, linear_reference(xq, xs, layer.weight, layer.weight_scale, layer.alpha, None,
                                             torch.float32))


def test_torch_compile_calls_the_gemm_at_run_time(blackwell):
    fake = blackwell(SM100)
    layer, _, _ = _layer(64, 96, bias=True)
    fake.register(layer)
    model = nn.Sequential(layer)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = _input(6, 96)
    eager = model(x)
    calls = len(fake.calls)
    for _ in range(2):
        assert torch.equal(compiled(x), eager)
    assert len(fake.calls) >= calls + 2 and all(c.layer is layer for c in fake.calls)


# ----------------------------------------------------------------------------------------------------------------
# Shapes the kernel cannot take: padded with exact zeros.
# ----------------------------------------------------------------------------------------------------------------

MISALIGNED = [(200, 48), (40, 80), (72, 96), (24, 32)]  # N % 32, K % 32 in every combination (N % 8 == 0 for 72, 24)


@pytest.mark.parametrize("capability", [SM100, SM120])
@pytest.mark.parametrize("n,k", MISALIGNED)
def test_misaligned_shapes_are_padded_with_exact_zeros(blackwell, capability, n, k):
    """Without padding the stand-in (like FlashInfer's binding) refuses these shapes. With it: the padded operands
    decode to the layer's values plus exact +0 entries, the exact sums are unchanged, a K-ordered FP32 accumulation
    gives the same bytes, and the layer returns the padded GEMM's first N columns plus the bias."""
    fake = blackwell(capability)
    layer, packed, scales = _layer(n, k, bias=True, seed=n)
    fake.register(layer)
    x = _input(11, k, seed=k)
    out = layer(x)
    call = fake.calls[-1]
    assert call.layer is layer and call.padded_b == fake.misaligned(n, k)
    assert call.k % 32 == 0 and call.n % fake.n_multiple() == 0
    xq, xs = quantize_nvfp4(x, layer.input_scale_inv, fast_math=fast_math_from_env())
    a, w = fakes.decode_swizzled(xq, xs), fakes.decode(packed, scales)
    a_pad, w_pad = call.a_values, call.b_values
    assert torch.equal(a_pad[:, :k], a) and torch.equal(w_pad[:n, :k], w)
    for pad in (a_pad[:, k:], w_pad[:, k:], w_pad[n:]):
        assert torch.equal(pad, torch.zeros_like(pad)) and not bool(torch.signbit(pad).any())
    assert torch.equal(fakes.exact_gemm(a_pad, w_pad)[:, :n], fakes.exact_gemm(a, w))
    assert torch.equal(fakes.ordered_fp32_gemm(a_pad, w_pad)[:, :n], fakes.ordered_fp32_gemm(a, w))
    padded_result = fakes.emulated_result(a_pad, w_pad, layer.alpha, x.dtype)[:, :n]
    assert torch.equal(out, padded_result + layer.bias)
    padded = fast_path_report(nn.Sequential(layer))["Sequential"].get("gemm_padded_layers")
    assert (padded is not None) == fake.misaligned(n, k) and (padded is None or list(padded.values()) == [1])


def test_padding_leaves_aligned_operands_alone():
    x = torch.zeros(3, 48, dtype=torch.uint8)
    w = torch.zeros(64, 48, dtype=torch.uint8)
    assert all(a is b for a, b in zip(padded_operands("flashinfer", SM100, x, w), (x, w)))
    assert padded_operands("flashinfer", SM120, x, torch.zeros(40, 48, dtype=torch.uint8))[1].shape == (40, 48)
    assert padded_operands("flashinfer", SM100, x, torch.zeros(40, 48, dtype=torch.uint8))[1].shape == (64, 48)


# ----------------------------------------------------------------------------------------------------------------
# enable_fast_paths: warm-up, set-up errors, scale padding.
# ----------------------------------------------------------------------------------------------------------------


def _three_shape_model():
    torch.manual_seed(0)
    model = nn.Sequential(*[NVFP4Linear.from_weight(torch.randn(n, k), None, 0.02)
                            for n, k in ((64, 96), (96, 64), (64, 96), (200, 48))])
    return model


def test_enable_fast_paths_warms_up_every_layer_shape(blackwell):
    fake = blackwell(SM100)
    model = _three_shape_model()
    report = enable_fast_paths(model)["Sequential"]
    warm = [c for c in fake.calls if c.layer is None]
    assert sorted((c.n, c.k) for c in warm) == [(64, 96), (96, 64), (224, 64)]  # [200, 48] padded
    assert all(c.m == 1 for c in warm)
    assert report["gemm_backend"] == "flashinfer" and report["gemm_warm_up"]["shapes"] == 3
    assert report["gemm_padded_layers"] == {"flashinfer SM100: K % 32 != 0 and N % 32 != 0, padded with exact "
                                            "zeros": 1}
    disable_fast_paths(model)


def test_a_failing_first_call_is_one_error_at_enable_time_naming_what_to_install(blackwell, monkeypatch):
    fake = blackwell(SM100)

    def no_toolkit(*args, **kwargs):
        raise RuntimeError("Could not find nvcc and default cuda_home='/usr/local/cuda' doesn't exist")

    monkeypatch.setattr(fake, "mm_fp4", no_toolkit)
    model = _three_shape_model()
    with pytest.raises(GemmSetupError) as error:
        enable_fast_paths(model)
    message = str(error.value)
    for needle in ("warm-up call", "Could not find nvcc", "CUDA toolkit", "flashinfer install-jit-cache-wheel",
                   "DIFFUSERS_NVFP4_GEMM_BACKEND=cublaslt"):
        assert needle in message, (needle, message)
    assert not hasattr(model, "_nvfp4_fast_paths")


def test_nonzero_scale_padding_is_zeroed_before_the_tensor_core_gemm_reads_it(blackwell, caplog):
    """FlashInfer multiplies the 128x4 padding by the zero codes beyond K (0 x NaN = NaN); no other backend reads it,
    so a checkpoint's garbage there is zeroed when the fast paths are enabled on SM100+."""
    fake = blackwell(SM100)
    layer, packed, scales = _layer(40, 48, seed=5)
    layer.weight_scale.data[-1, -1] = 0x7F
    with caplog.at_level(logging.WARNING, logger="diffusers_nvfp4_fast"):
        enable_fast_paths(nn.Sequential(layer))
    assert "zeroed 1 nonzero padding bytes" in caplog.text
    assert torch.equal(layer.weight_scale, swizzle_scales(scales))
    fake.register(layer)
    x = _input(3, 48)
    assert torch.equal(layer(x), _truth(layer, packed, scales, x))


# ----------------------------------------------------------------------------------------------------------------
# The cuBLASLt backend (torch.nn.functional.scaled_mm, two-level NVFP4).
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,k,bias", [(96, 160, True), (40, 48, False)])
def test_cublaslt_backend_contract(blackwell, n, k, bias):
    fake = blackwell(SM100, backend="cublaslt")
    assert dispatch.gemm_backend(torch.device("cpu")) == "cublaslt"
    layer, packed, scales = _layer(n, k, bias=bias, seed=n)
    fake.register(layer)
    x = _input(7, k)
    out = layer(x)
    call = fake.calls[-1]
    assert call.layer is layer and call.padded_b == fake.misaligned(n, k)
    padded_result = fakes.emulated_result(call.a_values, call.b_values, layer.alpha, x.dtype)[:, :n]
    assert torch.equal(out, padded_result if layer.bias is None else padded_result + layer.bias)
    assert torch.equal(call.b_values[:n, :k], fakes.decode(packed, scales))
    if not call.padded_b:
        assert torch.equal(out, _truth(layer, packed, scales, x))


def test_cublaslt_is_never_chosen_automatically(blackwell):
    blackwell(SM100)
    assert dispatch.gemm_backend(torch.device("cpu")) == "flashinfer"


# ----------------------------------------------------------------------------------------------------------------
# Whole tiny pipelines.
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    cache = {}

    def get(which):
        if which not in cache:
            cache[which] = quantize_tiny_pipeline(which, tmp_path_factory.mktemp(f"bw_{which}") / which, steps=1)
        return cache[which]

    return get


def _png(pipe, kwargs):
    return png_sha256(run_pipeline(pipe, kwargs, size=32, steps=1))


@pytest.mark.parametrize("which,capability", [("flux2", SM100), ("flux2", SM120), ("klein", SM120), ("qwen", SM100)])
def test_tiny_pipelines_on_and_off_make_only_valid_calls_and_the_emulated_png(blackwell, checkpoints, which,
                                                                              capability):
    pipe, kwargs = tiny.TINY_PIPELINES[which](load_nvfp4_transformer(checkpoints(which)))
    pipe.set_progress_bar_config(disable=True)
    emulated = _png(pipe, kwargs)
    fake = blackwell(capability)
    fake.register(pipe.transformer)
    off = _png(pipe, kwargs)
    off_calls = len(fake.layer_calls())
    enable_fast_paths(pipe)  # also moves the weights off safetensors' 8-byte aligned CPU storage
    fake.register(pipe.transformer)
    on_start = len(fake.calls)
    on = _png(pipe, kwargs)
    report = fast_path_report(pipe)[type(pipe.transformer).__name__]
    disable_fast_paths(pipe)
    assert off == emulated and on == emulated
    assert off_calls > 0 and len(fake.layer_calls()) > off_calls
    assert not any(c.copied_b for c in fake.calls[on_start:]), "a weight copied per call after enabling"
    assert {c.out_dtype for c in fake.calls} == {torch.bfloat16}
    assert report["gemm_backend"] == "flashinfer" and sum(report["fused_calls"].values()) > 0
    assert report["verifications"]["failed"] == 0


# ----------------------------------------------------------------------------------------------------------------
# Ahead-of-time builds of the activation kernels that run on Blackwell (hardware E2M1).
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("capability", [103, 110, 121])
@pytest.mark.parametrize("fast_math", [True, False])
def test_quantize_kernel_builds_for_every_blackwell_target(capability, fast_math):
    """SM100 and SM120 are compiled in tests/test_quantize.py; these are the other Blackwell GPUs FlashInfer's
    CUTLASS GEMM serves (B300, Thor, DGX Spark)."""
    pytest.importorskip("triton", reason="Triton is not installed, so the ahead-of-time builds did not run")
    from support.sass_count import compile_kernel

    compiled = compile_kernel("quantize", capability, fast_math)
    assert "cvt.rn.satfinite.e2m1x2.f32" in compiled.asm["ptx"] and f".target sm_{capability}a" in compiled.asm["ptx"]
    assert len(compiled.asm["cubin"]) > 0


@pytest.mark.parametrize("capability", [100, 120])
def test_adaln_kernel_builds_packed_for_blackwell(capability):
    """The norm1 site's packed output (the decoded variant serves SM80-SM90 only) on both Blackwell families."""
    pytest.importorskip("triton", reason="Triton is not installed, so the ahead-of-time builds did not run")
    from support.sass_count import compile_qwen_resnorm

    compiled = compile_qwen_resnorm(3072, capability, has_residual=False, decoded=False)
    assert "cvt.rn.satfinite.e2m1x2.f32" in compiled.asm["ptx"] and len(compiled.asm["cubin"]) > 0


# ----------------------------------------------------------------------------------------------------------------
# FP16 models loaded by diffusers' BFLQuantizationConfig (docs/blackwell.md, "FP16 models").
# ----------------------------------------------------------------------------------------------------------------


def _diffusers_bfl_layer(dtype):
    from diffusers.quantizers.bfl.utils import BFLNVFP4Linear

    gen = torch.Generator().manual_seed(7)
    layer = BFLNVFP4Linear(64, 32, bias=False, compute_dtype=dtype)
    layer.weight.data = torch.randint(0, 256, (32, 32), generator=gen, dtype=torch.uint8)
    layer.weight_scale = torch.randint(0x20, 0x50, (32, 4), generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)
    layer.weight_scale_2 = torch.tensor(0.013)
    layer.input_scale = torch.tensor(0.021)
    return layer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_converted_fp16_layers_say_they_differ_from_diffusers_own_blackwell_path(dtype):
    """diffusers 0.42.1's BFLNVFP4Linear on SM100+ quantizes ``x.to(bfloat16)`` and asks for BF16 output; a converted
    layer quantizes x in its own dtype. Same recipe for BF16; for FP16 the report says that the bytes differ, and
    they do."""
    model = nn.Sequential(_diffusers_bfl_layer(dtype))
    report = enable_fast_paths(model)["Sequential"]
    assert ("runs in FP16" in report["numerics"]) == (dtype == torch.float16)
    layer = model[0]
    x = _input(6, 64, dtype=dtype, scale=0.3)
    ours = layer(x)
    xq, xs = quantize_nvfp4(x.to(torch.bfloat16), layer.input_scale_inv, fast_math=fast_math_from_env())
    diffusers_recipe = linear_reference(xq, xs, layer.weight, layer.weight_scale, layer.alpha, None,
                                        torch.bfloat16).to(dtype)
    assert torch.equal(ours, diffusers_recipe) == (dtype == torch.bfloat16)
    disable_fast_paths(model)
