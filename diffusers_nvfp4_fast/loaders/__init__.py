"""The loaders wing: every route by which NVFP4 weights enter a diffusers model (docs/checkpoints.md).

``load_nvfp4_transformer`` reads files (ModelOpt export directories, BFL / ComfyUI single files); the in-memory
routes (ModelOpt-quantized models, diffusers' own BFL quantizer) are converted by ``enable_fast_paths``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from ..format import ScaleLayout
from .errors import NVFP4CheckpointError

__all__ = ["NVFP4CheckpointError", "load_nvfp4_transformer"]


def load_nvfp4_transformer(
    path_or_repo_id: str | os.PathLike,
    *,
    subfolder: str | None = None,
    torch_dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    scale_layout: ScaleLayout | None = None,
    filename: str | None = None,
    **single_file_kwargs,
) -> nn.Module:
    """Load an NVFP4 transformer into its diffusers class, with ``NVFP4Linear`` layers that never exist in BF16.

    A directory (or repo id) is read as a ModelOpt NVFP4 diffusers export (FLUX.2 dev/klein, Qwen-Image); a single
    ``.safetensors`` file (a local path, or ``filename=`` inside a repo or directory) as the BFL / ComfyUI FLUX.2
    format, which takes the extra keyword arguments of ``loaders.bfl.load_bfl_nvfp4_transformer`` (``config``,
    ``nibble_order``, ``input_scales``, ``dynamic_input_scale``).

    Every key is checked (missing, unexpected, dtype, shape) and all problems are raised together in one
    ``NVFP4CheckpointError``. Block scales are converted to the 128x4 layout exactly once.

    Args:
        path_or_repo_id: local directory or file, or Hugging Face repo id.
        subfolder: e.g. ``"transformer"`` inside a pipeline repo.
        torch_dtype: dtype of unquantized weights and biases.
        device: where to put the model (default: stays on CPU).
        scale_layout: force how stored block scales are read ("linear" or "128x4") when the file cannot tell.
        filename: a single-file checkpoint inside ``path_or_repo_id`` (BFL format).
    """
    if filename is not None or Path(path_or_repo_id).is_file():
        from .bfl import load_bfl_nvfp4_transformer

        return load_bfl_nvfp4_transformer(
            path_or_repo_id, filename=filename, subfolder=subfolder, torch_dtype=torch_dtype, device=device,
            scale_layout=scale_layout, **single_file_kwargs,
        )
    if single_file_kwargs:
        raise TypeError(f"{sorted(single_file_kwargs)} only apply to single-file (BFL format) checkpoints")
    from .modelopt_export import load_modelopt_export

    return load_modelopt_export(path_or_repo_id, subfolder=subfolder, torch_dtype=torch_dtype, device=device,
                                scale_layout=scale_layout)
