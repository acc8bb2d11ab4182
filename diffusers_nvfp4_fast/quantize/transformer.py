"""``quantize_transformer``: a BF16 diffusers transformer -> an NVFP4 checkpoint that ``load_nvfp4_transformer``
reads, streamed tensor by tensor (docs/checkpoints.md, "Making an NVFP4 checkpoint").
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..loaders.common import is_excluded, qkv_group, quantization_config
from ..utils import check_device
from .calibration import DEFAULT_PROMPTS, calibrate_pipeline, free, load_pipeline
from .layers import nvfp4_layer_tensors, weight_amax
from .recipes import RECIPE_SOURCES, exclude_patterns, kept_bf16, qwen_rule_applies
from .source import BF16Source, open_source
from .workdir import remove_stale_work_dirs, terminate_raises, work_dir_for
from .writer import ShardWriter, check_target, parse_size, publish

MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SET_BY_THE_COMMAND = {"prompt": "--prompts / prompts=", "num_inference_steps": "--steps / num_inference_steps=",
                      "generator": "--seed / seed="}


class EmptyPlanError(ValueError):
    """No Linear of the model would become NVFP4; the message says which option or recipe rule kept each one BF16
    and how to write the all-BF16 checkpoint anyway (``allow_empty``)."""


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
        steps = (f"{scales['num_inference_steps']} steps each" if "num_inference_steps" in scales
                 else "each encoded once (encode_prompt)")
        how = (f"calibrated: max |input| over {len(scales['prompts'])} prompt(s), {steps}; input_scale = amax / "
               f"2688 ({scales['min_input_scale']:.4g} .. {scales['max_input_scale']:.4g})"
               if scales["method"] == "calibrated"
               else f"ModelOpt's max calibration over {len(scales['prompts'])} prompt(s), {steps}"
               if scales["method"] == "modelopt"
               else "none: no layer is NVFP4 (allow_empty)" if scales["method"] == "none"
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


def check_run_arguments(pipeline: Any, dynamic: bool, dtype: torch.dtype, method: str) -> None:
    """Refuse a method, calibration choice or dtype no quantize run can use (transformers and text encoders alike)."""
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


def _check_arguments(pipeline: Any, dynamic: bool, dtype: torch.dtype, method: str, options: Mapping[str, Any],
                     device: str, max_shard_size: int | str) -> None:
    """Refuse, before anything is read, an argument no run can use (each check is cheap and names the value)."""
    check_run_arguments(pipeline, dynamic, dtype, method)
    steps = options["steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"num_inference_steps={steps!r} (--steps): calibration runs at least 1 step per prompt")
    given = sorted(set(options["call_kwargs"] or {}) & set(SET_BY_THE_COMMAND))
    if given:
        raise ValueError(f"call_kwargs (--call-kwargs) set {', '.join(given)}, which the command sets itself: use "
                         + ", ".join(SET_BY_THE_COMMAND[k] for k in given))
    check_device(device)
    parse_size(max_shard_size)


def refuse_overlap(source_dir: Path, out_dir: Path) -> None:
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


def input_scale_facts(method: str, amax: dict[str, float] | None, prompts: Sequence[str],
                       steps: int) -> dict[str, Any]:
    """``quantization_config.input_scales``: ``none`` (no NVFP4 layer), ``dynamic``, ``modelopt`` (ModelOpt's max
    calibration, its scales in the export) or ``calibrated`` (this package's, with the range of the scales)."""
    if method == "none":
        return {"method": "none", "reason": "no Linear is NVFP4 (allow_empty)"}
    if method == "dynamic":
        return {"method": "dynamic"}
    facts: dict[str, Any] = {"method": method, "prompts": list(prompts), "num_inference_steps": steps}
    if method == "calibrated" and amax:
        facts.update(min_input_scale=min(amax.values()) / 2688.0, max_input_scale=max(amax.values()) / 2688.0)
    return facts


def _package_scale_method(quant: Sequence[str], dynamic: bool) -> str:
    """How this package's route makes the input scales: ``none`` (nothing is quantized), ``dynamic`` or
    ``calibrated``."""
    return "none" if not quant else "dynamic" if dynamic else "calibrated"


def _nothing_to_quantize(src: BF16Source, patterns: Sequence[str], given: bool) -> str:
    """Why no Linear of ``src`` would become NVFP4: which option or recipe rule kept how many of them BF16."""
    linears = src.linears
    excluded, narrow = kept_bf16(list(linears), patterns)
    what = f"{src.model_dir}: no Linear would become NVFP4, so the checkpoint would be all BF16: "
    if not linears:
        return what + f"this {src.class_name} has no Linear layers"
    if given:
        why = f"--exclude / exclude= ({' '.join(patterns)}) matches {excluded} of its {len(linears)} Linears"
    elif qwen_rule_applies(src.class_name):
        why = (f"the recipe for {src.class_name} keeps everything outside transformer_blocks and the first two and "
               f"the last two of them in BF16, and this model has num_layers={src.config.get('num_layers')} "
               f"transformer_blocks (5 or more leave one to quantize); {excluded} of its {len(linears)} Linears "
               "match the recipe")
    else:
        why = (f"the recipe for {src.class_name} ({', '.join(patterns)}) matches {excluded} of its "
               f"{len(linears)} Linears")
    if narrow:
        why += f", and the other {narrow} have in_features that are not a multiple of 16"
    return what + why + ". Pass --allow-empty (allow_empty=True) to write it anyway"


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
    allow_empty: bool = False,
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
        allow_empty: write the checkpoint even when no Linear becomes NVFP4 (``exclude`` or the recipe keeps every
            one BF16; ``quantization_config.input_scales.method`` is then ``"none"``; this package's method only).
            Refused otherwise, naming the option or recipe rule.

    Returns:
        A ``QuantizedCheckpoint`` (``.summary()`` reads well).

    Raises:
        FileNotFoundError: no such source; FileExistsError: ``out_dir`` not empty; ValueError (``QuantizeSourceError``,
        ``UnknownModelClassError``, ``EmptyPlanError``, ``CalibrationError``): an argument, source, class, plan or
        calibration this cannot use. Nothing is written in any of these cases. ``workdir.Terminated`` (a
        ``SystemExit`` with status 128 + the signal number): SIGTERM or SIGHUP arrived, the work directory was
        removed; a ``KeyboardInterrupt`` removes it too.
    """
    dtype = dtype or torch_dtype or torch.bfloat16
    options = {"call_kwargs": call_kwargs, "offload": offload, "steps": num_inference_steps, "seed": seed,
               "progress": progress}
    _check_arguments(pipeline, dynamic, dtype, method, options, device, max_shard_size)
    out = Path(out_dir)
    check_target(out, overwrite)
    started = time.perf_counter()
    src = open_source(source, subfolder)
    refuse_overlap(src.model_dir, out)
    patterns = tuple(exclude) if exclude is not None else exclude_patterns(src.class_name, src.config, src.model_dir)
    recipe = "given by the caller" if exclude is not None else RECIPE_SOURCES[src.class_name]
    quant, kept = _plan(src, patterns)
    _refuse_empty_plan(src, patterns, quant, exclude is not None, allow_empty, method)
    run = _Run(src, out, patterns, recipe, quant, kept, list(prompts or DEFAULT_PROMPTS), dtype, device, options,
               overwrite, started)
    remove_stale_work_dirs(out)
    with terminate_raises():
        if method == "modelopt":
            return _modelopt_route(run, pipeline)
        return _package_route(run, pipeline, dynamic, max_shard_size)


@dataclass
class _Run:
    """What both routes need: the source, the target, the plan (``quant`` / ``kept``) and the options."""

    src: BF16Source
    out: Path
    patterns: tuple[str, ...]
    recipe: str
    quant: list[str]
    kept: list[str]
    prompts: list[str]
    dtype: torch.dtype
    device: str
    options: dict[str, Any]
    overwrite: bool
    started: float

    def result(self, input_scales: dict[str, Any], files: list[str], total_bytes: int,
               seconds: dict[str, float]) -> QuantizedCheckpoint:
        return QuantizedCheckpoint(self.out, self.src.class_name, self.patterns, self.recipe, self.quant, self.kept,
                                   input_scales, files, total_bytes, seconds)


def _refuse_empty_plan(src: BF16Source, patterns: tuple[str, ...], quant: list[str], given: bool, allow_empty: bool,
                       method: str) -> None:
    if quant:
        return
    if not allow_empty:
        raise EmptyPlanError(_nothing_to_quantize(src, patterns, given))
    if method == "modelopt":
        raise EmptyPlanError(f"{src.model_dir}: no Linear would become NVFP4, and ModelOpt exports such a model as a "
                             "plain BF16 model without a quantization_config; use method='package' (--method "
                             "package) for an all-BF16 checkpoint with allow_empty")


def _package_route(run: _Run, pipeline: Any, dynamic: bool, max_shard_size: int | str) -> QuantizedCheckpoint:
    """This package's quantizer: calibrate (unless dynamic or nothing is quantized), stream, publish."""
    src, quant = run.src, run.quant
    amax = None if dynamic or not quant else _calibrate(src, quant, pipeline, run.prompts, run.dtype, run.device,
                                                        run.options)
    calibrated = time.perf_counter()
    with work_dir_for(run.out) as work:
        writer = ShardWriter(work, max_shard_size)
        _stream(src, quant, amax, writer, run.dtype, run.device, run.options["progress"])
        files = writer.finish()
        qconfig = quantization_config(run.kept, "linear", quant if dynamic else [])
        qconfig["input_scales"] = input_scale_facts(_package_scale_method(quant, dynamic), amax, run.prompts,
                                                     run.options["steps"])
        qconfig["exclude_patterns"], qconfig["exclude_recipe"] = list(run.patterns), run.recipe
        publish(work, {**src.config, "quantization_config": qconfig}, run.out, run.overwrite)
    seconds = {"calibration": calibrated - run.started, "quantization": time.perf_counter() - calibrated}
    return run.result(qconfig["input_scales"], files, writer.total_bytes, seconds)


def _modelopt_route(run: _Run, pipeline: Any) -> QuantizedCheckpoint:
    """``method="modelopt"``: ModelOpt quantizes, calibrates and exports (``modelopt_route``); this package adds its
    facts to the export's ``quantization_config`` and publishes the directory whole or not at all."""
    from .modelopt_route import export_with_modelopt

    with work_dir_for(run.out) as work:
        config = export_with_modelopt(run.src, run.quant, pipeline, run.prompts, run.dtype, run.device, run.options,
                                      work)
        qconfig = config["quantization_config"]
        qconfig["input_scales"] = input_scale_facts("modelopt", None, run.prompts, run.options["steps"])
        qconfig["exclude_patterns"], qconfig["exclude_recipe"] = list(run.patterns), run.recipe
        files = sorted(p.name for p in work.iterdir() if p.suffix == ".safetensors")
        total = sum((work / f).stat().st_size for f in files)
        publish(work, config, run.out, run.overwrite)
    return run.result(qconfig["input_scales"], files, total,
                      {"calibration and export (ModelOpt)": time.perf_counter() - run.started})
