"""The BF16 diffusers transformer to quantize, read from its files tensor by tensor (headers first, never whole).

``open_source`` checks everything it can before any weight is read: the directory, ``config.json`` and its
``_class_name``, that the weights are not already quantized, and every key and shape against the diffusers class
built on the meta device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..loaders.modelopt_export import read_json, resolve_dir, weight_files
from ..loaders.safetensors_header import CheckpointIndex
from .recipes import RECIPE_SOURCES

TRANSFORMERS_MODULE = "diffusers.models.transformers."  # where diffusers defines its transformer (denoiser) classes


class QuantizeSourceError(ValueError):
    """The source is not a BF16 diffusers transformer this command can quantize; the message names the file, key or
    value."""


@dataclass
class BF16Source:
    """A diffusers transformer on disk: its directory, config, class, a meta-device skeleton and the tensor index.

    ``linears``: name -> ``nn.Linear`` of the skeleton (shapes and module types only, no data)."""

    model_dir: Path
    config: dict[str, Any]
    cls: type
    skeleton: nn.Module
    index: CheckpointIndex

    @property
    def class_name(self) -> str:
        return self.cls.__name__

    @property
    def linears(self) -> dict[str, nn.Linear]:
        return {n: m for n, m in self.skeleton.named_modules() if isinstance(m, nn.Linear)}

    def read(self, key: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """One stored tensor, cast to ``dtype`` when it is floating point, on ``device``."""
        tensor = self.index.load([key])[key]
        if tensor.is_floating_point():
            tensor = tensor.to(dtype)
        return tensor.to(device)


def _diffusers_class(config: dict[str, Any], config_path: Path) -> type:
    import diffusers

    name = config.get("_class_name")
    if not name:
        raise QuantizeSourceError(f"{config_path}: no _class_name, so this is not a diffusers model config (a "
                                  "transformer directory holds config.json with e.g. \"_class_name\": "
                                  "\"Flux2Transformer2DModel\"; is `subfolder` right?)")
    cls = getattr(diffusers, str(name), None)
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise QuantizeSourceError(f"{config_path}: _class_name={name!r} is not a model class of diffusers "
                                  f"{diffusers.__version__}")
    if not cls.__module__.startswith(TRANSFORMERS_MODULE):
        raise QuantizeSourceError(
            f"{config_path}: _class_name={name!r} is not a transformer class this command supports: it quantizes "
            f"the denoising transformer of a pipeline, {', '.join(RECIPE_SOURCES)} with their recipes, or another "
            f"class of {TRANSFORMERS_MODULE[:-1]} with --exclude (is --subfolder right? a pipeline keeps it in "
            "'transformer')")
    return cls


def refuse_quantized(model_dir: Path, config: dict[str, Any], index: CheckpointIndex) -> None:
    quantized = [k for k in index.entries if k.endswith((".weight_scale", ".weight_scale_2", ".input_scale"))]
    if config.get("quantization_config") is not None or quantized:
        what = f"tensor {quantized[0]}" if quantized else "config.json has a quantization_config"
        raise QuantizeSourceError(f"{model_dir}: already quantized ({what}); quantize the BF16 model it was made from")


def _key_problems(skeleton: nn.Module, index: CheckpointIndex) -> list[str]:
    """Missing, unexpected, non-floating and wrongly shaped keys of the source against the class."""
    expected = skeleton.state_dict()
    params = dict(skeleton.named_parameters())
    problems = [f"missing key {k} (shape {list(t.shape)})" for k, t in params.items() if k not in index]
    for key, (path, info) in index.entries.items():
        problem = stored_key_problem(key, path, info, expected[key] if key in expected else None)
        if problem:
            problems.append(problem)
    return problems


def stored_key_problem(key: str, path: Path, info: Any, expected: torch.Tensor | None) -> str | None:
    """What is wrong with stored tensor ``key`` (its header ``info``) against the class's tensor ``expected`` (None:
    the class has no such key), or None."""
    if expected is None:
        return f"unexpected key {key} in {path.name} ({info.dtype}, {list(info.shape)})"
    if info.shape != tuple(expected.shape):
        return f"{key} in {path.name}: shape {list(info.shape)}, expected {list(expected.shape)}"
    if info.dtype not in ("BF16", "F16", "F32"):
        return f"{key} in {path.name}: dtype {info.dtype}, expected BF16, F16 or F32"
    return None


def open_source(path_or_repo_id: str | os.PathLike, subfolder: str | None = None) -> BF16Source:
    """Resolve (a local directory or a Hugging Face repo id, with ``subfolder``) and check a BF16 transformer.

    Raises:
        FileNotFoundError: no such directory or repo, or no ``config.json`` there.
        QuantizeSourceError: not a diffusers model, already quantized, or keys / shapes that do not fit its class.
    """
    from accelerate import init_empty_weights

    model_dir = resolve_dir(path_or_repo_id, subfolder)
    config = read_json(model_dir / "config.json")
    cls = _diffusers_class(config, model_dir / "config.json")
    index = CheckpointIndex(weight_files(model_dir))
    refuse_quantized(model_dir, config, index)
    with init_empty_weights(include_buffers=False):
        skeleton = cls.from_config(config)  # type: ignore[attr-defined]  # a diffusers ModelMixin
    problems = _key_problems(skeleton, index)
    if problems:
        raise QuantizeSourceError(f"{model_dir}: {len(problems)} problem(s) reading it as {cls.__name__}:\n  "
                                  + "\n  ".join(problems))
    return BF16Source(model_dir, config, cls, skeleton, index)
