"""The private torch functions of ``diffusers_nvfp4_fast.torch_compat`` exist in the installed torch, and the CUDA
graph backend frees torch's cuBLAS workspaces exactly when its last user releases (docs/design.md §8)."""

from __future__ import annotations

import pytest
import torch

from diffusers_nvfp4_fast import torch_compat
from diffusers_nvfp4_fast.graphs import backends


def test_the_installed_torch_has_the_private_functions_this_package_calls():
    if torch.version.cuda is None:
        pytest.skip(f"torch {torch.__version__} is a CPU build: it has no CUDA functions to check (CUDA builds do)")
    assert callable(getattr(torch._C, torch_compat.CLEAR_CUBLAS_WORKSPACES))


def test_the_last_backend_to_release_frees_the_cublas_workspaces(monkeypatch):
    cleared = []
    monkeypatch.setattr(backends, "clear_cublas_workspaces", lambda: cleared.append(True))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    first, second, idle = backends.CudaBackend(), backends.CudaBackend(), backends.CudaBackend()
    for used in (first, second):  # what warm_up does: a side stream that ran work
        used._stream = object()
        backends._WORKSPACE_USERS.add(used)
    idle.release()  # never ran anything: nothing to free
    first.release()  # the second one's graphs may still read its workspace
    assert cleared == [] and first._stream is None
    second.release()
    assert cleared == [True] and not backends._WORKSPACE_USERS
    second.release()  # twice: nothing more
    assert cleared == [True]
