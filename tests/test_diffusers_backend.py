"""diffusers' own ``from_pretrained`` reads this package's checkpoints once ``diffusers_nvfp4_fast`` is imported, and
quantizes a BF16 transformer while loading it with ``quantization_config=NVFP4FastConfig(...)``: the same tensors,
layers and layouts as ``load_nvfp4_transformer`` (of ``quantize_transformer``'s output), the same PNG with fast paths
on; the registration keeps ``import diffusers_nvfp4_fast`` light and warns on a diffusers without what it uses; a
pipeline save that an NVFP4 model refuses writes nothing."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import diffusers_nvfp4_fast
from diffusers_nvfp4_fast import (
    NVFP4CheckpointError,
    NVFP4FastConfig,
    NVFP4Linear,
    enable_fast_paths,
    fast_path_report,
    load_nvfp4_transformer,
    quantize_transformer,
)
from diffusers_nvfp4_fast import diffusers_backend as backend
from diffusers_nvfp4_fast.testing import tiny
from diffusers_nvfp4_fast.utils import png_sha256, run_pipeline

PIPELINE = {"flux2": "Flux2Pipeline", "klein": "Flux2KleinPipeline", "qwen": "QwenImagePipeline"}
MODEL = {"flux2": "Flux2Transformer2DModel", "klein": "Flux2Transformer2DModel", "qwen": "QwenImageTransformer2DModel"}


def _diffusers(name: str):
    import diffusers

    return getattr(diffusers, name)


def _tensors(model) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def assert_same_model(reference, model) -> None:
    """Every parameter and buffer (non-persistent ones too) equal in dtype and bytes; the same module classes, scale
    layouts and per-call activation scales."""
    a, b = _tensors(reference), _tensors(model)
    assert sorted(a) == sorted(b)
    differ = [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
              or not torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))]
    assert not differ, differ[:8]

    def layers(m) -> dict:
        return {n: (type(x).__name__, getattr(x, "scale_layout", None), getattr(x, "dynamic_input_scale", None))
                for n, x in m.named_modules()}

    assert layers(reference) == layers(model)
    assert sum(isinstance(x, NVFP4Linear) for x in model.modules()) > 0


# --- the diffusers API this package uses ------------------------------------------------------------------------


def test_installed_diffusers_has_what_the_backend_uses():
    import importlib

    from diffusers_nvfp4_fast.loaders.common import PRODUCER

    assert backend.missing_api() == []
    for (module, qualname), calls in backend.CALL_SITES.items():
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        source = inspect.getsource(obj)
        assert not [c for c in calls if c not in source], (module, qualname)
    module, cls, method = backend.PIPELINE_SAVE
    parameters = inspect.signature(getattr(getattr(importlib.import_module(module), cls), method)).parameters
    assert set(backend.PIPELINE_SAVE_ARGUMENTS) <= set(parameters)
    assert backend.QUANT_METHOD == PRODUCER
    assert backend.is_registered()


def test_a_diffusers_without_the_tables_is_warned_and_left_alone(monkeypatch):
    import diffusers.quantizers.auto as auto

    monkeypatch.setattr(backend, "_WARNED", set())
    monkeypatch.delitem(auto.AUTO_QUANTIZER_MAPPING, backend.QUANT_METHOD)
    monkeypatch.delitem(auto.AUTO_QUANTIZATION_CONFIG_MAPPING, backend.QUANT_METHOD)
    monkeypatch.delattr(auto, "AUTO_QUANTIZER_MAPPING")
    with pytest.warns(RuntimeWarning, match=r"diffusers 0\.42\.1; diffusers \S+ lacks diffusers\.quantizers\.auto\."
                                            r"AUTO_QUANTIZER_MAPPING, so 'diffusers-nvfp4-fast' was NOT registered"):
        assert backend.register_quantizer() is False
    assert backend.QUANT_METHOD not in auto.AUTO_QUANTIZATION_CONFIG_MAPPING
    monkeypatch.undo()
    assert backend.is_registered()


def test_another_diffusers_release_registers_with_a_warning(monkeypatch):
    import diffusers
    import diffusers.quantizers.auto as auto

    monkeypatch.setattr(backend, "_WARNED", set())
    monkeypatch.delitem(auto.AUTO_QUANTIZER_MAPPING, backend.QUANT_METHOD)
    monkeypatch.setattr(diffusers, "__version__", "0.99.0")
    with pytest.warns(RuntimeWarning, match=r"diffusers 0\.99\.0 has every name it uses, so 'diffusers-nvfp4-fast' "
                                            r"was registered, but its calls are unchecked"):
        assert backend.register_quantizer() is True
    assert backend.is_registered()


_REPORT = "import sys\nprint('HEAVY', sorted(m for m in ('torch', 'diffusers') if m in sys.modules))\n"
_CHECK = ("import diffusers.quantizers.auto as auto\n"
          "print('REGISTERED', getattr(auto.AUTO_QUANTIZER_MAPPING.get('diffusers-nvfp4-fast'), '__name__', None))\n")
ORDERS = {
    # the package first (light), diffusers after: registered when diffusers imports its quantizers, which its model
    # loading (models/modeling_utils.py) does at import, so before any from_pretrained
    "package first": "import diffusers_nvfp4_fast\n" + _REPORT,
    # the public config class first: its module imports diffusers, and registers once the module is ready
    "config first": "from diffusers_nvfp4_fast import NVFP4FastConfig\n",
}


def test_registration_keeps_the_import_light_and_follows_diffusers_import():
    runs = {name: subprocess.Popen([sys.executable, "-c", code + _CHECK], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True) for name, code in ORDERS.items()}
    outputs = {name: (*run.communicate(timeout=120), run.returncode) for name, run in runs.items()}
    for name, (out, err, code) in outputs.items():
        assert code == 0 and "REGISTERED NVFP4FastQuantizer" in out, (name, out, err)
        assert "diffusers-nvfp4-fast" not in err, (name, err)  # no warning of ours
    assert "HEAVY []" in outputs["package first"][0]


def test_registration_with_diffusers_already_imported_is_immediate(monkeypatch):
    import diffusers.quantizers.auto as auto
    from diffusers.pipelines.pipeline_utils import DiffusionPipeline

    from diffusers_nvfp4_fast import registration

    monkeypatch.delitem(auto.AUTO_QUANTIZER_MAPPING, backend.QUANT_METHOD)
    monkeypatch.delitem(auto.AUTO_QUANTIZATION_CONFIG_MAPPING, backend.QUANT_METHOD)
    hooks = [f for f in sys.meta_path if isinstance(f, registration.AfterImport)]
    registration.install()
    assert backend.is_registered() and DiffusionPipeline.save_pretrained._nvfp4_guarded
    assert [f for f in sys.meta_path if isinstance(f, registration.AfterImport)] == hooks == []


# --- reading a saved checkpoint ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_pipelines(modelopt_exports, tmp_path_factory):
    """which -> (directory of ``pipe.save_pretrained`` of the tiny pipeline holding the real ModelOpt export,
    its call kwargs)."""
    cache: dict[str, tuple[Path, dict]] = {}

    def get(which: str) -> tuple[Path, dict]:
        if which not in cache:
            pipe, kwargs = tiny.TINY_PIPELINES[which](load_nvfp4_transformer(modelopt_exports(which)))
            path = tmp_path_factory.mktemp(f"saved_{which}") / "pipe"
            pipe.save_pretrained(path)
            cache[which] = (path, kwargs)
        return cache[which]

    return get


def _png(pipe, kwargs) -> str:
    pipe.set_progress_bar_config(disable=True)
    report = enable_fast_paths(pipe)
    png = png_sha256(run_pipeline(pipe, kwargs, size=32, steps=2))
    fused = fast_path_report(pipe)[type(pipe.transformer).__name__]["fused_calls"]
    assert report and sum(fused.values()) > 0, fused
    return png


@pytest.mark.parametrize("which", ["flux2", "qwen"])
def test_diffusers_from_pretrained_loads_a_saved_pipeline_as_the_loader_does(which, saved_pipelines):
    from diffusers import DiffusionPipeline

    path, kwargs = saved_pipelines(which)
    reference = load_nvfp4_transformer(path, subfolder="transformer")
    pipeline_cls, model_cls = _diffusers(PIPELINE[which]), _diffusers(MODEL[which])
    assert_same_model(reference, model_cls.from_pretrained(path, subfolder="transformer", dtype=torch.bfloat16))
    assert_same_model(reference, DiffusionPipeline.from_pretrained(path, dtype=torch.bfloat16).transformer)
    pipe = pipeline_cls.from_pretrained(path, dtype=torch.bfloat16)
    assert_same_model(reference, pipe.transformer)
    readme = pipeline_cls.from_pretrained(path, transformer=reference, dtype=torch.bfloat16)
    assert _png(pipe, kwargs) == _png(readme, kwargs)


def test_dtype_is_what_diffusers_passes(saved_pipelines):
    from diffusers import Flux2Transformer2DModel

    path, _ = saved_pipelines("flux2")
    default = Flux2Transformer2DModel.from_pretrained(path, subfolder="transformer")  # the loader's default: BF16
    assert_same_model(load_nvfp4_transformer(path, subfolder="transformer"), default)
    half = Flux2Transformer2DModel.from_pretrained(path, subfolder="transformer", torch_dtype=torch.float16)
    assert_same_model(load_nvfp4_transformer(path, subfolder="transformer", dtype=torch.float16), half)
    assert half.x_embedder.weight.dtype == torch.float16


def test_a_bad_checkpoint_is_refused_by_diffusers_as_by_the_loader(saved_pipelines, tmp_path):
    from diffusers import Flux2Transformer2DModel

    path, _ = saved_pipelines("flux2")
    config = json.loads((path / "transformer" / "config.json").read_text())
    config["quantization_config"]["weight_scale_layout"] = "linear"  # the stored scales are 128x4
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps(config))
    (tmp_path / "t" / "diffusion_pytorch_model.safetensors").symlink_to(
        path / "transformer" / "diffusion_pytorch_model.safetensors")
    with pytest.raises(NVFP4CheckpointError, match="is the 128x4 shape, but the scales are declared linear"):
        load_nvfp4_transformer(tmp_path / "t")
    with pytest.raises(NVFP4CheckpointError, match="is the 128x4 shape, but the scales are declared linear"):
        Flux2Transformer2DModel.from_pretrained(tmp_path / "t")
    with pytest.raises(ValueError, match="device_map='auto'.*loads onto one device"):
        Flux2Transformer2DModel.from_pretrained(path, subfolder="transformer", device_map="auto")


# --- quantizing while loading -----------------------------------------------------------------------------------


def _bf16_source(which: str, root: Path, pipeline: bool = False):
    """The tiny BF16 transformer saved in ``root / "bf16"``; with ``pipeline``, its pipeline and call kwargs."""
    if not pipeline:
        model = tiny.tiny_qwen_transformer() if which == "qwen" else tiny.tiny_flux2_transformer(which == "flux2")
        model.save_pretrained(root / "bf16")
        return None, {}
    pipe, kwargs = tiny.TINY_PIPELINES[which]()
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.save_pretrained(root / "bf16")
    return pipe, kwargs


def _input_scales(checkpoint: Path, path: Path) -> Path:
    """The ``input_scale`` of every NVFP4 layer of a checkpoint, as a JSON side file."""
    tensors = load_file(str(checkpoint / "diffusion_pytorch_model.safetensors"))
    scales = {k.rpartition(".")[0]: float(v) for k, v in tensors.items() if k.endswith(".input_scale")}
    path.write_text(json.dumps({"input_scales": scales}))
    return path


CASES = {  # (family, quantize_transformer's options; NVFP4FastConfig takes the same, with input_scales if calibrated)
    "flux2 dynamic": ("flux2", {"dynamic": True}),
    "qwen dynamic": ("qwen", {"dynamic": True}),
    "klein calibrated, exclude": ("klein", {"exclude": [*tiny.FLUX2_EXCLUDE, "single_transformer_blocks.1*"]}),
}


@pytest.mark.parametrize("case", CASES)
def test_quantize_on_load_equals_the_loaded_quantize_transformer_checkpoint(case, tmp_path):
    which, options = CASES[case]
    pipe, kwargs = _bf16_source(which, tmp_path, pipeline=not options.get("dynamic"))
    if options.get("dynamic"):
        quantize_transformer(tmp_path / "bf16", tmp_path / "nvfp4", progress=False, **options)
        config = NVFP4FastConfig(**options)
    else:
        call = {**{k: v for k, v in kwargs.items() if k != "prompt"}, "height": 32, "width": 32}
        quantize_transformer(tmp_path / "bf16", tmp_path / "nvfp4", pipeline=pipe, prompts=[kwargs["prompt"]],
                             call_kwargs=call, num_inference_steps=1, progress=False, **options)
        config = NVFP4FastConfig(input_scales=_input_scales(tmp_path / "nvfp4", tmp_path / "scales.json"),
                                 **options)
    reference = load_nvfp4_transformer(tmp_path / "nvfp4")
    model_cls = _diffusers(MODEL[which])
    quantized = model_cls.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16, quantization_config=config)
    assert_same_model(reference, quantized)
    assert_same_model(reference, model_cls.from_pretrained(tmp_path / "nvfp4"))  # its checkpoint, read by diffusers
    quantized.save_pretrained(tmp_path / "saved")
    assert_same_model(reference, load_nvfp4_transformer(tmp_path / "saved"))


def test_a_pipeline_quantizes_its_transformer_on_load(tmp_path):
    from diffusers import DiffusionPipeline, PipelineQuantizationConfig

    pipe, _ = tiny.tiny_klein_pipeline()
    pipe.save_pretrained(tmp_path / "pipe")
    quantize_transformer(tmp_path / "pipe", tmp_path / "nvfp4", subfolder="transformer", dynamic=True, progress=False)
    config = PipelineQuantizationConfig(quant_mapping={"transformer": NVFP4FastConfig(dynamic=True)})
    loaded = DiffusionPipeline.from_pretrained(tmp_path / "pipe", dtype=torch.bfloat16, quantization_config=config)
    assert_same_model(load_nvfp4_transformer(tmp_path / "nvfp4"), loaded.transformer)


def test_quantize_on_load_refuses_what_it_cannot_do(tmp_path):
    from diffusers import Flux2Transformer2DModel

    with pytest.raises(ValueError, match="either dynamic=True.*or input_scales="):
        NVFP4FastConfig()
    with pytest.raises(NVFP4CheckpointError, match=r"invalid input scales:\n  x: -1.0 is not a finite number > 0"):
        NVFP4FastConfig(input_scales={"x": -1.0})
    _bf16_source("flux2", tmp_path)
    scales = NVFP4FastConfig(input_scales={"x_embedder": 0.5, "transformer_blocks.0.attn.to_q": 0.5})
    with pytest.raises(NVFP4CheckpointError, match=r"names 1 layer\(s\) that are not quantized here: \['x_embedder'\].*"
                                                   r"lacks \d+ quantized layer\(s\).*dynamic=True"):
        Flux2Transformer2DModel.from_pretrained(tmp_path / "bf16", quantization_config=scales)
    with pytest.raises(ValueError, match=r"no Linear of this Flux2Transformer2DModel would become NVFP4: .*given by "
                                         r"the caller: \*\) match (\d+) of its \1 Linears; load it without"):
        Flux2Transformer2DModel.from_pretrained(tmp_path / "bf16",
                                                quantization_config=NVFP4FastConfig(dynamic=True, exclude=["*"]))


def test_the_config_is_public_and_serializable():
    config = NVFP4FastConfig(dynamic=True, exclude=["proj_out"])
    assert diffusers_nvfp4_fast.NVFP4FastConfig is NVFP4FastConfig and "NVFP4FastConfig" in diffusers_nvfp4_fast.__all__
    assert json.loads(json.dumps(config.to_dict())) == {"quant_method": "diffusers-nvfp4-fast", "dynamic": True,
                                                        "input_scales": None, "exclude": ["proj_out"]}
    assert config.quant_method.value == "diffusers-nvfp4-fast" and "NVFP4FastConfig" in repr(config)


# --- a pipeline save that an NVFP4 model refuses ----------------------------------------------------------------


def test_a_refused_pipeline_save_writes_nothing(modelopt_exports, tmp_path):
    pipe, _ = tiny.tiny_flux2_pipeline(load_nvfp4_transformer(modelopt_exports("flux2")))
    with pytest.raises(ValueError, match=r"Flux2Pipeline.save_pretrained\(.*\): its transformer "
                                         r"\(Flux2Transformer2DModel\) cannot be saved: .*safetensors only.*"
                                         r"nothing was written"):
        pipe.save_pretrained(tmp_path / "pipe", safe_serialization=False)
    assert not (tmp_path / "pipe").exists()
    pipe.save_pretrained(tmp_path / "pipe")
    assert (tmp_path / "pipe" / "transformer" / "config.json").is_file()


def test_a_pipeline_holding_a_lora_refuses_to_save_before_writing(modelopt_exports, tmp_path):
    pytest.importorskip("peft", reason="peft is not installed, so the LoRA save test did not run; "
                                       "it runs wherever peft is installed, as in CI (pip install -e '.[test]')")
    from test_lora import SINGLE_TO_OUT, lora_state_dict

    pipe, _ = tiny.tiny_flux2_pipeline(load_nvfp4_transformer(modelopt_exports("flux2")))
    pipe.load_lora_weights(lora_state_dict("flux2", SINGLE_TO_OUT), adapter_name="a")
    with pytest.raises(ValueError, match=r"its transformer .* holds a LoRA \(peft\).*nothing was written"):
        pipe.save_pretrained(tmp_path / "pipe")
    assert not (tmp_path / "pipe").exists()


# --- on the GPU: quantized on the device, the same bytes ---------------------------------------------------------


@pytest.mark.gpu
def test_gpu_quantize_and_load_on_the_device_give_the_cpu_bytes(saved_pipelines, tmp_path):
    from diffusers import Flux2Transformer2DModel

    path, _ = saved_pipelines("flux2")
    on_gpu = Flux2Transformer2DModel.from_pretrained(path, subfolder="transformer", device_map="cuda")
    assert on_gpu.x_embedder.weight.device.type == "cuda"
    assert_same_model(load_nvfp4_transformer(path, subfolder="transformer"), on_gpu.to("cpu"))
    _bf16_source("flux2", tmp_path)
    quantize_transformer(tmp_path / "bf16", tmp_path / "nvfp4", dynamic=True, progress=False)
    quantized = Flux2Transformer2DModel.from_pretrained(tmp_path / "bf16", device_map="cuda",
                                                        quantization_config=NVFP4FastConfig(dynamic=True))
    assert_same_model(load_nvfp4_transformer(tmp_path / "nvfp4"), quantized.to("cpu"))
