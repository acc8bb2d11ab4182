"""``diffusers-nvfp4-fast quantize`` refuses nonsense before any work, in one line with exit status 2: a plan with no
NVFP4 layer (unless ``--allow-empty``), ``--steps 0``, a device this machine lacks, a subfolder that is not a
transformer; and it reads image files for image arguments (``"@PATH"`` in ``--call-kwargs``), so Edit pipelines can
calibrate."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from diffusers_nvfp4_fast import load_nvfp4_transformer, load_summary, quantize_transformer
from diffusers_nvfp4_fast.commands.cli import _call_kwargs, main
from diffusers_nvfp4_fast.quantize.transformer import EmptyPlanError
from diffusers_nvfp4_fast.testing import tiny
from support import tiny_family


def _cli(capsys, *args) -> tuple[int, str, str]:
    code = main(["quantize", *map(str, args), "--no-progress"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _refused(capsys, *args) -> str:
    """The one stderr line of a refused run (exit 2, nothing on stdout)."""
    code, out, err = _cli(capsys, *args)
    assert code == 2 and not out and err.count("\n") == 1, (code, out, err)
    return err


@pytest.fixture(scope="module")
def klein_pipeline_dir(tmp_path_factory):
    """A saved tiny FLUX.2-klein pipeline: ``transformer`` (25 Linears) and ``vae`` subfolders."""
    root = tmp_path_factory.mktemp("klein_pipeline")
    pipe, _ = tiny.tiny_klein_pipeline()
    pipe.save_pretrained(root)
    return root


def _no_work_left(parent) -> bool:
    return not [p for p in parent.iterdir() if p.name.startswith(".")]


# --- 1. a plan with no NVFP4 layer ------------------------------------------------------------------------------


def test_exclude_everything_is_refused_unless_allow_empty(klein_pipeline_dir, tmp_path, capsys):
    src = klein_pipeline_dir / "transformer"
    err = _refused(capsys, src, tmp_path / "out", "--dynamic", "--exclude", "*")
    assert "no Linear would become NVFP4" in err and "--exclude" in err and "matches 25 of its 25 Linears" in err
    assert "--allow-empty" in err and not (tmp_path / "out").exists() and _no_work_left(tmp_path)
    code, out, err = _cli(capsys, src, tmp_path / "out", "--dynamic", "--exclude", "*", "--allow-empty")
    assert code == 0, err
    assert "0 NVFP4 Linears, 25 kept BF16" in out and "input scales: none" in out
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["input_scales"]["method"] == "none" and qc["dynamic_input_scale"] == [] and len(qc["ignore"]) == 25
    assert load_summary(load_nvfp4_transformer(tmp_path / "out"))["nvfp4_linears"] == 0


def test_allow_empty_records_no_input_scales_for_a_calibrated_run(klein_pipeline_dir, tmp_path):
    """The package route with a pipeline used to record ``input_scales.method: "modelopt"`` for an empty plan."""
    pipe, kwargs = tiny.tiny_klein_pipeline()
    result = quantize_transformer(klein_pipeline_dir / "transformer", tmp_path / "out", pipeline=pipe,
                                  prompts=[kwargs["prompt"]], exclude=["*"], allow_empty=True, progress=False)
    assert result.input_scales == {"method": "none", "reason": "no Linear is NVFP4 (allow_empty)"}
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["input_scales"] == result.input_scales and "none" in result.summary()
    with pytest.raises(EmptyPlanError, match="ModelOpt exports such a model as a plain BF16 model"):
        quantize_transformer(klein_pipeline_dir / "transformer", tmp_path / "o2", pipeline=pipe, exclude=["*"],
                             allow_empty=True, method="modelopt")
    assert not (tmp_path / "o2").exists()


def _qwen(num_layers: int):
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    return QwenImageTransformer2DModel(  # type: ignore[attr-defined]  # mypy picks diffusers' dummy placeholder
        patch_size=2, in_channels=16, out_channels=4, num_layers=num_layers, attention_head_dim=32,
        num_attention_heads=2, joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 12, 12),
    ).to(torch.bfloat16)


@pytest.mark.parametrize("make", [lambda: _qwen(4), lambda: tiny_family.tiny_qwen21_transformer(num_layers=4)],
                         ids=["qwen_image", "qwen_image_21"])
def test_qwen_recipe_on_four_blocks_is_refused(make, tmp_path, capsys):
    model = make()
    model.save_pretrained(tmp_path / "bf16")
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    err = _refused(capsys, tmp_path / "bf16", tmp_path / "out", "--dynamic")
    assert f"the recipe for {type(model).__name__}" in err and "the first two and the last two" in err
    assert "num_layers=4" in err and f"{linears} of its {linears} Linears" in err and "--allow-empty" in err
    assert not (tmp_path / "out").exists() and _no_work_left(tmp_path)


# --- 2. options refused before any work -------------------------------------------------------------------------


def test_zero_steps_and_reserved_call_kwargs_are_refused_first(tmp_path, capsys):
    missing = tmp_path / "missing"  # never read: the option checks come first
    err = _refused(capsys, missing, tmp_path / "out", "--pipeline", missing, "--steps", 0)
    assert "num_inference_steps=0 (--steps)" in err and "at least 1 step" in err
    err = _refused(capsys, missing, tmp_path / "out", "--pipeline", missing, "--call-kwargs", '{"prompt": "x"}')
    assert "prompt" in err and "--prompts" in err
    err = _refused(capsys, missing, tmp_path / "out", "--dynamic", "--max-shard-size", "lots")
    assert "max_shard_size='lots'" in err
    err = _refused(capsys, missing, tmp_path / "out", "--dynamic", "--device", "gpu")
    assert "device='gpu': not a torch device" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine there is no refusal to check; "
                                                      "this runs in the CPU suite (CI)")
def test_cuda_without_a_gpu_is_one_line(klein_pipeline_dir, tmp_path, capsys):
    err = _refused(capsys, klein_pipeline_dir / "transformer", tmp_path / "out", "--dynamic", "--device", "cuda")
    assert "device='cuda': torch sees no CUDA GPU here" in err and not (tmp_path / "out").exists()
    assert main(["selftest", "--device", "cuda"]) == 2
    captured = capsys.readouterr()
    assert not captured.out and captured.err.count("\n") == 1
    assert captured.err.startswith("diffusers-nvfp4-fast selftest: device='cuda': torch sees no CUDA GPU here")


def test_a_subfolder_that_is_not_a_transformer_is_named(klein_pipeline_dir, tmp_path, capsys):
    err = _refused(capsys, klein_pipeline_dir, tmp_path / "out", "--subfolder", "vae", "--dynamic")
    assert "_class_name='AutoencoderKLFlux2' is not a transformer class this command supports" in err
    assert "Flux2Transformer2DModel, QwenImageTransformer2DModel, QwenImage21Transformer2DModel" in err
    assert "'transformer'" in err and "vae" in err


# --- 5. image files for image arguments -------------------------------------------------------------------------


def _pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image)


def test_call_kwargs_load_image_files(tmp_path, capsys):
    rgb = tiny_family._picture(1)
    rgb.save(tmp_path / "a.png")
    tiny_family._mask().save(tmp_path / "mask.png")
    (tmp_path / "text.png").write_text("not an image")
    got = _call_kwargs(json.dumps({"image": f"@{tmp_path / 'a.png'}", "mask_image": f"@{tmp_path / 'mask.png'}",
                                   "edit": [f"@{tmp_path / 'a.png'}", "@@literal"], "strength": 0.9}))
    assert got["image"].mode == "RGB" and np.array_equal(_pixels(got["image"]), _pixels(rgb))
    assert got["mask_image"].mode == "RGB"  # as diffusers' load_image gives it; the pipelines make masks grayscale
    assert np.array_equal(_pixels(got["mask_image"].convert("L")), _pixels(tiny_family._mask()))
    assert len(got["edit"]) == 2 and got["edit"][1] == "@literal" and got["strength"] == 0.9
    err = _refused(capsys, tmp_path / "src", tmp_path / "out", "--pipeline", tmp_path / "pipe", "--call-kwargs",
                   json.dumps({"image": f"@{tmp_path / 'missing.png'}"}))
    assert "--call-kwargs image" in err and "missing.png: no such file" in err
    err = _refused(capsys, tmp_path / "src", tmp_path / "out", "--pipeline", tmp_path / "pipe", "--call-kwargs",
                   json.dumps({"image": f"@{tmp_path / 'text.png'}"}))
    assert "text.png: not an image PIL can read" in err
    err = _refused(capsys, tmp_path / "src", tmp_path / "out", "--dynamic", "--call-kwargs", "[1]")
    assert "is not a JSON object" in err


def test_edit_pipeline_calibrates_with_an_image_file(tmp_path, capsys):
    """A tiny Qwen-Image Edit pipeline read from disk calibrates through the command with ``"@cond.png"``: the
    checkpoint is byte for byte the one ``quantize_transformer`` writes with the PIL image (given the string, the
    pipeline fails: it needs the image)."""
    from diffusers import DiffusionPipeline

    pipe, kwargs = tiny_family.qwen_edit(tiny_family.tiny_matrix_qwen_transformer())
    pipe.save_pretrained(tmp_path / "pipe")
    kwargs["image"].save(tmp_path / "cond.png")
    call = {"negative_prompt": kwargs["negative_prompt"], "true_cfg_scale": kwargs["true_cfg_scale"],
            "max_sequence_length": kwargs["max_sequence_length"], "height": 32, "width": 32}
    with tiny_family.small_target_areas():
        code, out, err = _cli(capsys, tmp_path / "pipe", tmp_path / "cli", "--subfolder", "transformer", "--pipeline",
                              tmp_path / "pipe", "--prompts", kwargs["prompt"], "--steps", 1, "--call-kwargs",
                              json.dumps({**call, "image": f"@{tmp_path / 'cond.png'}"}))
        assert code == 0, err
        loaded = DiffusionPipeline.from_pretrained(tmp_path / "pipe", dtype=torch.bfloat16)
        loaded.set_progress_bar_config(disable=True)
        quantize_transformer(tmp_path / "pipe", tmp_path / "api", subfolder="transformer", pipeline=loaded,
                             prompts=[kwargs["prompt"]], num_inference_steps=1, progress=False,
                             call_kwargs={**call, "image": kwargs["image"]})
    assert "14 NVFP4 Linears" in out
    cli, api = (load_file(str(tmp_path / n / "diffusion_pytorch_model.safetensors")) for n in ("cli", "api"))
    assert len([k for k in cli if k.endswith(".input_scale")]) == 14
    assert sorted(cli) == sorted(api) and all(torch.equal(cli[k], api[k]) for k in cli)
