"""Every loading route kept right (issue 33): what each route must refuse before it changes anything, what it must
save and reload byte for byte, and what it must put back.

Files are written from the session's real ModelOpt export of the tiny FLUX.2 transformer: in the layout diffusers'
``BFLQuantizationConfig`` reads (low nibble first, linear scales) and in the official BFL / ComfyUI one (high nibble
first, 128x4 scales), which diffusers splits wrongly."""

from __future__ import annotations

import json
import shutil
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
from diffusers_nvfp4_fast.linear import NVFP4Linear
from diffusers_nvfp4_fast.testing import tiny
from diffusers_nvfp4_fast.utils import png_sha256, run_pipeline
from support.bfl_files import write_bfl_file

DIFFUSERS_LAYOUT = dict(nibble_order="lo_first", swizzle=False, markers=False, header=False)


@pytest.fixture(scope="module")
def export(modelopt_exports) -> Path:
    return modelopt_exports("flux2")


@pytest.fixture(scope="module")
def files(export, tmp_path_factory) -> dict[str, Path]:
    """The transformer config alone (``from_single_file`` reads it instead of FLUX.2's), and both BFL files."""
    tmp = tmp_path_factory.mktemp("routes")
    cfg = json.loads((export / "config.json").read_text())
    cfg.pop("quantization_config")
    (tmp / "config").mkdir()
    (tmp / "config" / "config.json").write_text(json.dumps(cfg))
    write_bfl_file(export, tmp / "native.safetensors", **DIFFUSERS_LAYOUT)
    write_bfl_file(export, tmp / "official.safetensors")
    return {"config": tmp / "config", "native": tmp / "native.safetensors", "official": tmp / "official.safetensors"}


def load_native(files: dict[str, Path], which: str = "native"):
    from diffusers import BFLQuantizationConfig, Flux2Transformer2DModel

    return Flux2Transformer2DModel.from_single_file(str(files[which]), config=str(files["config"]),
                                                    quantization_config=BFLQuantizationConfig(),
                                                    torch_dtype=torch.bfloat16)


def modules(model) -> dict[str, torch.nn.Module]:
    return dict(model.named_modules())


def tensor_bytes(model) -> dict[str, torch.Tensor]:
    return {k: v.reshape(-1).view(torch.uint8) for k, v in model.state_dict().items()}


def assert_same_checkpoint(a, b) -> None:
    ta, tb = tensor_bytes(a), tensor_bytes(b)
    assert sorted(ta) == sorted(tb)
    assert not [k for k in ta if not torch.equal(ta[k], tb[k])]


def sha(transformer) -> str:
    pipe, kwargs = tiny.tiny_flux2_pipeline(transformer)
    pipe.set_progress_bar_config(disable=True)
    return png_sha256(run_pipeline(pipe, kwargs, steps=2))


# Point 1: a conversion reads only tensors it understands.

def test_official_layout_read_by_diffusers_is_refused_before_any_layer_changes(files):
    """diffusers splits the official file's padded 128x4 scales into wrong shapes ((43, 4) for a [32, 32] layer);
    converting them used to pad them up and give another image than the same weights through our loader."""
    model = load_native(files, "official")
    before = modules(model)
    with pytest.raises(NVFP4CheckpointError) as info:
        enable_fast_paths(model)
    msg = str(info.value)
    assert "transformer_blocks.0.attn.to_q.weight_scale: torch.float8_e4m3fn [43, 4], expected" in msg, msg
    assert "[32, 2]" in msg and "BFL/Comfy layout" in msg and "load_nvfp4_transformer" in msg, msg
    assert modules(model) == before and all(modules(model)[n] is m for n, m in before.items())
    assert not fast_path_report(model)["Flux2Transformer2DModel"]["enabled"]


def test_modelopt_layer_whose_tensor_does_not_fit_is_refused_before_any_change():
    from diffusers_nvfp4_fast.loaders.modelopt_memory import convert_modelopt_model
    from support.bfl_files import quantize_tiny_flux2

    model = quantize_tiny_flux2(True)
    layer = model.single_transformer_blocks[0].attn.to_out
    layer.bias = torch.nn.Parameter(torch.zeros(layer.out_features + 1, dtype=torch.bfloat16))
    before = modules(model)
    with pytest.raises(NVFP4CheckpointError, match=r"single_transformer_blocks\.0\.attn\.to_out\.bias: \[33\], "
                                                   r"expected \[32\]"):
        convert_modelopt_model(model)
    assert all(modules(model)[n] is m for n, m in before.items())


# Point 6: disable puts the ModelOpt modules back.

def test_disable_restores_a_modelopt_in_memory_model():
    from diffusers_nvfp4_fast.loaders.modelopt_memory import has_modelopt_modules
    from support.bfl_files import quantize_tiny_flux2

    model = quantize_tiny_flux2(True)
    before = modules(model)
    amax = model.transformer_blocks[0].attn.to_q.input_quantizer.amax.clone()
    converted = enable_fast_paths(model)["Flux2Transformer2DModel"]["converted"]
    assert converted == {"ModelOpt (in memory)": 13} and not has_modelopt_modules(model)
    disable_fast_paths(model)
    assert has_modelopt_modules(model) and set(modules(model)) == set(before)
    assert all(modules(model)[n] is m for n, m in before.items()), "the same ModelOpt objects are back"
    assert torch.equal(model.transformer_blocks[0].attn.to_q.input_quantizer.amax, amax)
    enable_fast_paths(model)  # and converts again
    assert not has_modelopt_modules(model)


# Points 2, 3, 7: save_pretrained on every route.

def test_bfl_file_saves_and_reloads_byte_for_byte(files, tmp_path):
    model = load_nvfp4_transformer(files["official"])
    model.save_pretrained(tmp_path / "saved")
    again = load_nvfp4_transformer(tmp_path / "saved")
    assert_same_checkpoint(model, again)
    assert sha(again) == sha(model)


def test_diffusers_loaded_model_saves_after_enable_fast_paths(files, tmp_path):
    model = load_native(files)
    enable_fast_paths(model)
    model.save_pretrained(tmp_path / "saved")
    assert model.hf_quantizer is not None, "diffusers' quantizer is only hidden while saving"
    assert_same_checkpoint(model, load_nvfp4_transformer(tmp_path / "saved"))
    disable_fast_paths(model)  # diffusers' BFLNVFP4Linear layers are back: diffusers cannot save them
    with pytest.raises(ValueError, match=r"diffusers' .*BFL quantizer built.*enable_fast_paths\(pipe\) converts"):
        model.save_pretrained(tmp_path / "again")
    assert not (tmp_path / "again").exists()


def test_pipeline_save_pretrained_and_reload_of_the_transformer(export, tmp_path):
    """The README's pipeline-level round trip: ``pipe.save_pretrained(P)`` + ``load_nvfp4_transformer(P,
    subfolder="transformer")``."""
    pipe, kwargs = tiny.tiny_flux2_pipeline(load_nvfp4_transformer(export))
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(tmp_path / "pipe")
    transformer = load_nvfp4_transformer(tmp_path / "pipe", subfolder="transformer")
    assert_same_checkpoint(pipe.transformer, transformer)


def test_failed_save_leaves_nothing_that_looks_like_a_checkpoint(export, tmp_path, monkeypatch):
    import safetensors.torch

    model = load_nvfp4_transformer(export)

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        model.save_pretrained(tmp_path / "saved")
    assert list(tmp_path.iterdir()) == [], "no config.json alone, no temporary directory"
    monkeypatch.undo()
    model.save_pretrained(tmp_path / "saved")  # an earlier checkpoint stays whole when a later save fails
    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    with pytest.raises(OSError):
        model.save_pretrained(tmp_path / "saved")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved"]
    assert_same_checkpoint(model, load_nvfp4_transformer(tmp_path / "saved"))


def test_bin_save_is_refused_before_anything_is_written(export, tmp_path):
    model = load_nvfp4_transformer(export)
    with pytest.raises(ValueError, match="written as safetensors only.*nothing was written"):
        model.save_pretrained(tmp_path / "saved", safe_serialization=False)
    assert not (tmp_path / "saved").exists()


def test_lora_wrapped_model_is_refused_at_save_and_named_at_reload(export, tmp_path):
    pytest.importorskip("peft", reason="peft is not installed, so the LoRA save test did not run; "
                                       "it runs wherever peft is installed, as in CI (pip install -e '.[test]')")
    from diffusers.models.modeling_utils import ModelMixin
    from test_lora import SINGLE_TO_OUT, lora_state_dict

    pipe, _ = tiny.tiny_flux2_pipeline(load_nvfp4_transformer(export))
    pipe.load_lora_weights(lora_state_dict("flux2", SINGLE_TO_OUT), adapter_name="a")
    with pytest.raises(ValueError, match=r"holds a LoRA \(peft\) on 2 layer\(s\).*unload_lora_weights"):
        pipe.transformer.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved").exists()
    ModelMixin.save_pretrained(pipe.transformer, tmp_path / "old")  # what diffusers' own save writes
    with pytest.raises(NVFP4CheckpointError, match="this checkpoint holds a LoRA-wrapped model"):
        load_nvfp4_transformer(tmp_path / "old")


def test_saved_directory_replaces_an_earlier_sharded_checkpoint(export, tmp_path):
    model = load_nvfp4_transformer(export)
    model.save_pretrained(tmp_path / "saved", max_shard_size="20KB")
    assert (tmp_path / "saved" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    (tmp_path / "saved" / "notes.txt").write_text("kept")
    model.save_pretrained(tmp_path / "saved")
    names = sorted(p.name for p in (tmp_path / "saved").iterdir())
    assert names == ["config.json", "diffusion_pytorch_model.safetensors", "notes.txt"], names
    assert_same_checkpoint(model, load_nvfp4_transformer(tmp_path / "saved"))


def test_copied_model_saves_itself(export, tmp_path):
    import copy

    model = load_nvfp4_transformer(export)
    twin = copy.deepcopy(model)
    assert twin.save_pretrained.model is twin
    twin.save_pretrained(tmp_path / "twin")
    assert isinstance(load_nvfp4_transformer(tmp_path / "twin").single_transformer_blocks[0].attn.to_out, NVFP4Linear)


# Point 4: a refused fuse_lora changes nothing; point 15: no peft warning for the layers this package supports.

def test_refused_fuse_lora_leaves_the_image_unchanged(export):
    pytest.importorskip("peft", reason="peft is not installed, so the fuse_lora test did not run")
    from test_lora import TARGETS, lora_state_dict

    pipe, kwargs = tiny.tiny_flux2_pipeline(load_nvfp4_transformer(export))
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(lora_state_dict("flux2", TARGETS["flux2"]), adapter_name="a")  # BF16 x_embedder too
    x_embedder = pipe.transformer.x_embedder.base_layer.weight.clone()
    before = png_sha256(run_pipeline(pipe, kwargs, steps=2))
    with pytest.raises(RuntimeError, match="fuse_lora cannot merge a LoRA into an NVFP4 layer.*Nothing was fused"):
        pipe.fuse_lora(lora_scale=0.5)
    assert png_sha256(run_pipeline(pipe, kwargs, steps=2)) == before
    assert torch.equal(pipe.transformer.x_embedder.base_layer.weight, x_embedder), "the BF16 layer was not fused"


def test_lora_on_nvfp4_layers_loads_without_peft_warnings(export):
    pytest.importorskip("peft", reason="peft is not installed, so the LoRA warning test did not run")
    import warnings

    from test_lora import SINGLE_TO_OUT, lora_state_dict

    pipe, _ = tiny.tiny_flux2_pipeline(load_nvfp4_transformer(export))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe.load_lora_weights(lora_state_dict("flux2", SINGLE_TO_OUT), adapter_name="a")
    assert not [w for w in caught if "Unsupported layer type" in str(w.message)]
    assert type(pipe.transformer.single_transformer_blocks[0].attn.to_out).__name__ == "NVFP4LoraLinear"


# Point 5: the fast paths follow a LoRA loaded after enable_fast_paths.

def test_adaln_sites_follow_a_lora_loaded_after_enable_fast_paths(export):
    pytest.importorskip("peft", reason="peft is not installed, so the LoRA-after-enable test did not run")
    from test_lora import SINGLE_TO_OUT, lora_state_dict

    pipe, kwargs = tiny.tiny_flux2_pipeline(load_nvfp4_transformer(export))
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(lora_state_dict("flux2", SINGLE_TO_OUT + r"|.*transformer_blocks\.0\.attn\.to_q"),
                           adapter_name="a")
    off = png_sha256(run_pipeline(pipe, kwargs, steps=1))
    pipe.unload_lora_weights()
    enable_fast_paths(pipe)
    pipe.load_lora_weights(lora_state_dict("flux2", SINGLE_TO_OUT + r"|.*transformer_blocks\.0\.attn\.to_q"),
                           adapter_name="a")  # load_state_dict reloads every layer's scales, to_q gets wrapped
    on = png_sha256(run_pipeline(pipe, kwargs, steps=1))
    report = fast_path_report(pipe)["Flux2Transformer2DModel"]
    assert on == off
    assert report["fallbacks"] == {"flux2_adaln: lora": 1, "flux2_token_cat: lora": 2}, report["fallbacks"]
    assert report["fused_calls"]["flux2_adaln"] == 3  # the text stream and both single blocks still fused
    pipe.unload_lora_weights()
    run_pipeline(pipe, kwargs, steps=1)
    assert fast_path_report(pipe)["Flux2Transformer2DModel"]["fused_calls"]["flux2_adaln"] == 3 + 4


# Point 13: a readable report; point 14: on == off with the public API on the diffusers route.

def test_report_prints_per_site_with_modules_calls_and_reasons(export):
    pipe, kwargs = tiny.tiny_flux2_pipeline(load_nvfp4_transformer(export))
    pipe.set_progress_bar_config(disable=True)
    report = enable_fast_paths(pipe)
    assert isinstance(report, dict) and report["Flux2Transformer2DModel"]["sites"]["flux2_token_cat"] == 2
    handle = pipe.transformer.transformer_blocks[0].attn.to_v.register_forward_hook(lambda *args: None)
    run_pipeline(pipe, kwargs, steps=1)
    handle.remove()
    report = fast_path_report(pipe)
    entry = report["Flux2Transformer2DModel"]
    assert entry["site_modules"]["flux2_token_cat"] == ["single_transformer_blocks.0.attn",
                                                        "single_transformer_blocks.1.attn"]
    text = str(report)
    assert "flux2_token_cat: 2 site(s) on single_transformer_blocks.[0-1].attn\n" \
           "    fused: 2 call(s) (flux2_token_cat_swiglu 2)" in text, text
    assert "flux2_adaln: 4 site(s) on transformer_blocks.0.attn (img), transformer_blocks.0.attn (txt), " \
           "single_transformer_blocks.[0-1].attn\n    fused: 3 call(s)\n" \
           "    fell back: hook on to_v: torch forward hook (1)" in text, text
    assert "flux2_token_cat_swiglu:" not in text, "one site name everywhere"
    assert json.loads(json.dumps(report)) == report
    disable_fast_paths(pipe)
    assert str(fast_path_report(pipe)) == "Flux2Transformer2DModel: fast paths off (16 NVFP4 linears)"


def test_fused_false_converts_without_fused_sites_so_on_equals_off_on_the_diffusers_route(files, export):
    pipe, kwargs = tiny.tiny_flux2_pipeline(load_nvfp4_transformer(export))
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer = load_native(files)  # after the tiny pipeline's cast to BF16, which diffusers refuses for it
    entry = enable_fast_paths(pipe, fused=False)["Flux2Transformer2DModel"]
    assert entry["converted"] == {"diffusers BFLQuantizationConfig": 16} and entry["sites"] == {}
    assert entry["fused"] is False and "fused paths off (fused=False)" in str(fast_path_report(pipe))
    off = png_sha256(run_pipeline(pipe, kwargs, steps=2))
    assert fast_path_report(pipe)["Flux2Transformer2DModel"]["fused_calls"] == {}
    entry = enable_fast_paths(pipe)["Flux2Transformer2DModel"]  # fused=True re-enables with the sites
    assert entry["fused"] is True and entry["sites"]["flux2_token_cat"] == 2
    on = png_sha256(run_pipeline(pipe, kwargs, steps=2))
    assert fast_path_report(pipe)["Flux2Transformer2DModel"]["fused_calls"]["flux2_token_cat_swiglu"] == 4
    assert on == off
    disable_fast_paths(pipe)
    assert all(type(m).__name__ != "NVFP4Linear" for m in pipe.transformer.modules())


# Point 8: inspect on a ModelOpt export runs the loader's checks.

def _edited_export(export: Path, out: Path, edit) -> Path:
    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(export, out)
    for file in out.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        edit(tensors)
        save_file(tensors, str(file), metadata=meta)
    return out


LAYER = "transformer_blocks.0.attn.to_q"


def _set_byte(tensors, key, value):
    tensors[key].view(torch.uint8).reshape(-1)[3] = value


@pytest.mark.parametrize("edit, says, needs_block_scales", [
    (lambda t: t.pop(f"{LAYER}.input_scale"), f"missing key {LAYER}.input_scale", False),
    (lambda t: t.__setitem__(f"{LAYER}.weight", t[f"{LAYER}.weight"][:-1].clone()), f"{LAYER}.weight in", False),
    (lambda t: t[f"{LAYER}.weight_scale_2"].fill_(float("nan")), f"{LAYER}.weight_scale_2 is nan", False),
    (lambda t: _set_byte(t, f"{LAYER}.weight_scale", 0x7F), f"{LAYER}.weight_scale holds 1 E4M3 NaN byte", True),
], ids=["missing-key", "wrong-shape", "nan-weight-scale-2", "e4m3-nan-byte"])
def test_inspect_of_a_modelopt_export_refuses_what_the_loader_refuses(export, tmp_path, capsys, edit, says,
                                                                      needs_block_scales):
    from diffusers_nvfp4_fast.commands.cli import main

    bad = _edited_export(export, tmp_path / "bad", edit)
    with pytest.raises(NVFP4CheckpointError, match=says):
        load_nvfp4_transformer(bad)
    assert main(["inspect", str(bad), "--check-scales"]) == 1
    assert says in capsys.readouterr().out
    assert main(["inspect", str(bad)]) == (0 if needs_block_scales else 1)
    out = capsys.readouterr().out
    assert (says not in out and "block scales not read (--check-scales reads them)" in out) if needs_block_scales \
        else says in out
    assert main(["inspect", str(export), "--check-scales"]) == 0
    assert "loader dry run: Flux2Transformer2DModel" in capsys.readouterr().out


# Point 9: errors that name the thing.

def test_pipeline_without_transformer_says_so():
    pipe, _ = tiny.tiny_flux2_pipeline()
    pipe.transformer = None
    with pytest.raises(ValueError, match=r"Flux2Pipeline has no transformer \(pipe.transformer is None\)"):
        enable_fast_paths(pipe)


def test_missing_path_says_no_such_file_or_directory(tmp_path):
    for missing in (tmp_path / "no" / "such" / "export", tmp_path / "missing.safetensors"):
        with pytest.raises(FileNotFoundError, match="no such file or directory"):
            load_nvfp4_transformer(missing)


def test_broken_config_and_missing_shard_name_the_file(export, tmp_path):
    bad = shutil.copytree(export, tmp_path / "bad_json")
    (bad / "config.json").write_text("{not json")
    with pytest.raises(NVFP4CheckpointError, match=rf"{bad / 'config.json'}: not valid JSON"):
        load_nvfp4_transformer(bad)
    nameless = shutil.copytree(export, tmp_path / "nameless")
    config = json.loads((nameless / "config.json").read_text())
    del config["_class_name"]
    (nameless / "config.json").write_text(json.dumps(config))
    with pytest.raises(NVFP4CheckpointError, match=rf"{nameless / 'config.json'}: no _class_name"):
        load_nvfp4_transformer(nameless)
    model = load_nvfp4_transformer(export)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    shard = sorted((tmp_path / "sharded").glob("*-of-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(NVFP4CheckpointError, match=rf"lists 1 shard\(s\) that are not in .*: {shard.name}"):
        load_nvfp4_transformer(tmp_path / "sharded")


@pytest.mark.parametrize("content, says", [
    (b"PK\x03\x04" + bytes(64), "a zip archive"), (b"\x80\x02}q\x00" + bytes(64), "a Python pickle"),
    (b"import torch\nprint('hello')\n", "does not begin with a safetensors header"),
], ids=["zip", "pickle", "python"])
def test_inspect_on_a_non_safetensors_file_says_so(tmp_path, capsys, content, says):
    from diffusers_nvfp4_fast.commands.cli import main

    path = tmp_path / "model.bin"
    path.write_bytes(content)
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert "not a safetensors file" in err and says in err and "truncated" not in err, err


def test_dtype_is_accepted_and_unknown_keywords_are_named(export):
    model = load_nvfp4_transformer(export, dtype=torch.float16)
    assert model.x_embedder.weight.dtype == torch.float16
    assert load_nvfp4_transformer(export, dtype=torch.float16, torch_dtype=torch.float16) is not None
    with pytest.raises(ValueError, match="dtype=torch.float16 and torch_dtype=torch.bfloat16 disagree"):
        load_nvfp4_transformer(export, dtype=torch.float16, torch_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['low_cpu_mem_usage'\]"):
        load_nvfp4_transformer(export, low_cpu_mem_usage=True)
    with pytest.raises(TypeError, match=r"\['nibble_order'\] only apply to single-file"):
        load_nvfp4_transformer(export, nibble_order="lo_first")


def test_bfl_scale_errors_are_not_called_block_scales_and_flag_sources_differ(export, tmp_path):
    def nan_scale(tensors, metadata):
        tensors["single_blocks.0.linear2.weight_scale_2"] = torch.tensor(float("nan"))

    path = tmp_path / "nan.safetensors"
    write_bfl_file(export, path, edit=nan_scale)
    with pytest.raises(NVFP4CheckpointError, match="1 problem.s. in NVFP4 scales:") as info:
        load_nvfp4_transformer(path)
    assert "block scales" not in str(info.value)
    write_bfl_file(export, path, markers=False, file_flags={"nibble_order": "lo_first"},
                   layer_flags={"nibble_order": "hi_first"})
    with pytest.raises(NVFP4CheckpointError) as info:
        load_nvfp4_transformer(path)
    msg = str(info.value)
    assert ("conflicting nibble_order for layer double_blocks.0.img_attn.qkv: the file-wide flags of header "
            "_quantization_metadata say 'lo_first', header _quantization_metadata "
            "layers['double_blocks.0.img_attn.qkv'] says 'hi_first'") in msg, msg


def test_fit_to_budget_without_a_gpu_says_so(export, monkeypatch):
    from diffusers_nvfp4_fast import fit_to_budget

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    pipe, _ = tiny.tiny_flux2_pipeline(load_nvfp4_transformer(export))
    with pytest.warns(UserWarning, match="no CUDA device here, so the 24 GiB GPU budget does not apply"):
        assert fit_to_budget(pipe, 24) == "resident"
