"""``benchmarks/profile_step.py``'s split of NVFP4 GEMM time by layer shape: kernel time inside each layer's GPU-side
range, counted once (the first version added the CPU range's device total to the GPU span's length, and a later one
missed the Triton launches that are not tied to the CPU range)."""

from __future__ import annotations

from types import SimpleNamespace

import profile_step  # benchmarks/ is on the test path (pyproject.toml)
import pytest
import torch

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


def _event(name: str, start: float, end: float, device=CUDA):
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))


def test_kernel_time_is_summed_inside_each_range_once():
    qkv, mod = "gemm M=4096 N=3072 K=3072", "gemm M=1 N=18432 K=3072"
    events = [
        _event(qkv, 100, 200), _event(qkv, 100, 200, CPU),  # a layer call: its GPU span and its CPU range
        _event("other kernel", 90, 95),  # before the range
        _event("_quantize_nvfp4_decoded_kernel", 100, 130), _event("_nvfp4_gemm_sm90_kernel", 140, 190),  # idle between
        _event("elementwise", 205, 215),  # after it
        _event(qkv, 300, 400), _event("_nvfp4_gemm_sm90_kernel", 310, 350),  # the same shape again
        _event(mod, 500, 600), _event("_nvfp4_gemm_kernel", 520, 530),
    ]
    shapes = profile_step.kernel_time_in_ranges(events)
    assert shapes == {qkv: pytest.approx(0.12), mod: pytest.approx(0.01)}  # ms: (30 + 50 + 40) us and 10 us
