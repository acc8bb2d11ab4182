"""``quantize_transformer``: a BF16 diffusers transformer -> an NVFP4 checkpoint that ``load_nvfp4_transformer``
reads, streamed tensor by tensor (docs/checkpoints.md, "Making an NVFP4 checkpoint").
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..loaders.common import is_excluded, qkv_group, quantization_config
from .calibration import DEFAULT_PROMPTS, calibrate_pipeline, free, load_pipeline
from .layers import nvfp4_layer_tensors, weight_amax
from .recipes import RECIPE_SOURCES, exclude_patterns
from .source import BF16Source, open_source
from .writer import ShardWriter, check_target, new_work_dir, publish

MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass
class QuantizedCheckpoint:
    """What ``quantize_transformer`` wrote: where, which layers became NVFP4, how the input scales were made."""

    path: Path
    class_name: str
    exclude: tuple[str, ...]
    recipe: str
    nvfp4_layers: list[str]
    bf16_linears: list[str]
    input_scales: dict[str, Any]
    files: list[str]
    total_bytes: int
    seconds: dict[str, float] = field(default_factory=dict)

    def summary(self) -> str:
        """A few readable lines (the command prints them)."""
        scales = self.input_scales
        how = (f"calibrated: max |input| over {len(scales['prompts'])} prompt(s), {scales['num_inference_steps']} "
               f"steps each; input_scale = amax / 2688 ({scales['min_input_scale']:.4g} .. "
               f"{scales['max_input_scale']:.4g})" if scales["method"] == "calibrated"
               else f"ModelOpt's max calibration over {len(scales['prompts'])} prompt(s), "
                    f"{scales['num_inference_steps']} steps each" if scales["method"] == "modelopt"
               else "dynamic: each call uses amax(input) / 2688 (not a calibrated recipe; fused paths fall back)")
        timing = ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items())
        return "\n".join([
            f"wrote {self.path} ({self.class_name}): {len(self.nvfp4_layers)} NVFP4 Linears, "
            f"{len(self.bf16_linears)} kept BF16, {self.total_bytes / 1e6:.1f} MB in {len(self.files)} file(s)",
            f"kept BF16: {', '.join(self.exclude)} ({self.recipe})",
            f"input scales: {how}",
            f"time: {timing}",
        ])


def quantizable(name: str, linear: nn.Linear, exclude: Sequence[str]) -> bool:
    """Whether Linear ``name`` becomes NVFP4: not excluded, and in_features a multiple of 16."""
    return not is_excluded(name, list(exclude)) and linear.in_features % 16 == 0


def _plan(source: BF16Source, exclude: Sequence[str]) -> tuple[list[str], list[str]]:
    """(Linears to quantize, Linears kept BF16)."""
    quant: list[str] = []
    kept: list[str] = []
    for name, linear in source.linears.items():
        (quant if quantizable(name, linear, exclude) else kept).append(name)
    return quant, kept


METHODS = ("package", "modelopt")


def _check_arguments(pipeline: Any, dynamic: bool, dtype: torch.dtype, method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"method={method!r}: expected one of {', '.join(METHODS)}")
    if dynamic == (pipeline is not None):
        raise ValueError("give either a pipeline to calibrate input scales with (--pipeline / pipeline=) or "
                         "dynamic=True (--dynamic: activation scales computed per call), not both or neither")
    if dynamic and method == "modelopt":
        raise ValueError("method='modelopt' calibrates its input scales through a pipeline (--pipeline); "
                         "dynamic=True (--dynamic) is this package's method only")
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"dtype={dtype}: expected one of {', '.join(map(str, MODEL_DTYPES))}")


def _refuse_overlap(source_dir: Path, out_dir: Path) -> None:
    src, out = source_dir.resolve(), out_dir.resolve()
    if src == out or src in out.parents or out in src.parents:
        raise ValueError(f"{out_dir}: the output would overlap the source model directory {source_dir}")


def _calibrate(source: BF16Source, quant: list[str], pipeline: Any, prompts: Sequence[str], dtype: torch.dtype,
               device: str, options: Mapping[str, Any]) -> dict[str, float]:
    """Input amax of every layer in ``quant``: the BF16 transformer, loaded whole, run in ``pipeline``."""
    model = source.cls.from_pretrained(source.model_dir, dtype=dtype)  # type: ignore[attr-defined]
    pipe = load_pipeline(pipeline, model, dtype) if isinstance(pipeline, (str, os.PathLike)) else pipeline
    try:
        return calibrate_pipeline(pipe, model, quant, prompts, device=device, **options)
    finally:
        del pipe
        free(model)


def _stream(source: BF16Source, quant: list[str], amax: dict[str, float] | None, writer: ShardWriter,
            dtype: torch.dtype, device: str, progress: bool) -> None:
    """Every tensor of the source, in the class's order: quantized Linears as their four NVFP4 tensors (q/k/v groups
    together, sharing scales), everything else cast to ``dtype``."""
    from tqdm.auto import tqdm

    linears, quantized = source.linears, set(quant)
    done: set[str] = set()
    bar = tqdm(total=len(quant), desc="quantizing", unit="layer", disable=not progress)
    for key in source.skeleton.state_dict():
        module, _, leaf = key.rpartition(".")
        if module in quantized and leaf == "weight":
            if module not in done:
                group = [g for g in qkv_group(module) if g in linears]
                weights = {g: source.read(f"{g}.weight", dtype, device) for g in group}
                group_amax = max(weight_amax(w) for w in weights.values())
                a_amax = None if amax is None else max(amax.get(g, 0.0) for g in group)
                for g in (g for g in group if g in quantized):
                    for suffix, t in nvfp4_layer_tensors(weights[g], group_amax, a_amax).items():
                        writer.add(f"{g}.{suffix}", t)
                    done.add(g)
                    bar.update(1)
        elif key in source.index:
            writer.add(key, source.read(key, dtype))
    bar.close()


def _input_scale_facts(amax: dict[str, float] | None, prompts: Sequence[str], steps: int) -> dict[str, Any]:
    if amax is None:
        return {"method": "dynamic"}
    if not amax:  # the ModelOpt route: ModelOpt's max calibration, its scales in the export
        return {"method": "modelopt", "prompts": list(prompts), "num_inference_steps": steps}
    return {"method": "calibrated", "prompts": list(prompts), "num_inference_steps": steps,
            "min_input_scale": min(amax.values()) / 2688.0, "max_input_scale": max(amax.values()) / 2688.0}


def quantize_transformer(
    source: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    subfolder: str | None = None,
    pipeline: str | os.PathLike | Any | None = None,
    prompts: Sequence[str] | None = None,
    call_kwargs: Mapping[str, Any] | None = None,
    num_inference_steps: int = 4,
    seed: int = 0,
    dynamic: bool = False,
    dtype: torch.dtype | None = None,
    torch_dtype: torch.dtype | None = None,
    device: str = "cpu",
    offload: str | None = None,
    exclude: Sequence[str] | None = None,
    overwrite: bool = False,
    max_shard_size: int | str = "10GB",
    progress: bool = True,
    method: str = "package",
) -> QuantizedCheckpoint:
    """Quantize a BF16 diffusers transformer into an NVFP4 checkpoint directory that ``load_nvfp4_transformer`` reads.

    Weights are quantized with ``format.quantize_nvfp4`` in precise mode (the same bytes on CPU and GPU), read and
    written one tensor at a time, so the model never sits whole in memory for this step. The directory is written
    whole or not at all.

    Args:
        source: directory of a diffusers transformer (``config.json`` + safetensors) or a Hugging Face repo id.
        out_dir: the checkpoint directory to write; refused if it is not empty, unless ``overwrite``.
        subfolder: e.g. ``"transformer"`` inside a pipeline repo or directory.
        pipeline: calibrate input scales by running ``prompts`` through this pipeline (a directory / repo id loaded
            with ``DiffusionPipeline.from_pretrained``, or a pipeline object; its transformer slot holds the BF16
            model read from ``source`` while it runs); the BF16 transformer is then whole on ``device``.
        prompts: calibration prompts (default: three generic ones); ``call_kwargs`` go to every pipeline call
            (``height``, ``width``, ``guidance_scale``...); ``num_inference_steps`` and ``seed`` per prompt.
        dynamic: instead of calibrating, mark every NVFP4 layer as computing ``amax(input) / 2688`` per call.
        dtype: dtype of the BF16-kept tensors and of the weights before quantization (default bfloat16;
            ``torch_dtype`` is accepted too).
        device: where weights are quantized and calibration runs (``"cuda"`` or ``"cpu"``).
        offload: calibrate with diffusers' ``"model"`` or ``"sequential"`` CPU offload instead of the whole
            pipeline on ``device``.
        exclude: fnmatch patterns of Linears to keep BF16; default: the recipe of the config's ``_class_name``.
        max_shard_size: bytes per safetensors file (``"10GB"``, as diffusers; this package's method).
        progress: tqdm progress bars.
        method: ``"package"`` (default: this package's precise quantizer, streamed) or ``"modelopt"`` (ModelOpt's
            ``mtq.quantize`` with ``NVFP4_DEFAULT_CFG`` and max calibration through ``pipeline``, the recipe's
            BF16 layers' quantizers disabled, written by ModelOpt's ``export_hf_checkpoint``; needs
            nvidia-modelopt, and the BF16 transformer whole on ``device`` for the export too).

    Returns:
        A ``QuantizedCheckpoint`` (``.summary()`` reads well).

    Raises:
        FileNotFoundError: no such source; FileExistsError: ``out_dir`` not empty; ValueError (``QuantizeSourceError``,
        ``UnknownModelClassError``, ``CalibrationError``): a source, class or calibration this cannot use. Nothing is
        written in any of these cases.
    """
    dtype = dtype or torch_dtype or torch.bfloat16
    _check_arguments(pipeline, dynamic, dtype, method)
    out = Path(out_dir)
    check_target(out, overwrite)
    started = time.perf_counter()
    src = open_source(source, subfolder)
    _refuse_overlap(src.model_dir, out)
    patterns = tuple(exclude) if exclude is not None else exclude_patterns(src.class_name, src.config, src.model_dir)
    recipe = "given by the caller" if exclude is not None else RECIPE_SOURCES[src.class_name]
    quant, kept = _plan(src, patterns)
    prompts = list(prompts or DEFAULT_PROMPTS)
    options = {"call_kwargs": call_kwargs, "offload": offload, "steps": num_inference_steps, "seed": seed,
               "progress": progress}
    if method == "modelopt":
        return _modelopt_route(src, out, patterns, recipe, quant, kept, pipeline, prompts, dtype, device, options,
                               overwrite, started)
    amax = None if dynamic else _calibrate(src, quant, pipeline, prompts, dtype, device, options)
    calibrated = time.perf_counter()
    work = new_work_dir(out)
    try:
        writer = ShardWriter(work, max_shard_size)
        _stream(src, quant, amax, writer, dtype, device, progress)
        files = writer.finish()
        qconfig = quantization_config(kept, "linear", quant if dynamic else [])
        qconfig["input_scales"] = _input_scale_facts(amax, prompts, num_inference_steps)
        qconfig["exclude_patterns"], qconfig["exclude_recipe"] = list(patterns), recipe
        publish(work, {**src.config, "quantization_config": qconfig}, out, overwrite)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    seconds = {"calibration": calibrated - started, "quantization": time.perf_counter() - calibrated}
    return QuantizedCheckpoint(out, src.class_name, patterns, recipe, quant, kept, qconfig["input_scales"], files,
                               writer.total_bytes, seconds)


def _modelopt_route(src: BF16Source, out: Path, patterns: tuple[str, ...], recipe: str, quant: list[str],
                    kept: list[str], pipeline: Any, prompts: list[str], dtype: torch.dtype, device: str,
                    options: dict[str, Any], overwrite: bool, started: float) -> QuantizedCheckpoint:
    """``method="modelopt"``: ModelOpt quantizes, calibrates and exports (``modelopt_route``); this package adds its
    facts to the export's ``quantization_config`` and publishes the directory whole or not at all."""
    from .modelopt_route import export_with_modelopt

    work = new_work_dir(out)
    try:
        config = export_with_modelopt(src, quant, pipeline, prompts, dtype, device, options, work)
        qconfig = config["quantization_config"]
        qconfig["input_scales"] = _input_scale_facts({}, prompts, options["steps"])
        qconfig["exclude_patterns"], qconfig["exclude_recipe"] = list(patterns), recipe
        files = sorted(p.name for p in work.iterdir() if p.suffix == ".safetensors")
        total = sum((work / f).stat().st_size for f in files)
        publish(work, config, out, overwrite)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return QuantizedCheckpoint(out, src.class_name, patterns, recipe, quant, kept, qconfig["input_scales"], files,
                               total, {"calibration and export (ModelOpt)": time.perf_counter() - started})
