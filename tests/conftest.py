import os
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from diffusers_nvfp4_fast.switches import CHECK_OPS

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):  # an xdist worker: its share of the cores, not all of them each
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
os.environ.setdefault(CHECK_OPS, "1")  # every op call through the dispatcher checks its outputs

_DURATIONS: dict[str, float] = defaultdict(float)
_GPU_TESTS: set[str] = set()
_START = [time.perf_counter()]


def pytest_sessionstart(session):
    _START[0] = time.perf_counter()


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (the default, pyproject.toml): every core of a CPU machine, at most 4 (each worker holds torch,
    diffusers and its own tiny fixtures); on a machine with a GPU, none: the GPU tests share one device."""
    from support.time_budget import worker_count

    return worker_count(os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"), os.cpu_count(), torch.cuda.is_available())


def pytest_runtest_logreport(report):
    _DURATIONS[report.nodeid] += report.duration
    if "gpu" in report.keywords:  # here, not at collection: under xdist only the workers collect
        _GPU_TESTS.add(report.nodeid)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Every run: the total and the slowest tests against the time budget (tests/support/time_budget.py)."""
    from support.time_budget import process_wall_s, verdict

    wall = process_wall_s() or time.perf_counter() - _START[0]
    result = verdict(dict(_DURATIONS), wall, gpu_tests=frozenset(_GPU_TESTS))
    terminalreporter.section("time budget")
    for line in result.lines:
        terminalreporter.write_line(line)
    if result.too_slow:
        terminalreporter.write_line(f"{len(result.too_slow)} test(s) past the per-test limit fail this run")
        terminalreporter._session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="GPU test (marked gpu) not run: no CUDA device here; "
                                   "it runs on the GPU machine with `pytest -m gpu`")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def modelopt_exports(tmp_path_factory):
    """which -> directory of a real ModelOpt NVFP4 export of the tiny transformer (built once per session)."""
    from support.modelopt_exports import export_with_modelopt

    cache = {}

    def get(which: str) -> Path:
        if which not in cache:
            cache[which] = export_with_modelopt(which, tmp_path_factory.mktemp(f"modelopt_{which}"))
        return cache[which]

    return get


@pytest.fixture
def fresh_verdicts():
    """Forget the process-wide verification verdicts before and after a test (modules opt in with usefixtures)."""
    from diffusers_nvfp4_fast.ops import verify

    verify.reset_verification()
    yield
    verify.reset_verification()
