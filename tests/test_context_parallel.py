"""Fast paths under diffusers' context parallelism (``examples/context_parallel.py`` launched with torchrun, two
processes): the fused sites run on every rank and the PNG with fast paths on equals the one with them off under the
same parallel config, in either order of ``enable_parallelism`` and ``enable_fast_paths``. CPU: gloo, Ulysses (the
only mode a CPU attention backend of diffusers 0.42.1 supports). ``gpu``: NCCL on two GPUs, Ulysses and ring.

Context parallelism itself changes bytes against one process (each rank attends over its own key order, so the
softmax sums round differently); that is diffusers' and is not compared here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "context_parallel.py"
FUSED = {"flux2": {"flux2_swiglu", "flux2_token_cat_swiglu", "flux2_rotary", "flux2_resnorm", "flux2_adaln"},
         "qwen": {"qwen_resnorm", "qwen_gelu", "qwen_adaln", "qwen_qk_rotary"}}


# A rank that aborts in torch's teardown after both ranks' results are out and the process group is destroyed
# (2026-12-06: in 2 of 3 full CPU suites and 2 of 20 runs of the ulysses cases under pytest, none of 59 launched from
# a shell); such a run is launched again, at most twice.
TEARDOWN_ABORT = "terminate called without an active exception"


def _launch(tmp_path, *args: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(EXAMPLE),
           "--tiny", *args]
    for _ in range(3):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
        finished = out.stdout.count("RANK ") == 2 and TEARDOWN_ABORT in out.stderr
        if out.returncode == 0 or not finished:
            break
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ranks = [json.loads(line[5:]) for line in out.stdout.splitlines() if line.startswith("RANK ")]
    assert [r["rank"] for r in ranks] == [0, 1], out.stdout
    return ranks


def _check(ranks: list[dict], model: str) -> None:
    for r in ranks:
        assert r["on"] == r["off"] == ranks[0]["off"], ranks
        assert set(r["fused_calls"]) == FUSED[model] and all(n > 0 for n in r["fused_calls"].values()), r
        assert not r["fallbacks"], r


@pytest.mark.parametrize(("model", "order"), [("flux2", ()), ("flux2", ("--fast-paths-first",)), ("qwen", ())])
def test_ulysses_on_two_cpu_processes(model, order, tmp_path):
    _check(_launch(tmp_path, "--model", model, "--mode", "ulysses", *order), model)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="2-GPU context-parallel test not run: fewer than two CUDA "
                    "GPUs here; it runs on a two-GPU machine (benchmarks/gpu_run.sh cp)")
@pytest.mark.parametrize("mode", ["ulysses", "ring"])
@pytest.mark.parametrize("model", ["flux2", "qwen"])
def test_gpu_two_ranks(model, mode, tmp_path):
    _check(_launch(tmp_path, "--model", model, "--mode", mode), model)


def test_benchmark_dry_run(tmp_path):
    """``bench_context_parallel.py --tiny``: the whole logic (1-process and 2-rank steps, on == off, the result
    file) on the CPU; the GPU run is the same code at full size."""
    bench = EXAMPLE.parents[1] / "benchmarks" / "bench_context_parallel.py"
    out = tmp_path / "cp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(bench),
           "--model", "flux2-dev", "--tiny", "--skip-bf16", "--steps-timed", "1", "--warmup", "1", "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    cases = json.loads(out.read_text())["cases"]
    assert {(c["rank"], c["gpus"], c["variant"]) for c in cases} == {
        (r, g, v) for r in (0, 1) for g in (1, 2) for v in ("nvfp4_fast_off", "nvfp4_fast_on")}
    assert all(c["exact_on_equals_off"] for c in cases)
    assert all(c["fused_calls"] == {"flux2_swiglu": 2, "flux2_token_cat_swiglu": 2, "flux2_rotary": 6,
                                    "flux2_resnorm": 2, "flux2_adaln": 4}
               for c in cases if c["variant"] == "nvfp4_fast_on")
