"""The last step of every NVFP4 loader: refuse unfilled tensors, move, and install this package's
``save_pretrained`` and ``fuse_lora`` on the instance (apart from ``common`` so ``save`` can import ``common``)."""

from __future__ import annotations

from torch import nn

from ..lora import install_fuse_lora_guard, register_lora_support
from .common import record_checkpoint_config
from .errors import NVFP4CheckpointError
from .save import install_save_pretrained


def install_model_methods(model: nn.Module) -> None:
    """This instance's ``save_pretrained`` (a checkpoint ``load_nvfp4_transformer`` reads back, written whole or not
    at all) and ``fuse_lora`` (refused before any layer is touched) for an NVFP4 model; peft learns ``NVFP4Linear``."""
    register_lora_support()
    install_save_pretrained(model)
    install_fuse_lora_guard(model)


def finish_model(model: nn.Module, source, device) -> None:
    """Refuse a model with tensors the checkpoint did not fill; eval mode; move to ``device``; record the checkpoint
    facts for ``save_pretrained``; install this package's ``save_pretrained`` and ``fuse_lora``."""
    meta = [n for n, p in model.named_parameters() if p.is_meta] + [n for n, b in model.named_buffers() if b.is_meta]
    if meta:
        raise NVFP4CheckpointError(f"{source}: no data for {meta}")
    model.eval()
    if device is not None:
        model.to(device)
    record_checkpoint_config(model)
    install_model_methods(model)
