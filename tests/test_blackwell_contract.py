"""The Blackwell GEMM path, proven on a CPU: ``NVFP4Linear`` -> ``ops/linear.py`` -> ``ops/blackwell.py`` -> torch's
cuBLASLt ``scaled_mm`` (the automatic choice on SM100+: it ships compiled, no nvcc) or, when forced,
``flashinfer.mm_fp4(..., backend="cutlass")``, as ``ops/dispatch.py`` picks them.

What runs where. The ``blackwell`` fixture makes the GEMM dispatch believe it is on an SM100 / SM120 GPU while the
tensors stay on the CPU: it replaces ``dispatch.gemm_device_capability`` (the one question the GEMM dispatch asks; in
production it answers None for CPU tensors, so nothing there is weakened) and installs ``support.blackwell_fakes``'s
stand-ins: ``FakeScaledMM`` as ``torch.nn.functional.scaled_mm`` and, for the automatic choice, a
``CompilingFlashInfer`` whose GEMM entry raises as a machine without nvcc would (or, with ``backend="flashinfer"``,
``FakeFlashInfer`` forced by ``DIFFUSERS_NVFP4_GEMM_BACKEND``). Everything else takes its CPU path, because it asks
about the tensors, not about the GEMM: the activation quantize and the fused sites run their torch references (on a
real Blackwell GPU they are Triton kernels with the hardware E2M1 conversion, which a CPU cannot run; they are
compiled ahead of time for sm_100 / sm_103 / sm_110 / sm_120 / sm_121 at the end of this file and in the kernels' own
test files). The Hopper GEMM kernels are made to fail if anything calls them. So each test here runs the real call
path into a stand-in that checks every call against torch 2.14.1's or FlashInfer 0.7.2.post1's contract
(support/blackwell_fakes.py says which source line each check comes from) and computes the result with its own
decoder from docs/design.md §3.

Not proven here (docs/blackwell.md): that cuBLASLt's or FlashInfer's kernel computes what its contract says, its FP32
summation order and output rounding, and the Triton kernels' results on SM100+; ``diffusers-nvfp4-fast selftest``
checks those on a Blackwell GPU."""

from __future__ import annotations

import importlib.util
import logging
import shutil
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


AUTOMATIC, FLASHINFER = "automatic", "flashinfer"
BACKENDS = [AUTOMATIC, FLASHINFER]  # the default (cuBLASLt, nothing set) and the forced FlashInfer


@pytest.fixture
def blackwell(monkeypatch):
    """``install(capability, backend)`` -> the stand-in GEMM that serves the calls. 'automatic' (nothing forced):
    FakeScaledMM, with a CompilingFlashInfer importable whose GEMM raises; 'flashinfer' / 'cublaslt': that backend
    forced by DIFFUSERS_NVFP4_GEMM_BACKEND (FakeFlashInfer / FakeScaledMM). The Hopper GEMM kernels raise if called."""

    def install(capability=SM100, backend=AUTOMATIC, version="0.7.2.post1"):
        monkeypatch.setattr(dispatch, "gemm_device_capability", lambda device: capability)
        if dispatch.kernels is not None:
            for name in ("nvfp4_gemm", "nvfp4_gemm_fp16_x", "quantize_nvfp4_decoded"):
                monkeypatch.setattr(dispatch.kernels, name, _no_hopper_gemm)
        monkeypatch.delenv(dispatch.GEMM_BACKEND_VAR, raising=False)
        if backend == FLASHINFER:
            monkeypatch.setenv(dispatch.GEMM_BACKEND_VAR, "flashinfer")
            fake: fakes._LayerContract = fakes.FakeFlashInfer(capability, version)
            monkeypatch.setitem(sys.modules, "flashinfer", fake)
        else:
            if backend == "cublaslt":
                monkeypatch.setenv(dispatch.GEMM_BACKEND_VAR, "cublaslt")
            fake = fakes.FakeScaledMM(capability)
            monkeypatch.setattr(torch.nn.functional, "scaled_mm", fake)
            monkeypatch.setitem(sys.modules, "flashinfer", fakes.CompilingFlashInfer(capability))
        dispatch.reset_backend_choice()
        return fake

    yield install
    dispatch.reset_backend_choice()


def _name(backend: str) -> str:
    """The report's name of the backend a ``blackwell`` install runs."""
    return "flashinfer" if backend == FLASHINFER else "cublaslt"


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
# The automatic choice, forced backends, versions, signatures.
# ----------------------------------------------------------------------------------------------------------------

NO_NVCC = "no nvcc needed"


@pytest.mark.parametrize("capability", [(10, 0), (10, 3), (11, 0), (12, 0), (12, 1)])
def test_every_blackwell_family_gets_cublaslt_which_ships_compiled(blackwell, capability):
    blackwell(capability)
    cpu = torch.device("cpu")
    assert dispatch.gemm_backend(cpu) == "cublaslt"
    backend, why = dispatch.backend_choice(cpu)
    assert backend == "cublaslt" and "ships compiled, no nvcc needed" in why and torch.__version__ in why


@pytest.mark.parametrize("installed", ["nothing", "flashinfer", "flashinfer + flashinfer-jit-cache",
                                       "flashinfer, DIFFUSERS_NVFP4_GEMM_BACKEND=''"])
def test_the_automatic_choice_does_not_depend_on_what_else_is_installed(blackwell, monkeypatch, installed):
    """Whether FlashInfer, its prebuilt kernels or nothing is installed (another package may pull FlashInfer in), two
    runs on one machine choose the same backend with the same reason: cuBLASLt."""
    blackwell(SM100)
    if installed == "nothing":
        monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer raises ImportError
    if "jit-cache" in installed:
        monkeypatch.setattr(dispatch, "flashinfer_prebuilt", lambda: "0.7.2.post1")
    if "''" in installed:
        monkeypatch.setenv(dispatch.GEMM_BACKEND_VAR, "")
    dispatch.reset_backend_choice()
    cpu = torch.device("cpu")
    assert dispatch.backend_choice(cpu) == ("cublaslt", dispatch._chosen_because("cublaslt"))


@pytest.mark.parametrize("capability", [(7, 5), (8, 0), (9, 0), (10, 0), (12, 1)])
def test_the_automatic_choice_per_capability(blackwell, capability):
    """cuBLASLt from SM100 on, never below (there the Triton GEMM runs, on CUDA tensors: with the seam's CPU tensors
    the choice below SM100 is the emulation, and the reason names both refusals)."""
    blackwell(capability)
    backend, why = dispatch.backend_choice(torch.device("cpu"))
    if capability >= (10, 0):
        assert backend == "cublaslt"
    else:
        assert backend == "emulated" and why.startswith(
            f"not cublaslt: the FP4 tensor-core GEMM (cublaslt) needs SM100 or newer, this GPU is SM{capability[0]}"
            f"{capability[1]}; not triton: ")


def _no_scaled_mm(monkeypatch):
    monkeypatch.delattr(torch.nn.functional, "scaled_mm")


@pytest.mark.parametrize("torch_build,needle", [
    (_no_scaled_mm, "has no two-level NVFP4 torch.nn.functional.scaled_mm"),
    (lambda mp: mp.setattr(torch.version, "cuda", "12.6"), "is built with CUDA 12.6; cuBLASLt's FP4 GEMM needs a torch "
                                                           "built with CUDA >= 12.8"),
    (lambda mp: mp.setattr(torch.version, "cuda", None), "is not built with CUDA"),
])
def test_a_torch_without_cublaslt_fp4_gets_the_emulation_with_a_warning_never_flashinfer(
        blackwell, monkeypatch, caplog, torch_build, needle):
    """No silent change of backend: where torch cannot run cuBLASLt's FP4 GEMM, the automatic choice is the exact
    emulation with a warning that says why and names the way to FlashInfer; it never compiles FlashInfer's GEMM."""
    blackwell(SM100)
    torch_build(monkeypatch)
    dispatch.reset_backend_choice()
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="diffusers_nvfp4_fast"):
        assert dispatch.gemm_backend(cpu) == "emulated"
    assert needle in caplog.text and "emulation" in caplog.text and "=flashinfer" in caplog.text
    assert needle in dispatch.backend_choice(cpu)[1]
    monkeypatch.setenv(dispatch.GEMM_BACKEND_VAR, "cublaslt")
    with pytest.raises(dispatch.BackendUnavailableError, match="cublaslt cannot run here"):
        dispatch.gemm_backend(cpu)


@pytest.mark.parametrize("prebuilt", [None, "0.7.2.post1"])
def test_forced_flashinfer_says_whether_it_compiles_with_nvcc(blackwell, monkeypatch, prebuilt):
    blackwell(SM100, backend=FLASHINFER)
    monkeypatch.setattr(dispatch, "flashinfer_prebuilt", lambda: prebuilt)
    backend, why = dispatch.backend_choice(torch.device("cpu"))
    assert backend == "flashinfer" and why.startswith(f"forced by {dispatch.GEMM_BACKEND_VAR}")
    if prebuilt is None:
        assert "no flashinfer-jit-cache installed: its CUTLASS FP4 GEMM compiles with nvcc at the first call" in why
    else:
        assert f"prebuilt kernels are installed (flashinfer-jit-cache {prebuilt}), no nvcc needed" in why


@pytest.mark.parametrize("capability,version,floor", [((12, 0), "0.3.0", "0.3.1"), ((11, 0), "0.5.2", "0.5.3"),
                                                      ((10, 0), "0.2.8", "0.2.9")])
def test_forced_flashinfer_older_than_the_family_floor_is_refused_with_the_version(blackwell, capability, version,
                                                                                  floor):
    blackwell(capability, backend=FLASHINFER, version=version)
    with pytest.raises(dispatch.BackendUnavailableError, match=f"FlashInfer {version} predates {floor}.*"
                                                               f"flashinfer-python>={floor}"):
        dispatch.gemm_backend(torch.device("cpu"))


def test_production_dispatch_never_sends_cpu_tensors_to_a_tensor_core_gemm(monkeypatch):
    """Without the seam, CPU tensors get the emulation even with FlashInfer and torch's scaled_mm importable."""
    monkeypatch.setitem(sys.modules, "flashinfer", fakes.FakeFlashInfer(SM100))
    dispatch.reset_backend_choice()
    try:
        assert dispatch.gemm_backend(torch.device("cpu")) == "emulated"
        for backend in ("flashinfer", "cublaslt"):
            monkeypatch.setenv(dispatch.GEMM_BACKEND_VAR, backend)
            with pytest.raises(dispatch.BackendUnavailableError, match="the tensors are on cpu"):
                dispatch.gemm_backend(torch.device("cpu"))
    finally:
        dispatch.reset_backend_choice()


def test_scaled_mm_stand_in_has_the_installed_torchs_signature():
    """The drift guard of the default backend's stand-in (``fakes.SCALED_MM_SOURCE``): parameter names, kinds and
    defaults of the installed torch's ``torch.nn.functional.scaled_mm``, which every supported torch has."""
    assert fakes.signature_problems(fakes.FakeScaledMM(SM100).__call__, torch.nn.functional.scaled_mm) == []


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

    def scaled_mm_drifted(mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, swizzle_a=None,
                          swizzle_b=None, bias=None, output_dtype=None, use_fast_accum=False):
        raise NotImplementedError

    problems = fakes.signature_problems(fakes.FakeScaledMM(SM100).__call__, scaled_mm_drifted)
    assert any(p.startswith("parameters") for p in problems) and any(p.startswith("output_dtype") for p in problems)


# ----------------------------------------------------------------------------------------------------------------
# The call contract and the values.
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("capability", [SM100, SM120])
@pytest.mark.parametrize("dtype,bias", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float16, True)])
def test_pass_through_equals_linear_reference(blackwell, backend, capability, dtype, bias):
    """Argument order, dtypes, views and out_dtype (checked by the stand-in); the bias added by torch after the GEMM
    (the stand-ins refuse a bias argument); the bytes of the recipe."""
    fake = blackwell(capability, backend)
    layer, packed, scales = _layer(96, 160, bias=bias, dtype=dtype)
    fake.register(layer)
    x = _input(15, 160, dtype=dtype).reshape(3, 5, 160)
    out = layer(x)
    assert len(fake.calls) == 1 and fake.calls[0].layer is layer and fake.calls[0].out_dtype == dtype
    assert out.shape == (3, 5, 96) and out.dtype == dtype
    assert torch.equal(out.reshape(15, 96), _reference(layer, x.reshape(15, 160)))
    assert torch.equal(out.reshape(15, 96), _truth(layer, packed, scales, x))


@pytest.mark.parametrize("backend", BACKENDS)
def test_semantic_probes_with_scales_far_from_one(blackwell, backend):
    """input_scale 2^-13-ish, weight_scale_2 ~ 2^6: every plausible mistake in alpha (cuBLASLt: the two global
    scales) or in the activation's global scale gives other bytes than the recipe, and the recipe is what comes out."""
    fake = blackwell(SM100, backend)
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_nibble_probes_one_nonzero_per_row(blackwell, backend):
    """Row r of the activation holds one nonzero value, at column r: even columns sit in a byte's low nibble. Any
    nibble-order mistake on either operand moves the product onto the neighbouring column's weights."""
    fake = blackwell(SM100, backend)
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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n,k", [(n, k) for n in (32, 160, 3072) for k in (32, 96, 3072)])
def test_layout_probes(blackwell, backend, n, k):
    """M in {1, 7, 129, 300} (one, under, just over and well over a 128-row scale tile), a distinct random scale per
    block: the 128x4 reading of both scale operands and the transposed weight view."""
    fake = blackwell(SM100, backend)
    layer, packed, scales = _layer(n, k, seed=n + k)
    fake.register(layer)
    w_values = fakes.decode(packed, scales)
    for m in (1, 7, 129, 300):
        x = _input(m, k, seed=m)
        xq, xs = quantize_nvfp4(x, layer.input_scale_inv, fast_math=fast_math_from_env())
        want = fakes.emulated_result(fakes.decode_swizzled(xq, xs), w_values, layer.alpha, x.dtype)
        assert torch.equal(layer(x), want), (m, n, k)
    assert [c.m for c in fake.calls] == [1, 7, 129, 300] and all(c.layer is layer for c in fake.calls)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dynamic_input_scale_alpha_is_computed_per_call(blackwell, backend):
    fake = blackwell(SM100, backend)
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_output_is_computed_by_the_reference(blackwell, backend):
    """Both tensor-core backends are asked for BF16/FP16 only (FlashInfer writes no other); an FP32 request never
    reaches them."""
    fake = blackwell(SM100, backend)
    layer, _, _ = _layer(32, 64)
    fake.register(layer)
    xq, xs = quantize_nvfp4(_input(5, 64), layer.input_scale_inv, fast_math=True)
    out = layer.forward_prequantized(xq, xs, torch.float32)
    assert fake.calls == [] and out.dtype == torch.float32
    assert torch.equal(out, linear_reference(xq, xs, layer.weight, layer.weight_scale, layer.alpha, None,
                                             torch.float32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_calls_the_gemm_at_run_time(blackwell, backend):
    fake = blackwell(SM100, backend)
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

# N % 32, K % 32 in every combination (N % 8 == 0 for 72, 24, 48); N = 48: padded for FlashInfer SM100 only
MISALIGNED = [(200, 48), (40, 80), (72, 96), (24, 32), (48, 96)]


@pytest.mark.parametrize("backend,capability", [(AUTOMATIC, SM100), (FLASHINFER, SM100), (FLASHINFER, SM120)])
@pytest.mark.parametrize("n,k", MISALIGNED)
def test_misaligned_shapes_are_padded_with_exact_zeros(blackwell, backend, capability, n, k):
    """Without padding the stand-in (like FlashInfer's binding) refuses these shapes. With it: the padded operands
    decode to the layer's values plus exact +0 entries, the exact sums are unchanged, a K-ordered FP32 accumulation
    gives the same bytes, and the layer returns the padded GEMM's first N columns plus the bias. cuBLASLt pads to
    K % 32, N % 16 on every family, FlashInfer to K % 32 and N % 32 (SM100) or N % 8 (SM120)."""
    fake = blackwell(capability, backend)
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
    for backend in ("flashinfer", "cublaslt"):
        assert all(a is b for a, b in zip(padded_operands(backend, SM100, x, w), (x, w)))
    assert padded_operands("flashinfer", SM120, x, torch.zeros(40, 48, dtype=torch.uint8))[1].shape == (40, 48)
    assert padded_operands("flashinfer", SM100, x, torch.zeros(40, 48, dtype=torch.uint8))[1].shape == (64, 48)
    assert padded_operands("cublaslt", SM100, x, torch.zeros(48, 48, dtype=torch.uint8))[1].shape == (48, 48)
    assert padded_operands("cublaslt", SM120, x, torch.zeros(40, 48, dtype=torch.uint8))[1].shape == (48, 48)


# ----------------------------------------------------------------------------------------------------------------
# enable_fast_paths: warm-up, set-up errors, scale padding, and no compiler.
# ----------------------------------------------------------------------------------------------------------------


def _three_shape_model():
    torch.manual_seed(0)
    model = nn.Sequential(*[NVFP4Linear.from_weight(torch.randn(n, k), None, 0.02)
                            for n, k in ((64, 96), (96, 64), (64, 96), (200, 48))])
    return model


@pytest.mark.parametrize("backend,padded_shape,reason", [
    (AUTOMATIC, (208, 64), "cublaslt SM100: K % 32 != 0 and N % 16 != 0, padded with exact zeros"),
    (FLASHINFER, (224, 64), "flashinfer SM100: K % 32 != 0 and N % 32 != 0, padded with exact zeros"),
])
def test_enable_fast_paths_warms_up_every_layer_shape(blackwell, backend, padded_shape, reason):
    fake = blackwell(SM100, backend)
    model = _three_shape_model()
    report = enable_fast_paths(model)["Sequential"]
    warm = [c for c in fake.calls if c.layer is None]
    assert sorted((c.n, c.k) for c in warm) == [(64, 96), (96, 64), padded_shape]  # [200, 48] padded
    assert all(c.m == 1 for c in warm)
    assert report["gemm_backend"] == _name(backend) and report["gemm_warm_up"]["shapes"] == 3
    assert report["gemm_padded_layers"] == {reason: 1}
    disable_fast_paths(model)


def test_the_default_backend_never_reaches_flashinfers_compile(blackwell):
    """A machine without a CUDA toolkit, FlashInfer installed: the stand-in's GEMM entry raises as FlashInfer's nvcc
    build would (``fakes.MM_FP4_JIT_ENTRY``). Enabling the fast paths (the warm-up calls) and the first calls of
    every layer run cuBLASLt and never get there."""
    fake = blackwell(SM100)
    compiling = sys.modules["flashinfer"]
    model = _three_shape_model()
    enable_fast_paths(model)
    fake.register(model)
    for layer in model:
        layer(_input(5, layer.in_features))
    assert compiling.compile_attempts == 0
    assert len([c for c in fake.calls if c.layer is None]) == 3 and len(fake.layer_calls()) == 4
    assert fast_path_report(model)["Sequential"]["gemm_backend"] == "cublaslt"
    disable_fast_paths(model)
    with pytest.raises(RuntimeError, match="nvcc"):  # the guard is live: a call raises, and is counted
        compiling.mm_fp4()
    assert compiling.compile_attempts == 1


@pytest.mark.parametrize("backend,error,needles", [
    (AUTOMATIC, "CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul",
     ("warm-up call", "CUBLAS_STATUS_NOT_SUPPORTED", "no CUDA toolkit", "CUDA >= 12.8",
      "DIFFUSERS_NVFP4_GEMM_BACKEND=flashinfer")),
    (FLASHINFER, "Could not find nvcc and default cuda_home='/usr/local/cuda' doesn't exist",
     ("warm-up call", "Could not find nvcc", "CUDA toolkit", "flashinfer install-jit-cache-wheel",
      "unset DIFFUSERS_NVFP4_GEMM_BACKEND (cuBLASLt through torch, no toolkit)")),
])
def test_a_failing_first_call_is_one_error_at_enable_time_naming_what_to_install(blackwell, monkeypatch, backend,
                                                                                  error, needles):
    fake = blackwell(SM100, backend)

    def failing(*args, **kwargs):
        raise RuntimeError(error)

    if backend == FLASHINFER:
        monkeypatch.setattr(fake, "mm_fp4", failing)
    else:
        monkeypatch.setattr(torch.nn.functional, "scaled_mm", failing)
    model = _three_shape_model()
    with pytest.raises(GemmSetupError) as raised:
        enable_fast_paths(model)
    message = str(raised.value)
    for needle in needles:
        assert needle in message, (needle, message)
    assert not hasattr(model, "_nvfp4_fast_paths")


@pytest.mark.parametrize("backend", BACKENDS)
def test_nonzero_scale_padding_is_zeroed_before_the_tensor_core_gemm_reads_it(blackwell, caplog, backend):
    """FlashInfer multiplies the 128x4 padding by the zero codes beyond K (0 x NaN = NaN), and nothing says that
    cuBLASLt does not; the Hopper kernels and the emulation never read it, so a checkpoint's garbage there is zeroed
    when the fast paths are enabled for either tensor-core backend."""
    fake = blackwell(SM100, backend)
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
# cuBLASLt forced by the variable: the same calls as the automatic choice.
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,k,bias", [(96, 160, True), (40, 48, False)])
def test_forced_cublaslt_makes_the_calls_of_the_automatic_choice(blackwell, n, k, bias):
    fake = blackwell(SM100, backend="cublaslt")
    assert dispatch.backend_choice(torch.device("cpu")) == ("cublaslt", f"forced by {dispatch.GEMM_BACKEND_VAR}")
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


@pytest.mark.parametrize("which,capability,backend", [
    ("flux2", SM100, AUTOMATIC), ("klein", SM120, AUTOMATIC), ("qwen", SM100, AUTOMATIC),
    ("flux2", SM120, FLASHINFER), ("qwen", SM100, FLASHINFER)])
def test_tiny_pipelines_on_and_off_make_only_valid_calls_and_the_emulated_png(blackwell, checkpoints, which,
                                                                              capability, backend):
    """Fast paths off and on give the same PNG with the default backend (and with FlashInfer forced), and it is the
    emulated backend's PNG: a GEMM computing its contract with FP32 sums in the stand-in's order gives those bytes."""
    pipe, kwargs = tiny.TINY_PIPELINES[which](load_nvfp4_transformer(checkpoints(which)))
    pipe.set_progress_bar_config(disable=True)
    emulated = _png(pipe, kwargs)
    fake = blackwell(capability, backend)
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
    assert report["gemm_backend"] == _name(backend) and sum(report["fused_calls"].values()) > 0
    assert report["verifications"]["failed"] == 0
    if backend == AUTOMATIC:
        assert sys.modules["flashinfer"].compile_attempts == 0


@pytest.mark.gpu
def test_on_a_blackwell_gpu_the_default_backend_runs_without_a_toolkit_or_flashinfer(monkeypatch):
    """On an SM100+ GPU with no nvcc on PATH, no CUDA_HOME and FlashInfer unimportable: the automatic backend is
    cuBLASLt, and the self-test's GEMM checks and tiny FLUX.2 pipeline (fast paths off == on) pass with it."""
    from diffusers_nvfp4_fast.commands import selftest

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 10:
        pytest.skip("the toolkit-free default backend did not run: this is no SM100+ GPU; it runs on a Blackwell GPU "
                    "(pytest -m gpu tests/test_blackwell_contract.py), none of which has run it yet")
    device = torch.device("cuda", torch.cuda.current_device())
    for name in ("CUDA_HOME", "CUDA_PATH", dispatch.GEMM_BACKEND_VAR):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # the host compiler that Triton's launcher build needs stays
    if shutil.which("nvcc") is not None:
        pytest.skip(f"the toolkit-free run did not happen: nvcc is in /usr/bin or /bin ({shutil.which('nvcc')}); "
                    "it runs on a Blackwell machine whose nvcc is elsewhere or absent")
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    dispatch.reset_backend_choice()
    try:
        assert dispatch.backend_choice(device)[0] == "cublaslt"
        checks = selftest.gemm_checks(device) + [selftest.pipeline_check(device)]
    finally:
        dispatch.reset_backend_choice()
    assert all(c["equal"] for c in checks), checks


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
