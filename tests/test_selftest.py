"""``diffusers-nvfp4-fast selftest``: on the CPU (what CI runs) it passes and exits 0, exits 1 on any mismatch, and its
GEMM checks drive the Blackwell call path too (through the stand-in of tests/test_blackwell_contract.py). On a GPU
(``gpu``) the whole self-test must pass: every kernel that GPU uses, byte for byte."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from diffusers_nvfp4_fast.commands import cli, selftest
from diffusers_nvfp4_fast.format import decode_nvfp4
from diffusers_nvfp4_fast.ops import dispatch
from diffusers_nvfp4_fast.ops import linear as linear_op
from support import blackwell_fakes as fakes


@pytest.fixture(scope="module")
def cpu_result():
    return selftest.run_selftest("cpu")


def test_cpu_selftest_passes_with_non_trivial_checks(cpu_result):
    env = cpu_result["environment"]
    assert env["device"] == "cpu" and env["gemm_backend"] == "emulated" and "on cpu" in env["gemm_backend_why"]
    assert env["torch"] == torch.__version__ and env["activation_recipe"] in ("fast-math", "precise")
    names = [c["name"] for c in cpu_result["checks"]]
    assert sum(n.startswith("GEMM ") for n in names) == len(selftest.CPU_GEMM_SHAPES)
    assert any(n.startswith("tiny FLUX.2 pipeline") for n in names)
    assert all(c["equal"] is True for c in cpu_result["checks"]), cpu_result["checks"]
    assert cpu_result["passed"]
    pipeline = cpu_result["checks"][-1]
    assert "fused calls" in pipeline["detail"] and not pipeline["detail"].startswith("fused calls 0")


def test_report_and_json(cpu_result, monkeypatch, capsys):
    monkeypatch.setattr(selftest, "run_selftest", lambda device: cpu_result)
    assert cli.main(["selftest", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["passed"] is True
    assert cli.main(["selftest", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("diffusers-nvfp4-fast selftest") and "GEMM      emulated" in text
    assert "\n  launches  no Triton kernels run on this device\n" in text
    assert text.rstrip().endswith(f"PASSED ({len(cpu_result['checks'])} checks, 0 failed)")


def test_launch_path_says_why_kernels_take_tritons_own_path(monkeypatch):
    """On a CUDA device the report says whether the installed Triton's binaries are launched directly, or why not."""
    if dispatch.kernels is None:
        pytest.skip("Triton is not installed, so no launch path is reported; this runs where Triton is installed, as "
                    "in CI (pip install -e '.[test]')")
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(dispatch.kernels.launch, "direct_launch_unavailable", lambda: None)
    assert selftest.launch_path(cuda) == "direct, through Triton's C launcher (launch plans)"
    monkeypatch.setattr(dispatch.kernels.launch, "direct_launch_unavailable", lambda: "Triton 9.9's launcher differs")
    assert selftest.launch_path(cuda) == "Triton's own path: Triton 9.9's launcher differs"
    assert selftest.launch_path(torch.device("cpu")) == "no Triton kernels run on this device"


def test_a_wrong_gemm_byte_fails_the_selftest_with_exit_status_1(monkeypatch, capsys):
    """One ulp off in the emulated GEMM's output: the GEMM checks say how many bytes differ, the command exits 1."""
    reference = linear_op.linear_reference

    def off_by_one_ulp(*args, **kwargs):
        out = reference(*args, **kwargs)
        bits = out.view(torch.int16).clone()
        bits.view(-1)[0] += 1
        return bits.view(out.dtype)

    monkeypatch.setattr(linear_op, "linear_reference", off_by_one_ulp)
    monkeypatch.setattr(selftest, "pipeline_check", lambda device: {"name": "pipeline", "equal": None})
    assert selftest.main(["--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "1 of" in out and "bytes differ" in out and out.rstrip().endswith("failed)")


def test_exact_operands_decode_to_the_values_they_were_built_from():
    gen = torch.Generator().manual_seed(0)
    packed, scales, values = selftest.exact_operand(130, 96, gen, torch.device("cpu"))
    assert torch.equal(decode_nvfp4(packed, scales, dtype=torch.float64), values)


def test_exact_operands_keep_every_partial_sum_exact_at_the_largest_k():
    """The premise of the GEMM checks at FLUX.2-dev's K = 24576: the sum of the product magnitudes of a row-column
    pair stays far below 2^20 (measured here on 16 x 16 pairs; the bound leaves a factor of about 5)."""
    k = max(k for _, _, k in selftest.GPU_GEMM_SHAPES.values())
    gen = torch.Generator().manual_seed(2)
    x, w = (selftest.exact_operand(16, k, gen, torch.device("cpu"))[2] for _ in range(2))
    assert float((x.abs() @ w.abs().t()).max()) < 2.0 ** 20 / 4
    assert selftest._exact_expected(x, w) is not None


@pytest.fixture
def sm100(monkeypatch):
    """The dispatch believes it is on an SM100 GPU; torch's ``scaled_mm`` (cuBLASLt) and ``flashinfer`` are the
    contract-checking stand-ins of tests/test_blackwell_contract.py."""
    fake, cublaslt = fakes.FakeFlashInfer((10, 0)), fakes.FakeScaledMM((10, 0))
    fake.any_weight = cublaslt.any_weight = True  # the self-test multiplies operands of no layer
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(torch.nn.functional, "scaled_mm", cublaslt)
    monkeypatch.setattr(dispatch, "gemm_device_capability", lambda device: (10, 0))
    monkeypatch.delenv(dispatch.GEMM_BACKEND_VAR, raising=False)
    dispatch.reset_backend_choice()
    yield fake, cublaslt
    dispatch.reset_backend_choice()


def test_selftest_gemm_checks_drive_the_blackwell_path(sm100):
    """With the dispatch believing it is on an SM100 GPU and the stand-ins installed, the self-test's GEMM checks pass
    through cuBLASLt's ``scaled_mm`` (the default; the unaligned shape padded), and its optional checks through
    FlashInfer's ``mm_fp4``."""
    fake, cublaslt = sm100
    checks = selftest.gemm_checks(torch.device("cpu"))
    optional = selftest.optional_backend_checks(torch.device("cpu"))
    assert all(c["equal"] is True and c["compared"].startswith("cublaslt") for c in checks), checks
    assert len(cublaslt.calls) >= len(checks) and {(c.n, c.k) for c in cublaslt.calls} >= {(208, 192), (3072, 3072)}
    assert len(optional) == len(checks) and all(c["optional"] and c["equal"] is True for c in optional), optional
    assert all(c["compared"].startswith("flashinfer") and "[flashinfer, optional]" in c["name"] for c in optional)
    assert len(fake.calls) >= len(optional) and {(c.n, c.k) for c in fake.calls} >= {(224, 192), (3072, 3072)}
    assert dispatch.GEMM_BACKEND_VAR not in os.environ


def test_selftest_optional_flashinfer_line_says_why_where_it_is_not_installed(sm100, monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    dispatch.reset_backend_choice()
    optional = selftest.optional_backend_checks(torch.device("cpu"))
    assert [(c["name"], c["equal"], c["optional"]) for c in optional] == [
        ("GEMM (flashinfer) [flashinfer, optional]", None, True)]
    assert "FlashInfer is not installed" in optional[0]["detail"]


@pytest.mark.parametrize("forced,prebuilt,needle", [
    (None, None, "cublaslt: cuBLASLt's NVFP4 GEMM through torch"),
    (None, "0.7.2.post1", "ships compiled, no nvcc needed; the automatic choice on SM100+ whatever else is installed"),
    ("flashinfer", None, "flashinfer: forced by DIFFUSERS_NVFP4_GEMM_BACKEND; no flashinfer-jit-cache installed: its "
                         "CUTLASS FP4 GEMM compiles with nvcc at the first call"),
    ("flashinfer", "0.7.2.post1", "its prebuilt kernels are installed (flashinfer-jit-cache 0.7.2.post1), no nvcc"),
])
def test_selftest_reports_the_blackwell_backend_and_why(sm100, monkeypatch, cpu_result, forced, prebuilt, needle):
    """The report's GEMM line on an SM100 GPU: the backend, and whether its first call needs nvcc."""
    if forced:
        monkeypatch.setenv(dispatch.GEMM_BACKEND_VAR, forced)
    monkeypatch.setattr(dispatch, "flashinfer_prebuilt", lambda: prebuilt)
    env = selftest.environment(torch.device("cpu"))
    assert env["flashinfer_jit_cache"] == prebuilt
    text = selftest.format_report({**cpu_result, "environment": env})
    line = next(line for line in text.splitlines() if line.startswith("  GEMM "))
    assert needle in line, line


@pytest.mark.gpu
def test_gpu_selftest_passes():
    """Every kernel this GPU uses, byte for byte against its torch reference (prints the report: run with -s)."""
    result = selftest.run_selftest("cuda")
    print(selftest.format_report(result))
    assert result["passed"], selftest.format_report(result)
    assert any(c["name"].startswith("quantize fast-math") for c in result["checks"])
