"""``kernels.launch``: host helpers that replace Triton's (CPU), and direct launches of the binary Triton's binder
picks, which must run the same binary as ``kernel[grid](...)``: same bytes, a new binary for every new
specialization, Triton's own path under launch hooks, capturable by CUDA graphs (``gpu``)."""

import importlib

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed, so the launch tests did not run; they "
                                               "run wherever Triton is installed, as in CI (pip install -e '.[test]')")

from diffusers_nvfp4_fast import kernels  # noqa: E402
from diffusers_nvfp4_fast.format import quantize_nvfp4 as reference_quantize  # noqa: E402

launch_mod = importlib.import_module("diffusers_nvfp4_fast.kernels.launch")
quantize_mod = importlib.import_module("diffusers_nvfp4_fast.kernels.quantize_nvfp4")


def test_host_cdiv_and_next_power_of_2_match_triton():
    """The plain host helpers that replace triton.cdiv / triton.next_power_of_2 in launch code give the same values."""
    from diffusers_nvfp4_fast.kernels.launch import cdiv, next_power_of_2

    values = [0, 1, 2, 15, 16, 17, 127, 128, 129, 4095, 4096, 4097, 70000, 2**31 - 1]
    for a in values:
        for b in (1, 2, 4, 16, 64, 128, 192, 256, 1000):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
    for n in [*range(1, 5000), 65535, 65536, 65537, 2**31 - 1]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n


def _entries(kernel) -> int:
    return sum(1 for kernel_of_entry, _ in launch_mod._COMPILED.values() if kernel_of_entry is kernel)


@pytest.mark.gpu
def test_gpu_direct_launches_match_reference_across_specializations():
    # Row counts 16 (divisible by 16), 1 (specialized to a constant), 17 and 16 again: Triton specializes integer
    # arguments on both properties, so the first three need their own binaries and the last reuses the first.
    g = torch.tensor([0.7], device="cuda")
    for rows in (16, 1, 17, 16, 1, 17):
        x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16) * 3
        want = reference_quantize(x, g, fast_math=False)  # exact in the precise recipe
        for _ in range(3):  # first call: Triton's path (compile, cache); then direct launches
            got = kernels.quantize_nvfp4_triton(x, g, fast_math=False)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"rows={rows}"
    assert _entries(quantize_mod._quantize_nvfp4_kernel) >= 3


@pytest.mark.gpu
def test_gpu_launch_hook_takes_tritons_path():
    g = torch.tensor([0.7], device="cuda")
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    kernels.quantize_nvfp4_triton(x, g, fast_math=False)
    kernels.quantize_nvfp4_triton(x, g, fast_math=False)  # now cached: the direct path would not call hooks
    seen = []

    def hook(metadata):
        seen.append(metadata)

    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        got = kernels.quantize_nvfp4_triton(x, g, fast_math=False)
        torch.cuda.synchronize()
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert seen, "a registered launch hook must see the launch (Triton's own path)"
    want = reference_quantize(x, g, fast_math=False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
def test_gpu_direct_launch_is_captured_by_cuda_graphs():
    g = torch.tensor([0.7], device="cuda")
    x = torch.randn(256, 2048, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        kernels.quantize_nvfp4_triton(x, g, fast_math=False)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        packed, scales = kernels.quantize_nvfp4_triton(x, g, fast_math=False)
    x.copy_(torch.randn_like(x) * 5)
    graph.replay()
    torch.cuda.synchronize()
    want = reference_quantize(x, g, fast_math=False)
    assert torch.equal(packed, want[0]) and torch.equal(scales, want[1])
