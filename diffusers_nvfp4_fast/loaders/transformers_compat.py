"""The one module that reads transformers' internals (transformers 5.25, tested by tests/test_text_encoder_loader.py
and tests/test_quantize_text_encoder.py): the checkpoint-key renames of its ``conversion_mapping`` (a Qwen2.5-VL file
stores ``model.layers.*`` and ``visual.*``, the class holds ``model.language_model.*`` and ``model.visual.*``), the
way back that ``save_pretrained`` takes (``revert_weight_conversion``), and an empty model built from a config on the
meta device."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def checkpoint_key_renamer(model: Any) -> Callable[[str], str]:
    """stored key -> the model's key, as transformers' ``from_pretrained`` renames it (renames only: a key a
    converter would reshape, fuse or split keeps its name and is reported by the caller as unexpected)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    renamings = [t for t in get_model_conversion_mapping(model) if type(t) is WeightRenaming]

    def rename(key: str) -> str:
        return rename_source_key(key, renamings, [])[0]

    return rename


def empty_model(cls: type, config: dict, dtype: torch.dtype) -> nn.Module:
    """``cls`` built from the config dict with its parameters on the meta device (buffers real) in ``dtype``, its
    tied weights tied (an ``lm_head`` tied to the embeddings is one parameter, which a file stores once)."""
    from accelerate import init_empty_weights

    config_obj = cls.config_class.from_dict(config)  # type: ignore[attr-defined]  # a PreTrainedModel class
    with init_empty_weights(include_buffers=False):
        model = cls._from_config(config_obj, dtype=dtype)  # type: ignore[attr-defined]  # (as above)
    model.tie_weights()
    return model


def file_keys(model: nn.Module) -> dict[str, str]:
    """In-memory state-dict key -> the key ``save_pretrained`` writes for it (the same key where nothing renames)."""
    state = model.state_dict(keep_vars=True)
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers without load-time renaming: the keys are the files' keys
        return {k: k for k in state}
    names = {}
    for key, tensor in state.items():
        reverted = revert_weight_conversion(model, {key: torch.empty(tensor.shape, device="meta")})  # type: ignore[arg-type]
        if len(reverted) != 1:
            raise ValueError(f"{type(model).__name__}: transformers saves {key} as {len(reverted)} tensors "
                             f"({', '.join(reverted)}); only renamed keys are supported")
        names[key] = next(iter(reverted))
    return names
