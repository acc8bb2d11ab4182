"""LoRA on NVFP4 transformers (diffusers' ``load_lora_weights`` / ``set_adapters`` / ``unload_lora_weights``, peft
underneath): the low-rank branch runs beside the packed weight exactly as peft's ``Linear`` runs it on a BF16 layer,
fused sites with a LoRA'd consumer fall back (reason "lora"), the PNG is the same with fast paths on and off, and
``fuse_lora`` is refused. LoRA files are made here with peft on the tiny BF16 transformers."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft", reason="peft is not installed, so the LoRA tests did not run; they run wherever "
                                   "peft is installed, as in CI (pip install -e '.[test]')")

from diffusers_nvfp4_fast import disable_fast_paths, enable_fast_paths, fast_path_report
from diffusers_nvfp4_fast.linear import NVFP4Linear
from diffusers_nvfp4_fast.testing import tiny
from diffusers_nvfp4_fast.utils import png_sha256, run_pipeline
from support.modelopt_exports import nvfp4_pipeline

pytestmark = pytest.mark.usefixtures("fresh_verdicts")

# peft matches a list by name suffix and a string as a regex of the whole name (FLUX.2's double-stream "to_out" is a
# ModuleList, its single-stream "to_out" a Linear).
SINGLE_TO_OUT = r".*single_transformer_blocks\.\d+\.attn\.to_out"
TARGETS = {
    "flux2": rf".*(to_q|to_k|to_v|to_qkv_mlp_proj|linear_in|linear_out|x_embedder)|{SINGLE_TO_OUT}",
    "qwen": ["to_q", "to_k", "to_v", "to_out.0", "to_add_out", "proj", "net.2", "img_in"],
}
MODEL_CLASS = {"flux2": "Flux2Transformer2DModel", "qwen": "QwenImageTransformer2DModel"}
SITE = {"flux2": "flux2_token_cat", "qwen": "qwen_resnorm"}


def lora_state_dict(which: str, targets: list[str] | str, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random rank-4 LoRA for the tiny ``which`` transformer, in diffusers' ``transformer.``-prefixed peft format."""
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    base = tiny.tiny_qwen_transformer() if which == "qwen" else tiny.tiny_flux2_transformer(True)
    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=4, target_modules=targets, init_lora_weights=False)
    model = inject_adapter_in_model(config, base)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.05)
    return {f"transformer.{k}": v.to(torch.bfloat16) for k, v in get_peft_model_state_dict(model).items()}


def _pipeline(which, modelopt_exports):
    return nvfp4_pipeline(which, modelopt_exports(which))


def _sha(pipe, kwargs) -> str:
    return png_sha256(run_pipeline(pipe, kwargs))


@pytest.mark.parametrize("which", ["flux2", "qwen"])
def test_load_set_unload_and_fast_paths_on_equals_off(which, modelopt_exports):
    pipe, kwargs = _pipeline(which, modelopt_exports)
    plain = _sha(pipe, kwargs)
    pipe.load_lora_weights(lora_state_dict(which, TARGETS[which]), adapter_name="style")
    lora_layers = [m for m in pipe.transformer.modules() if type(m).__name__ == "NVFP4LoraLinear"]
    assert lora_layers, "peft did not wrap any NVFP4Linear"
    with_lora = _sha(pipe, kwargs)
    assert with_lora != plain, "the LoRA changed nothing: the test could not tell a missing branch"

    report = enable_fast_paths(pipe)[MODEL_CLASS[which]]
    assert _sha(pipe, kwargs) == with_lora
    report = fast_path_report(pipe)[MODEL_CLASS[which]]
    assert any(k.startswith(f"{SITE[which]}: lora") for k in report["fallbacks"]), report["fallbacks"]

    pipe.set_adapters(["style"], [0.5])
    half = _sha(pipe, kwargs)
    disable_fast_paths(pipe)
    assert half not in (with_lora, plain) and _sha(pipe, kwargs) == half

    pipe.unload_lora_weights()
    assert not any(type(m).__name__ == "NVFP4LoraLinear" for m in pipe.transformer.modules())
    assert _sha(pipe, kwargs) == plain


def test_branch_is_peft_linear_semantics_in_the_model_dtype(modelopt_exports):
    """``NVFP4LoraLinear(x) == nvfp4(x) + lora_B(lora_A(x)) * scaling``, byte for byte, adapters in BF16."""
    pipe, _ = _pipeline("flux2", modelopt_exports)
    pipe.load_lora_weights(lora_state_dict("flux2", SINGLE_TO_OUT), adapter_name="a")
    layer = pipe.transformer.single_transformer_blocks[0].attn.to_out
    base = layer.get_base_layer()
    assert isinstance(base, NVFP4Linear) and layer.lora_A["a"].weight.dtype == torch.bfloat16
    x = torch.randn(5, base.in_features, dtype=torch.bfloat16)
    with torch.no_grad():
        want = base(x) + layer.lora_B["a"](layer.lora_A["a"](x)) * layer.scaling["a"]
        assert torch.equal(layer(x).view(torch.int16), want.view(torch.int16))


def test_lora_on_bf16_layers_only_loads(modelopt_exports):
    """A LoRA that touches only BF16 layers: loading used to fail in ``load_state_dict`` on any NVFP4 model."""
    pipe, kwargs = _pipeline("flux2", modelopt_exports)
    plain = _sha(pipe, kwargs)
    pipe.load_lora_weights(lora_state_dict("flux2", ["x_embedder", "proj_out"]), adapter_name="bf16")
    assert _sha(pipe, kwargs) != plain


def test_fuse_lora_is_refused_with_a_clear_message(modelopt_exports):
    pipe, _ = _pipeline("flux2", modelopt_exports)
    pipe.load_lora_weights(lora_state_dict("flux2", SINGLE_TO_OUT), adapter_name="a")
    with pytest.raises(RuntimeError, match="fuse_lora cannot merge a LoRA into an NVFP4 layer"):
        pipe.fuse_lora()
