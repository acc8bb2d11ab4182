"""Every FLUX.2 and Qwen-Image pipeline class of diffusers 0.42.1 with a tiny NVFP4 transformer
(``support/tiny_family.MATRIX``): the same PNG bytes with fast paths off, on and off again; every fused site kind
installed runs (``fused_calls``), nothing falls back, no verification fails. The "Pipeline classes" table of
docs/pipelines.md lists exactly the classes covered here."""

from __future__ import annotations

import re
from pathlib import Path

import diffusers
import pytest

from diffusers_nvfp4_fast import disable_fast_paths, enable_fast_paths, fast_path_report, load_nvfp4_transformer
from diffusers_nvfp4_fast.linear import NVFP4Linear
from diffusers_nvfp4_fast.report import SITE_OF
from support.tiny_family import (
    MATRIX,
    MatrixCase,
    generate,
    images_sha256,
    write_matrix_transformers,
)

pytestmark = pytest.mark.usefixtures("fresh_verdicts")

TABLE = Path(__file__).resolve().parents[1] / "docs" / "pipelines.md"

FLUX2_SITES = {"flux2_token_cat": 2, "flux2_rotary": 3, "flux2_swiglu": 2, "flux2_resnorm": 2, "flux2_adaln": 4}
# 1 NVFP4 block: 2 feed-forwards (GELU), 2 streams' query/key/value (adaptive LayerNorm), 1 attention processor
QWEN_SITES = {"qwen_resnorm": 1, "qwen_gelu": 2, "qwen_adaln": 2, "qwen_qk_rotary": 1}
# 2 NVFP4 Qwen-Image 2.1 blocks: norm1 (query/key/value), norm2 (gate_layer and proj), the SwiGLU into out, and the
# attention processor (query/key norm + rotary) each
QWEN21_SITES = {"qwen21_adaln": 2, "qwen21_resnorm": 2, "qwen21_swiglu": 2, "qwen21_qk_rotary": 2}
SITES = {"flux2": FLUX2_SITES, "klein": FLUX2_SITES, "qwen_small": QWEN_SITES, "qwen_zero_cond_t": QWEN_SITES,
         "qwen_layered": QWEN_SITES, "qwen21": QWEN21_SITES}
# Flux2KleinKVPipeline sets Flux2KVAttnProcessor on the double-stream attention, where the rotary and adaptive-
# LayerNorm sites are installed only over diffusers' Flux2AttnProcessor: that attention runs diffusers' code. Its
# step 0 ("extract") modulates the reference tokens with their own timestep, so the image stream's residual-norm
# site falls back once, with its reason.
CASE_SITES: dict[str, dict] = {}
CASE_FALLBACKS = {"klein_kv": {"flux2_resnorm: modulation parameters are not per sample [B, 1, D] bf16": 1}}

# The classes of the two families in diffusers 0.42.1 that no case builds, and why (docs/pipelines.md).
NOT_COVERED = {
    name: "modular pipeline: not built here"
    for name in ("Flux2ModularPipeline", "Flux2KleinModularPipeline", "Flux2KleinBaseModularPipeline",
                 "QwenImageModularPipeline", "QwenImageEditModularPipeline", "QwenImageEditPlusModularPipeline",
                 "QwenImageLayeredModularPipeline", "QwenImage21ModularPipeline", "QwenImage21TurboModularPipeline")
}


@pytest.fixture(scope="module")
def exports(modelopt_exports, tmp_path_factory):
    """case.transformer -> export directory: ModelOpt's for FLUX.2 and klein, this package's writer for the rest."""
    written = write_matrix_transformers(tmp_path_factory.mktemp("matrix"))
    return lambda which: modelopt_exports(which) if which in ("flux2", "klein") else written[which]


def _nvfp4_pipeline(case: MatrixCase, exports):
    pipe, kwargs = case.build(load_nvfp4_transformer(exports(case.transformer)))
    pipe.set_progress_bar_config(disable=True)
    return pipe, kwargs


def _check_off_on_off(case: MatrixCase, pipe, kwargs: dict, *, cpu_counts: bool = True) -> None:
    """Same PNGs off, on, off again; the sites, fused calls and fallbacks the case expects on the CPU (``cpu_counts``:
    on a GPU the kernels' own gates refuse the tiny hidden sizes, counted with their reason); no failed check."""
    assert type(pipe).__name__ == case.pipeline
    off = images_sha256(generate(pipe, kwargs))
    enable_fast_paths(pipe)
    on = images_sha256(generate(pipe, kwargs))
    entry = fast_path_report(pipe)[type(pipe.transformer).__name__]
    disable_fast_paths(pipe)
    again = images_sha256(generate(pipe, kwargs))
    assert on == off == again
    assert entry["verifications"]["failed"] == 0
    if not cpu_counts:
        assert all(reason and n > 0 for reason, n in entry["fallbacks"].items()), entry["fallbacks"]
        return
    sites = CASE_SITES.get(case.id, SITES[case.transformer])
    assert entry["sites"] == sites and entry["nvfp4_linears"] > 0
    assert {SITE_OF.get(kind, kind) for kind in entry["fused_calls"]} == set(sites)  # every installed kind ran
    assert entry["fallbacks"] == CASE_FALLBACKS.get(case.id, {})
    assert entry["verifications"]["failed"] == 0
    assert entry["verifications"]["passed"] >= len(entry["fused_calls"])


@pytest.mark.parametrize("case", MATRIX, ids=[case.id for case in MATRIX])
def test_same_png_off_on_off(case: MatrixCase, exports):
    _check_off_on_off(case, *_nvfp4_pipeline(case, exports))


@pytest.mark.gpu
@pytest.mark.parametrize("case", MATRIX, ids=[case.id for case in MATRIX])
def test_gpu_same_png_off_on_off(case: MatrixCase, exports):
    pipe, kwargs = _nvfp4_pipeline(case, exports)
    _check_off_on_off(case, pipe.to("cuda"), kwargs, cpu_counts=False)


def test_qwen21_sites_run_at_the_extract_and_the_cached_step(exports):
    """QwenImage21Pipeline prefills its KV cache at step 0 (``kv_cache_mode="extract"``: text, condition and target
    tokens) and later steps decode the target tokens from it (``"cached"``): every fused site runs at both steps (each
    call of the two NVFP4 blocks counts norm1, norm2 and the SwiGLU once each, the query/key norm twice), verified at
    every call, with the NVFP4 layers' block scales in the 128x4 layout, and the PNG is the one with fast paths off."""
    case = next(case for case in MATRIX if case.pipeline == "QwenImage21Pipeline")
    pipe, kwargs = _nvfp4_pipeline(case, exports)
    off = images_sha256(generate(pipe, kwargs))
    modes: list[str] = []
    handle = pipe.transformer.register_forward_pre_hook(lambda module, args, kw: modes.append(kw["kv_cache_mode"]),
                                                        with_kwargs=True)
    enable_fast_paths(pipe, verify="always")
    try:
        on = images_sha256(generate(pipe, kwargs))
        entry = fast_path_report(pipe)["QwenImage21Transformer2DModel"]
        layouts = {m.scale_layout for m in pipe.transformer.modules() if isinstance(m, NVFP4Linear)}
    finally:
        handle.remove()
        disable_fast_paths(pipe)
    assert on == off and modes == ["extract", "cached"] and layouts == {"128x4"}
    per_call = {"qwen21_adaln": 2, "qwen21_resnorm": 2, "qwen21_swiglu": 2, "qwen21_qk_rotary": 4}
    assert entry["fused_calls"] == {kind: 2 * n for kind, n in per_call.items()}, entry
    assert entry["verifications"]["passed_by_kind"] == entry["fused_calls"] and entry["fallbacks"] == {}, entry


def _table_pipelines() -> list[str]:
    section = TABLE.read_text().split("\n## Pipeline classes\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `(\w+)` \|", section, re.M)


def test_docs_table_lists_exactly_the_matrix():
    listed = _table_pipelines()
    assert len(listed) == len(set(listed)), f"a class appears twice in the docs/pipelines.md table: {listed}"
    assert set(listed) == {case.pipeline for case in MATRIX}


def test_matrix_covers_every_pipeline_class_of_both_families():
    families = {name for name in dir(diffusers)
                if name.startswith(("Flux2", "QwenImage")) and name.endswith("Pipeline")}
    covered = {case.pipeline for case in MATRIX}
    assert families - covered == set(NOT_COVERED), "a diffusers pipeline class is neither tested nor listed"
    assert covered <= families
