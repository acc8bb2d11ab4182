"""What the studies in this folder share: the benchmarks' helpers (``benchmarks/common.py``) on the import path, this
folder's results, and a study loaded by its name without the date (``load("compile_diagnose")``).

A study is a one-off question asked of the GPU, kept runnable where that is cheap: ``YYYYMMDD_<name>.py``, dated by
its last run, with its JSON in ``results/``. What each found is told in docs/history.md; the product's benchmarks,
whose figures docs/performance.md and docs/profile.md quote, stay in ``benchmarks/``.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

STUDIES = Path(__file__).resolve().parent
RESULTS = STUDIES / "results"
for _folder in (STUDIES.parent, STUDIES):  # ends with this folder first: the dated modules, then common.py
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))


def load(name: str) -> ModuleType:
    """The study ``YYYYMMDD_<name>.py`` of this folder (the latest date where several exist), imported."""
    dated = sorted(STUDIES.glob(f"[0-9]*_{name}.py"))
    if not dated:
        raise ModuleNotFoundError(f"no study named {name!r} in {STUDIES} (files YYYYMMDD_{name}.py)")
    return importlib.import_module(dated[-1].stem)


def write_result(result: dict, name: str | None = None) -> Path:
    """``common.write_result`` into this folder's ``results/``."""
    import common

    return common.write_result(result, name, folder=RESULTS)
