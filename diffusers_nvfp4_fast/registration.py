"""Register this package with diffusers when both are imported, whichever comes first, without importing diffusers
(or torch) itself: ``import diffusers_nvfp4_fast`` stays light, so the command line starts fast (docs/design.md §2).

``install()`` (called by the package's ``__init__``) runs each step of ``diffusers_backend`` at once if its diffusers
module is already imported, else right after that module's first import, through a one-shot finder on
``sys.meta_path`` that wraps the module's loader. diffusers' model loading imports ``diffusers.quantizers`` at import
time, so the quantizer is registered before any ``from_pretrained`` can run. A step that fails warns; it never breaks
the import of diffusers.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

BACKEND = "diffusers_nvfp4_fast.diffusers_backend"
# diffusers module -> the step of diffusers_backend to run once it is imported (diffusers 0.42.1's layout: the
# quantizer tables are built by `diffusers.quantizers`; DiffusionPipeline lives in `pipeline_utils`).
STEPS = {
    "diffusers.quantizers": "register_quantizer",
    "diffusers.pipelines.pipeline_utils": "guard_pipeline_save",
}


def run_step(step: str) -> None:
    """Run ``diffusers_backend.<step>()``; a failure is a warning (diffusers itself must still import)."""
    backend = sys.modules.get(BACKEND)
    if backend is not None and not getattr(backend, "READY", False):
        return  # diffusers_backend is being imported (it imported diffusers): it runs its steps when it is done
    try:
        getattr(importlib.import_module(BACKEND), step)()
    except Exception as e:  # noqa: BLE001  (any failure of ours must leave diffusers importable)
        warnings.warn(f"diffusers-nvfp4-fast could not hook into diffusers ({step}: {type(e).__name__}: {e}); "
                      "diffusers' from_pretrained cannot read this package's checkpoints in this process: load them "
                      "with diffusers_nvfp4_fast.load_nvfp4_transformer", RuntimeWarning, stacklevel=2)


class _ThenRun(importlib.abc.Loader):
    """A module's own loader, followed by ``callback()`` once the module has executed."""

    def __init__(self, loader: Any, callback: Callable[[], None]) -> None:
        self.loader, self.callback = loader, callback

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.loader  # the module keeps its own loader (for get_source, resources...)
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.callback()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


class AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for ``name`` it asks the other finders and wraps the loader they return."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name, self.callback = name, callback

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the other finders from seeing this one
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _ThenRun(spec.loader, self.callback)
                return spec
        return None


def install() -> None:
    """Run every step now or after its module's first import (idempotent)."""
    for module, step in STEPS.items():
        if module in sys.modules:
            run_step(step)
        elif not any(isinstance(f, AfterImport) and f.name == module for f in sys.meta_path):
            sys.meta_path.insert(0, AfterImport(module, functools.partial(run_step, step)))
