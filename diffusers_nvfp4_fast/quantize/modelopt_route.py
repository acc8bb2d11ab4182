"""``quantize_transformer(..., method="modelopt")``: ModelOpt's own NVFP4 quantizer and max calibration, run through
the user's pipeline, written by ModelOpt's ``export_hf_checkpoint`` (docs/checkpoints.md, "The ModelOpt route").

Only public ModelOpt names are used (``mtq.quantize``, ``mtq.NVFP4_DEFAULT_CFG``, ``mtq.disable_quantizer``,
``export_hf_checkpoint``). The layers this package's recipe keeps in BF16 get their quantizers disabled after
calibration (ModelOpt's calibration does not quantize, so the layers it measured saw BF16 inputs either way).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .calibration import free, load_pipeline, place_pipeline, run_prompts, transformer_in
from .source import BF16Source


class ModelOptUnavailableError(RuntimeError):
    """``method="modelopt"`` without nvidia-modelopt installed."""


def _modelopt():
    try:
        import modelopt.torch.quantization as mtq
        from modelopt.torch.export import export_hf_checkpoint
    except ImportError as e:
        raise ModelOptUnavailableError(
            f"method='modelopt' needs nvidia-modelopt (pip install 'nvidia-modelopt==0.47.0'): {e}") from e
    return mtq, export_hf_checkpoint


def export_with_modelopt(source: BF16Source, quant: Sequence[str], pipeline: Any, prompts: Sequence[str],
                         dtype: torch.dtype, device: str, options: Mapping[str, Any], work_dir: Path) -> dict:
    """Load the BF16 transformer whole, let ModelOpt calibrate it over ``prompts`` in ``pipeline`` and quantize the
    Linears in ``quant`` (every other quantizer disabled), and export it into ``work_dir``. Returns the config
    ModelOpt wrote (its ``quantization_config`` names the producer and the BF16 layers)."""
    mtq, export_hf_checkpoint = _modelopt()
    model = source.cls.from_pretrained(source.model_dir, dtype=dtype)  # type: ignore[attr-defined]
    pipe = load_pipeline(pipeline, model, dtype) if isinstance(pipeline, (str, os.PathLike)) else pipeline
    quantized = set(quant)

    def forward_loop(_model: torch.nn.Module) -> None:
        run_prompts(pipe, prompts, options.get("call_kwargs"), options.get("steps", 4), options.get("seed", 0),
                    options.get("progress", True))

    try:
        # no_grad, not inference_mode: the calibrators update their amax buffers in place.
        with transformer_in(pipe, model), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ModelOpt's own notices (inserted quantizers, export steps)
            place_pipeline(pipe, device, options.get("offload"))
            mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, forward_loop)
            mtq.disable_quantizer(model, lambda name: name.rpartition(".")[0] not in quantized)
            export_hf_checkpoint(model, export_dir=work_dir)
    finally:
        free(model)
    return json.loads((work_dir / "config.json").read_text())


def export_text_encoder_with_modelopt(model: torch.nn.Module, pipe: Any, quantized: set[str], run: Any,
                                      work_dir: Path) -> None:
    """ModelOpt's LLM route for a text encoder: ``mtq.quantize(model, NVFP4_DEFAULT_CFG, forward_loop)`` with the
    pipeline encoding ``run.prompts`` (``text_calibration.encode_prompts``), every quantizer outside ``quantized``
    disabled (the recipe's own disables, plus ``exclude`` and in_features not a multiple of 16), exported by
    ``export_hf_checkpoint`` into ``work_dir``."""
    from .text_calibration import encode_prompts, text_encoder_in

    mtq, export_hf_checkpoint = _modelopt()
    encode = encode_prompts(pipe, run.prompts, run.call_kwargs, run.device, run.progress)
    with text_encoder_in(pipe, model), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ModelOpt's own notices (inserted quantizers, export steps)
        model.to(run.device)
        mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, lambda _model: encode())
        mtq.disable_quantizer(model, lambda name: name.rpartition(".")[0] not in quantized)
        export_hf_checkpoint(model, dtype=run.dtype, export_dir=work_dir)
