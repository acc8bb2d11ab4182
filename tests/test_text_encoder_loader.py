"""NVFP4 text encoders: ModelOpt Hugging Face exports and ComfyUI single files of the four classes the pipelines use,
loaded as ``NVFP4Linear`` and decoded byte for byte as their producers decode them; fast paths on == off for the
prompt embeddings and the PNG; every problem in one ``NVFP4CheckpointError``."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from diffusers_nvfp4_fast import (
    NVFP4CheckpointError,
    NVFP4Linear,
    disable_fast_paths,
    enable_fast_paths,
    fast_path_report,
    load_nvfp4_text_encoder,
    load_summary,
)
from diffusers_nvfp4_fast.format import dequantize_nvfp4
from diffusers_nvfp4_fast.loaders.transformers_compat import checkpoint_key_renamer
from diffusers_nvfp4_fast.utils import png_sha256
from support import text_encoders as te
from support.comfy_files import ck_dequantize, ck_quantize

CLASS_NAMES = {"mistral3": "Mistral3ForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
               "qwen3": "Qwen3ForCausalLM", "qwen3_vl": "Qwen3VLForConditionalGeneration"}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """which -> the ModelOpt export directory of the tiny text encoder (built once per module)."""
    cache: dict[str, Path] = {}

    def get(which: str) -> Path:
        if which not in cache:
            cache[which] = te.export_with_modelopt(which, tmp_path_factory.mktemp(f"te_{which}"))
        return cache[which]

    return get


def _decoded(layer: NVFP4Linear, dtype: torch.dtype) -> torch.Tensor:
    return dequantize_nvfp4(layer.weight, layer.weight_scale, weight_scale_2=layer.weight_scale_2,
                            scale_layout=layer.scale_layout, dtype=dtype)


def _modelopt_decoded(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """ModelOpt 0.47's own dequantize of an exported layer (``NVFP4QTensor.dequantize``, FP32)."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    shape = torch.Size([packed.shape[0], packed.shape[1] * 2])
    return NVFP4QTensor(shape, torch.float32, packed).dequantize(
        dtype=torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: 16})


def _decodes_as_modelopt(model: nn.Module, stored: dict[str, torch.Tensor]) -> dict[str, tuple[NVFP4Linear, str]]:
    """Every NVFP4Linear of ``model`` and its stored key, after checking that the layers are exactly the file's packed
    weights and that each decodes ``torch.equal`` to ModelOpt's own dequantize of its tensors."""
    rename = checkpoint_key_renamer(model)
    by_name = {rename(k).removesuffix(".weight"): k.removesuffix(".weight") for k, v in stored.items()
               if k.endswith(".weight") and v.dtype == torch.uint8}
    layers = {n: m for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    assert set(layers) == set(by_name) and layers
    for name, layer in layers.items():
        key = by_name[name]
        theirs = _modelopt_decoded(stored[f"{key}.weight"], stored[f"{key}.weight_scale"],
                                   stored[f"{key}.weight_scale_2"])
        assert torch.equal(_decoded(layer, torch.float32), theirs), name
    return {name: (layer, by_name[name]) for name, layer in layers.items()}


@pytest.mark.parametrize("which", te.CLASSES)
def test_modelopt_export_loads_as_modelopt_decodes_it(which, exports):
    directory = exports(which)
    model = load_nvfp4_text_encoder(directory)
    assert type(model).__name__ == CLASS_NAMES[which]
    stored = te.directory_tensors(directory)
    layers = _decodes_as_modelopt(model, stored)
    for name, (layer, key) in layers.items():
        assert torch.equal(layer.input_scale, stored[f"{key}.input_scale"].float()), name
    # what the recipe keeps BF16 stays BF16: embeddings, lm_head, the vision tower
    assert isinstance(model.get_output_embeddings(), nn.Linear)
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    vision = [m for n, m in model.named_modules() if ("visual" in n or "vision" in n) and isinstance(m, nn.Linear)]
    assert (which in ("mistral3", "qwen2_5_vl", "qwen3_vl")) == bool(vision)
    summary = load_summary(model)
    assert summary["format"] == "modelopt_export" and summary["nvfp4_linears"] == len(layers)


@pytest.mark.parametrize("which", te.CLASSES)
def test_comfy_file_loads_as_comfy_kitchen_decodes_it(which, tmp_path):
    file = tmp_path / f"{which}_nvfp4.safetensors"
    written = te.write_comfy_file(which, file, ck_quantize)
    model = load_nvfp4_text_encoder(file, config=te.config_of(which))
    stored = te.directory_tensors(tmp_path)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    assert set(layers) == set(written)
    for name, layer in layers.items():
        key = written[name]
        theirs = ck_dequantize(stored[f"{key}.weight"], stored[f"{key}.weight_scale_2"], stored[f"{key}.weight_scale"])
        assert torch.equal(_decoded(layer, torch.float64), theirs), name
        assert torch.equal(layer.input_scale, stored[f"{key}.input_scale"]), name
    plain = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    embeddings = model.get_input_embeddings().weight
    for name, linear in plain.items():  # every BF16 Linear holds the file's bytes (a tied lm_head: the embeddings)
        key = te.stored_name(which, name) + ".weight"
        assert torch.equal(linear.weight, stored[key]) if key in stored else linear.weight is embeddings, name
    assert load_summary(model)["format"] == "comfy_single_file"


def _generate_off_on_off(pipe, kwargs):
    """(embeddings, PNG SHA256) with fast paths off, on, off again."""
    results = [te.encoder_outputs(pipe, kwargs)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tiny pipeline's transformer is BF16: enable_fast_paths says so
        report = enable_fast_paths(pipe)
    assert report[type(pipe.text_encoder).__name__]["enabled"]
    results.append(te.encoder_outputs(pipe, kwargs))
    disable_fast_paths(pipe)
    results.append(te.encoder_outputs(pipe, kwargs))
    return [(embeds, png_sha256(image)) for embeds, image in results]


@pytest.mark.parametrize("which", te.CLASSES)
def test_fast_paths_on_equal_off_for_embeddings_and_png(which, exports):
    encoder = load_nvfp4_text_encoder(exports(which))
    pipe, kwargs = te.tiny_pipeline(which, encoder)
    (off, sha_off), (on, sha_on), (again, sha_again) = _generate_off_on_off(pipe, kwargs)
    assert sha_off == sha_on == sha_again
    assert len(off) == len(on) == len(again) > 0
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(off, on, again, strict=True))


@pytest.mark.parametrize("which", ["qwen3", "qwen2_5_vl"])
def test_report_lists_the_text_encoder_and_nothing_is_installed_on_bf16_layers(which, exports):
    encoder = load_nvfp4_text_encoder(exports(which))
    pipe, kwargs = te.tiny_pipeline(which, encoder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = enable_fast_paths(pipe)
    entry = report[CLASS_NAMES[which]]
    assert entry["component"] == "text_encoder" and entry["enabled"]
    assert entry["nvfp4_linears"] == load_summary(encoder)["nvfp4_linears"] and entry["fused_paths"] is False
    touched = [n for n, m in encoder.named_modules() if not isinstance(m, NVFP4Linear) and "forward" in m.__dict__]
    assert touched == []
    assert not hasattr(encoder.save_pretrained, "__self__") or encoder.save_pretrained.__func__ is \
        type(encoder).save_pretrained  # transformers' own save_pretrained stays
    disable_fast_paths(pipe)
    assert fast_path_report(pipe)[CLASS_NAMES[which]]["enabled"] is False


def test_a_bf16_text_encoder_is_not_visited():
    pipe, _ = te.tiny_pipeline("qwen3")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = enable_fast_paths(pipe)
    assert "Qwen3ForCausalLM" not in report
    disable_fast_paths(pipe)


def test_checkpoint_key_renames_are_transformers_own():
    """transformers 5.25 renames Qwen2.5-VL's stored keys (``model.layers``, ``visual``) and keeps Qwen3's."""
    pipe, _ = te.tiny_pipeline("qwen2_5_vl")
    rename = checkpoint_key_renamer(pipe.text_encoder)
    assert rename("model.layers.0.mlp.up_proj.weight_scale") == "model.language_model.layers.0.mlp.up_proj.weight_scale"
    assert rename("visual.blocks.0.attn.qkv.weight") == "model.visual.blocks.0.attn.qkv.weight"
    assert rename("lm_head.weight") == "lm_head.weight"
    klein, _ = te.tiny_pipeline("qwen3")
    assert checkpoint_key_renamer(klein.text_encoder)("model.layers.0.mlp.up_proj.weight") == \
        "model.layers.0.mlp.up_proj.weight"


def _edit_export(directory: Path, edit) -> None:
    from safetensors.torch import save_file

    tensors = te.directory_tensors(directory)
    edit(tensors)
    for f in directory.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def test_every_export_problem_is_in_one_error(exports, tmp_path):
    import shutil

    directory = tmp_path / "broken"
    shutil.copytree(exports("qwen3"), directory)

    def edit(t):
        del t["model.layers.0.mlp.up_proj.input_scale"]
        t["model.layers.1.mlp.down_proj.weight_scale_2"] = torch.tensor(float("nan"))
        t["model.layers.0.self_attn.q_proj.weight"] = t["model.layers.0.self_attn.q_proj.weight"][:, :4].clone()

    _edit_export(directory, edit)
    with pytest.raises(NVFP4CheckpointError) as err:
        load_nvfp4_text_encoder(directory)
    text = str(err.value)
    assert str(directory) in text
    assert "missing key model.layers.0.mlp.up_proj.input_scale" in text
    assert "model.layers.0.self_attn.q_proj.weight in model.safetensors: shape [16, 4]" in text


def test_bad_scale_values_are_refused_naming_key_and_value(exports, tmp_path):
    import shutil

    directory = tmp_path / "nan"
    shutil.copytree(exports("qwen3"), directory)
    _edit_export(directory, lambda t: t.update({"model.layers.1.mlp.down_proj.weight_scale_2": torch.tensor(-1.0)}))
    with pytest.raises(NVFP4CheckpointError, match=r"model\.layers\.1\.mlp\.down_proj\.weight_scale_2 is -1\.0"):
        load_nvfp4_text_encoder(directory)


def test_an_export_of_another_class_is_refused(exports, tmp_path):
    import shutil

    directory = tmp_path / "llama"
    shutil.copytree(exports("qwen3"), directory)
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(NVFP4CheckpointError, match=r"config\.json: architectures \['LlamaForCausalLM'\]"):
        load_nvfp4_text_encoder(directory)


def test_comfy_file_problems_are_in_one_error(tmp_path):
    file = tmp_path / "bad.safetensors"

    def edit(t):
        del t["model.layers.0.mlp.gate_proj.input_scale"]
        t["model.layers.1.mlp.up_proj.weight_scale"] = t["model.layers.1.mlp.up_proj.weight_scale"][:16].clone()

    te.write_comfy_file("qwen3", file, ck_quantize, edit)
    with pytest.raises(NVFP4CheckpointError) as err:
        load_nvfp4_text_encoder(file, config=te.config_of("qwen3"))
    text = str(err.value)
    assert str(file) in text and "missing key model.layers.0.mlp.gate_proj.input_scale" in text
    assert "model.layers.1.mlp.up_proj.weight_scale" in text


def _without_input_scales(tensors: dict) -> None:
    for key in [k for k in tensors if k.endswith(".input_scale")]:
        del tensors[key]


@pytest.mark.parametrize("which", ["qwen3", "qwen2_5_vl"])
def test_comfy_file_without_input_scales_loads_dynamic_when_asked_and_runs_on_equal_off(which, tmp_path):
    """A ComfyUI file quantized for a dynamic activation scale stores no ``input_scale``: refused with the advice by
    default, read with ``dynamic_input_scale=True`` (comfy-kitchen's decode; each call its own scale), and the
    pipeline's embeddings and PNG are then the same with fast paths on and off."""
    file = tmp_path / f"{which}_nvfp4.safetensors"
    written = te.write_comfy_file(which, file, ck_quantize, _without_input_scales)
    with pytest.raises(NVFP4CheckpointError, match=r"have no input_scale .*pass dynamic_input_scale=True"):
        load_nvfp4_text_encoder(file, config=te.config_of(which))
    model = load_nvfp4_text_encoder(file, config=te.config_of(which), dynamic_input_scale=True)
    stored = te.directory_tensors(tmp_path)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    assert set(layers) == set(written) and all(layer.dynamic_input_scale for layer in layers.values())
    for name, layer in layers.items():
        key = written[name]
        theirs = ck_dequantize(stored[f"{key}.weight"], stored[f"{key}.weight_scale_2"], stored[f"{key}.weight_scale"])
        assert torch.equal(_decoded(layer, torch.float64), theirs), name
    pipe, kwargs = te.tiny_pipeline(which, model)
    (off, sha_off), (on, sha_on), (again, sha_again) = _generate_off_on_off(pipe, kwargs)
    assert sha_off == sha_on == sha_again and len(off) == len(on) > 0
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(off, on, again, strict=True))


def test_comfy_layer_in_another_format_is_refused(tmp_path):
    file = tmp_path / "fp8.safetensors"
    te.write_comfy_file("qwen3", file, ck_quantize, lambda t: t.update(
        {"model.layers.0.mlp.up_proj.comfy_quant": te._marker({"format": "float8_e4m3fn"})}))
    with pytest.raises(NVFP4CheckpointError, match=r"model\.layers\.0\.mlp\.up_proj\.comfy_quant: format "
                                                   r"'float8_e4m3fn'"):
        load_nvfp4_text_encoder(file, config=te.config_of("qwen3"))


def test_comfy_file_of_unknown_size_asks_for_config(tmp_path):
    file = tmp_path / "tiny.safetensors"
    te.write_comfy_file("qwen3", file, ck_quantize)
    with pytest.raises(NVFP4CheckpointError, match=r"hidden size 16\); pass config="):
        load_nvfp4_text_encoder(file)


@pytest.mark.gpu
@pytest.mark.parametrize("which", te.CLASSES)
def test_gpu_embeddings_on_equal_off_and_decode_rows_take_the_gemv(which, exports):
    from diffusers_nvfp4_fast.ops.linear import takes_one_row

    encoder = load_nvfp4_text_encoder(exports(which), device="cuda")
    pipe, kwargs = te.tiny_pipeline(which, encoder)
    pipe.to("cuda")
    (off, sha_off), (on, sha_on), (again, _) = _generate_off_on_off(pipe, kwargs)
    assert sha_off == sha_on
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(off, on, again, strict=True))
    layer = next(m for m in encoder.modules() if isinstance(m, NVFP4Linear))
    if torch.cuda.get_device_capability()[0] in (8, 9):  # SM80-SM90: one row is the GEMV, a prefill the GEMM
        args = (layer.weight.device, layer.bias, torch.bfloat16, layer.scale_layout == "128x4")
        assert takes_one_row(1, *args) and not takes_one_row(20, *args)


def test_sharded_export_and_hf_quant_config_alone_load_the_same_bytes(exports, tmp_path):
    import shutil

    from safetensors.torch import save_file

    directory = tmp_path / "sharded"
    shutil.copytree(exports("qwen2_5_vl"), directory)
    tensors = te.directory_tensors(directory)
    (directory / "model.safetensors").unlink()
    keys = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for name, part in shards.items():
        save_file({k: tensors[k] for k in part}, str(directory / name), metadata={"format": "pt"})
    weight_map = {k: name for name, part in shards.items() for k in part}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = json.loads((directory / "config.json").read_text())
    del config["quantization_config"]  # hf_quant_config.json alone says what is quantized
    (directory / "config.json").write_text(json.dumps(config))
    ours, reference = load_nvfp4_text_encoder(directory), load_nvfp4_text_encoder(exports("qwen2_5_vl"))
    theirs = dict(reference.state_dict())
    assert all(torch.equal(v, theirs[k]) for k, v in ours.state_dict().items())


def test_arguments_that_do_not_apply_are_refused(exports, tmp_path):
    with pytest.raises(TypeError, match="config= applies to single files"):
        load_nvfp4_text_encoder(exports("qwen3"), config={"model_type": "qwen3"})
    file = tmp_path / "klein.safetensors"
    te.write_comfy_file("qwen3", file, ck_quantize)
    with pytest.raises(TypeError, match="scale_layout= applies to ModelOpt export directories"):
        load_nvfp4_text_encoder(file, config=te.config_of("qwen3"), scale_layout="linear")


def test_a_text_encoder_passed_alone_is_a_text_encoder(exports):
    encoder = load_nvfp4_text_encoder(exports("qwen3"))
    save_pretrained = type(encoder).save_pretrained
    report = enable_fast_paths(encoder)
    assert report["Qwen3ForCausalLM"]["component"] == "text_encoder"
    assert encoder.save_pretrained.__func__ is save_pretrained  # not replaced by the diffusers checkpoint writer
    disable_fast_paths(encoder)
    assert fast_path_report(encoder)["Qwen3ForCausalLM"]["enabled"] is False


@pytest.mark.parametrize("cls", ["Qwen3ForCausalLM", "Qwen2_5_VLForConditionalGeneration",
                                 "Mistral3ForConditionalGeneration", "Qwen3VLForConditionalGeneration"])
def test_quantize_text_encoder_output_loads_back_byte_for_byte(cls, tmp_path):
    """The quantize command's text encoders (``quantize_text_encoder``) load back: every stored NVFP4 tensor is a
    layer's, the per-layer dynamic flags follow the renamed keys."""
    from diffusers_nvfp4_fast.quantize.text_encoder import quantize_text_encoder
    from support.tiny_text_encoders import PromptEncoder, save_tiny_text_encoder

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        source = save_tiny_text_encoder(cls, tmp_path / "bf16")
        quantize_text_encoder(source, tmp_path / "static", pipeline=PromptEncoder(), prompts=["a red fox"],
                              progress=False)
        quantize_text_encoder(source, tmp_path / "dynamic", dynamic=True, progress=False)
    for variant in ("static", "dynamic"):
        model = load_nvfp4_text_encoder(tmp_path / variant)
        assert type(model).__name__ == cls
        for name, (layer, _) in _decodes_as_modelopt(model, te.directory_tensors(tmp_path / variant)).items():
            assert layer.dynamic_input_scale == (variant == "dynamic"), name


def test_an_undeclared_layout_of_modelopts_format_is_linear_where_shapes_fit_both(tmp_path):
    """A ``[128, 64]`` layer's block scales ``[128, 4]`` fit both layouts; ModelOpt's HF export format
    (``quant_method: "modelopt"``) stores them linear, which ``quantize_text_encoder`` does without saying so."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from diffusers_nvfp4_fast.quantize.text_encoder import quantize_text_encoder

    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=32, vocab_size=272, architectures=["Qwen3ForCausalLM"])
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_text_encoder(tmp_path / "bf16", tmp_path / "nvfp4", dynamic=True, progress=False)
    model = load_nvfp4_text_encoder(tmp_path / "nvfp4")
    stored = te.directory_tensors(tmp_path / "nvfp4")
    up = model.model.layers[0].mlp.up_proj
    assert tuple(stored["model.layers.0.mlp.up_proj.weight_scale"].shape) == (128, 4)
    theirs = _modelopt_decoded(stored["model.layers.0.mlp.up_proj.weight"],
                               stored["model.layers.0.mlp.up_proj.weight_scale"],
                               stored["model.layers.0.mlp.up_proj.weight_scale_2"])
    assert torch.equal(_decoded(up, torch.float32), theirs)


@pytest.mark.parametrize("header_only", [False, True])
def test_comfy_markers_or_header_alone_say_which_layers_are_nvfp4(header_only, tmp_path, caplog):
    file = tmp_path / "qwen_2.5_vl_nvfp4.safetensors"
    written = te.write_comfy_file("qwen2_5_vl", file, ck_quantize, header_only=header_only)
    with caplog.at_level("WARNING", logger="diffusers_nvfp4_fast"):
        model = load_nvfp4_text_encoder(file, config=te.config_of("qwen2_5_vl"))
    assert {n for n, m in model.named_modules() if isinstance(m, NVFP4Linear)} == set(written)
    assert "stored differently" not in caplog.text


@pytest.mark.parametrize("plan", ["text_encoder_offload", "group_offload_leaf"])
def test_budget_plans_count_the_nvfp4_text_encoder_and_keep_the_image(plan, exports):
    """``fit_to_budget``'s estimates take an NVFP4 text encoder at its NVFP4 size (packed weights and block scales,
    byte for byte), and the plans that offload the text encoder (leaf-level group offload moves each NVFP4Linear as
    its own group) keep the resident image and embeddings."""
    from diffusers_nvfp4_fast import budget
    from diffusers_nvfp4_fast.utils import tensor_bytes

    encoder = load_nvfp4_text_encoder(exports("qwen2_5_vl"))
    layers = [m for m in encoder.modules() if isinstance(m, NVFP4Linear)]
    # each layer is counted with its packed weight and its block scales (128x4-padded: at 16x16, more than BF16)
    assert layers and all(tensor_bytes(m) >= m.out_features * m.in_features * 9 // 16 for m in layers)
    pipe, kwargs = te.tiny_pipeline("qwen2_5_vl", encoder)
    before = budget.plan_estimates(pipe)
    pipe.text_encoder = nn.Linear(8, 8).to(torch.bfloat16)  # the estimate follows the encoder's bytes
    shrunk = budget.plan_estimates(pipe)
    pipe.register_modules(text_encoder=encoder)
    assert (before["resident"] - shrunk["resident"]) * budget.GIB == tensor_bytes(encoder) - 8 * 8 * 2 - 8 * 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tiny pipeline's transformer is BF16
        enable_fast_paths(pipe)
    want = te.encoder_outputs(pipe, kwargs)
    budget.apply_plan(pipe, plan, "cpu")
    from diffusers.hooks import HookRegistry

    assert all(HookRegistry.check_if_exists_or_initialize(m).get_hook("group_offloading") for m in layers)
    got = te.encoder_outputs(pipe, kwargs)
    assert png_sha256(got[1]) == png_sha256(want[1])
    assert all(torch.equal(a, b) for a, b in zip(want[0], got[0], strict=True))
    disable_fast_paths(pipe)


def _parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("which", te.CLASSES)
def test_without_lm_head_the_embeddings_and_png_are_the_same_and_its_bytes_are_gone(which, exports):
    """``lm_head=False``: the pipeline's prompt embeddings and image are those of the whole model, byte for byte, the
    file's head is not read, and an untied head's weights are no longer held (a tied one held none of its own)."""
    whole = load_nvfp4_text_encoder(exports(which))
    headless = load_nvfp4_text_encoder(exports(which), lm_head=False)
    tied = whole.lm_head.weight is whole.get_input_embeddings().weight
    assert not any(n.startswith("lm_head") for n, _ in headless.named_parameters())
    saved = _parameter_bytes(whole) - _parameter_bytes(headless)
    assert saved == (0 if tied else whole.lm_head.weight.numel() * whole.lm_head.weight.element_size())
    outputs = [te.encoder_outputs(*te.tiny_pipeline(which, model)) for model in (whole, headless)]
    (embeds_a, image_a), (embeds_b, image_b) = outputs
    assert len(embeds_a) == len(embeds_b) > 0
    assert all(torch.equal(a, b) for a, b in zip(embeds_a, embeds_b, strict=True))
    assert png_sha256(image_a) == png_sha256(image_b)


def test_a_comfy_file_without_lm_head_loads_with_lm_head_false_and_says_so_otherwise(tmp_path):
    """A file stored without its output head: one error that names the key and the option; with the option, the
    embeddings of the file that has the head, and fast paths on == off."""
    full, headless = tmp_path / "full.safetensors", tmp_path / "headless.safetensors"
    te.write_comfy_file("qwen2_5_vl", full, ck_quantize)
    te.write_comfy_file("qwen2_5_vl", headless, ck_quantize,
                        lambda t: [t.pop(k) for k in [k for k in t if k.startswith("lm_head.")]])
    config = te.config_of("qwen2_5_vl")
    with pytest.raises(NVFP4CheckpointError, match=r"missing key lm_head\.weight .*lm_head=False"):
        load_nvfp4_text_encoder(headless, config=config)
    embeds = [te.encoder_outputs(*te.tiny_pipeline("qwen2_5_vl", load_nvfp4_text_encoder(file, config=config,
                                                                                          lm_head=keep)))[0]
              for file, keep in ((full, True), (headless, False))]
    assert len(embeds[0]) == len(embeds[1]) > 0
    assert all(torch.equal(a, b) for a, b in zip(*embeds, strict=True))
    pipe, kwargs = te.tiny_pipeline("qwen2_5_vl", load_nvfp4_text_encoder(headless, config=config, lm_head=False))
    (off, sha_off), (on, sha_on), _ = _generate_off_on_off(pipe, kwargs)  # fast paths leave NoLogits alone
    assert sha_off == sha_on and all(torch.equal(a, b) for a, b in zip(off, on, strict=True))
