"""Checks of ``kernels.launch.launch_by_site`` call sites on the GPU: every keyed launch must run the binary that
Triton's binder picks for the same arguments."""

from __future__ import annotations

import importlib

import torch

launch_mod = importlib.import_module("diffusers_nvfp4_fast.kernels.launch")


def check_sites_against_binder(module, monkeypatch) -> list:
    """Wrap ``module.launch_by_site`` so that each launch of a recorded site first asks Triton's binder for its
    specialization and asserts that the recorded binary is the binder's. Returns the list of checked sites (filled
    as the launches happen)."""
    real, checked = module.launch_by_site, []

    def checking(kernel, grid, site, *args, **kwargs):
        device = torch.cuda.current_device()
        entry = launch_mod._BY_SITE.get((id(kernel), site, device))
        if entry is not None:
            _, key = launch_mod.binder_key(kernel, device, args, kwargs)
            assert entry[1] is launch_mod._COMPILED[key][1], f"site {site}: not the binder's binary"
            checked.append(site)
        real(kernel, grid, site, *args, **kwargs)

    monkeypatch.setattr(module, "launch_by_site", checking)
    return checked
