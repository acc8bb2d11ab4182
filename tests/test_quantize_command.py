"""``quantize_transformer`` / ``diffusers-nvfp4-fast quantize``: a BF16 diffusers transformer on disk -> an NVFP4
checkpoint. Its tensors are the bytes of ``format.quantize_nvfp4`` (and of the test exporter) for the same weights
and calibration; it passes ``inspect``, loads, and the tiny pipeline's PNG is the same with fast paths on and off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from diffusers_nvfp4_fast import (
    enable_fast_paths,
    load_nvfp4_transformer,
    load_summary,
    quantize_nvfp4,
    quantize_transformer,
)
from diffusers_nvfp4_fast.commands.cli import main
from diffusers_nvfp4_fast.loaders.common import is_excluded, qkv_group
from diffusers_nvfp4_fast.quantize import recipes
from diffusers_nvfp4_fast.quantize.calibration import CalibrationError, check_input_amax, record_input_amax
from diffusers_nvfp4_fast.testing import export, tiny
from diffusers_nvfp4_fast.utils import png_sha256, run_pipeline

SIZE, STEPS = 32, 1


def _calibration_call(kwargs: dict) -> dict:
    return {**{k: v for k, v in kwargs.items() if k != "prompt"}, "height": SIZE, "width": SIZE}


def _old_style_amax(pipe, kwargs, names) -> dict[str, float]:
    """The oracle's calibration: a float max per call, as ModelOpt's max calibrator keeps it."""
    amax = dict.fromkeys(names, 0.0)
    hooks = [pipe.transformer.get_submodule(n).register_forward_pre_hook(
        lambda _m, args, n=n: amax.__setitem__(n, max(amax[n], float(args[0].abs().float().max())))) for n in names]
    call = _calibration_call(kwargs)
    with torch.inference_mode():
        pipe(prompt=kwargs["prompt"], num_inference_steps=STEPS, generator=torch.Generator().manual_seed(0),
             output_type="latent", **call)
    for h in hooks:
        h.remove()
    return amax


_CACHE: dict[str, tuple] = {}


def _quantized(which: str, tmp_path_factory) -> tuple:
    """(BF16 source dir, NVFP4 checkpoint dir, result, pipeline, call kwargs), made once per family."""
    if which not in _CACHE:
        root = tmp_path_factory.mktemp(f"quantize_{which}")
        pipe, kwargs = tiny.TINY_PIPELINES[which]()
        pipe.set_progress_bar_config(disable=True)
        pipe.transformer.save_pretrained(root / "bf16")
        result = quantize_transformer(root / "bf16", root / "nvfp4", pipeline=pipe, prompts=[kwargs["prompt"]],
                                      call_kwargs=_calibration_call(kwargs), num_inference_steps=STEPS,
                                      progress=False)
        _CACHE[which] = (root / "bf16", root / "nvfp4", result, pipe, kwargs)
    return _CACHE[which]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("which", ["flux2", "klein"])
def test_tensors_are_the_bytes_of_quantize_nvfp4_and_the_exporter(which, tmp_path_factory, tmp_path):
    _, out, result, pipe, kwargs = _quantized(which, tmp_path_factory)
    written = load_file(str(out / "diffusion_pytorch_model.safetensors"))
    model = pipe.transformer
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    exclude = tiny.TINY_EXCLUDES[which]
    quant = [n for n in linears if not is_excluded(n, list(exclude)) and linears[n].in_features % 16 == 0]
    assert result.nvfp4_layers == quant and len(quant) > 0
    amax = _old_style_amax(pipe, kwargs, quant)
    for name in quant:
        group = [g for g in qkv_group(name) if g in linears]
        w_amax = max(float(linears[g].weight.detach().abs().float().max()) for g in group)
        ws2 = torch.tensor(w_amax / 2688.0, dtype=torch.float32)
        packed, scales = quantize_nvfp4(linears[name].weight.detach(), 1.0 / ws2, scale_layout="linear",
                                        fast_math=False)
        input_scale = torch.tensor(max(amax[g] for g in group) / 2688.0, dtype=torch.float32)
        for suffix, want in (("weight", packed), ("weight_scale", scales), ("weight_scale_2", ws2),
                             ("input_scale", input_scale)):
            assert torch.equal(_bytes(written[f"{name}.{suffix}"]), _bytes(want)), f"{name}.{suffix}"
    plain = {k: v for k, v in model.state_dict().items() if k.rpartition(".")[0] not in quant or k.endswith("bias")}
    assert all(torch.equal(_bytes(written[k]), _bytes(v.to(torch.bfloat16))) for k, v in plain.items())
    exported = load_file(str(export.export_nvfp4(model, tmp_path / "exported", exclude, amax)
                             / "diffusion_pytorch_model.safetensors"))
    assert sorted(exported) == sorted(written)
    assert not [k for k in written if not torch.equal(_bytes(written[k]), _bytes(exported[k]))]


@pytest.mark.parametrize("which", ["flux2", "klein", "qwen"])
def test_checkpoint_passes_inspect_and_loads(which, tmp_path_factory, capsys):
    _, out, result, _, _ = _quantized(which, tmp_path_factory)
    assert main(["inspect", str(out)]) == 0, capsys.readouterr().out
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["input_scales"]["method"] == "calibrated" and qc["dynamic_input_scale"] == []
    assert qc["ignore"] == sorted(result.bf16_linears)
    model = load_nvfp4_transformer(out)
    assert load_summary(model)["nvfp4_linears"] == len(result.nvfp4_layers) > 0


@pytest.mark.parametrize("which", ["flux2", "klein", "qwen"])
def test_checkpoint_gives_the_same_png_with_fast_paths_on_and_off(which, tmp_path_factory):
    pipe, kwargs = tiny.TINY_PIPELINES[which](load_nvfp4_transformer(_quantized(which, tmp_path_factory)[1]))
    pipe.set_progress_bar_config(disable=True)
    off = png_sha256(run_pipeline(pipe, kwargs, size=SIZE, steps=1))
    enable_fast_paths(pipe)
    assert png_sha256(run_pipeline(pipe, kwargs, size=SIZE, steps=1)) == off


def test_dynamic_and_sharded_checkpoint_loads_with_per_call_scales(tmp_path_factory, tmp_path):
    src, out, _, _, _ = _quantized("klein", tmp_path_factory)
    result = quantize_transformer(src, tmp_path / "dyn", dynamic=True, max_shard_size="20KB", progress=False)
    index = json.loads((tmp_path / "dyn" / "diffusion_pytorch_model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == len(result.files) - 1 > 1
    assert "dynamic" in result.summary()
    model = load_nvfp4_transformer(tmp_path / "dyn")
    layers = {n: m for n, m in model.named_modules() if hasattr(m, "dynamic_input_scale")}
    assert sorted(layers) == sorted(result.nvfp4_layers) and all(m.dynamic_input_scale for m in layers.values())
    calibrated = load_file(str(out / "diffusion_pytorch_model.safetensors"))
    dynamic = {}
    for name in set(index["weight_map"].values()):
        dynamic.update(load_file(str(tmp_path / "dyn" / name)))
    assert sorted(dynamic) == sorted(calibrated)
    differ = [k for k in calibrated if not torch.equal(_bytes(calibrated[k]), _bytes(dynamic[k]))]
    assert differ and all(k.endswith(".input_scale") for k in differ)


def test_exclusion_recipes_per_model_class():
    assert recipes.exclude_patterns("Flux2Transformer2DModel", {}) == recipes.FLUX2_EXCLUDE
    qwen = recipes.exclude_patterns("QwenImageTransformer2DModel", {"num_layers": 60})
    assert [p for p in qwen if p.startswith("transformer_blocks")] == [
        f"transformer_blocks.{i}" for i in (0, 1, 58, 59)]
    assert "modulation*" in recipes.exclude_patterns("QwenImage21Transformer2DModel", {"num_layers": 32})
    assert "modulation*" not in qwen
    with pytest.raises(recipes.UnknownModelClassError, match=r"'FluxTransformer2DModel'.*--exclude"):
        recipes.exclude_patterns("FluxTransformer2DModel", {})


def test_qwen_image_21_round_trip(tmp_path):
    from diffusers import QwenImage21Transformer2DModel

    torch.manual_seed(0)
    QwenImage21Transformer2DModel(  # type: ignore[attr-defined]
        patch_size=1, in_channels=16, out_channels=16, num_layers=5, attention_head_dim=32, num_attention_heads=2,
        context_in_dim=32, mlp_ratio=2, axes_dims_rope=(8, 12, 12),
    ).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    result = quantize_transformer(tmp_path / "bf16", tmp_path / "nvfp4", dynamic=True, progress=False)
    assert result.nvfp4_layers and all(n.startswith("transformer_blocks.2.") for n in result.nvfp4_layers)
    assert "modulation.1" in result.bf16_linears
    model = load_nvfp4_transformer(tmp_path / "nvfp4")
    assert load_summary(model)["nvfp4_linears"] == len(result.nvfp4_layers)


def test_calibration_refuses_layers_without_a_usable_amax():
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    amax = record_input_amax(model, ["0", "1"], lambda: model[0](torch.ones(2, 16)))
    assert amax == {"0": 1.0, "1": 0.0}
    with pytest.raises(CalibrationError, match=r"1 quantized layer\(s\).*1 \(never called\).*--dynamic"):
        check_input_amax(amax)
    with pytest.raises(CalibrationError, match="nan"):
        check_input_amax({"0": float("nan")})


def test_failed_write_leaves_the_target_as_it_was(tmp_path_factory, tmp_path, monkeypatch):
    from diffusers_nvfp4_fast.quantize import transformer as command

    src = _quantized("klein", tmp_path_factory)[0]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("old")

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(command, "nvfp4_layer_tensors", broken)
    for target, overwrite in ((tmp_path / "new", False), (tmp_path / "out", True)):
        with pytest.raises(RuntimeError, match="disk full"):
            quantize_transformer(src, target, dynamic=True, overwrite=overwrite, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


# --- the command line -------------------------------------------------------------------------------------------


def _cli(capsys, *args: str) -> tuple[int, str]:
    code = main(["quantize", *map(str, args), "--no-progress"])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_cli_calibrates_through_a_pipeline_directory(tmp_path_factory, tmp_path, capsys):
    pipe, kwargs = tiny.TINY_PIPELINES["klein"]()
    pipe.save_pretrained(tmp_path / "pipe")
    call = {k: list(v) if isinstance(v, tuple) else v for k, v in _calibration_call(kwargs).items()}
    code, text = _cli(capsys, tmp_path / "pipe", tmp_path / "out", "--subfolder", "transformer", "--pipeline",
                      tmp_path / "pipe", "--prompts", kwargs["prompt"], "--steps", STEPS, "--call-kwargs",
                      json.dumps(call))
    assert code == 0, text
    assert "calibrated: max |input| over 1 prompt(s)" in text and "filter_func_flux_dev" in text
    # A pipeline read back from disk encodes prompts slightly differently from the in-memory one (its text
    # encoder's rotary buffers are not cast to BF16), so only the input scales may differ from the in-memory run.
    same = load_file(str(_quantized("klein", tmp_path_factory)[1] / "diffusion_pytorch_model.safetensors"))
    written = load_file(str(tmp_path / "out" / "diffusion_pytorch_model.safetensors"))
    assert sorted(same) == sorted(written)
    assert not [k for k in same if not k.endswith("input_scale") and not torch.equal(_bytes(same[k]),
                                                                                         _bytes(written[k]))]
    assert all(float(written[k]) > 0 for k in written if k.endswith("input_scale"))


def test_cli_errors_name_the_problem(tmp_path_factory, tmp_path, capsys):
    src, out, _, _, _ = _quantized("klein", tmp_path_factory)
    code, text = _cli(capsys, tmp_path / "missing", tmp_path / "o1", "--dynamic")
    assert code == 2 and "missing" in text and "no such local file or directory" in text
    (tmp_path / "notmodel").mkdir()
    (tmp_path / "notmodel" / "config.json").write_text(json.dumps({"hidden_size": 8}))
    code, text = _cli(capsys, tmp_path / "notmodel", tmp_path / "o2", "--dynamic")
    assert code == 2 and "no _class_name" in text and "config.json" in text
    code, text = _cli(capsys, out, tmp_path / "o3", "--dynamic")
    assert code == 2 and "already quantized" in text
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    code, text = _cli(capsys, src, tmp_path / "full", "--dynamic")
    assert code == 2 and "full" in text and "--overwrite" in text
    with pytest.raises(SystemExit) as exited:  # neither --pipeline nor --dynamic: argparse's usage error
        main(["quantize", str(src), str(tmp_path / "o4")])
    assert exited.value.code == 2 and "--pipeline --dynamic is required" in capsys.readouterr().err
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()
    code, text = _cli(capsys, src, tmp_path / "full", "--dynamic", "--overwrite")
    assert code == 0 and (tmp_path / "full" / "config.json").is_file() and not (tmp_path / "full" / "x").exists()


def test_cli_unknown_class_needs_exclude(tmp_path, capsys):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    FluxTransformer2DModel(  # type: ignore[attr-defined]
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 6, 6],
    ).to(torch.bfloat16).save_pretrained(tmp_path / "flux1")
    code, text = _cli(capsys, tmp_path / "flux1", tmp_path / "out", "--dynamic")
    assert code == 2 and "'FluxTransformer2DModel'" in text and "--exclude" in text
    code, text = _cli(capsys, tmp_path / "flux1", tmp_path / "out", "--dynamic", "--exclude", "x_embedder",
                      "proj_out", "norm_out*", "time_text_embed*", "context_embedder")
    assert code == 0, text
    assert "given by the caller" in text
    assert main(["inspect", str(tmp_path / "out")]) == 0
    assert isinstance(load_nvfp4_transformer(Path(tmp_path / "out")), FluxTransformer2DModel)


@pytest.mark.parametrize("which", ["flux2", "qwen"])
def test_modelopt_method_exports_what_the_loader_reads(which, tmp_path_factory, tmp_path, capsys):
    """``method="modelopt"``: ModelOpt's quantizer and max calibration through the pipeline, written by its
    ``export_hf_checkpoint``: the recipe's BF16 layers carry no NVFP4 tensors, the export passes ``inspect`` and
    loads, and its tiny pipeline gives the same PNG with fast paths on and off. The input scales are ModelOpt's
    calibrated amax over the same prompt, so they equal this package's calibration of the same run."""
    src, ours, result, _, kwargs = _quantized(which, tmp_path_factory)
    pipe, _ = tiny.TINY_PIPELINES[which]()
    pipe.set_progress_bar_config(disable=True)
    out = tmp_path / "modelopt"
    got = quantize_transformer(src, out, pipeline=pipe, prompts=[kwargs["prompt"]], call_kwargs=_calibration_call(
        kwargs), num_inference_steps=STEPS, progress=False, method="modelopt")
    assert main(["inspect", str(out)]) == 0, capsys.readouterr().out
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["producer"]["name"] == "modelopt" and qc["input_scales"]["method"] == "modelopt"
    written = load_file(str(out / "diffusion_pytorch_model.safetensors"))
    assert {k.rpartition(".")[0] for k in written if k.endswith(".weight_scale_2")} == set(result.nvfp4_layers)
    assert got.nvfp4_layers == result.nvfp4_layers and "modelopt" in got.summary().lower()
    mine = load_file(str(ours / "diffusion_pytorch_model.safetensors"))
    for name in result.nvfp4_layers:
        assert torch.equal(written[f"{name}.input_scale"].float(), mine[f"{name}.input_scale"].float()), name
    model = load_nvfp4_transformer(out)
    assert load_summary(model)["nvfp4_linears"] == len(result.nvfp4_layers)
    nvfp4_pipe, call = tiny.TINY_PIPELINES[which](model)
    nvfp4_pipe.set_progress_bar_config(disable=True)
    off = png_sha256(run_pipeline(nvfp4_pipe, call, steps=STEPS))
    enable_fast_paths(nvfp4_pipe)
    assert png_sha256(run_pipeline(nvfp4_pipe, call, steps=STEPS)) == off


def test_modelopt_method_refuses_dynamic_scales(tmp_path):
    with pytest.raises(ValueError, match="method='modelopt' calibrates"):
        quantize_transformer(tmp_path / "src", tmp_path / "out", dynamic=True, method="modelopt")
    with pytest.raises(ValueError, match="method='gptq'"):
        quantize_transformer(tmp_path / "src", tmp_path / "out", dynamic=True, method="gptq")
