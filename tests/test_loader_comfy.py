"""NVFP4 single files of the whole family, proven against their producers' own code.

The oracle is comfy-kitchen 0.2.40, ComfyUI's quantization library: files are written by its own quantizer in
ComfyUI's layout (``support.comfy_files``: FLUX.2 dev / klein with BFL names, Qwen-Image, its Edit-2511 and Layered
checkpoints, Qwen-Image 2.1 with ComfyUI's fused ``gate_up``; markers, header or both; key prefix or not; with, without
or with some ``input_scale``), and every NVFP4 layer ``load_nvfp4_transformer`` builds must decode to exactly what
comfy-kitchen's ``dequantize_nvfp4`` gives for the stored bytes, mapped by diffusers' own single-file converter
(float64: exact on both sides). BF16 tensors arrive unchanged; pipelines give the same PNG with fast paths off, on and
off again. diffusers' BFL files are written by diffusers' own ``quantize_nvfp4`` and must load to the tensors
diffusers' own loader builds. ``inspect`` exits 1 exactly when the loader refuses. This package's writer
(``support.comfy_writer``) writes comfy-kitchen's bytes, so the GPU test can write its files without comfy-kitchen.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffusers_nvfp4_fast import (
    NVFP4CheckpointError,
    disable_fast_paths,
    enable_fast_paths,
    fast_path_report,
    load_nvfp4_transformer,
    load_summary,
)
from diffusers_nvfp4_fast.commands.cli import main as cli_main
from diffusers_nvfp4_fast.format import decode_nvfp4, dequantize_nvfp4, unswizzle_scales
from diffusers_nvfp4_fast.linear import NVFP4Linear
from diffusers_nvfp4_fast.loaders.bfl.naming import single_file_converter
from support.comfy_files import FAMILIES, FILE_MATRIX, FileCase, ck_dequantize, make_source, write_case
from support.comfy_writer import comfy_quantize
from support.tiny_family import generate, images_sha256

CASES = {case.id: case for case in FILE_MATRIX}
CLASS = {"flux2": "Flux2Transformer2DModel", "klein": "Flux2Transformer2DModel",
         "qwen": "QwenImageTransformer2DModel", "qwen_edit_2511": "QwenImageTransformer2DModel",
         "qwen_layered": "QwenImageTransformer2DModel", "qwen21": "QwenImage21Transformer2DModel"}
MARKER_KEYS = (".comfy_quant", "__index_timestep_zero__")


@pytest.fixture(scope="session")
def sources():
    cache: dict = {}

    def get(family: str):
        if family not in cache:
            cache[family] = make_source(FAMILIES[family])
        return cache[family]

    return get


@pytest.fixture(scope="session")
def files(sources, tmp_path_factory):
    """case id -> path of the file written by its producer's own quantizer (once per session)."""
    root = tmp_path_factory.mktemp("comfy_files")
    cache: dict = {}

    def get(case_id: str) -> Path:
        if case_id not in cache:
            case = CASES[case_id]
            path = root / f"{case_id}.safetensors"
            write_case(sources(case.family), case, path)
            cache[case_id] = path
        return cache[case_id]

    return get


def load_kwargs(case: FileCase) -> dict:
    """What the tiny file needs beyond the defaults: the config keys its shapes cannot tell, and for files without
    (some) input scales the per-call scales."""
    kwargs: dict = {"config": dict(FAMILIES[case.family].config)} if FAMILIES[case.family].config else {}
    if case.input_scales != "all":
        kwargs["dynamic_input_scale"] = True
    if case.convention == "bare":
        kwargs.update(scale_layout="128x4", nibble_order="hi_first")
    return kwargs


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# The writers: this package's writes comfy-kitchen's bytes.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case_id", ["flux2-markers+header-prefix", "klein-markers-prefix-no_input_scales",
                                     "qwen-header-prefix-some_input_scales", "qwen_edit_2511-markers+header-prefix",
                                     "qwen_layered-header", "qwen21-markers+header-prefix", "flux2-bare"])
def test_package_writer_writes_comfy_kitchens_bytes(case_id, files, sources, tmp_path):
    """Every family, every marker style: the writer's own quantizer gives comfy-kitchen's file bytes."""
    case = CASES[case_id]
    ours = tmp_path / "package.safetensors"
    write_case(sources(case.family), case, ours, quantize=comfy_quantize)
    assert sha256(ours) == sha256(files(case_id))


def test_comfy_kitchen_facts_the_loader_relies_on():
    """What comfy-kitchen 0.2.40 itself says a ComfyUI NVFP4 layer holds: the suffixes, dtypes and shapes, high
    nibble first, block scales in the 128x4 layout (format.swizzle_scales), and weight_scale_2 = amax / (448 * 6), the
    scale that multiplies the decoded values."""
    from comfy_kitchen.backends.eager.quantization import dequantize_nvfp4 as ck_deq
    from comfy_kitchen.float_utils import pack_uint4, to_blocked

    from support.comfy_files import ck_quantize

    torch.manual_seed(0)
    w = torch.randn(256, 64, dtype=torch.bfloat16)
    t = ck_quantize(w)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in t.items()} == {
        "weight": (torch.uint8, (256, 32)), "weight_scale": (torch.float8_e4m3fn, (256, 4)),
        "weight_scale_2": (torch.float32, ())}
    assert t["weight_scale_2"] == (w.abs().amax() / 2688.0).float()
    codes = torch.arange(16, dtype=torch.uint8).repeat(4).reshape(2, 32)
    assert torch.equal(pack_uint4(codes), (codes[:, 0::2] << 4) | codes[:, 1::2])  # element 2j: high nibble
    scales = torch.randint(0, 127, (200, 12), dtype=torch.uint8)
    from diffusers_nvfp4_fast.format import swizzle_scales

    assert torch.equal(to_blocked(scales, flatten=False), swizzle_scales(scales))
    assert torch.equal(unswizzle_scales(t["weight_scale"].view(torch.uint8), 256, 4),
                       unswizzle_scales(swizzle_scales(unswizzle_scales(t["weight_scale"].view(torch.uint8), 256, 4)),
                                        256, 4))
    dense = ck_deq(t["weight"], t["weight_scale_2"], t["weight_scale"], torch.float64)
    from diffusers_nvfp4_fast.format import swap_nibbles

    ours = decode_nvfp4(swap_nibbles(t["weight"]), t["weight_scale"], dtype=torch.float64)
    ours = ours * t["weight_scale_2"].double()
    assert torch.equal(dense, ours)
    assert (dense.float() - w.float()).norm() / w.float().norm() < 0.12  # it is the weight, not its inverse scale


def test_dequantize_takes_the_checkpoints_scalar_by_name():
    """A ComfyUI user passing the file's ``weight_scale_2`` gets comfy-kitchen's values byte for byte; the old
    positional call, whose scale was 1 / weight_scale_2, is refused, naming both choices."""
    import comfy_kitchen as ck

    from support.comfy_files import ck_quantize

    torch.manual_seed(1)
    t = ck_quantize(torch.randn(128, 96, dtype=torch.bfloat16))
    want = ck.dequantize_nvfp4(t["weight"], t["weight_scale_2"], t["weight_scale"], torch.float32)
    got = dequantize_nvfp4(t["weight"], t["weight_scale"], weight_scale_2=t["weight_scale_2"], nibble_order="hi_first")
    assert got.dtype == torch.float32 and torch.equal(got, want)
    got64 = dequantize_nvfp4(t["weight"], t["weight_scale"], weight_scale_2=t["weight_scale_2"],
                             nibble_order="hi_first", dtype=torch.float64)
    assert torch.equal(got64, ck_dequantize(t["weight"], t["weight_scale_2"], t["weight_scale"]))
    with pytest.raises(TypeError, match=r"weight_scale_2=.*global_scale=<1 / weight_scale_2>"):
        dequantize_nvfp4(t["weight"], t["weight_scale"], t["weight_scale_2"])
    with pytest.raises(TypeError, match="exactly one of weight_scale_2= .* and global_scale="):
        dequantize_nvfp4(t["weight"], t["weight_scale"])
    g = 1.0 / t["weight_scale_2"]
    assert torch.allclose(dequantize_nvfp4(t["weight"], t["weight_scale"], global_scale=g, nibble_order="hi_first"),
                          want, rtol=1e-6, atol=0)  # the encode scale divides: the same values up to rounding


# ---------------------------------------------------------------------------------------------------------------
# The matrix: inspect's exit status is the loader's verdict; every loaded layer is the producer's.
# ---------------------------------------------------------------------------------------------------------------


def dry_count(dry: dict) -> int:
    return sum(dry["nibble_order"].values())


def decoded_file(path: Path, case: FileCase) -> tuple[dict, dict, dict]:
    """The file's tensors under diffusers' names, as its producer's own code reads them: FP4 weights decoded by
    comfy-kitchen (float64) or diffusers (its BFL dequantize), everything else as stored; both mapped by diffusers'
    own converter. Returns (dense FP4 weights, plain tensors, {diffusers Linear: (weight_scale_2, input_scale)})."""
    from diffusers.quantizers.bfl.utils import dequantize_nvfp4 as diffusers_dequantize

    stored = {k.removeprefix(case.prefix): v for k, v in load_file(str(path)).items()}
    stored = {k: v for k, v in stored.items() if not k.endswith(MARKER_KEYS)}
    fp4 = {k[: -len(".weight_scale_2")] for k in stored if k.endswith(".weight_scale_2")}
    convert = single_file_converter(CLASS[case.family])
    dense, scalars = {}, {}
    for m in fp4:
        w, ws, ws2 = stored.pop(f"{m}.weight"), stored.pop(f"{m}.weight_scale"), stored.pop(f"{m}.weight_scale_2")
        value = (diffusers_dequantize(w, ws, ws2) if case.convention == "diffusers" else ck_dequantize(w, ws2, ws))
        input_scale = stored.pop(f"{m}.input_scale", None)
        for target, tensor in convert({f"{m}.weight": value}).items():
            dense[target] = tensor
            scalars[target.removesuffix(".weight")] = (ws2, input_scale)
    return dense, convert(stored), scalars


def our_dense(layer: NVFP4Linear, convention: str) -> torch.Tensor:
    if convention == "diffusers":
        from diffusers.quantizers.bfl.utils import dequantize_nvfp4 as diffusers_dequantize

        n, k = layer.out_features, layer.in_features
        scales = unswizzle_scales(layer.weight_scale, n, k // 16) if layer.scale_layout == "128x4" else \
            layer.weight_scale.view(torch.uint8)
        return diffusers_dequantize(layer.weight, scales.view(torch.float8_e4m3fn), layer.weight_scale_2)
    decoded = decode_nvfp4(layer.weight, layer.weight_scale, scale_layout=layer.scale_layout, dtype=torch.float64)
    return decoded * layer.weight_scale_2.double()


def check_verdict(case: FileCase, path: Path, capsys):
    """``load_nvfp4_transformer(path)`` with default arguments (plus the config keys the tiny shapes cannot tell)
    loads exactly the files it should, and ``inspect`` exits 1 exactly when it refuses, naming what to pass. Returns
    the model it loaded, or None."""
    config = FAMILIES[case.family].config
    model = None
    try:
        model = load_nvfp4_transformer(path, **({"config": config} if config else {}))
        loads, message = True, ""
    except NVFP4CheckpointError as e:
        loads, message = False, str(e)
    assert loads == case.loads, message
    assert cli_main(["inspect", str(path), "--json"]) == (0 if loads else 1)
    facts = json.loads(capsys.readouterr().out)
    assert bool(facts["refusals"]) == (not loads)
    dry = facts["loader_dry_run"]
    assert dry["class"] == CLASS[case.family] and dry["family_evidence"] and dry["converter"].startswith("diffusers'")
    if case.convention == "comfy":
        assert dry["convention"].startswith("ComfyUI") and dry["nibble_order"] == {"hi_first": dry_count(dry)}
    elif case.convention == "diffusers":
        assert dry["convention"] == "diffusers BFLQuantizationConfig" and "quantization='nvfp4'" in \
            dry["convention_evidence"] and dry["scale_layout"] == {"linear": dry_count(dry)}
    if case.convention == "bare":
        assert 'scale_layout="128x4", nibble_order="hi_first"' in message
        assert 'scale_layout="linear", nibble_order="lo_first"' in message
    elif case.input_scales != "all":
        assert "input_scales=" in message and "dynamic_input_scale=True" in message
        assert "input_scales=" in facts["refusals"][0]
    assert "FLUX.2 transformer?" not in message + json.dumps(facts)
    return model


@pytest.mark.parametrize("case_id", list(CASES))
def test_file_matrix(case_id, files, sources, capsys):
    """Per file: the loader's verdict and inspect's exit status; then (loaded with what it needs) every NVFP4 layer
    decodes to its producer's values, and BF16 tensors, scalars and the config are the file's."""
    case = CASES[case_id]
    path = files(case_id)
    model = check_verdict(case, path, capsys) or load_nvfp4_transformer(path, **load_kwargs(case))
    dense, plain, scalars = decoded_file(path, case)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    assert sorted(layers) == sorted(scalars) and layers
    for name, layer in layers.items():
        assert torch.equal(our_dense(layer, case.convention), dense[f"{name}.weight"]), name
        ws2, input_scale = scalars[name]
        assert torch.equal(layer.weight_scale_2, ws2.reshape(()).float()), name
        if input_scale is not None:
            assert torch.equal(layer.input_scale, input_scale.reshape(()).float()), name
        assert layer.dynamic_input_scale == (input_scale is None), name
    state = model.state_dict()
    assert all(state[k].dtype == v.dtype and torch.equal(state[k], v) for k, v in plain.items())
    quantized = {f"{n}.{s}" for n in layers for s, _ in layers[n].named_parameters()}
    assert {k for k, v in state.items() if v.is_floating_point() and k not in quantized
            and not k.endswith(("weight_scale", "weight_scale_2", "input_scale"))} <= set(plain)
    config = dict(model.config)
    for key, value in sources(case.family).model.config.items():
        if not key.startswith("_"):
            assert config[key] == (list(value) if isinstance(value, tuple) else value) or config[key] == value, key
    summary = load_summary(model)
    assert summary["class"] == CLASS[case.family] and summary["format"] == "single_file"


def test_dropping_an_input_scale_is_named_and_calibration_fills_it(files, sources):
    case = CASES["qwen-header-prefix-some_input_scales"]
    path = files(case.id)
    with pytest.raises(NVFP4CheckpointError, match="2 NVFP4 layer\\(s\\) have no input_scale") as info:
        load_nvfp4_transformer(path)
    names = [line.strip() for line in str(info.value).splitlines()[-2:]]
    amax = sources(case.family).amax
    model = load_nvfp4_transformer(path, input_scales={n: amax[n] / 2688.0 for n in names})
    assert load_summary(model)["input_scale_sources"]["input_scales"] == 2


# ---------------------------------------------------------------------------------------------------------------
# Pipelines: fast paths on == off == off again, the fused sites running.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("fresh_verdicts")
@pytest.mark.parametrize("case_id", ["flux2-markers+header-prefix", "qwen-markers+header-prefix",
                                     "qwen21-markers+header-prefix"])
def test_pipeline_off_on_off(case_id, files):
    """One pipeline per model class here (klein shares FLUX.2's, Edit-2511 Qwen-Image's: the GPU test runs them,
    tests/test_pipeline_matrix.py runs their pipelines on the CPU)."""
    case = CASES[case_id]
    pipe, kwargs = FAMILIES[case.family].pipeline(load_nvfp4_transformer(files(case_id), **load_kwargs(case)))
    pipe.set_progress_bar_config(disable=True)
    off = images_sha256(generate(pipe, kwargs, steps=1))
    enable_fast_paths(pipe)
    on = images_sha256(generate(pipe, kwargs, steps=1))
    entry = fast_path_report(pipe)[CLASS[case.family]]
    disable_fast_paths(pipe)
    assert images_sha256(generate(pipe, kwargs, steps=1)) == on == off
    assert entry["fused_calls"] and entry["verifications"]["failed"] == 0, entry
    assert sum(entry["fused_calls"].values()) >= len(entry["sites"]) > 0, entry


# ---------------------------------------------------------------------------------------------------------------
# diffusers' BFL files against diffusers' own loader; ModelOpt's single file; conventions never confused.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case_id", ["flux2-diffusers", "qwen-diffusers"])
def test_diffusers_bfl_file_loads_what_diffusers_loads(case_id, files, sources, tmp_path):
    import diffusers
    from diffusers import BFLQuantizationConfig
    from diffusers.quantizers.bfl.utils import dequantize_nvfp4 as diffusers_dequantize

    case = CASES[case_id]
    sources(case.family).model.save_config(tmp_path / "config")
    cls = getattr(diffusers, CLASS[case.family])
    theirs = cls.from_single_file(str(files(case_id)), config=str(tmp_path / "config"),
                                  quantization_config=BFLQuantizationConfig(), torch_dtype=torch.bfloat16)
    ours = load_nvfp4_transformer(files(case_id))
    converted = {n: m for n, m in theirs.named_modules() if type(m).__name__ == "BFLNVFP4Linear"}
    assert converted and sorted(converted) == sorted(n for n, m in ours.named_modules() if isinstance(m, NVFP4Linear))
    for name, layer in converted.items():
        mine = ours.get_submodule(name)
        want = diffusers_dequantize(layer.weight, layer.weight_scale, layer.weight_scale_2)
        assert torch.equal(our_dense(mine, "diffusers"), want), name
        assert torch.equal(mine.input_scale, layer.input_scale), name
        assert torch.equal(mine.weight_scale_2, layer.weight_scale_2), name
    theirs_plain = {k: v for k, v in theirs.state_dict().items() if k.rsplit(".", 1)[0] not in converted}
    mine_state = ours.state_dict()
    assert all(torch.equal(mine_state[k], v) for k, v in theirs_plain.items())


def test_modelopt_single_file_needs_its_declaration_then_loads_as_its_directory(modelopt_exports, capsys):
    from test_loader_bfl import assert_same_model

    export = modelopt_exports("flux2")
    path = export / "diffusion_pytorch_model.safetensors"
    with pytest.raises(NVFP4CheckpointError) as info:
        load_nvfp4_transformer(path)
    message = str(info.value)
    assert "fit only the linear layout" in message and 'scale_layout="linear", nibble_order="lo_first"' in message
    assert "cannot infer" not in message
    assert cli_main(["inspect", str(path)]) == 1
    assert "verdict: load_nvfp4_transformer refuses" in capsys.readouterr().out
    model = load_nvfp4_transformer(path, scale_layout="linear", nibble_order="lo_first")
    assert_same_model(model, load_nvfp4_transformer(export))


def test_an_argument_overrides_a_convention_and_is_checked_against_the_shapes(files):
    """A convention is a default: an argument overrides it (an explicit flag it may not, tests/test_loader_bfl.py),
    and the shapes still have to fit."""
    path = files("flux2-markers")
    with pytest.raises(NVFP4CheckpointError, match="taken as linear \\(argument\\)"):
        load_nvfp4_transformer(path, scale_layout="linear")


def test_both_conventions_in_one_file_are_refused(files, tmp_path):
    from safetensors.torch import save_file

    tensors = load_file(str(files("flux2-markers")))
    path = tmp_path / "both.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "quantization": "nvfp4"})
    with pytest.raises(NVFP4CheckpointError, match="both ComfyUI's quantization metadata and diffusers' BFL header "
                                                   "\\(11 comfy_quant marker\\(s\\); header quantization='nvfp4'"):
        load_nvfp4_transformer(path)
    model = load_nvfp4_transformer(path, scale_layout="128x4", nibble_order="hi_first")
    assert set(load_summary(model)["nibble_order"]) == {"hi_first"}


# ---------------------------------------------------------------------------------------------------------------
# Family, config, zero_cond_t: what the file tells and what to pass.
# ---------------------------------------------------------------------------------------------------------------


def test_family_errors_name_what_to_pass(files, tmp_path, sources):
    from safetensors.torch import save_file

    path = files("qwen-markers")
    flux_config = {"_class_name": "Flux2Transformer2DModel", "num_layers": 1}
    with pytest.raises(NVFP4CheckpointError, match="config= is a Flux2Transformer2DModel config, but the file's keys "
                                                   "are Qwen-Image's"):
        load_nvfp4_transformer(path, config=flux_config)
    other = tmp_path / "other.safetensors"
    save_file({"blocks.0.attn.qkv.weight": torch.zeros(4, 4)}, str(other))
    with pytest.raises(NVFP4CheckpointError, match="cannot tell which transformer this file holds.*pass config= with "
                                                   "the _class_name"):
        load_nvfp4_transformer(other)
    assert cli_main(["inspect", str(other)]) == 1


def test_config_from_a_dict_a_file_a_directory_or_a_repo(files, sources, tmp_path, monkeypatch):
    import huggingface_hub

    case = CASES["qwen21-markers+header-prefix"]
    path = files(case.id)
    source = sources(case.family).model
    (tmp_path / "pipe" / "transformer").mkdir(parents=True)
    source.save_config(tmp_path / "pipe" / "transformer")
    downloads = []

    def fake_download(repo_id, filename, subfolder=None, **kwargs):
        downloads.append((repo_id, filename, subfolder))
        return str(tmp_path / "pipe" / (subfolder or "") / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    want = {k: v for k, v in source.config.items() if not k.startswith("_")}
    for config in ({"axes_dims_rope": [32, 48, 48]}, tmp_path / "pipe" / "transformer" / "config.json",
                   tmp_path / "pipe", "org/qwen-image-2.1", "org/qwen-image-2.1/transformer"):
        model = load_nvfp4_transformer(path, config=config)
        got = {k: model.config[k] for k in want}
        assert json.loads(json.dumps(got)) == json.loads(json.dumps(want)), config
        assert "axes_dims_rope" not in load_summary(model)["assumed"]
    assert downloads == [("org/qwen-image-2.1", "config.json", "transformer")] * 2
    default = load_nvfp4_transformer(path)
    assert list(default.config["axes_dims_rope"]) == [16, 56, 56]  # what the shapes cannot tell: diffusers' default
    assert "axes_dims_rope" in load_summary(default)["assumed"]


def test_zero_cond_t_is_read_from_comfyuis_marker(files, capsys):
    path = files("qwen_edit_2511-markers+header-prefix")
    model = load_nvfp4_transformer(path)
    assert model.config["zero_cond_t"] is True and "zero_cond_t" not in load_summary(model)["assumed"]
    assert "Qwen-Image-Edit-2511" in load_summary(model)["variant"]
    with pytest.raises(NVFP4CheckpointError, match="__index_timestep_zero__ .*zero_cond_t=False"):
        load_nvfp4_transformer(path, config={"zero_cond_t": False})
    plain = load_nvfp4_transformer(files("qwen-markers"))
    assert plain.config["zero_cond_t"] is False and "zero_cond_t" in load_summary(plain)["assumed"]
    assert load_nvfp4_transformer(files("qwen-markers"), config={"zero_cond_t": True}).config["zero_cond_t"] is True
    layered = load_nvfp4_transformer(files("qwen_layered-header"))
    assert layered.config["use_additional_t_cond"] and layered.config["use_layer3d_rope"]
    assert "Qwen-Image-Layered" in load_summary(layered)["variant"]


def test_diffusers_single_file_table_has_the_converters_used_here():
    """The one diffusers internal read (``loaders/bfl/naming.py``): each class's ``checkpoint_mapping_fn`` in
    ``SINGLE_FILE_LOADABLE_CLASSES`` as diffusers 0.42.1 has it."""
    from diffusers_nvfp4_fast.loaders.bfl.naming import converter_name, diffusers_targets

    assert converter_name("Flux2Transformer2DModel") == "diffusers' convert_flux2_transformer_checkpoint_to_diffusers"
    assert converter_name("QwenImageTransformer2DModel").startswith("diffusers' identity mapping")
    assert diffusers_targets("QwenImage21Transformer2DModel", "transformer_blocks.0.img_mlp.gate_up.weight") == (
        ("transformer_blocks.0.img_mlp.gate_layer.weight", ((0, 6),)),
        ("transformer_blocks.0.img_mlp.proj.weight", ((6, 12),)))
    assert diffusers_targets("Flux2Transformer2DModel", "final_layer.adaLN_modulation.1.weight") == (
        ("norm_out.linear.weight", ((6, 12), (0, 6))),)


# ---------------------------------------------------------------------------------------------------------------
# GPU: the same files (this package's writer: comfy-kitchen's bytes) with the fast paths and the CUDA-graph runner.
# ---------------------------------------------------------------------------------------------------------------


# Qwen-Image 2.1's pipeline passes its KV cache object to every transformer call: the runner runs those eagerly.
KV_CACHE_CALLS = {"qwen21": "argument kwargs['kv_cache'] is a QwenImage21KVCache"}
# With zero_cond_t (Edit-2511), diffusers 0.42.1's forward builds modulate_index with torch.tensor(list, device=...)
# at every call, a host-to-device copy that a CUDA graph cannot capture: the runner runs those calls eagerly.
UNCAPTURABLE = {"qwen_edit_2511"}


@pytest.mark.gpu
@pytest.mark.usefixtures("fresh_verdicts")
@pytest.mark.parametrize("family", ["flux2", "klein", "qwen", "qwen_edit_2511", "qwen21"])
def test_gpu_comfy_files_with_fast_paths_and_cuda_graphs(family, tmp_path):
    """Written by ``support.comfy_writer.comfy_quantize`` (the CPU tests prove its bytes are comfy-kitchen's), loaded
    onto the GPU; the same PNG with fast paths off, on with every transformer call replayed from a CUDA graph
    (Qwen-Image 2.1: eager, its KV cache), and off again."""
    case = FileCase(f"{family}-gpu", family, prefix="model.diffusion_model.")
    path = tmp_path / "model.safetensors"
    write_case(make_source(FAMILIES[family]), case, path, quantize=comfy_quantize)
    model = load_nvfp4_transformer(path, device="cuda", **load_kwargs(case))
    pipe, kwargs = FAMILIES[family].pipeline(model)
    pipe.to("cuda")
    pipe.set_progress_bar_config(disable=True)
    off = images_sha256(generate(pipe, kwargs))
    enable_fast_paths(pipe, cuda_graphs=True)
    on = [images_sha256(generate(pipe, kwargs)) for _ in range(2)]  # the second run replays the captured graphs
    report = fast_path_report(pipe)[CLASS[family]]
    disable_fast_paths(pipe)
    assert on == [off, off] and images_sha256(generate(pipe, kwargs)) == off
    graphs = report["cuda_graphs"]
    if family in KV_CACHE_CALLS:
        assert set(graphs["eager_calls"]) == {KV_CACHE_CALLS[family]} and graphs["replays"] == 0, graphs
    elif family in UNCAPTURABLE:
        reasons = graphs["eager_calls"]
        print("eager calls:", reasons)
        assert graphs["graphs"] == graphs["replays"] == 0 and reasons, graphs
        assert all(reason.startswith("capture failed: ") for reason in reasons), reasons
    else:
        assert graphs["replays"] > 0 and graphs["eager_calls"] == {}, graphs
    assert report["verifications"]["failed"] == 0, report
