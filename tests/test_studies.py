"""The studies of ``benchmarks/studies/`` stay runnable: each imports, is named by the date of its last run and writes
into that folder's results; and the compile diagnosis's pure parts on the CPU (the checksum that tells launches apart,
the wrapper diff that masks what only a compile counter or a cache path changes, the search for the first differing
launch). The GPU runs themselves are in each study's docstring."""

from __future__ import annotations

import json
import re

import pytest
import torch
from studies import study  # benchmarks/ is on the test path (pyproject.toml)

compile_diagnose = study.load("compile_diagnose")


def test_every_study_is_dated_imports_and_writes_into_the_study_results():
    pytest.importorskip("triton", reason="the kernel studies import Triton, so they were not imported; "
                                         "this runs wherever Triton is installed, as in CI")
    scripts = sorted(p for p in study.STUDIES.glob("*.py") if p.name != "study.py")
    assert len(scripts) >= 6
    for path in scripts:
        date = re.fullmatch(r"(\d{4})(\d{2})(\d{2})_\w+\.py", path.name)
        assert date, f"{path.name}: not YYYYMMDD_<name>.py"
        text = path.read_text()
        assert f"last run {'-'.join(date.groups())}" in text, f"{path.name}: its docstring names another date"
        assert "study.write_result(" in text and "common.write_result(" not in text, path.name
        study.load(path.stem.split("_", 1)[1])


def test_every_study_result_names_a_study_that_writes_it():
    scripts = [p.read_text() for p in study.STUDIES.glob("[0-9]*_*.py")]
    results = sorted(study.RESULTS.glob("*.json"))
    assert len(results) >= 16
    for path in results:
        benchmark = json.loads(path.read_text())["benchmark"]
        assert any(f'"{benchmark}' in text for text in scripts), f"{path.name}: no study writes {benchmark!r}"


def test_digest_sees_one_changed_element_and_a_moved_one():
    x = torch.randn(1000, dtype=torch.bfloat16)
    y = x.clone()
    y.view(torch.int16)[500] += 1  # one ulp
    swapped = x.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert compile_diagnose.digest(x) == compile_diagnose.digest(x.clone())
    assert compile_diagnose.digest(x) != compile_diagnose.digest(y)
    assert x[3] == x[4] or compile_diagnose.digest(x) != compile_diagnose.digest(swapped)
    assert compile_diagnose.digest(torch.polar(torch.ones(3), torch.arange(3.0))) is not None
    assert compile_diagnose.digest(torch.empty(0)) is None and compile_diagnose.digest(3) is None


def _wrapper(aot: int, path: str, kernel_body: str) -> str:
    return (f"# AOT ID: ['{aot}_inference']\n"
            "async_compile = AsyncCompile()\n"
            f"# kernel path: /tmp/torchinductor_root/{path}.py\n"
            "triton_red_fused_0 = async_compile.triton('triton_red_fused_0', '''\n"
            f"{kernel_body}\n''', device_str='cuda')\n"
            "def call(args):\n"
            "    extern_kernels.mm(buf0, arg1_1, out=buf1)\n")


def test_code_diff_masks_counters_and_paths_and_names_the_kernel():
    a = _wrapper(0, "ab/cabc" + "0" * 40, "R0_BLOCK: 2048")
    same = compile_diagnose.code_diff(a, _wrapper(7, "cd/cdef" + "1" * 40, "R0_BLOCK: 2048"))
    assert same["identical"] and same["lines_changed"] == 0 and same["extern_calls_equal"]
    other = compile_diagnose.code_diff(a, _wrapper(1, "ab/cabc" + "0" * 40, "R0_BLOCK: 1024"))
    assert not other["identical"] and other["kernels_differing"] == ["triton_red_fused_0"]
    assert other["lines_changed"] == 2 and any("R0_BLOCK: 1024" in line for line in other["diff_head"])
    assert other["extern_calls"] == ["extern_kernels.mm"]


def test_first_divergence_names_the_launch_whose_inputs_agree():
    def event(name, ins, outs, config="XBLOCK=64"):
        return {"kind": "triton", "name": name, "ins": ins, "outs": outs, "config": config}

    a = [event("k0", {"in_ptr0": "x"}, {"out_ptr0": "y"}), event("k1", {"in_ptr0": "y"}, {"out_ptr0": "z"}),
         event("k2", {"in_ptr0": "z"}, {"out_ptr0": "w"})]
    b = [a[0], event("k1", {"in_ptr0": "y"}, {"out_ptr0": "z2"}, "XBLOCK=128"),
         event("k2", {"in_ptr0": "z2"}, {"out_ptr0": "w2"})]
    report = compile_diagnose.first_divergence(a, b)
    first = report["first"]
    assert report["differing"] == 2 and first["index"] == 1 and first["name"] == "k1" and first["inputs_equal"]
    assert first["outputs_differing"] == ["out_ptr0"] and (first["a"]["config"], first["b"]["config"]) == (
        "XBLOCK=64", "XBLOCK=128")
    assert compile_diagnose.first_divergence(a, a)["first"] is None
    moved = compile_diagnose.first_divergence(a, [a[0], event("k9", {}, {})])
    assert moved["first"]["why"] == "another kernel at this position" and moved["sequence_differs_at"] == 1


def test_every_patch_names_settings_this_torch_has_and_restores_them():
    for _, settings, _ in compile_diagnose.PATCHES:
        for key in settings:
            assert compile_diagnose.setting(key) != "absent", key
    assert compile_diagnose.setting("no_such_setting") == "absent"
    key = "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction"
    before = compile_diagnose.setting(key)
    with compile_diagnose.patched({key: not before, "triton.autotune_pointwise": False}):
        assert compile_diagnose.setting(key) is (not before)
        assert compile_diagnose.setting("triton.autotune_pointwise") is False
        assert compile_diagnose.setting("deterministic") is True  # exact_inductor underneath
    assert compile_diagnose.setting(key) is before and compile_diagnose.setting("triton.autotune_pointwise") is True


def test_block_recorder_keeps_checksums_of_inputs_and_outputs_and_passes_the_output_through():
    compile_determinism = study.load("compile_determinism")

    torch.manual_seed(0)
    block, log = torch.nn.Linear(4, 3), []
    x = torch.randn(2, 4)
    out = compile_determinism._Recorder(block, log)(x)
    assert torch.equal(out, block(x)) and len(log) == 1
    assert log[0] == {"ins": [compile_diagnose.digest(x)], "outs": [compile_diagnose.digest(out)]}
    compile_determinism._Recorder(block, log)(x + 1)
    assert log[1]["ins"] != log[0]["ins"] and log[1]["outs"] != log[0]["outs"]
