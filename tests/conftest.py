import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="GPU test (marked gpu) not run: no CUDA device here; "
                                   "it runs on the GPU machine with `pytest -m gpu`")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def modelopt_exports(tmp_path_factory):
    """which -> directory of a real ModelOpt NVFP4 export of the tiny transformer (built once per session)."""
    from support.modelopt_exports import export_with_modelopt

    cache = {}

    def get(which: str) -> Path:
        if which not in cache:
            cache[which] = export_with_modelopt(which, tmp_path_factory.mktemp(f"modelopt_{which}"))
        return cache[which]

    return get


@pytest.fixture
def fresh_verdicts():
    """Forget the process-wide verification verdicts before and after a test (modules opt in with usefixtures)."""
    from diffusers_nvfp4_fast.ops import verify

    verify.reset_verification()
    yield
    verify.reset_verification()
