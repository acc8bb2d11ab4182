"""Which GPU a GPU test needs (the ``gpu`` marker already skips where there is no CUDA device)."""

from __future__ import annotations

import pytest
import torch


def skip_unless_sm80_to_sm90(what: str) -> None:
    """Skip ``what`` (the tests' subject) unless this GPU is SM80-SM90, where the Triton NVFP4 GEMMs run."""
    major, minor = torch.cuda.get_device_capability()
    if not 8 <= major <= 9:
        pytest.skip(f"{what} not run: this GPU is SM{major}{minor}; it runs on an SM80-SM90 GPU (Ampere to Hopper, the "
                    "H200 here); on Blackwell NVFP4Linear uses FlashInfer mm_fp4 instead")
