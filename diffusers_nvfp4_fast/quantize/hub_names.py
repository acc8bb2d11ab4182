"""The one place that uses a private name of transformers: the key a tensor has in the model's files.

transformers 5 renames some checkpoint keys while loading (Qwen2.5-VL's ``model.layers`` is
``model.language_model.layers`` in memory) and renames them back when saving (``save_pretrained`` calls
``transformers.core_model_loading.revert_weight_conversion``, transformers 5.25). The text-encoder quantizer reads
and writes the files' own keys, as ModelOpt's export does; tests/test_quantize_text_encoder.py checks this function
against the installed transformers.
"""

from __future__ import annotations

import torch
from torch import nn


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
