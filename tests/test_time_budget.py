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
