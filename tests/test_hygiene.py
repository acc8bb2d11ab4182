"""Resource hygiene: enabling and disabling the fast paths many times leaks nothing (Python objects, the verification
registry, CUDA memory on the GPU), and two pipelines generating in two threads at once give the bytes each gives
alone."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from diffusers_nvfp4_fast import disable_fast_paths, enable_fast_paths
from diffusers_nvfp4_fast.ops import verify
from diffusers_nvfp4_fast.utils import png_sha256, run_pipeline
from support.modelopt_exports import nvfp4_pipeline


def _pipeline(which, modelopt_exports, device="cpu"):
    return nvfp4_pipeline(which, modelopt_exports(which), device=device)


def _live_objects() -> int:
    gc.collect()
    return len(gc.get_objects())


def _cycles(pipe, kwargs, cycles: int, every: int, cuda: bool, toggle: bool = True) -> dict:
    """``cycles`` enable/disable rounds (``toggle``; without it, only the generations) with a generation every
    ``every``-th; object, registry and memory counts after the second and the last round of generations."""
    seen = {}
    for i in range(1, cycles + 1):
        if toggle:
            enable_fast_paths(pipe)
        if i % every == 0:
            run_pipeline(pipe, kwargs, size=32, steps=1)
        if toggle:
            disable_fast_paths(pipe)
        if i in (2 * every, cycles):
            if cuda:
                torch.cuda.synchronize()
            seen[i] = (_live_objects(), verify.live_stats_count(), torch.cuda.memory_allocated() if cuda else 0)
    return seen


@pytest.mark.parametrize("which", ["flux2", "qwen"])
def test_200_enable_disable_cycles_leak_nothing(which, modelopt_exports):
    """diffusers and torch keep a few objects per generation themselves (the count moves by one or two either way
    between runs), so the growth with enable/disable cycles is compared with the growth of the same generations
    without them: a leak of anything per cycle adds at least 160 objects over 160 cycles, far above that jitter."""
    pipe, kwargs = _pipeline(which, modelopt_exports)
    registry_before = verify.live_stats_count()
    plain = _cycles(pipe, kwargs, 200, 20, cuda=False, toggle=False)
    cycled = _cycles(pipe, kwargs, 200, 20, cuda=False)
    assert cycled[40][1] == cycled[200][1] == registry_before
    growth, baseline = cycled[200][0] - cycled[40][0], plain[200][0] - plain[40][0]
    # A baseline that shrank (objects of earlier tests freed meanwhile) is no allowance for growth; count it as 0.
    extra = growth - max(baseline, 0)
    assert extra < 16, f"{extra} more Python objects after 160 enable/disable cycles"


@pytest.mark.gpu
def test_gpu_200_cycles_leak_no_cuda_memory(modelopt_exports):
    pipe, kwargs = _pipeline("qwen", modelopt_exports, device="cuda")
    seen = _cycles(pipe, kwargs, 200, 20, cuda=True)
    assert seen[200][2] <= seen[40][2] and seen[200][1] == seen[40][1]


def test_two_pipelines_in_two_threads_give_the_bytes_of_one_at_a_time(modelopt_exports):
    pipes = [_pipeline(which, modelopt_exports) for which in ("flux2", "qwen")]
    for pipe, _ in pipes:
        enable_fast_paths(pipe)
    alone = [png_sha256(run_pipeline(pipe, kwargs)) for pipe, kwargs in pipes]
    together: list[str | None] = [None, None]

    def generate(i: int) -> None:
        pipe, kwargs = pipes[i]
        together[i] = png_sha256(run_pipeline(pipe, kwargs))

    threads = [threading.Thread(target=generate, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone
