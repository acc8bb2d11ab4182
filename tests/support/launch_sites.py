"""Checks of ``kernels.launch.launch_by_site`` callers on the GPU: every keyed launch must run the binary that
Triton's binder picks for the same arguments."""

from __future__ import annotations

import importlib

launch_mod = importlib.import_module("diffusers_nvfp4_fast.kernels.launch")
compat = importlib.import_module("diffusers_nvfp4_fast.kernels.triton_compat")


def check_sites_against_binder(module, monkeypatch) -> list:
    """Wrap ``module.launch_by_site`` so that each launch of a recorded key first asks Triton's binder for its
    specialization and asserts that the recorded binary is the binder's. Returns the list of checked specialization
    keys (filled as the launches happen)."""
    real, checked = module.launch_by_site, []

    def checking(kernel, grid, *args, **kwargs):
        recorded = launch_mod.recorded_binary(kernel, args, kwargs)
        if recorded is not None:
            key = compat.specialization_key(args, kwargs)
            assert recorded is launch_mod.binders_binary(kernel, args, kwargs), f"key {key}: not the binder's binary"
            checked.append(key)
        real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(module, "launch_by_site", checking)
    return checked
