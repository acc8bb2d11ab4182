"""Programmatic dependent launch (``kernels/grid_dependency.py``): the kernels launched with ``launch.pdl_options``
wait for the grids before them before any global memory access (CPU: their PTX for SM90, none of it for SM80), and a
chain of them launched back to back gives the bytes of the same chain with the device synchronized between launches
(``gpu``)."""

from __future__ import annotations

import importlib
import re

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed, so the grid dependency tests did not run; "
                                               "they run wherever Triton is installed, as in CI (pip install -e "
                                               "'.[test]')")

launch_mod = importlib.import_module("diffusers_nvfp4_fast.kernels.launch")

WAIT, RELEASE = "griddepcontrol.wait", "griddepcontrol.launch_dependents"
# Any PTX instruction that reads or writes global memory: plain and vector loads/stores, atomics, TMA copies.
GLOBAL_ACCESS = re.compile(r"^\s*(?:@%p\d+\s+)?(?:ld|st|red|atom)\.global|^\s*(?:@%p\d+\s+)?cp\.async\.bulk", re.M)


def _compile(kernel: str, arch: int):
    from support import sass_count

    if kernel == "sm90_gemm":
        pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper",
                            reason="this Triton has no Gluon Hopper API, so the SM90 GEMM's grid dependency check did "
                                   "not run; it runs with Triton >= 3.6, as CI installs")
        return sass_count.compile_gemm_sm90(pdl=arch >= 90)
    if kernel == "gemv":
        return sass_count.compile_gemv(False, arch=arch)
    return sass_count.compile_kernel(kernel, arch, fast_math=True, block_r=4, block_c=32)


@pytest.mark.parametrize("kernel", ["sm90_gemm", "gemv", "decoded", "gelu_decoded"])
def test_pdl_kernels_wait_before_any_global_memory_access(kernel):
    """For SM90 each kernel launched with the PDL attribute waits first, then releases the next kernel, and touches
    global memory only after both; its binary carries the launch attribute."""
    compiled = _compile(kernel, 90)
    ptx = compiled.asm["ptx"]
    first_access = GLOBAL_ACCESS.search(ptx)
    assert first_access is not None, "no global memory access found: the pattern no longer matches this PTX"
    assert ptx.count(WAIT) == 1 and ptx.count(RELEASE) == 1
    assert ptx.index(WAIT) < ptx.index(RELEASE) < first_access.start(), first_access.group()
    assert compiled.metadata.launch_pdl


@pytest.mark.parametrize("kernel", ["gemv", "decoded", "gelu_decoded"])
def test_pdl_kernels_compile_without_grid_dependency_before_sm90(kernel):
    """PTX has the instructions from SM90 on only; for SM80 the kernels are compiled without them."""
    compiled = _compile(kernel, 80)
    assert "griddepcontrol" not in compiled.asm["ptx"] and not compiled.metadata.launch_pdl


def test_pdl_options(monkeypatch):
    """On for CUDA devices of SM90 and newer while DIFFUSERS_NVFP4_PDL is not 0; never for other devices."""
    capability = {0: (9, 0), 1: (8, 0)}
    monkeypatch.setattr(launch_mod, "cuda_capability", lambda device: capability[device.index])
    monkeypatch.setattr(launch_mod, "INTERPRETING", False)
    monkeypatch.setattr(launch_mod, "PDL", True)
    assert launch_mod.pdl_options(torch.device("cuda", 0)) == {"PDL": True, "launch_pdl": True}
    assert launch_mod.pdl_options(torch.device("cuda", 1)) == {"PDL": False, "launch_pdl": False}
    assert launch_mod.pdl_options(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}
    monkeypatch.setattr(launch_mod, "PDL", False)
    assert launch_mod.pdl_options(torch.device("cuda", 0)) == {"PDL": False, "launch_pdl": False}
    monkeypatch.setattr(launch_mod, "INTERPRETING", True)  # the interpreter takes no launch attribute
    assert launch_mod.pdl_options(torch.device("cuda", 0)) == {"PDL": False}


def _weight(n: int, k: int, seed: int):
    from diffusers_nvfp4_fast.format import quantize_nvfp4

    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    g = (2688.0 / w.float().abs().amax()).reshape(())
    packed, scales = quantize_nvfp4(w, g, fast_math=False)
    return packed, scales, (1.0 / g).reshape(1).float()


def _chain(x_src: torch.Tensor, h_src: torch.Tensor, weights: list, scale: torch.Tensor, sync: bool) -> list:
    """Per input: x written by a torch kernel, then decoded quantize -> GEMM -> GEMM on the same decode (the query /
    key pattern), GELU quantize -> GEMM, and the one-row product; ``sync``: the device synchronized after each."""
    from diffusers_nvfp4_fast import kernels

    sm90 = importlib.import_module("diffusers_nvfp4_fast.kernels.nvfp4_gemm_sm90")
    step = torch.cuda.synchronize if sync else (lambda: None)

    def gemm(a16: torch.Tensor, w: torch.Tensor, s: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        return sm90.nvfp4_gemm_sm90(a16, w, s, alpha, torch.empty(a16.shape[0], w.shape[0], dtype=torch.bfloat16,
                                                                     device="cuda"))

    x = torch.empty_like(x_src[0])
    h = torch.empty_like(h_src[0])
    (w1, s1, a1), (w2, s2, a2), (w3, s3, a3), (w4, s4, a4) = weights
    outs = []
    for i in range(x_src.shape[0]):
        x.copy_(x_src[i])
        h.copy_(h_src[i])
        step()
        x16 = kernels.quantize_nvfp4_decoded(x, scale, fast_math=True)
        step()
        q = gemm(x16, w1, s1, a1)
        step()
        k = gemm(x16, w2, s2, a2)
        step()
        del x16  # its memory goes to the next allocation while the GEMMs may still read it
        h16 = kernels.gelu_quantize_decoded_triton(h, scale, fast_math=True)
        step()
        f = gemm(h16, w3, s3, a3)
        step()
        row16 = kernels.quantize_nvfp4_decoded(x[:1], scale, fast_math=True)
        step()
        r = kernels.nvfp4_gemv(row16, w4, s4, a4, torch.bfloat16)
        step()
        outs.append((q, k, f, r))
    torch.cuda.synchronize()
    return outs


@pytest.mark.gpu
def test_gpu_back_to_back_pdl_chain_equals_synchronized_chain():
    """Each kernel of the chain reads what the launch just before it wrote (a fresh buffer the allocator hands out
    again every round, so a read before the writer finished would see the previous round's values). Launched back to
    back with PDL, every output has the bytes of the chain run with the device synchronized between launches."""
    if torch.cuda.get_device_capability()[0] != 9 or not launch_mod.PDL:
        pytest.skip("PDL chain test not run: this GPU is not SM90 or DIFFUSERS_NVFP4_PDL=0; it runs on a Hopper GPU "
                    "(H100/H200, the SM90 GEMM) with DIFFUSERS_NVFP4_PDL unset or 1")
    m, k, hidden, rounds = 1024, 3072, 12288, 8
    gen = torch.Generator(device="cuda").manual_seed(3)
    x_src = (torch.randn(rounds, m, k, device="cuda", generator=gen) * 2).to(torch.bfloat16)
    h_src = (torch.randn(rounds, m, hidden, device="cuda", generator=gen) * 2).to(torch.bfloat16)
    weights = [_weight(3072, k, 1), _weight(3072, k, 2), _weight(3072, hidden, 3), _weight(6144, k, 4)]
    scale = torch.tensor([448.0 * 6.0 / 8.0], device="cuda")
    want = _chain(x_src, h_src, weights, scale, sync=True)
    for attempt in range(3):
        got = _chain(x_src, h_src, weights, scale, sync=False)
        for i, (a, b) in enumerate(zip(got, want)):
            for name, u, v in zip("qkfr", a, b):
                assert torch.equal(u, v), f"attempt {attempt}, round {i}: {name} differs from the synchronized chain"
    from diffusers_nvfp4_fast.kernels import triton_compat

    direct = launch_mod.direct_launch_unavailable() is None  # Triton 3.7+: every launch through CompiledKernel.run
    binaries = launch_mod.recorded_binaries()
    assert any(bool(getattr(triton_compat.direct_launch(b), "pdl", False)) if direct else b.metadata.launch_pdl
               for b in binaries), "no binary launched with PDL"
