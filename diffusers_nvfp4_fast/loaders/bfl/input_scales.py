"""Input scales for NVFP4 layers whose checkpoint has none (the FLUX.2 '-mixed' file): a user mapping or a JSON side
file, validated; and the error that lists the options when neither is given."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from ..errors import NVFP4CheckpointError

INPUT_SCALE_DIVISOR = 448.0 * 6.0  # ModelOpt: input_scale = amax / (E4M3_MAX * E2M1_MAX)
INPUT_SCALES_FORMAT = "diffusers-nvfp4-fast/input_scales"


def read_input_scales(arg: Mapping[str, float | torch.Tensor] | str | os.PathLike) -> dict[str, float]:
    """``{diffusers layer name: input_scale}`` from a mapping or a JSON side file (``calibrate_input_scales``'s output,
    or a flat ``{name: value}`` object). Values must be finite and > 0."""
    source = "input_scales"
    if isinstance(arg, (str, os.PathLike)):
        source = str(arg)
        data = json.loads(Path(arg).read_text())
        if not isinstance(data, dict):
            raise NVFP4CheckpointError(f"{source}: expected a JSON object")
        arg = data["input_scales"] if isinstance(data.get("input_scales"), dict) else data
    out = {}
    bad = []
    for name, value in arg.items():
        if torch.is_tensor(value):
            if value.numel() != 1:
                bad.append(f"{name}: tensor of shape {list(value.shape)}, expected one value")
                continue
            value = value.reshape(()).to(torch.float32).item()
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            bad.append(f"{name}: {value!r} is not a finite number > 0")
            continue
        out[str(name)] = float(value)
    if bad:
        raise NVFP4CheckpointError(f"{source}: invalid input scales:\n  " + "\n  ".join(bad))
    return out


def missing_input_scale_message(file: Path, names: list[str]) -> str:
    shown = "\n  ".join(names[:40]) + ("\n  ..." if len(names) > 40 else "")
    return (
        f"{file}: {len(names)} NVFP4 layer(s) have no input_scale (the activation scale the checkpoint was "
        f"calibrated with), e.g. the '-mixed' FLUX.2 file. Using 1.0 would saturate activations, so nothing was "
        f"loaded. Choose one:\n"
        f"  (A) input_scales={{layer: value}} or input_scales='scales.json' -- your own calibration; "
        f"diffusers_nvfp4_fast.loaders.calibrate.calibrate_input_scales(...) records one over a few prompts and "
        f"writes that file;\n"
        f"  (B) dynamic_input_scale=True -- per-call amax/2688 of each layer's actual input (not the checkpoint's "
        f"recipe: results depend on the batch).\n"
        f"Layers (diffusers names):\n  {shown}"
    )
