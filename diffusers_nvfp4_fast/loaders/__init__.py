"""The loaders wing: every route by which NVFP4 weights enter a diffusers model (docs/checkpoints.md).

``load_nvfp4_transformer`` reads files (ModelOpt export directories; single files: ComfyUI / BFL, diffusers' BFL
files, declared layouts, of FLUX.2, Qwen-Image and Qwen-Image 2.1); the in-memory
routes (ModelOpt-quantized models, diffusers' own BFL quantizer) are converted by ``enable_fast_paths``.
``load_nvfp4_text_encoder`` reads NVFP4 text encoders (ModelOpt Hugging Face exports, ComfyUI single files).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from ..format import ScaleLayout
from .common import load_summary
from .errors import NVFP4CheckpointError
from .text_encoder import load_nvfp4_text_encoder

__all__ = ["NVFP4CheckpointError", "load_nvfp4_text_encoder", "load_nvfp4_transformer", "load_summary"]


SINGLE_FILE_KWARGS = ("config", "nibble_order", "input_scales", "dynamic_input_scale")


def _is_repo_id(name: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return not name.endswith((".safetensors", ".json"))


def _check_arguments(path_or_repo_id: str | os.PathLike, dtype: torch.dtype | None, torch_dtype: torch.dtype | None,
                     single_file: bool, kwargs: dict) -> torch.dtype:
    """The dtype to load in; a clear error for a path that is not there and for keywords that do not apply."""
    unknown = sorted(set(kwargs) - set(SINGLE_FILE_KWARGS))
    if unknown:
        raise TypeError(f"load_nvfp4_transformer() got unexpected keyword argument(s) {unknown}; it takes subfolder, "
                        f"dtype (or torch_dtype), device, scale_layout, filename and, for single files, "
                        f"{', '.join(SINGLE_FILE_KWARGS)}")
    if kwargs and not single_file:
        raise TypeError(f"{sorted(kwargs)} only apply to single-file checkpoints; {path_or_repo_id} is "
                        "read as a ModelOpt export directory")
    if dtype is not None and torch_dtype is not None and dtype != torch_dtype:
        raise ValueError(f"dtype={dtype} and torch_dtype={torch_dtype} disagree: pass one (dtype is diffusers' newer "
                         "name for torch_dtype)")
    if not Path(path_or_repo_id).exists() and not _is_repo_id(str(path_or_repo_id)):
        raise FileNotFoundError(f"{path_or_repo_id}: no such file or directory (and not a Hugging Face repo id)")
    return dtype or torch_dtype or torch.bfloat16


def load_nvfp4_transformer(
    path_or_repo_id: str | os.PathLike,
    *,
    subfolder: str | None = None,
    dtype: torch.dtype | None = None,
    torch_dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    scale_layout: ScaleLayout | None = None,
    filename: str | None = None,
    **single_file_kwargs,
) -> nn.Module:
    """Load an NVFP4 transformer into its diffusers class, with ``NVFP4Linear`` layers that never exist in BF16.

    A directory (or repo id) is read as a ModelOpt NVFP4 diffusers export (FLUX.2 dev/klein, Qwen-Image), also one
    that ``save_pretrained`` of this package wrote (``subfolder="transformer"`` inside a saved pipeline); a single
    ``.safetensors`` file (a local path, or ``filename=`` inside a repo or directory) as a FLUX.2, Qwen-Image or
    Qwen-Image 2.1 single file (family from its keys; ComfyUI's / BFL's format, diffusers' BFL files, or a layout the
    arguments declare), which takes the extra keyword arguments of ``loaders.bfl.load_bfl_nvfp4_transformer``
    (``config``, ``nibble_order``, ``input_scales``, ``dynamic_input_scale``).

    Every key is checked (missing, unexpected, dtype, shape) and all problems are raised together in one
    ``NVFP4CheckpointError``. Block scales are converted to the 128x4 layout exactly once.

    Args:
        path_or_repo_id: local directory or file, or Hugging Face repo id.
        subfolder: e.g. ``"transformer"`` inside a pipeline repo.
        dtype: dtype of unquantized weights and biases (default BF16); ``torch_dtype`` is accepted too (diffusers'
            older name), and the two must agree.
        device: where to put the model (default: stays on CPU).
        scale_layout: force how stored block scales are read ("linear" or "128x4") when the file cannot tell.
        filename: a single-file checkpoint inside ``path_or_repo_id``.

    Raises:
        NVFP4CheckpointError: the checkpoint's problems, all of them. FileNotFoundError: no such path or repo.
        TypeError: keywords this loader does not take, or single-file keywords for a directory.
    """
    single_file = filename is not None or Path(path_or_repo_id).is_file()
    dtype = _check_arguments(path_or_repo_id, dtype, torch_dtype, single_file, single_file_kwargs)
    if single_file:
        from .bfl import load_bfl_nvfp4_transformer

        return load_bfl_nvfp4_transformer(
            path_or_repo_id, filename=filename, subfolder=subfolder, torch_dtype=dtype, device=device,
            scale_layout=scale_layout, **single_file_kwargs,
        )
    from .modelopt_export import load_modelopt_export

    return load_modelopt_export(path_or_repo_id, subfolder=subfolder, torch_dtype=dtype, device=device,
                                scale_layout=scale_layout)
