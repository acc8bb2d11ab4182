"""``diffusers_nvfp4_fast.caches``: every process-wide cache of the package and its kernels is registered with its
eviction policy, ``reset_all`` empties each, and no test reaches a cache through a module's private global."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from diffusers_nvfp4_fast import caches

ROOT = Path(__file__).resolve().parents[1]
# The caches the package keeps (docs/design.md §2, "Process-wide caches"); the kernels' ones where Triton is installed.
PACKAGE_CACHES = {"ops.blackwell.ones", "ops.fused.verification_keys", "ops.gelu_quantize.compiled_mismatch",
                  "ops.gelu_quantize.eager_mismatch", "ops.linear.calls_seen", "ops.linear.plans",
                  "ops.qk_norm_rotary.tree", "ops.shared_quantize.equal_scales", "ops.verify.failed_kinds",
                  "ops.verify.verdicts"}
KERNEL_CACHES = {"kernels.launch.by_key", "kernels.launch.compiled", "kernels.nvfp4_gemm.chosen_configs"}
SM90_CACHES = {"kernels.nvfp4_gemm_sm90.weight_descriptors", "kernels.nvfp4_gemm_sm90.x_descriptor_fields"}


def _import_everything() -> set[str]:
    for name in ("ops.blackwell", "ops.fused", "ops.gelu_quantize", "ops.linear", "ops.qk_norm_rotary",
                 "ops.shared_quantize", "ops.verify"):
        importlib.import_module(f"diffusers_nvfp4_fast.{name}")
    want = set(PACKAGE_CACHES)
    if importlib.util.find_spec("triton") is not None:
        importlib.import_module("diffusers_nvfp4_fast.kernels")
        want |= KERNEL_CACHES
        try:
            importlib.import_module("diffusers_nvfp4_fast.kernels.nvfp4_gemm_sm90")
            want |= SM90_CACHES
        except (ImportError, AttributeError):  # a Triton without the Gluon Hopper API
            pass
    return want


def test_every_cache_is_registered_with_its_eviction_policy():
    want = _import_everything()
    found = caches.registered()
    assert set(found) == want, (sorted(set(found) - want), sorted(want - set(found)))
    assert all(cache.eviction.strip() for cache in found.values())


def test_reset_all_empties_every_registered_cache():
    _import_everything()
    tables = [cache.table for cache in caches.registered().values() if isinstance(cache.table, dict)]
    marker = object()
    filled = [t for t in tables if marker not in t]
    for t in filled:
        t[marker] = None  # type: ignore[index]
    caches.reset_all()
    assert all(marker not in t for t in filled) and filled


def test_a_cache_is_reset_by_name_and_an_unknown_name_is_refused():
    table = caches.register("tests.scratch", {1: 2}, "emptied by this test")
    try:
        caches.reset("tests.scratch")
        assert table == {}
        with pytest.raises(KeyError, match="no cache named 'tests.nowhere'; registered: .*tests.scratch"):
            caches.reset("tests.nowhere")
        with pytest.raises(ValueError, match="say when its entries are evicted"):
            caches.register("tests.no_policy", {}, "")
    finally:
        caches.unregister("tests.scratch")


def test_no_test_reaches_a_cache_through_a_private_global():
    names = {"_CHOSEN", "_BY_SITE", "_COMPILED", "_WEIGHT_DESCRIPTORS", "_X_DESCRIPTOR_FIELDS", "_STATS",
             "_VERDICTS", "_FAILED_KINDS", "_EQUAL_SCALES", "_TREE", "_MISMATCH", "_KEYS", "_PLANS", "_SEEN", "_ONES"}
    alternatives = "|".join(names)
    pattern = re.compile(rf"\.({alternatives})\b|\"({alternatives})\"")
    offenders = [f"{path.relative_to(ROOT)}:{i}" for path in sorted((ROOT / "tests").rglob("*.py"))
                 if path.name != "test_caches.py"
                 for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not offenders, offenders
