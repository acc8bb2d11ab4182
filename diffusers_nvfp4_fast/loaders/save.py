"""``save_pretrained`` of an NVFP4 transformer: a checkpoint that ``load_nvfp4_transformer`` reads back byte for byte,
written whole or not at all.

diffusers' own ``ModelMixin.save_pretrained`` writes ``config.json`` first and the weights after it, into the target
directory, so a failed save leaves a directory that looks like a checkpoint; it refuses models whose diffusers
quantizer cannot serialize (``BFLQuantizationConfig``), even after ``enable_fast_paths`` converted every such layer
to ``NVFP4Linear``; and it writes peft's ``base_layer`` / ``lora_A`` keys of a loaded LoRA as if they were the model.
``NVFP4SavePretrained`` (installed per instance, so ``pipe.save_pretrained`` calls it too) refuses what cannot be
reloaded before writing anything, lets diffusers write into a temporary directory next to the target, and moves the
files into place only once every file is written (``config.json`` last).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import nn

from .common import record_checkpoint_config

WEIGHTS_PREFIX = "diffusion_pytorch_model"  # every weights file and index diffusers writes starts with it


def lora_wrapped_layers(model: nn.Module) -> list[str]:
    """Names of the peft tuner layers (a LoRA around a base layer) in ``model``; peft is not imported."""
    return [name for name, m in model.named_modules()
            if "base_layer" in m.__dict__["_modules"] and hasattr(m, "active_adapters")]


def _is_diffusers_quantized_layer(module: nn.Module) -> bool:
    return type(module).__module__.startswith("diffusers.quantizers.")


def _refusal(model: nn.Module, safe_serialization: bool, push_to_hub: bool, use_flashpack: bool) -> str | None:
    """Why ``model`` cannot be saved as a checkpoint that ``load_nvfp4_transformer`` reads, or None."""
    lora = lora_wrapped_layers(model)
    if lora:
        return (f"this model holds a LoRA (peft) on {len(lora)} layer(s), e.g. {lora[0]}; saving it would write peft's "
                "base_layer / lora_A / lora_B keys, which no loader reads as an NVFP4 checkpoint. Call "
                "pipe.unload_lora_weights() before saving, and save the LoRA itself with pipe.save_lora_weights(...)")
    if not safe_serialization:
        return "NVFP4 checkpoints are written as safetensors only (load_nvfp4_transformer reads no .bin)"
    if push_to_hub or use_flashpack:
        return ("push_to_hub / use_flashpack are not supported for NVFP4 checkpoints: save to a directory, then "
                "upload it with huggingface_hub.upload_folder")
    quantizer = model.__dict__.get("hf_quantizer")
    if quantizer is not None and any(_is_diffusers_quantized_layer(m) for m in model.modules()):
        method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", "?")
        return (f"it holds layers that diffusers' {method} quantizer built, which diffusers cannot save; "
                "enable_fast_paths(pipe) converts them to NVFP4Linear, which this save writes")
    return None


@contextlib.contextmanager
def _converted_quantizer_hidden(model: nn.Module) -> Iterator[None]:
    """Hide diffusers' quantizer of a model whose quantized layers were all converted to ``NVFP4Linear``: diffusers
    refuses to save while it is set, and nothing of what it built is left."""
    quantizer = model.__dict__.get("hf_quantizer")
    if quantizer is not None:
        model.hf_quantizer = None  # type: ignore[assignment]  # nn.Module takes any attribute
    try:
        yield
    finally:
        if quantizer is not None:
            model.hf_quantizer = quantizer


def _move_into_place(written: Path, target: Path) -> None:
    """Move the files of a finished save into ``target``, replacing a previous checkpoint's weights and config."""
    target.mkdir(parents=True, exist_ok=True)
    for old in target.iterdir():  # stale shards of an earlier save would mix with the new ones
        if old.is_file() and (old.name.startswith(WEIGHTS_PREFIX) or old.name == "config.json"):
            old.unlink()
    for new in sorted(written.iterdir(), key=lambda f: f.name == "config.json"):  # config.json last
        os.replace(new, target / new.name)


class NVFP4SavePretrained:
    """``model.save_pretrained`` for a diffusers model with ``NVFP4Linear`` layers (same signature as diffusers')."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, save_directory: str | os.PathLike, is_main_process: bool = True, save_function=None,
                 safe_serialization: bool = True, variant: str | None = None, max_shard_size: int | str = "10GB",
                 push_to_hub: bool = False, use_flashpack: bool = False, **kwargs: Any) -> None:
        """Write ``config.json`` (with the checkpoint facts ``load_nvfp4_transformer`` needs) and safetensors weights
        into ``save_directory``; nothing there changes unless every file was written.

        Raises:
            ValueError: before anything is written, for a model that holds a LoRA, for ``safe_serialization=False``,
                ``push_to_hub`` or ``use_flashpack``, or for layers diffusers' quantizer built and nobody converted.
        """
        model = self.model
        reason = _refusal(model, safe_serialization, push_to_hub, use_flashpack)
        if reason is not None:
            raise ValueError(f"{type(model).__name__}.save_pretrained({str(save_directory)!r}): {reason}; "
                             "nothing was written.")
        record_checkpoint_config(model)
        target = Path(save_directory)
        if target.is_file():
            raise FileExistsError(f"{target}: is a file; save_pretrained writes a directory")
        target.parent.mkdir(parents=True, exist_ok=True)
        written = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".saving", dir=target.parent))
        try:
            with _converted_quantizer_hidden(model):
                type(model).save_pretrained(model, written, is_main_process=is_main_process,  # type: ignore[attr-defined]
                                            save_function=save_function, variant=variant,
                                            max_shard_size=max_shard_size, **kwargs)
            _move_into_place(written, target)
        finally:
            shutil.rmtree(written, ignore_errors=True)


def refuse_pipeline_save(pipe: Any, save_directory: str | os.PathLike, safe_serialization: bool = True,
                         use_flashpack: bool = False) -> None:
    """Refuse ``pipe.save_pretrained(save_directory, ...)`` before diffusers writes any component, when one of its
    NVFP4 models would refuse its own save (diffusers saves the components one after another, so a refusal at the
    transformer would come after the others were written). diffusers passes each component ``safe_serialization``
    and ``use_flashpack``, never ``push_to_hub`` (it uploads the whole folder itself)."""
    for name, component in dict(getattr(pipe, "components", {}) or {}).items():
        model = getattr(component, "_orig_mod", component)  # torch.compile's wrapper
        if not isinstance(model, nn.Module) or not isinstance(model.__dict__.get("save_pretrained"),
                                                              NVFP4SavePretrained):
            continue
        reason = _refusal(model, safe_serialization, False, use_flashpack)
        if reason is not None:
            raise ValueError(f"{type(pipe).__name__}.save_pretrained({str(save_directory)!r}): its {name} "
                             f"({type(model).__name__}) cannot be saved: {reason}; nothing was written.")


def install_save_pretrained(model: nn.Module) -> None:
    """Give ``model`` (a diffusers model) ``NVFP4SavePretrained`` as its ``save_pretrained``, on this instance only."""
    if hasattr(type(model), "save_pretrained") and not isinstance(model.__dict__.get("save_pretrained"),
                                                                  NVFP4SavePretrained):
        model.save_pretrained = NVFP4SavePretrained(model)  # type: ignore[assignment]  # shadows the class method
