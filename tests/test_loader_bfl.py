"""BFL / ComfyUI FLUX.2 NVFP4 single files: loaded byte-identically to the ModelOpt export they were written from.

The files are produced from a real ModelOpt export of the tiny FLUX.2 transformer by
``support.bfl_files.write_bfl_file`` (BFL names, fused qkv, 128x4-swizzled scales, high-nibble-first packing, markers /
header metadata, BFL's [shift, scale] ``norm_out`` order, BF16 ``txt_attn.qkv``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diffusers_nvfp4_fast.commands.cli import main as cli_main
from diffusers_nvfp4_fast.linear import NVFP4Linear
from diffusers_nvfp4_fast.loaders import NVFP4CheckpointError, load_nvfp4_transformer, load_summary
from diffusers_nvfp4_fast.loaders.bfl import plan_bfl_checkpoint
from diffusers_nvfp4_fast.loaders.bfl.config import flux2_variant, infer_flux2_config
from diffusers_nvfp4_fast.loaders.calibrate import calibrate_input_scales
from diffusers_nvfp4_fast.loaders.safetensors_header import SafetensorsHeader
from support.bfl_files import cublas_swizzle, export_modelopt, marker, quantize_tiny_flux2, write_bfl_file

# Layers the "-mixed" style file ships without input_scale: a fused qkv (three diffusers layers) and two others.
MIXED_DROPPED = ("double_blocks.0.img_attn.qkv", "double_blocks.0.txt_mlp.2", "single_blocks.1.linear2")
MIXED_DIFFUSERS = (
    "transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k", "transformer_blocks.0.attn.to_v",
    "transformer_blocks.0.ff_context.linear_out", "single_transformer_blocks.1.attn.to_out",
)


@pytest.fixture(scope="session")
def export_dir(tmp_path_factory) -> Path:
    return export_modelopt(quantize_tiny_flux2(True), tmp_path_factory.mktemp("bfl_src") / "modelopt_export")


@pytest.fixture(scope="session")
def bfl_file(export_dir, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bfl") / "flux2-tiny-nvfp4.safetensors"
    write_bfl_file(export_dir, path)
    return path


@pytest.fixture(scope="session")
def mixed_file(export_dir, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bfl_mixed") / "flux2-tiny-nvfp4-mixed.safetensors"
    write_bfl_file(export_dir, path, drop_input_scale=MIXED_DROPPED)
    return path


@pytest.fixture
def reference(export_dir):
    return load_nvfp4_transformer(export_dir)  # fresh per test (20 ms): nothing can leak between tests


def everything(model) -> dict[str, torch.Tensor]:
    out = dict(model.state_dict())
    out.update(dict(model.named_buffers()))  # non-persistent ones too (alpha, input_scale_inv)
    return out


def assert_same_model(a, b) -> None:
    ta, tb = everything(a), everything(b)
    assert sorted(ta) == sorted(tb)
    differ = [k for k in ta
              if ta[k].dtype != tb[k].dtype or ta[k].shape != tb[k].shape or not torch.equal(ta[k], tb[k])]
    assert not differ, f"tensors differ: {differ}"
    kinds = lambda m: {n: (type(x).__name__, getattr(x, "scale_layout", None), getattr(x, "dynamic_input_scale", None))  # noqa: E731
                       for n, x in m.named_modules()}
    assert kinds(a) == kinds(b)
    assert dict(a.config) == dict(b.config) or {k: v for k, v in a.config.items() if not k.startswith("_")} == {
        k: v for k, v in b.config.items() if not k.startswith("_")}


def pipeline_with(transformer):
    """The tiny Flux2Pipeline around ``transformer``, attached after ``pipe.to(torch.bfloat16)``: that cast would turn
    NVFP4Linear's FP32 scalars (weight_scale_2, input_scale) into BF16."""
    from diffusers_nvfp4_fast.testing.tiny import tiny_flux2_pipeline

    pipe, kwargs = tiny_flux2_pipeline()
    pipe.transformer = transformer
    return pipe, kwargs


def expect_error(path: Path, *needles: str, **kwargs) -> str:
    with pytest.raises(NVFP4CheckpointError) as info:
        load_nvfp4_transformer(path, **kwargs)
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in:\n{message}"
    return message


# ---------------------------------------------------------------------------------------------------------------
# Equality with the ModelOpt export.
# ---------------------------------------------------------------------------------------------------------------


def test_bfl_file_loads_the_same_bytes_as_the_modelopt_export(bfl_file, reference):
    model = load_nvfp4_transformer(bfl_file)
    assert_same_model(model, reference)
    summary = load_summary(model)
    assert summary["format"] == "single_file" and summary["nvfp4_linears"] == load_summary(reference)["nvfp4_linears"]
    assert summary["input_scale_sources"] == {"checkpoint": summary["nvfp4_linears"], "input_scales": 0, "dynamic": 0}
    # The fused NVFP4 img qkv was split, the BF16 txt qkv too, and both stayed what they were.
    attn = model.transformer_blocks[0].attn
    assert isinstance(attn.to_q, NVFP4Linear) and isinstance(attn.to_v, NVFP4Linear)
    assert type(attn.add_q_proj) is torch.nn.Linear and attn.add_q_proj.weight.dtype == torch.bfloat16


def test_pipeline_png_sha256_matches_the_modelopt_export(bfl_file, reference):
    from diffusers_nvfp4_fast.utils import png_sha256, run_pipeline

    pipe, kwargs = pipeline_with(reference)
    want = png_sha256(run_pipeline(pipe, kwargs))
    pipe, kwargs = pipeline_with(load_nvfp4_transformer(bfl_file))
    assert png_sha256(run_pipeline(pipe, kwargs)) == want
    assert reference.transformer_blocks[0].attn.to_q.weight_scale_2.dtype == torch.float32


@pytest.mark.parametrize(
    "variant, writer, loader",
    [
        ("markers only", dict(header=False), {}),
        ("header only", dict(markers=False), {}),
        ("ComfyUI key prefix", dict(prefix="model.diffusion_model."), {}),
        ("lo-first + linear, per-layer flags", dict(nibble_order="lo_first", swizzle=False,
                                                   layer_flags={"nibble_order": "lo_first", "scale_layout": "linear"}),
         {}),
        ("lo-first + linear, file-wide flags", dict(nibble_order="lo_first", swizzle=False, markers=False,
                                                    file_flags={"hi_first": False, "swizzled": False}), {}),
        ("hi-first flag as a boolean", dict(layer_flags={"hi_first": True, "swizzled": True, "group_size": 16}), {}),
        ("no metadata, layout declared by arguments", dict(markers=False, header=False),
         dict(nibble_order="hi_first", scale_layout="128x4")),
    ],
)
def test_layout_variants_load_the_same_bytes(export_dir, reference, tmp_path, variant, writer, loader):
    path = tmp_path / "variant.safetensors"
    write_bfl_file(export_dir, path, **writer)
    assert_same_model(load_nvfp4_transformer(path, **loader), reference)


def test_directory_plus_filename(bfl_file, reference):
    assert_same_model(load_nvfp4_transformer(bfl_file.parent, filename=bfl_file.name), reference)


def test_config_is_inferred_from_shapes(bfl_file, export_dir):
    plan = plan_bfl_checkpoint(SafetensorsHeader(bfl_file))
    exported = json.loads((export_dir / "config.json").read_text())
    for key, value in plan.config.items():
        if key == "out_channels" and value is None:
            continue
        assert exported[key] == value, key
    assert plan.config_source == "inferred from shapes" and not plan.problems


@pytest.mark.parametrize(
    "name, config",
    [
        ("FLUX.2-dev", dict(num_layers=8, num_single_layers=48, num_attention_heads=48, joint_attention_dim=15360)),
        ("FLUX.2-klein-4B", dict(num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680,
                                 guidance_embeds=False)),
        ("FLUX.2-klein-9B", dict(num_layers=8, num_single_layers=24, num_attention_heads=32, joint_attention_dim=12288,
                                 guidance_embeds=False)),
    ],
)
def test_config_inference_for_the_real_sizes(name, config):
    from accelerate import init_empty_weights
    from diffusers import Flux2Transformer2DModel

    with init_empty_weights():
        model = Flux2Transformer2DModel(**config)
    inferred = infer_flux2_config({k: tuple(v.shape) for k, v in model.state_dict().items()})
    assert flux2_variant(inferred) == name
    for key, value in inferred.items():
        want = model.config[key]
        assert (list(want) if isinstance(want, tuple) else want) == value, key


# ---------------------------------------------------------------------------------------------------------------
# Corruptions: each one a clear error.
# ---------------------------------------------------------------------------------------------------------------


def _drop(key):
    return lambda t, m: t.pop(key)


def _as_dtype(key, dtype):
    def edit(t, m):
        t[key] = t[key].view(torch.uint8).to(dtype) if t[key].dtype == torch.float8_e4m3fn else t[key].to(dtype)
    return edit


def _marker(layer, spec):
    def edit(t, m):
        t[layer + ".comfy_quant"] = marker(spec)
    return edit


def _format_everywhere(layer, fmt):
    def edit(t, m):
        t[layer + ".comfy_quant"] = marker({"format": fmt})
        meta = json.loads(m["_quantization_metadata"])
        meta["layers"][layer] = {"format": fmt}
        m["_quantization_metadata"] = json.dumps(meta)
    return edit


def _unexpected(t, m):
    t["double_blocks.0.img_attn.foo.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "edit, needles",
    [
        (_drop("single_blocks.1.linear2.weight_scale"), ["missing key single_blocks.1.linear2.weight_scale"]),
        (_drop("double_blocks.0.txt_attn.qkv.weight"),
         ["missing: no tensor", "transformer_blocks.0.attn.add_q_proj.weight"]),
        (_as_dtype("double_blocks.0.img_mlp.0.weight_scale_2", torch.bfloat16),
         ["double_blocks.0.img_mlp.0.weight_scale_2: dtype BF16", "expected an F32 scalar"]),
        (_as_dtype("single_blocks.0.linear1.weight_scale", torch.bfloat16),
         ["single_blocks.0.linear1.weight_scale: dtype BF16, expected F8_E4M3"]),
        (_as_dtype("double_blocks.0.img_attn.proj.weight", torch.int8),
         ["double_blocks.0.img_attn.proj.weight: dtype I8", "marked nvfp4"]),
        (_marker("double_blocks.0.img_mlp.2", {"format": "nvfp4", "nibble_order": "middle_first"}),
         ["nibble_order='middle_first' is not 'hi_first' or 'lo_first'"]),
        (_marker("double_blocks.0.img_mlp.2", {"format": "nvfp4", "nibble_order": "lo_first", "hi_first": True}),
         ["contradictory nibble-order flags"]),
        (_marker("single_blocks.0.linear2", {"format": "float8_e4m3fn"}),
         ["conflicting formats for layer single_blocks.0.linear2", "'nvfp4'", "'float8_e4m3fn'"]),
        (_format_everywhere("single_blocks.0.linear2", "float8_e4m3fn"),
         ["layer single_blocks.0.linear2: quantization format 'float8_e4m3fn'", "is not supported; only 'nvfp4' is"]),
        (_unexpected, ["unexpected key double_blocks.0.img_attn.foo.weight"]),
    ],
    ids=["missing-fp4-key", "missing-bf16-key", "scalar-dtype", "scale-dtype", "packed-dtype", "invalid-nibble-flag",
         "contradictory-nibble-flags", "conflicting-formats", "unsupported-format", "unexpected-key"],
)
def test_corruptions_are_clear_errors(export_dir, tmp_path, edit, needles):
    path = tmp_path / "corrupt.safetensors"
    write_bfl_file(export_dir, path, edit=edit)
    expect_error(path, *needles)


def test_nibble_order_flag_conflicting_between_marker_and_header(export_dir, tmp_path):
    def edit(t, m):
        t["double_blocks.0.img_mlp.2.comfy_quant"] = marker({"format": "nvfp4", "nibble_order": "lo_first"})
    path = tmp_path / "conflict.safetensors"
    write_bfl_file(export_dir, path, layer_flags={"nibble_order": "hi_first"}, edit=edit)
    expect_error(path, "conflicting nibble_order for layer double_blocks.0.img_mlp.2", "'hi_first'", "'lo_first'")
    # A file-wide flag against a per-layer one, and an argument against the metadata, are errors as well.
    write_bfl_file(export_dir, path, file_flags={"nibble_order": "lo_first"}, layer_flags={"nibble_order": "hi_first"})
    expect_error(path, "conflicting nibble_order for layer")
    write_bfl_file(export_dir, path, layer_flags={"nibble_order": "hi_first"})
    expect_error(path, "nibble_order='lo_first' was passed, but the file's metadata says 'hi_first'",
                 nibble_order="lo_first")


def test_double_swizzled_scales_are_detected(export_dir, tmp_path):
    def edit(t, m):
        key = "single_blocks.0.linear2.weight_scale"  # [32 rows -> 128] x [8]: the padding shows a second swizzle
        t[key] = cublas_swizzle(t[key].view(torch.uint8)).view(torch.float8_e4m3fn)
    path = tmp_path / "double.safetensors"
    write_bfl_file(export_dir, path, edit=edit)
    expect_error(path, "single_blocks.0.linear2.weight_scale", "swizzled twice")
    assert cli_main(["inspect", str(path)]) == 0  # the header alone cannot tell...
    assert cli_main(["inspect", str(path), "--check-scales"]) == 1  # ...the block scales can: the loader's verdict


def test_linear_scales_taken_as_swizzled_is_an_error(export_dir, tmp_path):
    path = tmp_path / "linear.safetensors"
    write_bfl_file(export_dir, path, swizzle=False)  # no flag: the convention (128x4) does not fit the shapes
    expect_error(path, "but the scales are taken as 128x4-swizzled (ComfyUI convention)",
                 "scale_layout='linear'")
    write_bfl_file(export_dir, path, layer_flags={"scale_layout": "linear"})  # flag says linear, data is 128x4-padded
    expect_error(path, "but the scales are taken as linear (metadata)", "scale_layout='128x4'")


def test_packed_weight_without_metadata_is_an_error(export_dir, tmp_path):
    path = tmp_path / "bare.safetensors"
    write_bfl_file(export_dir, path, markers=False, header=False)
    message = expect_error(path, "11 U8 (packed FP4) weight(s) without a declaration of their layout",
                           'scale_layout="128x4", nibble_order="hi_first"',
                           'scale_layout="linear", nibble_order="lo_first"')
    assert "cannot infer" not in message and "missing:" not in message  # the undeclared layers are still mapped


# ---------------------------------------------------------------------------------------------------------------
# Missing input_scale (the "-mixed" file).
# ---------------------------------------------------------------------------------------------------------------


def test_missing_input_scale_is_an_error_naming_layers_and_options(mixed_file):
    message = expect_error(mixed_file, "5 NVFP4 layer(s) have no input_scale", "input_scales=",
                           "dynamic_input_scale=True", "calibrate_input_scales", *MIXED_DIFFUSERS)
    assert "transformer_blocks.0.attn.to_out.0" not in message


def test_input_scales_mapping_or_side_file_restores_the_export(mixed_file, export_dir, reference, tmp_path):
    from safetensors.torch import load_file

    sd = load_file(str(export_dir / "diffusion_pytorch_model.safetensors"))
    scales = {name: sd[name + ".input_scale"] for name in MIXED_DIFFUSERS}
    assert_same_model(load_nvfp4_transformer(mixed_file, input_scales=scales), reference)
    side = tmp_path / "scales.json"
    side.write_text(json.dumps({"input_scales": {k: float(v) for k, v in scales.items()}}))
    model = load_nvfp4_transformer(mixed_file, input_scales=side)
    assert_same_model(model, reference)
    assert load_summary(model)["input_scale_sources"]["input_scales"] == len(MIXED_DIFFUSERS)
    # Partial coverage still fails, for the rest; naming layers that have a scale (or do not exist) is an error.
    expect_error(mixed_file, "1 NVFP4 layer(s) have no input_scale", "single_transformer_blocks.1.attn.to_out",
                 input_scales={k: v for k, v in scales.items() if "single" not in k})
    expect_error(mixed_file, "whose input_scale is in the checkpoint", "transformer_blocks.0.ff.linear_in",
                 input_scales={**scales, "transformer_blocks.0.ff.linear_in": 0.01})
    expect_error(mixed_file, "not NVFP4 layers of this checkpoint", "proj_out",
                 input_scales={**scales, "proj_out": 0.01})
    with pytest.raises(NVFP4CheckpointError, match="not a finite number > 0"):
        load_nvfp4_transformer(mixed_file, input_scales={**scales, MIXED_DIFFUSERS[0]: 0.0})


def test_dynamic_input_scale_is_per_call_amax(mixed_file, reference):
    model = load_nvfp4_transformer(mixed_file, dynamic_input_scale=True)
    dynamic = {n for n, m in model.named_modules() if isinstance(m, NVFP4Linear) and m.dynamic_input_scale}
    assert dynamic == set(MIXED_DIFFUSERS)
    layer = model.get_submodule("single_transformer_blocks.1.attn.to_out")
    assert torch.isnan(layer.input_scale) and layer.input_scale_source == "dynamic"  # never a silent 1.0
    # Everything but the dynamic layers' input scales is the export's.
    ref, got = everything(reference), everything(model)
    scalars = ("input_scale", "input_scale_inv", "alpha")
    same = [k for k in ref if k.rsplit(".", 1)[0] not in dynamic or k.rsplit(".", 1)[1] not in scalars]
    assert all(torch.equal(ref[k], got[k]) for k in same)
    # The dynamic forward equals a static layer whose input_scale is this call's amax / 2688.
    x = torch.randn(3, 5, layer.in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16) * 3
    static = NVFP4Linear(layer.in_features, layer.out_features)
    static.load_nvfp4(layer.weight, layer.weight_scale, layer.weight_scale_2,
                      x.abs().amax().float() / (448.0 * 6.0), scale_layout=layer.scale_layout)
    assert torch.equal(layer(x), static(x))
    with pytest.raises(RuntimeError, match="dynamic_input_scale"):
        layer.forward_prequantized(torch.zeros(1, layer.in_features // 2, dtype=torch.uint8),
                                   torch.zeros(128, 4, dtype=torch.uint8))


def test_calibrate_input_scales_writes_a_reusable_side_file(mixed_file, tmp_path):
    from diffusers_nvfp4_fast.utils import png_sha256, run_pipeline

    model = load_nvfp4_transformer(mixed_file, dynamic_input_scale=True)
    pipe, kwargs = pipeline_with(model)
    side = tmp_path / "input_scales.json"
    scales = calibrate_input_scales(pipe, lambda: run_pipeline(pipe, kwargs, steps=2), side)
    assert set(scales) == set(MIXED_DIFFUSERS) and all(v > 0 for v in scales.values())
    data = json.loads(side.read_text())
    assert data["input_scales"] == scales and set(data["amax"]) == set(scales)
    assert not any(getattr(m, "dynamic_input_scale", False) for m in model.modules())
    reloaded = load_nvfp4_transformer(mixed_file, input_scales=side)
    assert_same_model(reloaded, model)
    image = png_sha256(run_pipeline(pipe, kwargs))
    pipe2, kwargs2 = pipeline_with(reloaded)
    assert png_sha256(run_pipeline(pipe2, kwargs2)) == image
    with pytest.raises(ValueError, match="no layers to calibrate"):
        calibrate_input_scales(model, lambda: None)


# ---------------------------------------------------------------------------------------------------------------
# inspect.
# ---------------------------------------------------------------------------------------------------------------


def test_inspect_prints_header_facts(bfl_file, mixed_file, capsys):
    assert cli_main(["inspect", str(bfl_file)]) == 0
    out = capsys.readouterr().out
    for needle in ("naming: BFL (double_blocks / single_blocks)", "comfy_quant markers: 11",
                   "_quantization_metadata: True", "double_blocks.*.img_attn.qkv.weight", "U8", "[96, 16]",
                   "scale layout by shape: {'128x4': 11}",
                   "hi_first (ComfyUI convention)", "cannot be detected from the bytes",
                   "layers without input_scale: 0", "problems: 0", '"num_layers": 1'):
        assert needle in out, needle
    assert cli_main(["inspect", str(mixed_file), "--json"]) == 1  # load_nvfp4_transformer(mixed_file) refuses
    facts = json.loads(capsys.readouterr().out)
    assert len(facts["refusals"]) == 1 and "input_scales=" in facts["refusals"][0]
    assert sorted(facts["missing_input_scale"]) == sorted(MIXED_DROPPED)
    assert sorted(facts["loader_dry_run"]["missing_input_scale"]) == sorted(MIXED_DIFFUSERS)
    assert facts["families"]["double_blocks.*.txt_attn.qkv.weight"]["dtypes"] == ["BF16"]


def test_inspect_reports_problems_and_directories(export_dir, tmp_path, capsys):
    path = tmp_path / "bad.safetensors"
    write_bfl_file(export_dir, path, edit=_drop("single_blocks.1.linear2.weight_scale"))
    assert cli_main(["inspect", str(path)]) == 1
    assert "missing key single_blocks.1.linear2.weight_scale" in capsys.readouterr().out
    write_bfl_file(export_dir, path, edit=lambda t, m: t.__setitem__(
        "single_blocks.0.linear2.weight_scale",
        cublas_swizzle(t["single_blocks.0.linear2.weight_scale"].view(torch.uint8))))
    cli_main(["inspect", str(path), "--check-scales"])
    assert "nonzero padding after one unswizzle (swizzled twice?)" in capsys.readouterr().out
    assert cli_main(["inspect", str(export_dir), "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["naming"] == "diffusers (transformer_blocks)" and facts["class"] == "Flux2Transformer2DModel"
    assert set(facts["scale_shape_guesses"]) <= {"linear", "ambiguous"}
    assert {x["nibble_order_source"] for x in facts["nvfp4_layers"]} == {"ModelOpt export convention"}
    assert cli_main(["inspect", str(tmp_path / "nope.safetensors")]) == 2


def test_python_dash_m_inspect(bfl_file):
    proc = subprocess.run([sys.executable, "-m", "diffusers_nvfp4_fast", "inspect", str(bfl_file), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["markers"] == 11
