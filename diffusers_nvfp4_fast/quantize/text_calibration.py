"""Calibrated activation scales of a text encoder: the max |input| of each quantized Linear while the pipeline encodes
its prompts (``pipe.encode_prompt``, the call the pipeline itself makes before denoising); ModelOpt's "max"
calibration, ``input_scale = amax / 2688`` (layers.py).

Only the text encoder sits on the device: the pipeline is loaded without its transformer and VAE, which
``encode_prompt`` does not use.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .calibration import check_input_amax, record_input_amax


@contextlib.contextmanager
def text_encoder_in(pipe: Any, model: nn.Module) -> Iterator[None]:
    """``pipe.text_encoder`` is ``model`` inside, the pipeline's own one again after."""
    if not hasattr(pipe, "encode_prompt") or not hasattr(pipe, "text_encoder"):
        raise ValueError(f"pipeline={type(pipe).__name__}: has no text_encoder / encode_prompt to calibrate with")
    before = pipe.text_encoder
    pipe.text_encoder = model
    try:
        yield
    finally:
        pipe.text_encoder = before


def load_text_pipeline(pipeline: str | os.PathLike, model: nn.Module, dtype: torch.dtype) -> Any:
    """``DiffusionPipeline.from_pretrained(pipeline, text_encoder=model, transformer=None, vae=None, dtype=dtype)``."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(pipeline), text_encoder=model, transformer=None, vae=None,
                                             dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def encode_prompts(pipe: Any, prompts: Sequence[str], call_kwargs: Mapping[str, Any] | None, device: str,
                   progress: bool) -> Callable[[], None]:
    """A function that runs ``pipe.encode_prompt(prompt=p, device=device, **call_kwargs)`` for each prompt."""
    from tqdm.auto import tqdm

    def run() -> None:
        for prompt in tqdm(list(prompts), desc="calibrating", unit="prompt", disable=not progress):
            pipe.encode_prompt(prompt=prompt, device=torch.device(device), **dict(call_kwargs or {}))

    return run


def calibrate_text_encoder(pipe: Any, model: nn.Module, names: Sequence[str], prompts: Sequence[str], *,
                           call_kwargs: Mapping[str, Any] | None = None, device: str = "cpu",
                           progress: bool = True) -> dict[str, float]:
    """Input amax of each named Linear of ``model`` (the BF16 text encoder, moved to ``device``) while ``pipe``
    encodes ``prompts``; refuses layers that saw no usable input (``calibration.check_input_amax``)."""
    with text_encoder_in(pipe, model), torch.inference_mode():
        model.to(device)
        amax = record_input_amax(model, names, encode_prompts(pipe, prompts, call_kwargs, device, progress))
    check_input_amax(amax)
    return amax
