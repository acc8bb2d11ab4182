"""``quantize_text_encoder`` / ``quantize SRC OUT --subfolder text_encoder``: the four text-encoder classes, written as
ModelOpt 0.47's ``export_hf_checkpoint`` writes them (its own export of the same model with the same amaxes is the
reference), the recipe, refusals and atomicity."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from diffusers_nvfp4_fast.commands.cli import main
from diffusers_nvfp4_fast.quantize.recipes import MODELOPT_LLM_DISABLED
from diffusers_nvfp4_fast.quantize.text_encoder import quantize_text_encoder
from support.text_encoders import directory_tensors
from support.tiny_text_encoders import CLASSES, PromptEncoder, save_tiny_text_encoder

MISTRAL3_LM_HEAD = {("Mistral3ForConditionalGeneration", "lm_head"): "language_model.lm_head"}
PROMPTS = ["a red fox in fresh snow", "a street market at dusk"]


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("text_sources")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {c: save_tiny_text_encoder(c, root / c / "text_encoder") for c in CLASSES}


def test_recipe_is_modelopts_nvfp4_default_disables():
    mtq = pytest.importorskip("modelopt.torch.quantization", reason="nvidia-modelopt is not installed, so the recipe "
                              "was not compared with it; it runs after pip install -e '.[test]', as CI does")
    disabled = tuple(e["quantizer_name"] for e in mtq.NVFP4_DEFAULT_CFG["quant_cfg"]
                     if e.get("enable") is False and "parent_class" not in e and e["quantizer_name"] != "*")
    assert disabled == MODELOPT_LLM_DISABLED


@pytest.mark.parametrize("cls", CLASSES)
def test_package_route_writes_what_modelopt_exports(cls, sources, tmp_path):
    pytest.importorskip("modelopt", reason="nvidia-modelopt is not installed, so ModelOpt's export was not compared; "
                        "it runs after pip install -e '.[test]', as CI does")
    ours = quantize_text_encoder(sources[cls], tmp_path / "ours", pipeline=PromptEncoder(), prompts=PROMPTS,
                                 progress=False)
    theirs = quantize_text_encoder(sources[cls], tmp_path / "modelopt", pipeline=PromptEncoder(), prompts=PROMPTS,
                                   progress=False, method="modelopt")
    assert ours.nvfp4_layers == theirs.nvfp4_layers and ours.nvfp4_layers
    mine, ref = directory_tensors(tmp_path / "ours"), directory_tensors(tmp_path / "modelopt")
    src = directory_tensors(sources[cls])
    assert sorted(mine) == sorted(ref)
    for key, tensor in ref.items():
        assert mine[key].dtype == tensor.dtype and torch.equal(_bytes(mine[key]), _bytes(tensor)), key
        if key in src and key.removesuffix(".weight") + ".weight_scale" not in ref:  # kept as stored
            assert torch.equal(mine[key], src[key]), key
    assert any(k.endswith(".input_scale") for k in mine)
    assert not any(k.startswith(("visual", "model.visual", "vision_tower", "model.vision_tower",
                                 "multi_modal_projector", "lm_head")) and k.endswith("weight_scale") for k in mine)
    config = json.loads((tmp_path / "ours" / "config.json").read_text())["quantization_config"]
    ref_config = json.loads((tmp_path / "modelopt" / "config.json").read_text())["quantization_config"]
    own = ("producer", "input_scales", "ignore")  # input_scales: how each route made them; ignore: below
    assert {k: v for k, v in config.items() if k not in own} == {k: v for k, v in ref_config.items() if k not in own}
    # ModelOpt 0.47 names Mistral3's lm_head "lm_head" in its lists although it writes the key under its file name
    # "language_model.lm_head"; this package names it as the file does.
    assert config["ignore"] == sorted(MISTRAL3_LM_HEAD.get((cls, i), i) for i in ref_config["ignore"])
    hf = json.loads((tmp_path / "ours" / "hf_quant_config.json").read_text())["quantization"]
    ref_hf = json.loads((tmp_path / "modelopt" / "hf_quant_config.json").read_text())["quantization"]
    assert {**hf, "exclude_modules": None} == {**ref_hf, "exclude_modules": None}
    assert hf["exclude_modules"] == config["ignore"]
    assert config["input_scales"]["method"] == "calibrated" and config["quant_method"] == "modelopt"


def test_cli_quantizes_a_text_encoder_subfolder_dynamic(sources, tmp_path, capsys):
    pipe_dir = sources["Qwen3ForCausalLM"].parent
    assert main(["quantize", str(pipe_dir), str(tmp_path / "out"), "--subfolder", "text_encoder", "--dynamic",
                 "--no-progress"]) == 0
    assert "Qwen3ForCausalLM" in capsys.readouterr().out
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert config["input_scales"] == {"method": "dynamic"}
    assert config["config_groups"]["group_0"]["input_activations"]["dynamic"] is True
    written = directory_tensors(tmp_path / "out")
    assert config["dynamic_input_scale"] == sorted(k[:-len(".input_scale")] for k in written
                                                   if k.endswith(".input_scale"))
    assert "lm_head.weight" not in written  # tied to the embeddings, as stored


def test_calibrates_through_the_klein_pipelines_own_prompt_encoding(tmp_path):
    from diffusers_nvfp4_fast.quantize.calibration import record_input_amax
    from diffusers_nvfp4_fast.testing.tiny import tiny_klein_pipeline

    pipe, kwargs = tiny_klein_pipeline()
    pipe.text_encoder.save_pretrained(tmp_path / "te")
    call = {"max_sequence_length": kwargs["max_sequence_length"],
            "text_encoder_out_layers": kwargs["text_encoder_out_layers"]}
    result = quantize_text_encoder(tmp_path / "te", tmp_path / "out", pipeline=pipe, prompts=PROMPTS,
                                   call_kwargs=call, progress=False)
    seen = record_input_amax(pipe.text_encoder, result.nvfp4_layers,
                             lambda: [pipe.encode_prompt(prompt=p, device="cpu", **call) for p in PROMPTS])
    written = directory_tensors(tmp_path / "out")
    layer = "model.layers.0.mlp.down_proj"
    assert written[f"{layer}.input_scale"].item() == torch.tensor(seen[layer] / 2688.0, dtype=torch.float32).item()
    assert pipe.text_encoder is not None and result.input_scales["calls"] == "encode_prompt"


def test_refusals_name_the_problem(sources, tmp_path, capsys):
    src = sources["Qwen3ForCausalLM"]
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("")
    with pytest.raises(FileExistsError, match="not empty"):
        quantize_text_encoder(src, tmp_path / "busy", dynamic=True)
    with pytest.raises(ValueError, match="not both or neither"):
        quantize_text_encoder(src, tmp_path / "o")
    with pytest.raises(ValueError, match="no Linear of this Qwen3ForCausalLM would become NVFP4"):
        quantize_text_encoder(src, tmp_path / "o", dynamic=True, exclude=["*"])
    bad = tmp_path / "unknown"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()),
                                                 "architectures": ["NoSuchModel"]}))
    assert main(["quantize", str(bad), str(tmp_path / "o"), "--dynamic"]) == 2
    assert "architectures=['NoSuchModel'] is not a model class of transformers" in capsys.readouterr().err
    done = tmp_path / "done"
    quantize_text_encoder(src, done, dynamic=True, progress=False)
    with pytest.raises(ValueError, match="already quantized"):
        quantize_text_encoder(done, tmp_path / "again", dynamic=True)
    assert not (tmp_path / "o").exists() and not (tmp_path / "again").exists()


def test_failed_run_leaves_no_output(sources, tmp_path, monkeypatch):
    from diffusers_nvfp4_fast.quantize import text_encoder as module

    def boom(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "nvfp4_layer_tensors", boom)
    with pytest.raises(KeyboardInterrupt):
        quantize_text_encoder(sources["Qwen3ForCausalLM"], tmp_path / "out", dynamic=True, progress=False)
    assert list(tmp_path.iterdir()) == []
