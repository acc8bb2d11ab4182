"""Record activation scales for NVFP4 layers that lack one (option A for the FLUX.2 '-mixed' file)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from ..format import decode_nvfp4
from ..linear import NVFP4Linear
from .bfl.input_scales import INPUT_SCALE_DIVISOR, INPUT_SCALES_FORMAT
from .common import record_checkpoint_config

logger = logging.getLogger("diffusers_nvfp4_fast")


def _runner(pipe_or_transformer: Any, prompts_or_run: Sequence[str] | Callable[[], Any],
            call_kwargs: Mapping[str, Any] | None) -> Callable[[], Any]:
    if callable(prompts_or_run):
        return prompts_or_run
    if not hasattr(pipe_or_transformer, "transformer"):
        raise TypeError("prompts need a pipeline to run; with a bare transformer pass a callable that runs it")
    prompts = [prompts_or_run] if isinstance(prompts_or_run, str) else list(prompts_or_run)

    def run() -> None:
        for p in prompts:
            pipe_or_transformer(prompt=p, **dict(call_kwargs or {}))

    return run


def _calibrating_forward(name: str, module: NVFP4Linear,
                         amax: dict[str, torch.Tensor | None]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A BF16 forward with the dequantized weight that records the running amax of the layer's input."""
    # e2m1 * e4m3 is exact; times weight_scale_2 is the weight the checkpoint encodes (up to one FP32 rounding).
    weight = decode_nvfp4(module.weight, module.weight_scale, scale_layout=module.scale_layout, dtype=torch.float32)
    weight = weight * module.weight_scale_2
    by_dtype: dict[torch.dtype, torch.Tensor] = {}

    def forward(x: torch.Tensor) -> torch.Tensor:
        seen = x.detach().abs().amax().to(torch.float32)
        before = amax[name]
        amax[name] = seen if before is None else torch.maximum(before, seen)
        if x.dtype not in by_dtype:
            by_dtype[x.dtype] = weight.to(x.dtype)
        return nn.functional.linear(x, by_dtype[x.dtype], module.bias)

    return forward


def _record_amax(modules: dict[str, NVFP4Linear], names: list[str], run: Callable[[], Any]) -> dict[str, torch.Tensor]:
    amax: dict[str, torch.Tensor | None] = dict.fromkeys(names)
    for name in names:
        modules[name].forward = _calibrating_forward(name, modules[name], amax)  # type: ignore[method-assign]
    try:
        with torch.no_grad():
            run()
    finally:
        for name in names:
            del modules[name].forward  # back to the class's forward
    never = [n for n, a in amax.items() if a is None or not bool(torch.isfinite(a)) or float(a) == 0.0]
    if never:
        raise RuntimeError(f"calibration saw no usable (nonzero, finite) input for {len(never)} layer(s): {never[:20]}")
    return cast("dict[str, torch.Tensor]", amax)  # no None left: `never` is empty


def _write_side_file(out_path: str | os.PathLike, scales: dict[str, float], amax: dict[str, torch.Tensor]) -> None:
    Path(out_path).write_text(json.dumps({
        "format": INPUT_SCALES_FORMAT, "version": 1,
        "note": "input_scale = amax / (448 * 6) per layer, recorded by diffusers_nvfp4_fast.calibrate_input_scales",
        "input_scales": scales, "amax": {n: float(a.item()) for n, a in amax.items()},
    }, indent=1))


@torch.no_grad()
def _apply(model: nn.Module, modules: dict[str, NVFP4Linear], scales: dict[str, float]) -> None:
    for name, value in scales.items():
        m = modules[name]
        m.input_scale = torch.tensor(value, dtype=torch.float32, device=m.weight.device)
        m.refresh_derived_scales_()
        m.dynamic_input_scale = False
        m.input_scale_source = "calibrated"
    record_checkpoint_config(model)


def calibrate_input_scales(
    pipe_or_transformer: Any,
    prompts_or_run: Sequence[str] | Callable[[], Any],
    out_path: str | os.PathLike | None = None,
    *,
    layers: Sequence[str] | None = None,
    apply: bool = True,
    call_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, float]:
    """Record activation amax for NVFP4 layers lacking an ``input_scale`` and turn it into ``amax / 2688``.

    The layers (default: every ``NVFP4Linear`` with ``dynamic_input_scale=True``, i.e. loaded without a checkpoint
    scale) run with dequantized weights in BF16 during the runs, the way ModelOpt's max calibration sees unquantized
    activations; all other layers run as they are. Save the result with ``out_path`` and reuse it with
    ``load_nvfp4_transformer(file, input_scales=out_path)``.

    Args:
        pipe_or_transformer: a pipeline (``.transformer`` is used) or the transformer.
        prompts_or_run: prompts (each runs ``pipe(prompt=p, **call_kwargs)``) or a callable doing the runs.
        out_path: JSON side file to write (``{"format", "version", "input_scales": {...}, "amax": {...}}``).
        layers: diffusers layer names to calibrate instead of the default set.
        apply: set the scales on the layers and switch their ``dynamic_input_scale`` off (default True).

    Returns:
        ``{layer name: input_scale}``.
    """
    model = getattr(pipe_or_transformer, "transformer", pipe_or_transformer)
    model = getattr(model, "_orig_mod", model)
    modules = {n: m for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    names = list(layers) if layers is not None else [n for n, m in modules.items() if m.dynamic_input_scale]
    unknown = [n for n in names if n not in modules]
    if unknown:
        raise ValueError(f"not NVFP4Linear layers of {type(model).__name__}: {unknown}")
    if not names:
        raise ValueError("no layers to calibrate: no NVFP4Linear has dynamic_input_scale=True (pass layers=)")
    amax = _record_amax(modules, names, _runner(pipe_or_transformer, prompts_or_run, call_kwargs))
    scales = {n: float((a.cpu() / INPUT_SCALE_DIVISOR).item()) for n, a in amax.items()}
    if out_path is not None:
        _write_side_file(out_path, scales, amax)
    if apply:
        _apply(model, modules, scales)
    logger.info("Calibrated input_scale for %d layer(s)%s", len(scales), f", wrote {out_path}" if out_path else "")
    return scales
