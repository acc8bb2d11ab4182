"""``transformer.save_pretrained(dir)`` of an NVFP4 transformer writes a checkpoint that ``load_nvfp4_transformer``
reads back byte for byte: the block-scale layout and nibble order are recorded in config.json, and a checkpoint
whose shapes fit both scale layouts and that says nothing is refused instead of guessed."""

from __future__ import annotations

import json

import pytest
import torch

from diffusers_nvfp4_fast import NVFP4CheckpointError, load_nvfp4_transformer
from diffusers_nvfp4_fast.testing import tiny
from diffusers_nvfp4_fast.utils import png_sha256, run_pipeline


def _tensors(model) -> dict[str, torch.Tensor]:
    return {k: v.reshape(-1).view(torch.uint8) for k, v in model.state_dict().items()}


def _same_model(a, b) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert sorted(ta) == sorted(tb)
    assert not [k for k in ta if not torch.equal(ta[k], tb[k])]
    assert ({n: getattr(m, "scale_layout", None) for n, m in a.named_modules()}
            == {n: getattr(m, "scale_layout", None) for n, m in b.named_modules()})


@pytest.mark.parametrize("which", ["qwen", "flux2"])
def test_save_pretrained_round_trip(which, modelopt_exports, tmp_path):
    model = load_nvfp4_transformer(modelopt_exports(which))
    model.save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]
    assert config["weight_scale_layout"] == "128x4" and config["nibble_order"] == "lo_first"
    again = load_nvfp4_transformer(tmp_path / "saved")
    _same_model(model, again)
    pipe, kwargs = tiny.TINY_PIPELINES[which](again)
    pipe.set_progress_bar_config(disable=True)
    first = png_sha256(run_pipeline(pipe, kwargs))
    pipe.transformer = model
    assert png_sha256(run_pipeline(pipe, kwargs)) == first


def test_ambiguous_shapes_without_a_declared_layout_are_refused(modelopt_exports, tmp_path):
    """Tiny Qwen-Image's layers (width 512) have the same scale shape in both layouts, as real sizes do."""
    model = load_nvfp4_transformer(modelopt_exports("qwen"))
    model.save_pretrained(tmp_path / "saved")
    path = tmp_path / "saved" / "config.json"
    config = json.loads(path.read_text())
    qc = config["quantization_config"]
    for key in ("weight_scale_layout", "nibble_order", "dynamic_input_scale"):
        del qc[key]
    qc["producer"] = {"name": "someone-else"}
    path.write_text(json.dumps(config))
    with pytest.raises(NVFP4CheckpointError, match=r"fits both the linear and the 128x4 layout.*scale_layout='128x4'"):
        load_nvfp4_transformer(tmp_path / "saved")
    _same_model(model, load_nvfp4_transformer(tmp_path / "saved", scale_layout="128x4"))
    with pytest.raises(NVFP4CheckpointError, match="is the 128x4 shape, but the scales are declared linear"):
        tiny_flux = load_nvfp4_transformer(modelopt_exports("flux2"))
        tiny_flux.save_pretrained(tmp_path / "flux2")
        load_nvfp4_transformer(tmp_path / "flux2", scale_layout="linear")

