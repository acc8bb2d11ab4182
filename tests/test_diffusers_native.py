"""NVFP4 FLUX.2 models loaded by diffusers itself (``from_single_file`` with ``BFLQuantizationConfig()``):
``enable_fast_paths`` converts diffusers' ``BFLNVFP4Linear`` layers in place (same packed weight object, 128x4 scales,
no BF16 copy) into exactly the layers ``load_nvfp4_transformer`` builds from the same bytes, and
``disable_fast_paths`` puts the original objects back. Also: what diffusers does with a file in the official
BFL / ComfyUI layout (high nibble first, 128x4 scales), and the refusals (offload hooks first, bad scales).

The files are written here from a real ModelOpt export: in the layout diffusers' quantizer reads (low nibble first,
linear scales, no metadata) and in the official one (``support.bfl_files.write_bfl_file``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from diffusers_nvfp4_fast import (
    NVFP4CheckpointError,
    disable_fast_paths,
    enable_fast_paths,
    fast_path_report,
    load_nvfp4_transformer,
)
from diffusers_nvfp4_fast.format import decode_nvfp4
from diffusers_nvfp4_fast.linear import NVFP4Linear
from diffusers_nvfp4_fast.loaders.inspect import format_report, inspect_checkpoint
from diffusers_nvfp4_fast.testing import tiny
from diffusers_nvfp4_fast.utils import png_sha256, run_pipeline
from support.bfl_files import export_modelopt, quantize_tiny_flux2, write_bfl_file

DIFFUSERS_LAYOUT = dict(nibble_order="lo_first", swizzle=False, markers=False, header=False)


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> Path:
    return export_modelopt(quantize_tiny_flux2(True), tmp_path_factory.mktemp("native") / "export")


@pytest.fixture(scope="module")
def config_dir(export_dir, tmp_path_factory) -> Path:
    """The transformer's config.json alone: ``from_single_file`` reads it instead of downloading FLUX.2's."""
    cfg = json.loads((export_dir / "config.json").read_text())
    cfg.pop("quantization_config")
    out = tmp_path_factory.mktemp("native_config")
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def diffusers_file(export_dir, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("native_file") / "flux2-tiny-diffusers-layout.safetensors"
    write_bfl_file(export_dir, path, **DIFFUSERS_LAYOUT)
    return path


def load_native(path: Path, config_dir: Path):
    from diffusers import BFLQuantizationConfig, Flux2Transformer2DModel

    return Flux2Transformer2DModel.from_single_file(
        str(path), config=str(config_dir), quantization_config=BFLQuantizationConfig(), torch_dtype=torch.bfloat16
    )


def bfl_layers(model) -> dict:
    return {n: m for n, m in model.named_modules() if type(m).__name__ == "BFLNVFP4Linear"}


def test_enable_converts_in_place_and_disable_restores_the_objects(diffusers_file, config_dir, export_dir):
    model = load_native(diffusers_file, config_dir)
    originals = bfl_layers(model)
    assert len(originals) == 13
    report = enable_fast_paths(model)["Flux2Transformer2DModel"]
    assert report["converted"] == {"diffusers BFLQuantizationConfig": 13} and "W4A16" in report["numerics"]
    reference = load_nvfp4_transformer(export_dir)
    for name, old in originals.items():
        new, ref = model.get_submodule(name), reference.get_submodule(name)
        assert isinstance(new, NVFP4Linear) and new.scale_layout == "128x4"
        assert new.weight is old.weight, "the packed weight is shared, not copied"
        for key in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
            got, want = getattr(new, key).reshape(-1).view(torch.uint8), getattr(ref, key).reshape(-1).view(torch.uint8)
            assert torch.equal(got, want), (name, key)
    disable_fast_paths(model)
    assert all(model.get_submodule(name) is old for name, old in originals.items())


def test_pipeline_png_equals_the_loader_route(diffusers_file, config_dir, export_dir):
    """Fast paths on (converted, fused) == the same NVFP4 bytes through ``load_nvfp4_transformer`` with fast paths
    off; diffusers' own unconverted forward (W4A16 below SM100) gives another image."""
    pipe, kwargs = tiny.tiny_flux2_pipeline(load_nvfp4_transformer(export_dir))
    pipe.set_progress_bar_config(disable=True)
    want = png_sha256(run_pipeline(pipe, kwargs))
    pipe.transformer = load_native(diffusers_file, config_dir)
    unconverted = png_sha256(run_pipeline(pipe, kwargs))
    enable_fast_paths(pipe)
    assert png_sha256(run_pipeline(pipe, kwargs)) == want
    assert fast_path_report(pipe)["Flux2Transformer2DModel"]["fused_calls"]["flux2_token_cat_swiglu"] > 0
    disable_fast_paths(pipe)
    assert png_sha256(run_pipeline(pipe, kwargs)) == unconverted != want


def test_offload_hooks_before_conversion_are_refused(diffusers_file, config_dir):
    model = load_native(diffusers_file, config_dir)
    model.enable_group_offload(torch.device("cpu"), offload_type="leaf_level")
    with pytest.raises(RuntimeError, match="call enable_fast_paths\\(pipe\\) first"):
        enable_fast_paths(model)
    assert len(bfl_layers(model)) == 13


def test_bad_scales_are_refused_before_anything_changes(diffusers_file, config_dir):
    model = load_native(diffusers_file, config_dir)
    layer = model.single_transformer_blocks[0].attn.to_out
    layer.input_scale.fill_(float("nan"))
    with pytest.raises(NVFP4CheckpointError, match=r"single_transformer_blocks\.0\.attn\.to_out\.input_scale is nan"):
        enable_fast_paths(model)
    assert len(bfl_layers(model)) == 13


def test_official_layout_is_misread_by_diffusers_and_inspect_says_so(tmp_path):
    """At sizes without scale padding (N % 128 == 0, K/16 % 4 == 0, as all of FLUX.2-dev) diffusers loads the
    official layout without an error and every weight comes out wrong; ``load_nvfp4_transformer`` reads it right."""
    from diffusers import Flux2Transformer2DModel
    from diffusers.quantizers.bfl.utils import dequantize_nvfp4 as diffusers_dequantize

    from diffusers_nvfp4_fast.testing.export import export_nvfp4
    from diffusers_nvfp4_fast.testing.tiny import FLUX2_EXCLUDE

    torch.manual_seed(0)
    bf16 = Flux2Transformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                   attention_head_dim=64, num_attention_heads=2, joint_attention_dim=48,
                                   timestep_guidance_channels=256, axes_dims_rope=[16, 16, 16, 16]).to(torch.bfloat16)
    names = [n for n, m in bf16.named_modules() if isinstance(m, torch.nn.Linear)]
    export = export_nvfp4(bf16, tmp_path / "export", FLUX2_EXCLUDE, dict.fromkeys(names, 4.0))
    official = tmp_path / "official.safetensors"
    write_bfl_file(export, official)
    cfg = json.loads((export / "config.json").read_text())
    cfg.pop("quantization_config")
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(cfg))

    misread = load_native(official, tmp_path / "cfg")
    ours = load_nvfp4_transformer(official)
    name = "single_transformer_blocks.0.attn.to_out"
    theirs = misread.get_submodule(name)
    truth = ours.get_submodule(name)
    want = decode_nvfp4(truth.weight, truth.weight_scale, dtype=torch.float32) * truth.weight_scale_2
    got = diffusers_dequantize(theirs.weight, theirs.weight_scale, theirs.weight_scale_2)
    cosine = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
    assert cosine < 0.5, cosine
    report = format_report(inspect_checkpoint(official))
    assert "diffusers' BFLQuantizationConfig would misread this file" in report
    assert "load_nvfp4_transformer" in report
