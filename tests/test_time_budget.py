"""The suite's time-budget guard: what it prints, and that only a test far past its budget fails the run."""

from __future__ import annotations

from support.time_budget import FAIL_FACTOR, GPU_TEST_LIMIT_S, TEST_BUDGET_S, verdict


def test_slow_but_within_the_limit_is_reported_not_failed():
    result = verdict({"a": 1.0, "b": TEST_BUDGET_S + 5, "c": 2.0}, 100.0)
    assert result.too_slow == []
    assert result.lines[0].startswith("time budget: 100 s of 600 s") and "OVER" not in result.lines[0]
    assert result.lines[1].endswith("b over budget") and result.lines[2].endswith("c")


def test_a_test_past_the_limit_fails_the_run_and_a_long_suite_is_flagged():
    limit = FAIL_FACTOR * TEST_BUDGET_S
    result = verdict({"fast": 0.1, "stuck": limit + 1, "slow": limit - 1}, 700.0, slowest=2)
    assert result.too_slow == ["stuck"]
    assert "OVER BUDGET" in result.lines[0] and len(result.lines) == 3
    assert result.lines[1].endswith("stuck FAILS: past the limit") and result.lines[2].endswith("slow over budget")


def test_gpu_tests_have_their_own_limit():
    """A GPU test (full-size compiles on the GPU machine) fails the run only past GPU_TEST_LIMIT_S."""
    limit = FAIL_FACTOR * TEST_BUDGET_S
    durations = {"compile": limit + 10, "stuck gpu": GPU_TEST_LIMIT_S + 1, "cpu": limit + 10}
    result = verdict(durations, 400.0, gpu_tests=frozenset({"compile", "stuck gpu"}))
    assert sorted(result.too_slow) == ["cpu", "stuck gpu"]
    assert f"a GPU test past {GPU_TEST_LIMIT_S:.0f} s" in result.lines[0]
    assert "GPU test" not in verdict({"cpu": 1.0}, 1.0).lines[0]


def test_xdist_workers_follow_the_cores_and_leave_a_gpu_machine_in_one_process():
    from support.time_budget import MAX_WORKERS, worker_count

    assert worker_count(None, 2, False) == 2  # the CI machine: both cores
    assert worker_count(None, 64, False) == MAX_WORKERS
    assert worker_count(None, 1, False) == worker_count(None, None, False) == 0
    assert worker_count(None, 16, True) == 0  # GPU tests share the device
    assert worker_count("3", 16, True) == 3  # PYTEST_XDIST_AUTO_NUM_WORKERS wins


def test_the_wall_time_counts_from_the_process_start(tmp_path):
    from support.time_budget import process_wall_s

    # A process named "a b) c" (a ')' in the name must not shift the fields) started at tick 250 of 100 per second.
    stat = tmp_path / "stat"
    stat.write_text("42 (a b) c) S " + " ".join(["0"] * 18) + " 250 0 0\n")
    uptime = tmp_path / "uptime"
    uptime.write_text("10.00 20.00\n")
    import os

    assert process_wall_s(str(stat), str(uptime)) == 10.0 - 250 / os.sysconf("SC_CLK_TCK")
    assert process_wall_s(str(tmp_path / "missing"), str(uptime)) is None
    wall = process_wall_s()
    assert wall is None or 0 < wall < 24 * 3600
