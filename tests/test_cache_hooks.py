"""Every cache hook diffusers ships (``transformer.enable_cache(...)``) on both tiny pipelines: wherever the hook runs
with fast paths off, the PNG with fast paths on is the same, and the table in docs/pipelines.md says which hooks
diffusers itself fails to run, with the error it raises. A hook that observes a module whose output a fused path
would change (TaylorSeer and PAB cache attention outputs) makes that part of the fused path fall back, counted with its
reason."""

from __future__ import annotations

from pathlib import Path

import pytest
from diffusers import hooks

from diffusers_nvfp4_fast import disable_fast_paths, enable_fast_paths, fast_path_report
from diffusers_nvfp4_fast.utils import png_sha256, run_pipeline
from support.modelopt_exports import nvfp4_pipeline

pytestmark = pytest.mark.usefixtures("fresh_verdicts")

STEPS = 6


def _always(pipe):
    return lambda: int(pipe.current_timestep) if pipe.current_timestep is not None else 500


CACHES = {
    "first_block": lambda pipe: hooks.FirstBlockCacheConfig(threshold=0.5),
    "pyramid_attention_broadcast": lambda pipe: hooks.PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 1001),
        current_timestep_callback=_always(pipe)),
    "faster": lambda pipe: hooks.FasterCacheConfig(
        spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 1001),
        current_timestep_callback=_always(pipe), is_guidance_distilled=True),
    "mag": lambda pipe: hooks.MagCacheConfig(threshold=1.0, max_skip_steps=2, retention_ratio=0.0,
                                             num_inference_steps=STEPS, mag_ratios=[1.0] * STEPS),
    "taylorseer": lambda pipe: hooks.TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1),
    "taylorseer_default": lambda pipe: hooks.TaylorSeerCacheConfig(),
    "sea": lambda pipe: hooks.SeaCacheConfig(threshold=1.0),
    "text_kv": lambda pipe: hooks.TextKVCacheConfig(),
}


TABLE = Path(__file__).resolve().parents[1] / "docs" / "pipelines.md"
PIPELINE_COLUMN = {"flux2": "`Flux2Pipeline`", "qwen": "`QwenImagePipeline`"}


def readme_cell(which: str, cache: str, pipe) -> str:
    """The docs/pipelines.md table's entry for this hook's config class and pipeline."""
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in TABLE.read_text().splitlines()
            if line.startswith("| ")]
    header = next(r for r in rows if r[0] == "cache hook config")
    table = {r[0].strip("`"): r for r in rows}
    return table[type(CACHES[cache](pipe)).__name__][header.index(PIPELINE_COLUMN[which])]


def _run(pipe, kwargs) -> str:
    return png_sha256(run_pipeline(pipe, kwargs, steps=STEPS))


@pytest.mark.parametrize("cache", sorted(CACHES))
@pytest.mark.parametrize("which", ["flux2", "qwen"])
def test_cache_hook_on_equals_off(which, cache, modelopt_exports):
    pipe, kwargs = nvfp4_pipeline(which, modelopt_exports(which))
    says = readme_cell(which, cache, pipe)
    try:
        pipe.transformer.enable_cache(CACHES[cache](pipe))
        off = _run(pipe, kwargs)
    except Exception as e:  # noqa: BLE001 - whatever the hook itself raises without this package
        error = f"`{type(e).__name__}: {str(e).splitlines()[0][:24]}"
        assert says.startswith("fails in diffusers: ") and error in says, (error, says)
        return
    assert says == "same image on and off", says
    enable_fast_paths(pipe)
    on = _run(pipe, kwargs)
    report = fast_path_report(pipe)
    disable_fast_paths(pipe)
    pipe.transformer.disable_cache()
    assert on == off, report
    entry = next(iter(report.values()))
    assert entry["verifications"]["failed"] == 0
