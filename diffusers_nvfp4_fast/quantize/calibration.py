"""Calibrated activation scales: the max |input| of each quantized Linear over a few prompts run through the user's
pipeline with the BF16 transformer (ModelOpt's "max" calibration; the scale is ``amax / 2688``, layers.py).

Memory: the whole BF16 transformer sits on the pipeline's device while it runs (FLUX.2-dev: about 64 GB, Qwen-Image:
about 41 GB), unless ``offload="model"`` (diffusers' ``enable_model_cpu_offload``: one component on the GPU at a time)
or ``offload="sequential"`` (``enable_sequential_cpu_offload``: one layer at a time, slowest).
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

DEFAULT_PROMPTS = ("a red fox in fresh snow", "a street market at dusk", "a glass teapot on a wooden table")
OFFLOAD_MODES = (None, "model", "sequential")


class CalibrationError(ValueError):
    """Calibration gave a layer no usable input amax (never called, all-zero, NaN or infinite input); the message
    names every such layer and the way out."""


def record_input_amax(model: nn.Module, names: Sequence[str], run: Callable[[], Any]) -> dict[str, float]:
    """Max |input| of each named Linear of ``model`` over everything ``run()`` executes (0.0: never called).

    The running max stays a tensor on the input's device, so the calls add no host synchronisation.
    """
    amax: dict[str, torch.Tensor | None] = dict.fromkeys(names)
    handles = []
    for name in names:
        def hook(_module: nn.Module, args: tuple, _name: str = name) -> None:
            seen = args[0].detach().abs().amax().to(torch.float32)
            before = amax[_name]
            amax[_name] = seen if before is None else torch.maximum(before, seen.to(before.device))
        handles.append(model.get_submodule(name).register_forward_pre_hook(hook))
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return {name: 0.0 if value is None else float(value) for name, value in amax.items()}


def check_input_amax(amax: Mapping[str, float]) -> None:
    """Refuse amaxes no input scale can come from (0: the layer saw no input; NaN / Inf), all layers in one error."""
    bad = [f"{name} ({'never called' if value == 0 else value})" for name, value in amax.items()
           if not math.isfinite(value) or value <= 0]
    if bad:
        shown = ", ".join(bad[:12]) + (" ..." if len(bad) > 12 else "")
        raise CalibrationError(
            f"{len(bad)} quantized layer(s) got no usable input amax during calibration: {shown}. Use prompts and "
            "call arguments that reach them, keep them in BF16 (--exclude / exclude=), or compute activation scales "
            "per call (--dynamic / dynamic=True)")


@contextlib.contextmanager
def transformer_in(pipe: Any, model: nn.Module) -> Iterator[None]:
    """``pipe.transformer`` is ``model`` inside, the pipeline's own one again after."""
    before = pipe.transformer
    pipe.transformer = model
    try:
        yield
    finally:
        pipe.transformer = before


def place_pipeline(pipe: Any, device: torch.device | str, offload: str | None) -> None:
    if offload not in OFFLOAD_MODES:
        raise ValueError(f"offload={offload!r}: expected one of {OFFLOAD_MODES}")
    if offload == "model":
        pipe.enable_model_cpu_offload(device=device)
    elif offload == "sequential":
        pipe.enable_sequential_cpu_offload(device=device)
    else:
        pipe.to(device)


def load_pipeline(pipeline: str | os.PathLike, model: nn.Module, dtype: torch.dtype) -> Any:
    """``DiffusionPipeline.from_pretrained(pipeline, transformer=model, dtype=dtype)``, progress bars off."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(pipeline), transformer=model, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def calibrate_pipeline(pipe: Any, model: nn.Module, names: Sequence[str], prompts: Sequence[str], *,
                       call_kwargs: Mapping[str, Any] | None = None, device: torch.device | str = "cpu",
                       offload: str | None = None, steps: int = 4, seed: int = 0,
                       progress: bool = True) -> dict[str, float]:
    """Run each prompt through ``pipe`` with ``model`` (the BF16 transformer) as its transformer, the pipeline moved
    to ``device`` (or offloaded there, ``offload``); returns the input amax of each named Linear.

    ``call_kwargs`` go to every call (``height``, ``width``, ``guidance_scale``...), with ``output_type="latent"``
    unless they say otherwise (the VAE does not change what the transformer sees)."""

    def run() -> None:
        run_prompts(pipe, prompts, call_kwargs, steps, seed, progress)

    with transformer_in(pipe, model), torch.inference_mode():
        place_pipeline(pipe, device, offload)
        amax = record_input_amax(model, names, run)
    check_input_amax(amax)
    return amax


def run_prompts(pipe: Any, prompts: Sequence[str], call_kwargs: Mapping[str, Any] | None, steps: int, seed: int,
                progress: bool) -> None:
    """Each prompt through ``pipe`` (``steps`` steps, seed ``seed``), latents only unless ``call_kwargs`` say
    otherwise (the VAE does not change what the transformer sees)."""
    from tqdm.auto import tqdm

    kwargs = {"output_type": "latent", **dict(call_kwargs or {})}
    for prompt in tqdm(list(prompts), desc="calibrating", unit="prompt", disable=not progress):
        generator = torch.Generator("cpu").manual_seed(seed)
        pipe(prompt=prompt, num_inference_steps=steps, generator=generator, **kwargs)


def free(model: nn.Module) -> None:
    """Drop ``model``'s weights from the GPU before the streamed quantization starts."""
    model.to("meta")
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
