"""In-memory ModelOpt models -> NVFP4Linear: byte-identical to what ``export_hf_checkpoint`` writes for the same model.

Quantization of the tiny FLUX.2 model is deterministic (seeded weights and calibration batches), so the model that is
exported and the model that is converted are two identical quantizations (a compressed model cannot be deep-copied).
The q/k/v weights have different amaxes, so the exporter's QKV fusion re-rounds k's and v's block scales.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffusers_nvfp4_fast.format import swizzle_scales
from diffusers_nvfp4_fast.linear import NVFP4Linear
from diffusers_nvfp4_fast.loaders import NVFP4CheckpointError, load_nvfp4_transformer
from diffusers_nvfp4_fast.loaders.modelopt_memory import convert_modelopt_model, has_modelopt_modules
from support.bfl_files import export_modelopt, quantize_tiny_flux2


def _compressed(**kwargs):
    import modelopt.torch.quantization as mtq

    model = quantize_tiny_flux2(True, bf16_txt_qkv=False, **kwargs)
    mtq.compress(model)
    return model


@pytest.fixture(scope="session")
def compressed_export(tmp_path_factory) -> Path:
    return export_modelopt(_compressed(), tmp_path_factory.mktemp("mo_compressed") / "export", copy_first=False)


@pytest.fixture(scope="session")
def fake_quant_export(tmp_path_factory) -> Path:
    return export_modelopt(quantize_tiny_flux2(True, bf16_txt_qkv=False), tmp_path_factory.mktemp("mo_fake") / "export")


def assert_same_tensors(a, b) -> None:
    ta = {**a.state_dict(), **dict(a.named_buffers())}
    tb = {**b.state_dict(), **dict(b.named_buffers())}
    assert sorted(ta) == sorted(tb)
    differ = [k for k in ta
              if ta[k].dtype != tb[k].dtype or ta[k].shape != tb[k].shape or not torch.equal(ta[k], tb[k])]
    assert not differ, f"tensors differ: {differ}"
    kinds = lambda m: {n: (type(x).__name__, getattr(x, "scale_layout", None)) for n, x in m.named_modules()  # noqa: E731
                       if isinstance(x, (torch.nn.Linear, NVFP4Linear))}
    assert kinds(a) == kinds(b)


def test_compressed_model_converts_to_the_export_bytes(compressed_export):
    model = _compressed()
    attn = model.transformer_blocks[0].attn
    # The fusion path is exercised: the members of a q/k/v group were compressed with different global scales.
    assert not torch.equal(attn.to_q.weight_quantizer._double_scale, attn.to_k.weight_quantizer._double_scale)
    assert has_modelopt_modules(model)
    converted = convert_modelopt_model(model)
    assert converted is model and not has_modelopt_modules(model)
    assert_same_tensors(model, load_nvfp4_transformer(compressed_export))
    assert model.transformer_blocks[0].attn.to_k.input_scale_source == "modelopt"


def test_fake_quant_model_converts_to_the_export_bytes(fake_quant_export, compressed_export):
    model = convert_modelopt_model(quantize_tiny_flux2(True, bf16_txt_qkv=False))
    assert_same_tensors(model, load_nvfp4_transformer(fake_quant_export))
    # Compressed and fake-quant exports agree except where the QKV fusion re-rounds k/v block scales of packed weights.
    a, b = load_nvfp4_transformer(fake_quant_export), load_nvfp4_transformer(compressed_export)
    assert torch.equal(a.transformer_blocks[0].attn.to_q.weight, b.transformer_blocks[0].attn.to_q.weight)
    assert not torch.equal(a.transformer_blocks[0].attn.to_k.weight_scale,
                           b.transformer_blocks[0].attn.to_k.weight_scale)


def test_tensorrt_llm_swizzled_block_scales(compressed_export):
    # On Blackwell with TensorRT-LLM, compress stores the block scale as a flat 128x4-swizzled uint8 tensor.
    model = _compressed()
    for module in model.modules():
        wq = getattr(module, "weight_quantizer", None)
        if wq is not None and getattr(wq, "_scale", None) is not None:
            wq._scale = swizzle_scales(wq._scale.view(torch.uint8)).flatten()
    assert_same_tensors(convert_modelopt_model(model), load_nvfp4_transformer(compressed_export))


def test_uncalibrated_input_is_an_error_unless_dynamic():
    import modelopt.torch.quantization as mtq

    model = _compressed()
    mtq.disable_quantizer(model, lambda n: n == "single_transformer_blocks.0.attn.to_out.input_quantizer")
    with pytest.raises(NVFP4CheckpointError,
                       match=r"single_transformer_blocks\.0\.attn\.to_out: .*dynamic_input_scale=True"):
        convert_modelopt_model(model)
    assert has_modelopt_modules(model)  # nothing was changed
    convert_modelopt_model(model, dynamic_input_scale=True)
    layer = model.single_transformer_blocks[0].attn.to_out
    assert isinstance(layer, NVFP4Linear) and layer.dynamic_input_scale and torch.isnan(layer.input_scale)
    assert sum(getattr(m, "dynamic_input_scale", False) for m in model.modules()) == 1


def test_has_modelopt_modules_is_false_for_plain_and_loaded_models(compressed_export):
    from diffusers_nvfp4_fast.testing.tiny import tiny_flux2_transformer

    assert not has_modelopt_modules(tiny_flux2_transformer(True))
    assert not has_modelopt_modules(load_nvfp4_transformer(compressed_export))
