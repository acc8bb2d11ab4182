"""The BF16 transformers text encoder to quantize, read from its files tensor by tensor (headers first, never whole).

``open_text_source`` checks what it can before any weight is read: ``config.json`` and its ``architectures``, that
the weights are not already quantized, and every key and shape against the transformers class built on the meta
device (keys as the files spell them: ``loaders.transformers_compat.file_keys``).
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
from ..loaders.transformers_compat import file_keys
from .source import QuantizeSourceError, refuse_quantized, stored_key_problem


@dataclass
class TextEncoderSource:
    """A transformers text encoder on disk: directory, config, class, meta skeleton, tensor index and key names.

    ``file_key``: in-memory state-dict key -> the key in the files (``model.language_model.layers.0...`` ->
    ``model.layers.0...`` for Qwen2.5-VL), for every key; tied ones (``lm_head.weight`` of a model with
    ``tie_word_embeddings``) may be absent from the files."""

    model_dir: Path
    config: dict[str, Any]
    cls: type
    skeleton: nn.Module
    index: CheckpointIndex
    file_key: dict[str, str]

    @property
    def class_name(self) -> str:
        return self.cls.__name__

    @property
    def linears(self) -> dict[str, nn.Linear]:
        """In-memory name -> Linear of the skeleton, for the Linears whose weight the files hold."""
        return {n: m for n, m in self.skeleton.named_modules()
                if isinstance(m, nn.Linear) and self.file_key[f"{n}.weight"] in self.index}

    def read(self, key: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """One stored tensor (by its file key), cast to ``dtype`` when it is floating point, on ``device``."""
        tensor = self.index.load([key])[key]
        if tensor.is_floating_point():
            tensor = tensor.to(dtype)
        return tensor.to(device)


def is_text_encoder_config(config: dict[str, Any]) -> bool:
    """A transformers config (``architectures``), not a diffusers one (``_class_name``)."""
    return "_class_name" not in config and bool(config.get("architectures"))


def _transformers_class(config: dict[str, Any], config_path: Path) -> type:
    import transformers

    names = config.get("architectures") or []
    if len(names) != 1:
        raise QuantizeSourceError(f"{config_path}: architectures={names!r}; expected one transformers class name")
    cls = getattr(transformers, str(names[0]), None)
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise QuantizeSourceError(f"{config_path}: architectures={names!r} is not a model class of transformers "
                                  f"{transformers.__version__}")
    return cls


def _key_problems(skeleton: nn.Module, index: CheckpointIndex, names: dict[str, str]) -> list[str]:
    expected = skeleton.state_dict()
    tied = set(getattr(skeleton, "all_tied_weights_keys", None) or {})
    by_file = {f: k for k, f in names.items()}
    problems = [f"missing key {f} (shape {list(expected[k].shape)})" for k, f in names.items()
                if f not in index and k not in tied and k in dict(skeleton.named_parameters())]
    for key, (path, info) in index.entries.items():
        problem = stored_key_problem(key, path, info, expected[by_file[key]] if key in by_file else None)
        if problem:
            problems.append(problem)
    return problems


def open_text_source(path_or_repo_id: str | os.PathLike, subfolder: str | None = None) -> TextEncoderSource:
    """Resolve (a local directory or a Hugging Face repo id, with ``subfolder``) and check a BF16 text encoder.

    Raises:
        FileNotFoundError: no such directory or repo, or no ``config.json`` there.
        QuantizeSourceError: not a transformers model, already quantized, or keys / shapes that do not fit its class.
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    model_dir = resolve_dir(path_or_repo_id, subfolder)
    config = read_json(model_dir / "config.json")
    if not is_text_encoder_config(config):
        raise QuantizeSourceError(f"{model_dir / 'config.json'}: no transformers 'architectures' (a diffusers "
                                  "model has _class_name: use quantize_transformer)")
    cls = _transformers_class(config, model_dir / "config.json")
    index = CheckpointIndex(weight_files(model_dir))
    refuse_quantized(model_dir, config, index)
    with init_empty_weights(include_buffers=False):
        skeleton = cls(AutoConfig.from_pretrained(model_dir))
    names = file_keys(skeleton)
    problems = _key_problems(skeleton, index, names)
    if problems:
        raise QuantizeSourceError(f"{model_dir}: {len(problems)} problem(s) reading it as {cls.__name__}:\n  "
                                  + "\n  ".join(problems))
    return TextEncoderSource(model_dir, config, cls, skeleton, index, names)
