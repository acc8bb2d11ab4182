"""Environment switches are declared once (``diffusers_nvfp4_fast/switches.py``): the readers use those names, the
kernels' own spellings (``kernels/`` cannot import the package) match them, and the CUDA-graph runner's key follows
every switch read at call time and the verification state that ``ops/verify.py`` registers as a state probe."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch
from torch import nn

from diffusers_nvfp4_fast import state_probes, switches
from diffusers_nvfp4_fast.graphs.keys import ModelWatch


def test_env_value_reads_what_os_environ_holds_at_each_call(monkeypatch):
    name = "DIFFUSERS_NVFP4_TEST_ENV_VALUE"
    monkeypatch.delenv(name, raising=False)
    assert switches.env_value(name) is None
    for value in ("1", "", " off ", "déjà"):
        monkeypatch.setenv(name, value)
        assert switches.env_value(name) == os.environ.get(name) == value
    os.environ[name] = "later"  # set directly, after the name was first looked up
    assert switches.env_value(name) == "later"
    del os.environ[name]
    assert switches.env_value(name) is None


def test_the_no_asm_switch_the_decode_kernel_reads_is_the_declared_one(monkeypatch):
    pytest.importorskip("triton", reason="the kernels import Triton, so they were not checked; "
                                         "this runs wherever Triton is installed, as in CI")
    from diffusers_nvfp4_fast.kernels import launch, nvfp4_decode

    if launch.INTERPRETING:
        pytest.skip("under TRITON_INTERPRET the decode never takes the PTX split, so the switch was not checked; "
                    "this runs without TRITON_INTERPRET, as in CI")
    assert nvfp4_decode.NO_ASM_VAR == switches.TRITON_NO_ASM
    cuda_tensor = types.SimpleNamespace(is_cuda=True)  # use_asm_split reads only this of its tensor
    monkeypatch.delenv(switches.TRITON_NO_ASM, raising=False)
    assert nvfp4_decode.use_asm_split(cuda_tensor)
    monkeypatch.setenv(switches.TRITON_NO_ASM, "1")
    assert not nvfp4_decode.use_asm_split(cuda_tensor)


def test_the_gemm_autotune_switch_the_gemm_reads_is_the_declared_one(monkeypatch):
    pytest.importorskip("triton", reason="the kernels import Triton, so they were not checked; "
                                         "this runs wherever Triton is installed, as in CI")
    import importlib

    nvfp4_gemm = importlib.import_module("diffusers_nvfp4_fast.kernels.nvfp4_gemm")  # the package exports a function
    assert nvfp4_gemm.AUTOTUNE_VAR == switches.GEMM_AUTOTUNE
    monkeypatch.delenv(switches.GEMM_AUTOTUNE, raising=False)
    assert not nvfp4_gemm.autotune_enabled()  # off by default: the shipped configs, nothing timed
    for value, on in (("1", True), ("true", True), ("0", False), ("", False), (" off ", False)):
        monkeypatch.setenv(switches.GEMM_AUTOTUNE, value)
        assert nvfp4_gemm.autotune_enabled() is on, value


def test_the_pdl_switch_the_launcher_reads_is_the_declared_one():
    """kernels/launch.py reads it once, at import: in a fresh process, the declared name set to 0 turns PDL off."""
    pytest.importorskip("triton", reason="the kernels import Triton, so they were not checked; "
                                         "this runs wherever Triton is installed, as in CI")
    code = ("import importlib, os, sys\n"
            "from diffusers_nvfp4_fast.kernels import launch\n"
            "off = launch.PDL\n"
            "os.environ[sys.argv[1]] = '1'\n"
            "print('PDL', off, importlib.reload(launch).PDL)")
    env = {**os.environ, switches.PDL: "0"}
    out = subprocess.run([sys.executable, "-c", code, switches.PDL], capture_output=True, text=True, timeout=120,
                         env=env)
    assert "PDL False True" in out.stdout, out.stdout + out.stderr


def test_the_runner_key_follows_every_call_time_switch(monkeypatch):
    for name in switches.CALL_TIME_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    watch = ModelWatch(nn.Linear(4, 4))
    first = watch.state()[1]
    for name in switches.CALL_TIME_SWITCHES:
        monkeypatch.setenv(name, "1")
        assert watch.state()[1] != first, name
        monkeypatch.delenv(name)
        assert watch.state()[1] == first, name  # a configuration seen before gets its number back


def test_the_fast_math_readers_use_the_declared_names(monkeypatch):
    from diffusers_nvfp4_fast.format import fast_math_from_env

    for name in switches.FAST_MATH_OFF:
        monkeypatch.delenv(name, raising=False)
    assert fast_math_from_env()
    for name in switches.FAST_MATH_OFF:
        assert name in switches.CALL_TIME_SWITCHES
        monkeypatch.setenv(name, "1")
        assert not fast_math_from_env(), name
        monkeypatch.delenv(name)


def test_the_runner_key_follows_failed_verifications(fresh_verdicts):
    from diffusers_nvfp4_fast.ops import verify
    from diffusers_nvfp4_fast.ops.site import Site

    assert "failed verifications" in state_probes.registered()
    watch = ModelWatch(nn.Linear(4, 4))
    first = watch.state()[1]
    stats_id, _ = verify.new_stats("first")
    try:
        with pytest.warns(RuntimeWarning, match="flux2_rotary falls back"):
            verify.run_checked(Site(stats_id, "flux2_rotary"), "probe", ("out",), lambda: (torch.zeros(2),),
                               lambda: (torch.ones(2),))
    finally:
        verify.drop_stats(stats_id)
    assert verify.failed_kinds_count() == 1
    assert watch.state()[1] != first


def test_every_switch_the_package_names_is_declared_here():
    """An environment name ``DIFFUSERS_NVFP4_*`` quoted in the package's or the kernels' code is one of ``switches``'
    declarations (a concept declared once)."""
    import re
    from pathlib import Path

    import diffusers_nvfp4_fast

    root = Path(diffusers_nvfp4_fast.__file__).parent
    declared = {v for k, v in vars(switches).items() if k.isupper() and isinstance(v, str)}
    files = [*root.rglob("*.py"), *(root.parent / "kernels").rglob("*.py")]
    quoted = r"(?<=[\"'`])DIFFUSERS_NVFP4_[A-Z0-9_]+"  # in a string or a docstring, not a Python name
    named = {m for f in files for m in re.findall(quoted, f.read_text())}
    assert named and named <= declared, sorted(named - declared)
