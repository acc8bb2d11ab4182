"""The quantize command's hidden work directory beside OUT: removed on SIGTERM (a real subprocess) and Ctrl-C with the
conventional exit status, removed by the next run when its recorded process is gone (SIGKILL, simulated), never
published with its owner record; and OUT gets the modes ``os.makedirs`` and diffusers' ``save_pretrained`` give under
the umask, not ``tempfile.mkdtemp``'s owner-only one."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diffusers_nvfp4_fast.commands.cli import main
from diffusers_nvfp4_fast.quantize import transformer as command
from diffusers_nvfp4_fast.quantize import workdir
from diffusers_nvfp4_fast.quantize.workdir import OWNER_FILE
from diffusers_nvfp4_fast.testing import tiny

ROOT = Path(__file__).resolve().parents[1]
# The child quantizes with its layer quantizer held up after the first layer, so the signal lands mid-write.
_CHILD = """
import pathlib, sys, time
from diffusers_nvfp4_fast.commands.cli import main
from diffusers_nvfp4_fast.quantize import transformer as command
real = command.nvfp4_layer_tensors
def held(*args, **kwargs):
    tensors = real(*args, **kwargs)
    pathlib.Path(sys.argv[3]).write_text("writing")
    time.sleep(300)
    return tensors
command.nvfp4_layer_tensors = held
sys.exit(main(["quantize", sys.argv[1], sys.argv[2], "--dynamic", "--no-progress"]))
"""


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A tiny FLUX.2-klein transformer in BF16 (25 Linears, 21 of them NVFP4 under the recipe)."""
    path = tmp_path_factory.mktemp("workdir_source") / "bf16"
    tiny.tiny_flux2_transformer(False).save_pretrained(path)
    return path


def _hidden(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def _wait_for(path: Path, child: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert child.poll() is None, child.communicate()
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.1)


def test_sigterm_removes_the_work_directory_and_exits_143(source, tmp_path):
    out, ready = tmp_path / "out", tmp_path / "ready"
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(source), str(out), str(ready)], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(ready, child)
        [work] = [tmp_path / name for name in _hidden(tmp_path)]
        owner = json.loads((work / OWNER_FILE).read_text())
        assert work.name.startswith(".out.") and work.name.endswith(".quantizing")
        assert owner["pid"] == child.pid and owner["host"] == socket.gethostname() and owner["out"] == str(out)
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 143, err
    assert err.strip().splitlines()[-1] == (f"diffusers-nvfp4-fast quantize: stopped by SIGTERM; its unfinished work "
                                            f"directory beside {out} was removed")
    assert _hidden(tmp_path) == [] and not out.exists()


def test_ctrl_c_removes_the_work_directory_and_exits_130(source, tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(command, "nvfp4_layer_tensors", interrupted)
    try:
        code = main(["quantize", str(source), str(tmp_path / "out"), "--dynamic", "--no-progress"])
    except KeyboardInterrupt:
        code = "KeyboardInterrupt escaped"
    assert code == 130
    assert "stopped by Ctrl-C (SIGINT)" in capsys.readouterr().err
    assert _hidden(tmp_path) == [] and not (tmp_path / "out").exists()


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _left_behind(parent: Path, name: str, owner: dict | None, size: int = 2_000_000) -> Path:
    path = parent / name
    path.mkdir()
    (path / ".shard-00000.safetensors").write_bytes(b"\0" * size)
    if owner is not None:
        (path / OWNER_FILE).write_text(json.dumps(owner))
    return path


def test_next_run_removes_work_directories_of_dead_processes(source, tmp_path, caplog, capsys):
    out, host = tmp_path / "out", socket.gethostname()
    killed = _left_behind(tmp_path, ".out.k1ll3d.quantizing", {"pid": _dead_pid(), "host": host, "out": str(out)})
    running = _left_behind(tmp_path, ".out.runn1n.quantizing", {"pid": os.getppid(), "host": host, "out": str(out)})
    elsewhere = _left_behind(tmp_path, ".out.0th3r.quantizing", {"pid": 1, "host": f"not-{host}", "out": str(out)})
    unknown = _left_behind(tmp_path, ".out.0ld.quantizing", None)
    sibling = _left_behind(tmp_path, ".out.v2.s1bl1n.quantizing",  # OUT "out.v2": another target, untouched
                           {"pid": _dead_pid(), "host": host, "out": str(tmp_path / "out.v2")})
    with caplog.at_level(logging.WARNING, logger="diffusers_nvfp4_fast"):
        assert main(["quantize", str(source), str(out), "--dynamic", "--no-progress"]) == 0, capsys.readouterr()
    assert not killed.exists() and running.exists() and elsewhere.exists() and unknown.exists() and sibling.exists()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert sum(f"removed stale work directory {killed} (2.0 MB) of process" in line for line in lines) == 1
    assert any(f"left {unknown} (2.0 MB) alone: it has no owner record" in line for line in lines)
    assert any(f"left {elsewhere} (2.0 MB) alone: it belongs to process 1 on host not-{host}" in line
               for line in lines)
    assert OWNER_FILE not in os.listdir(out) and "config.json" in os.listdir(out)


def test_a_failed_swap_puts_the_previous_out_back(source, tmp_path, monkeypatch, caplog):
    """``--overwrite``: the old OUT is moved aside, and put back when the new one cannot be renamed into place; a
    ``.replaced`` directory that holds the only copy of OUT is never removed as stale."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    real = os.replace

    def failing(src, dst):
        if str(src).endswith(".quantizing"):
            raise PermissionError(f"cannot rename {src}")
        real(src, dst)

    monkeypatch.setattr(workdir.os, "replace", failing)
    with pytest.raises(PermissionError):
        command.quantize_transformer(source, out, dynamic=True, overwrite=True, progress=False)
    assert os.listdir(out) == ["keep.txt"] and _hidden(tmp_path) == []
    aside = _left_behind(tmp_path, ".out.4s1de.replaced", {"pid": _dead_pid(), "host": socket.gethostname(),
                                                           "out": str(out)})
    real(out, aside / "out")
    with caplog.at_level(logging.WARNING, logger="diffusers_nvfp4_fast"):
        assert workdir.remove_stale_work_dirs(out) == []
    assert (aside / "out" / "keep.txt").exists()
    assert f"it holds the previous out, which a failed run moved aside; move it back to {out}" in caplog.text


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["022", "027"])
def test_out_has_the_modes_of_the_umask(source, tmp_path, umask):
    """The directory as ``os.makedirs`` and diffusers' ``save_pretrained`` make it, the files as ``open`` does
    (safetensors 0.8's ``save_file`` makes its files owner-only, so they are set explicitly)."""
    before = os.umask(umask)
    try:
        assert main(["quantize", str(source), str(tmp_path / "out"), "--dynamic", "--max-shard-size", "50KB",
                     "--no-progress"]) == 0
        os.makedirs(tmp_path / "made")
        (tmp_path / "made" / "opened").write_text("")
        tiny.tiny_flux2_transformer(False).save_pretrained(tmp_path / "saved")
    finally:
        os.umask(before)

    def mode(path: Path) -> int:
        return stat.S_IMODE(path.stat().st_mode)

    assert mode(tmp_path / "out") == mode(tmp_path / "made") == mode(tmp_path / "saved") == 0o777 & ~umask
    files = list((tmp_path / "out").iterdir())
    assert len(files) > 3 and (tmp_path / "out" / "diffusion_pytorch_model.safetensors.index.json") in files
    assert {mode(f) for f in files} == {mode(tmp_path / "made" / "opened")} == {0o666 & ~umask}
