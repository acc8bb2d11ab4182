"""The README's Python blocks run as written, in order, on the tiny models: only the checkpoint paths and repo ids,
the image size and step count, and the tiny text encoder's layer choice are substituted. So the quick start cannot
drift from diffusers again."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_lora import SINGLE_TO_OUT, lora_state_dict

from diffusers_nvfp4_fast.testing import tiny
from support.bfl_files import write_bfl_file
from support.comfy_files import FAMILIES, FileCase, make_source, write_case
from support.comfy_writer import COMFY_PREFIX
from support.text_encoders import export_with_modelopt as export_text_encoder

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


@pytest.fixture(scope="module")
def files(modelopt_exports, tmp_path_factory) -> dict[str, str]:
    pytest.importorskip("peft", reason="peft is not installed, so the README's Python blocks (one loads a LoRA) "
                                       "did not run; they run wherever peft is installed, as in CI "
                                       "(pip install -e '.[test]')")
    tmp = tmp_path_factory.mktemp("readme")
    pipe, _ = tiny.tiny_flux2_pipeline()
    pipe.save_pretrained(tmp / "flux2-pipeline")
    export = modelopt_exports("flux2")
    write_bfl_file(export, tmp / "native.safetensors", nibble_order="lo_first", swizzle=False, markers=False,
                   header=False)
    comfy = {}
    for family, name in (("flux2", "flux2-dev-nvfp4.safetensors"), ("qwen", "qwen_image_nvfp4.safetensors")):
        comfy[name] = tmp / name  # written by comfy-kitchen's own quantizer in ComfyUI's layout
        write_case(make_source(FAMILIES[family]), FileCase(name, family, prefix=COMFY_PREFIX), comfy[name])
    lora = {k.removeprefix("transformer."): v for k, v in lora_state_dict("flux2", SINGLE_TO_OUT).items()}
    save_file({f"transformer.{k}": v.contiguous() for k, v in lora.items()}, str(tmp / "lora.safetensors"))
    return {
        '"path/to/flux2-dev-nvfp4"': repr(str(export)),
        '"black-forest-labs/FLUX.2-dev"': repr(str(tmp / "flux2-pipeline")),
        '"path/to/flux2-nvfp4-diffusers-layout.safetensors"': repr(str(tmp / "native.safetensors")),
        '"path/to/lora.safetensors"': repr(str(tmp / "lora.safetensors")),
        '"path/to/qwen-image-te-nvfp4"': repr(str(export_text_encoder("qwen2_5_vl", tmp / "qwen-image-te-nvfp4"))),
        **{f'"{name}"': repr(str(path)) for name, path in comfy.items()},
    }


def substitute(code: str, paths: dict[str, str]) -> str:
    for old, new in paths.items():
        code = code.replace(old, new)
    code = code.replace("height=1024, width=1024, num_inference_steps=28",
                        "height=64, width=64, num_inference_steps=2")
    # The tiny Mistral text encoder has 3 layers; FLUX.2's default reads layers 10, 20 and 30.
    return code.replace('prompt="a red fox in fresh snow",',
                        'prompt="a red fox in fresh snow", text_encoder_out_layers=(1, 2, 3),')


def test_readme_has_the_blocks_this_test_substitutes():
    text = "\n".join(python_blocks())
    for needle in ("load_nvfp4_transformer(", "BFLQuantizationConfig()", "load_lora_weights(", "num_inference_steps=28",
                   'prompt="a red fox in fresh snow",', '"flux2-dev-nvfp4.safetensors"',
                   '"qwen_image_nvfp4.safetensors"', "load_nvfp4_text_encoder("):
        assert needle in text, needle


def test_readme_python_blocks_run_in_order(files):
    namespace: dict = {}
    blocks = python_blocks()
    assert len(blocks) >= 3
    for i, block in enumerate(blocks):
        code = substitute(block, files)
        assert "path/to/" not in code and "black-forest-labs" not in code, f"block {i} kept a path:\n{code}"
        exec(compile(code, f"README.md python block {i}", "exec"), namespace)  # noqa: S102 - the README's own code
    assert isinstance(namespace["image"].size, tuple)
    assert type(namespace["qwen"]).__name__ == "QwenImageTransformer2DModel"  # the "Where to get checkpoints" lines
    assert type(namespace["text_encoder"]).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert type(namespace["flux2"]).__name__ == "Flux2Transformer2DModel"
    assert not any(type(m).__name__ == "NVFP4LoraLinear" for m in namespace["pipe"].transformer.modules())
    report = namespace["enable_fast_paths"](namespace["pipe"])["Flux2Transformer2DModel"]
    assert report["converted"] == {"diffusers BFLQuantizationConfig": report["nvfp4_linears"]} != {}
    assert torch.is_tensor(namespace["pipe"].transformer.single_transformer_blocks[0].attn.to_out.weight)
