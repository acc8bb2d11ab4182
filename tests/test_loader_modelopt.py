"""Loading real ModelOpt NVFP4 exports of the tiny FLUX.2 / klein / Qwen-Image transformers."""

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from diffusers_nvfp4_fast import NVFP4CheckpointError, NVFP4Linear, load_nvfp4_transformer, load_summary
from diffusers_nvfp4_fast.format import decode_nvfp4, swap_nibbles, unswizzle_scales
from diffusers_nvfp4_fast.loaders.common import is_excluded, scale_layout_from_shape
from diffusers_nvfp4_fast.testing import export
from support.modelopt_exports import base_transformer, pipeline_sha

WHICH = ["flux2", "klein", "qwen"]
EXPECTED_NVFP4 = {"flux2": 16, "klein": 16, "qwen": 28}


@pytest.mark.parametrize("which", WHICH)
def test_loaded_buffers_are_the_exported_bytes(which, modelopt_exports, caplog):
    path = modelopt_exports(which)
    sd = load_file(str(path / "diffusion_pytorch_model.safetensors"))
    with caplog.at_level(logging.INFO, logger="diffusers_nvfp4_fast"):
        model = load_nvfp4_transformer(path)
    assert f"{EXPECTED_NVFP4[which]} NVFP4 linears" in caplog.text
    layers = {n: m for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    assert len(layers) == EXPECTED_NVFP4[which]
    for name, layer in layers.items():
        assert layer.scale_layout == "128x4"
        assert torch.equal(layer.weight, sd[f"{name}.weight"])
        assert torch.equal(unswizzle_scales(layer.weight_scale, layer.out_features, layer.in_features // 16),
                           sd[f"{name}.weight_scale"].view(torch.uint8))
        assert layer.weight_scale_2.dtype == torch.float32 and torch.equal(layer.weight_scale_2,
                                                                           sd[f"{name}.weight_scale_2"])
        assert torch.equal(layer.input_scale, sd[f"{name}.input_scale"])
        assert torch.equal(layer.alpha, sd[f"{name}.input_scale"] * sd[f"{name}.weight_scale_2"])
        if layer.bias is not None:
            assert torch.equal(layer.bias, sd[f"{name}.bias"])
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            assert torch.equal(module.weight, sd[f"{name}.weight"].to(torch.bfloat16)), name
    # quantized layers never materialized in BF16: the state dict holds the packed bytes only
    assert all(v.dtype != torch.bfloat16 for k, v in model.state_dict().items() if k.rsplit(".", 1)[0] in layers and
               not k.endswith("bias"))


def _transformer_inputs(which, model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    c = model.config
    common = dict(hidden_states=torch.randn(1, 64, c.in_channels, generator=gen).bfloat16(),
                  encoder_hidden_states=torch.randn(1, 24, c.joint_attention_dim, generator=gen).bfloat16(),
                  timestep=torch.full((1,), 0.6).bfloat16(), return_dict=False)
    if which == "qwen":
        return dict(common, encoder_hidden_states_mask=torch.ones(1, 24, dtype=torch.int64), img_shapes=[[(1, 8, 8)]])
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(8.0), torch.arange(8.0), torch.zeros(1),
                                     indexing="ij"), -1)
    extra = {"guidance": torch.full((1,), 4.0)} if c.guidance_embeds else {}
    return dict(common, img_ids=ids.reshape(-1, 4), txt_ids=torch.zeros(24, 4), **extra)


def _rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


# Relative L2 error against the BF16 source, measured on this CPU (torch 2.13): transformer outputs flux2 0.04,
# klein 0.04, qwen 0.01; single layers at most 0.11. The bounds leave room for other BLAS builds.
OUTPUT_BOUND = {"flux2": 0.08, "klein": 0.08, "qwen": 0.03}
LAYER_BOUND = 0.15


@pytest.mark.parametrize("which", WHICH)
def test_nvfp4_close_to_bf16_source_and_wrong_nibble_order_is_far(which, modelopt_exports):
    model = load_nvfp4_transformer(modelopt_exports(which))
    base = base_transformer(which)
    inputs = _transformer_inputs(which, model)
    with torch.inference_mode():
        err = _rel_err(model(**inputs)[0], base(**inputs)[0])
        assert err < OUTPUT_BOUND[which], err
        for name, layer in model.named_modules():
            if not isinstance(layer, NVFP4Linear):
                continue
            source = base.get_submodule(name)
            x = torch.randn(64, layer.in_features).bfloat16() * layer.input_scale.item() * 2688 / 4
            assert _rel_err(layer(x), source(x)) < LAYER_BOUND, name
            layer.weight.data = swap_nibbles(layer.weight.data)
            assert _rel_err(layer(x), source(x)) > 0.5, name


def test_scales_read_in_the_wrong_layout_are_far():
    """Block scales must be read in the layout they are in: linear bytes taken as 128x4 (a missing swizzle) break
    a layer whose blocks have different magnitudes."""
    from diffusers_nvfp4_fast.format import quantize_nvfp4

    w = torch.randn(256, 128) * torch.exp2(torch.arange(256 * 8).reshape(256, 8) % 9).repeat_interleave(16, 1)
    w = w.bfloat16()
    ws2 = w.float().abs().max() / 2688
    packed, linear = quantize_nvfp4(w, 1 / ws2, scale_layout="linear", fast_math=False)
    good = NVFP4Linear(128, 256).load_nvfp4(packed, linear, ws2, torch.tensor(0.01), scale_layout="linear")
    bad = NVFP4Linear(128, 256).load_nvfp4(packed, linear, ws2, torch.tensor(0.01), scale_layout="128x4")
    x = torch.randn(8, 128).bfloat16()
    ref = x @ w.t()
    assert _rel_err(good(x), ref) < 0.15
    assert _rel_err(bad(x), ref) > 0.5
    good.swizzle_weight_scales_()
    assert good.scale_layout == "128x4" and not good.swizzle_weight_scales_()  # a second swizzle is impossible
    assert _rel_err(good(x), ref) < 0.15


def test_nvfp4_linear_matches_dequantized_weight_matmul(modelopt_exports):
    model = load_nvfp4_transformer(modelopt_exports("qwen"))
    layer = model.transformer_blocks[2].img_mlp.net[0].proj
    x = torch.randn(37, layer.in_features).bfloat16()
    from diffusers_nvfp4_fast.format import quantize_nvfp4

    xq, xs = quantize_nvfp4(x, layer.input_scale_inv)
    expected = (decode_nvfp4(xq, xs, dtype=torch.float32)
                @ decode_nvfp4(layer.weight, layer.weight_scale, dtype=torch.float32).t())
    expected = (expected * layer.alpha).bfloat16() + layer.bias
    assert torch.equal(layer(x), expected)


def test_exclude_patterns_match_parents_and_img_mod_spelling():
    assert is_excluded("transformer_blocks.3.img_mod.1", ["transformer_blocks.3.img_mod"])
    assert is_excluded("transformer_blocks.0.attn.to_q", ["transformer_blocks.0*"])
    assert is_excluded("norm_out.linear", ["norm_out*"])
    assert not is_excluded("transformer_blocks.2.attn.to_q", ["transformer_blocks.0*", "proj_out"])
    assert scale_layout_from_shape((3072, 192), 3072, 3072) == "ambiguous"
    assert scale_layout_from_shape((256, 4), 200, 48) == "128x4"
    assert scale_layout_from_shape((200, 3), 200, 48) == "linear"
    assert scale_layout_from_shape((200, 4), 200, 48) == "neither"


def test_hf_quant_config_json_form(modelopt_exports, tmp_path):
    src = modelopt_exports("klein")
    dst = tmp_path / "nested"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    ignore = config.pop("quantization_config")["ignore"]
    (dst / "config.json").write_text(json.dumps(config))
    (dst / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"},
         "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ignore}}))
    a, b = load_nvfp4_transformer(src), load_nvfp4_transformer(dst)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    (dst / "hf_quant_config.json").unlink()
    with pytest.raises(NVFP4CheckpointError, match="hf_quant_config.json"):
        load_nvfp4_transformer(dst)


def test_sharded_checkpoint(modelopt_exports, tmp_path):
    src = modelopt_exports("flux2")
    dst = tmp_path / "sharded"
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    sd = load_file(str(src / "diffusion_pytorch_model.safetensors"))
    keys = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for fname, ks in shards.items():
        save_file({k: sd[k] for k in ks}, str(dst / fname))
    (dst / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    a, b = load_nvfp4_transformer(src), load_nvfp4_transformer(dst)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def _corrupt(src, dst, edit):
    shutil.copytree(src, dst)
    f = dst / "diffusion_pytorch_model.safetensors"
    sd = load_file(str(f))
    edit(sd)
    save_file(sd, str(f))
    return dst


def test_every_problem_is_listed_in_one_error(modelopt_exports, tmp_path):
    def edit(sd):
        del sd["transformer_blocks.0.attn.to_k.input_scale"]
        sd["transformer_blocks.0.attn.to_q.weight_scale"] = sd["transformer_blocks.0.attn.to_q.weight_scale"].float()
        sd["transformer_blocks.0.ff.linear_in.weight"] = sd["transformer_blocks.0.ff.linear_in.weight"][:-1]
        sd["x_embedder.weight"] = sd["x_embedder.weight"][:, :2].contiguous()
        sd["something.else"] = torch.zeros(3)

    path = _corrupt(modelopt_exports("flux2"), tmp_path / "bad", edit)
    with pytest.raises(NVFP4CheckpointError) as info:
        load_nvfp4_transformer(path)
    msg = str(info.value)
    assert "5 problem(s)" in msg and "diffusion_pytorch_model.safetensors" in msg
    for needle in ("missing key transformer_blocks.0.attn.to_k.input_scale",
                   "transformer_blocks.0.attn.to_q.weight_scale in diffusion_pytorch_model.safetensors: "
                   "dtype torch.float32",
                   "transformer_blocks.0.ff.linear_in.weight in diffusion_pytorch_model.safetensors: "
                   "shape [191, 16], expected [192, 16]",
                   "x_embedder.weight in diffusion_pytorch_model.safetensors: shape [32, 2]",
                   "unexpected key something.else"):
        assert needle in msg, msg


def test_scales_already_swizzled_are_detected_by_shape_and_not_swizzled_again(modelopt_exports, tmp_path):
    from diffusers_nvfp4_fast.format import swizzle_scales

    def edit(sd):
        for k in list(sd):
            if k.endswith(".weight_scale"):
                sd[k] = swizzle_scales(sd[k]).view(torch.float8_e4m3fn)

    # Every tiny FLUX.2 layer has N % 128 or (K/16) % 4 nonzero, so the padded swizzled shape gives it away.
    path = _corrupt(modelopt_exports("klein"), tmp_path / "swizzled", edit)
    a, b = load_nvfp4_transformer(modelopt_exports("klein")), load_nvfp4_transformer(path)
    assert (load_summary(a)["scales_swizzled_on_load"] == 16
            and load_summary(b)["scales_swizzled_on_load"] == 0)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_model_to_dtype_keeps_fp32_scales(modelopt_exports):
    model = load_nvfp4_transformer(modelopt_exports("klein"))
    layer = next(m for m in model.modules() if isinstance(m, NVFP4Linear))
    before = layer.weight_scale_2.clone()
    model.to(torch.bfloat16)
    assert layer.weight_scale_2.dtype == torch.float32 and torch.equal(layer.weight_scale_2, before)


@pytest.mark.parametrize("which", WHICH)
def test_tiny_pipeline_is_deterministic_in_process_and_across_processes(which, modelopt_exports):
    path = modelopt_exports(which)
    model = load_nvfp4_transformer(path)
    first, second = pipeline_sha(which, model), pipeline_sha(which, model)
    assert first == second
    script = Path(__file__).parent / "support" / "modelopt_exports.py"
    out = subprocess.run([sys.executable, str(script), which, str(path)], capture_output=True, text=True, timeout=300)
    assert f"SHA {first}" in out.stdout, out.stdout + out.stderr


def test_tiny_exporter_writes_a_loadable_checkpoint(tmp_path):
    path = export.quantize_tiny_pipeline("klein", tmp_path / "klein")
    model = load_nvfp4_transformer(path)
    assert sum(isinstance(m, NVFP4Linear) for m in model.modules()) == 16


def test_load_summary_is_public_a_copy_and_refuses_a_model_it_did_not_load(modelopt_exports):
    model = load_nvfp4_transformer(modelopt_exports("flux2"))
    summary = load_summary(model)
    assert summary["format"] == "modelopt_export" and summary["class"] == "Flux2Transformer2DModel"
    assert summary["nvfp4_linears"] == sum(isinstance(m, NVFP4Linear) for m in model.modules()) > 0
    summary["nvfp4_linears"] = -1
    assert load_summary(model)["nvfp4_linears"] > 0
    with pytest.raises(ValueError, match="Linear was not loaded by load_nvfp4_transformer"):
        load_summary(torch.nn.Linear(2, 2))
