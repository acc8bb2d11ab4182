"""The private torch functions this package calls outside the kernel launch path, in one place.

Each is checked against the installed torch by tests/test_torch_compat.py, so a torch release that renames or drops
one fails there, by name, instead of deep inside a caller.
"""

from __future__ import annotations

import torch

# torch keeps one cuBLAS (and cuBLASLt) workspace per (handle, stream) for the life of the process (32 MiB each on
# Hopper); this drops them all, and torch allocates a fresh one at the next cuBLAS call on a stream.
CLEAR_CUBLAS_WORKSPACES = "_cuda_clearCublasWorkspaces"


def clear_cublas_workspaces() -> bool:
    """Free every cached cuBLAS workspace (docs/design.md §8, "CUDA graphs"); False where this torch has no CUDA."""
    clear = getattr(torch._C, CLEAR_CUBLAS_WORKSPACES, None)
    if clear is None or not torch.cuda.is_available():
        return False
    clear()
    return True
