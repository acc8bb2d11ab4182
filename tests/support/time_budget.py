"""The suite's time budget (README, "The two commands"): every run prints its total and its slowest tests against
it; only a test far past its own budget fails the run, so machine noise never does."""

from __future__ import annotations

import os
from dataclasses import dataclass

SUITE_BUDGET_S = 600.0  # the whole README test command on a 2-core CI machine
TEST_BUDGET_S = 30.0  # one test: setup + call + teardown
FAIL_FACTOR = 4.0  # a test fails the run only past FAIL_FACTOR x TEST_BUDGET_S
# GPU tests (marked gpu) run on the GPU machine, outside the CI budget; full-size compiles take minutes there.
GPU_TEST_LIMIT_S = 300.0
MAX_WORKERS = 4  # xdist workers on a CPU machine: each holds torch, diffusers and its own session fixtures


def worker_count(requested: str | None, cores: int | None, has_gpu: bool) -> int:
    """Workers for ``-n auto``: ``PYTEST_XDIST_AUTO_NUM_WORKERS`` if set, none on a GPU machine (its tests share
    the device), else one per core up to ``MAX_WORKERS`` (none on one core: the run stays in this process)."""
    if requested:
        return int(requested)
    if has_gpu or not cores or cores < 2:
        return 0
    return min(cores, MAX_WORKERS)


def process_wall_s(stat: str = "/proc/self/stat", uptime: str = "/proc/uptime") -> float | None:
    """Seconds since this process started (the README command's wall time, interpreter start-up included), from
    Linux's /proc; None elsewhere."""
    try:
        with open(stat) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(uptime) as f:
            up = float(f.read().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return up - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 (starttime), counted after the name


@dataclass
class Verdict:
    lines: list[str]
    too_slow: list[str]  # tests past FAIL_FACTOR x TEST_BUDGET_S: these fail the run


def verdict(durations: dict[str, float], total_s: float, slowest: int = 10,
            gpu_tests: frozenset[str] = frozenset()) -> Verdict:
    """The report of one run: ``durations`` maps test ids to seconds (all phases), ``total_s`` is the wall time;
    tests in ``gpu_tests`` fail the run only past ``GPU_TEST_LIMIT_S``."""
    limit = FAIL_FACTOR * TEST_BUDGET_S
    over_suite = " OVER BUDGET" if total_s > SUITE_BUDGET_S else ""
    lines = [f"time budget: {total_s:.0f} s of {SUITE_BUDGET_S:.0f} s for the suite{over_suite}; "
             f"{TEST_BUDGET_S:.0f} s per test (a test fails the run past {limit:.0f} s"
             + (f", a GPU test past {GPU_TEST_LIMIT_S:.0f} s)" if gpu_tests & durations.keys() else ")")]
    ranked = sorted(durations.items(), key=lambda item: -item[1])

    def past(test: str, seconds: float) -> bool:
        return seconds > (GPU_TEST_LIMIT_S if test in gpu_tests else limit)

    for test, seconds in ranked[:slowest]:
        mark = " FAILS: past the limit" if past(test, seconds) else " over budget" if seconds > TEST_BUDGET_S else ""
        lines.append(f"  {seconds:7.1f} s  {test}{mark}")
    return Verdict(lines, [test for test, seconds in ranked if past(test, seconds)])
