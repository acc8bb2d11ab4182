"""``quantize_text_encoder``: a BF16 transformers text encoder (a pipeline's ``text_encoder``) -> the NVFP4
checkpoint ModelOpt's ``export_hf_checkpoint`` writes for it, streamed tensor by tensor (docs/checkpoints.md,
"Making an NVFP4 text encoder").
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..loaders.common import is_excluded
from ..utils import check_device
from .calibration import DEFAULT_PROMPTS, free
from .layers import nvfp4_layer_tensors, weight_amax
from .recipes import (
    MODELOPT_LLM_DISABLED,
    TEXT_ENCODER_CLASSES,
    TEXT_ENCODER_RECIPE,
    TEXT_SHARED_INPUT_GROUPS,
    UnknownModelClassError,
    modelopt_llm_disabled,
)
from .text_calibration import calibrate_text_encoder, load_text_pipeline
from .text_config import export_configs, summarize_ignore, unquantized_carriers
from .text_source import TextEncoderSource, open_text_source
from .transformer import (
    EmptyPlanError,
    QuantizedCheckpoint,
    check_run_arguments,
    input_scale_facts,
    refuse_overlap,
)
from .workdir import remove_stale_work_dirs, terminate_raises, work_dir_for
from .writer import ShardWriter, check_target, parse_size, publish

WEIGHTS_NAME, WEIGHTS_INDEX_NAME = "model.safetensors", "model.safetensors.index.json"  # transformers' names
HF_QUANT_CONFIG = "hf_quant_config.json"
COPIED_FILES = ("generation_config.json",)  # written by ModelOpt's export from the model, as stored here


def shared_input_group(name: str, quantized: set[str]) -> list[str]:
    """The quantized Linears that read the same input as ``name`` (q/k/v, gate/up siblings), ``name`` included."""
    parent, _, leaf = name.rpartition(".")
    for group in TEXT_SHARED_INPUT_GROUPS:
        if leaf in group:
            members = [f"{parent}.{g}" if parent else g for g in group]
            return [m for m in members if m in quantized]
    return [name]


def _plan(src: TextEncoderSource, exclude: Sequence[str] | None) -> tuple[list[str], list[str]]:
    """(Linears to quantize, Linears kept BF16), by in-memory name."""
    quant: list[str] = []
    kept: list[str] = []
    for name, linear in src.linears.items():
        off = is_excluded(name, list(exclude)) if exclude is not None else modelopt_llm_disabled(name)
        (kept if off or linear.in_features % 16 else quant).append(name)
    return quant, kept


@dataclass
class _TextRun:
    src: TextEncoderSource
    out: Path
    quant: list[str]
    kept: list[str]
    prompts: list[str]
    call_kwargs: Mapping[str, Any] | None
    dtype: torch.dtype
    device: str
    overwrite: bool
    progress: bool
    patterns: tuple[str, ...]
    recipe: str

    def hub(self, name: str) -> str:
        """A module's name as the files spell it (``model.language_model.layers.0.mlp`` -> ``model.layers.0.mlp``)."""
        return self.src.file_key[f"{name}.weight"].removesuffix(".weight")

    def ignore(self) -> list[str]:
        quantized = set(self.quant)
        carriers = [self.hub(n) for n in unquantized_carriers(self.src.skeleton, quantized)
                    if f"{n}.weight" in self.src.file_key]
        return summarize_ignore(carriers, [self.hub(n) for n in self.quant])


def _load_model(src: TextEncoderSource, dtype: torch.dtype) -> torch.nn.Module:
    return src.cls.from_pretrained(src.model_dir, dtype=dtype).eval()  # type: ignore[attr-defined]


def _calibrate(run: _TextRun, pipeline: Any) -> dict[str, float]:
    model = _load_model(run.src, run.dtype)
    pipe = load_text_pipeline(pipeline, model, run.dtype) if isinstance(pipeline, (str, os.PathLike)) else pipeline
    try:
        return calibrate_text_encoder(pipe, model, run.quant, run.prompts, call_kwargs=run.call_kwargs,
                                      device=run.device, progress=run.progress)
    finally:
        del pipe
        free(model)


def _stream(run: _TextRun, amax: dict[str, float] | None, writer: ShardWriter) -> None:
    """Every tensor of the files, under its file key: quantized Linears as their four NVFP4 tensors (a shared-input
    group quantized together, sharing both scales, as ModelOpt's export does), the rest cast to ``dtype``."""
    from tqdm.auto import tqdm

    src, quantized = run.src, set(run.quant)
    weight_of = {src.file_key[f"{n}.weight"]: n for n in run.quant}
    done: set[str] = set()
    bar = tqdm(total=len(run.quant), desc="quantizing", unit="layer", disable=not run.progress)
    for key in src.index.entries:
        name = weight_of.get(key)
        if name is None:
            writer.add(key, src.read(key, run.dtype))
            continue
        if name in done:
            continue
        group = shared_input_group(name, quantized)
        weights = {g: src.read(src.file_key[f"{g}.weight"], run.dtype, run.device) for g in group}
        group_amax = max(weight_amax(w) for w in weights.values())
        a_amax = None if amax is None else max(amax[g] for g in group)
        for g in group:
            for suffix, t in nvfp4_layer_tensors(weights[g], group_amax, a_amax).items():
                writer.add(f"{run.hub(g)}.{suffix}", t)
            done.add(g)
            bar.update(1)
    bar.close()


def _copy_side_files(src: TextEncoderSource, work: Path) -> None:
    for name in COPIED_FILES:
        if (src.model_dir / name).is_file():
            shutil.copyfile(src.model_dir / name, work / name)


def _package_route(run: _TextRun, pipeline: Any, dynamic: bool, max_shard_size: int | str,
                   started: float) -> QuantizedCheckpoint:
    amax = None if dynamic else _calibrate(run, pipeline)
    calibrated = time.perf_counter()
    with work_dir_for(run.out) as work:
        writer = ShardWriter(work, max_shard_size, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)
        _stream(run, amax, writer)
        files = writer.finish()
        qconfig, hf_quant = export_configs(run.ignore(), dynamic)
        if dynamic:
            qconfig["dynamic_input_scale"] = sorted(run.hub(n) for n in run.quant)
        facts = _text_scale_facts("dynamic" if dynamic else "calibrated", amax, run.prompts)
        qconfig.update(input_scales=facts, exclude_patterns=list(run.patterns), exclude_recipe=run.recipe)
        (work / HF_QUANT_CONFIG).write_text(json.dumps(hf_quant, indent=4) + "\n")
        _copy_side_files(run.src, work)
        publish(work, {**run.src.config, "quantization_config": qconfig}, run.out, run.overwrite)
    seconds = {"calibration": calibrated - started, "quantization": time.perf_counter() - calibrated}
    return _result(run, facts, files + [HF_QUANT_CONFIG], writer.total_bytes, seconds)


def _text_scale_facts(method: str, amax: dict[str, float] | None, prompts: Sequence[str]) -> dict[str, Any]:
    facts = input_scale_facts(method, amax, prompts, 1)
    facts.pop("num_inference_steps", None)
    if method != "dynamic":
        facts["calls"] = "encode_prompt"
    return facts


def _result(run: _TextRun, facts: dict[str, Any], files: list[str], total: int,
            seconds: dict[str, float]) -> QuantizedCheckpoint:
    return QuantizedCheckpoint(run.out, run.src.class_name, run.patterns, run.recipe, run.quant, run.kept, facts,
                               files, total, seconds)


def _modelopt_route(run: _TextRun, pipeline: Any, started: float) -> QuantizedCheckpoint:
    from .modelopt_route import export_text_encoder_with_modelopt

    model = _load_model(run.src, run.dtype)
    pipe = load_text_pipeline(pipeline, model, run.dtype) if isinstance(pipeline, (str, os.PathLike)) else pipeline
    with work_dir_for(run.out) as work:
        try:
            export_text_encoder_with_modelopt(model, pipe, set(run.quant), run, work)
        finally:
            del pipe
            free(model)
        config = json.loads((work / "config.json").read_text())
        facts = _text_scale_facts("modelopt", None, run.prompts)
        config["quantization_config"].update(input_scales=facts, exclude_patterns=list(run.patterns),
                                             exclude_recipe=run.recipe)
        files = sorted(p.name for p in work.iterdir() if p.suffix == ".safetensors")
        total = sum((work / f).stat().st_size for f in files)
        publish(work, config, run.out, run.overwrite)
    return _result(run, facts, files, total, {"calibration and export (ModelOpt)": time.perf_counter() - started})


def quantize_text_encoder(
    source: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    subfolder: str | None = None,
    pipeline: str | os.PathLike | Any | None = None,
    prompts: Sequence[str] | None = None,
    call_kwargs: Mapping[str, Any] | None = None,
    dynamic: bool = False,
    dtype: torch.dtype | None = None,
    device: str = "cpu",
    exclude: Sequence[str] | None = None,
    overwrite: bool = False,
    max_shard_size: int | str = "10GB",
    progress: bool = True,
    method: str = "package",
) -> QuantizedCheckpoint:
    """Quantize a pipeline's BF16 text encoder (``Mistral3ForConditionalGeneration``, ``Qwen2_5_VLForConditional
    Generation``, ``Qwen3ForCausalLM``, ``Qwen3VLForConditionalGeneration``) into the directory ModelOpt's
    ``export_hf_checkpoint`` writes for it: the same keys, the same NVFP4 tensors for the same weights and amaxes,
    ``config.json`` with ``quantization_config`` and ``hf_quant_config.json``.

    Weights are read, quantized (``format.quantize_nvfp4``, precise mode) and written one tensor at a time; the
    directory is written whole or not at all (``quantize_transformer``'s work directory and signal handling).

    Args:
        source: a transformers model directory (``config.json`` with ``architectures`` + safetensors) or a Hugging
            Face repo id; ``subfolder``: ``"text_encoder"`` inside a pipeline repo or directory.
        pipeline: calibrate input scales with the pipeline's own prompt encoding: ``pipe.encode_prompt(prompt=p,
            device=device, **call_kwargs)`` for each of ``prompts`` (default: three generic ones) with the BF16
            text encoder in its slot; a directory / repo id (loaded without transformer and VAE) or a pipeline.
        dynamic: instead of calibrating, every NVFP4 layer computes ``amax(input) / 2688`` per call (listed in
            ``quantization_config.dynamic_input_scale``; its ``input_scale`` tensors are a placeholder 1.0).
        dtype: dtype of the kept tensors and of the weights before quantization (default bfloat16).
        device: where calibration runs and weights are quantized (``"cuda"`` or ``"cpu"``).
        exclude: fnmatch patterns of Linears (in-memory names) to keep BF16; default: ModelOpt's LLM recipe
            (``recipes.MODELOPT_LLM_DISABLED``), declared for the four classes above.
        method: ``"package"`` (default) or ``"modelopt"``: ``mtq.quantize`` with ``NVFP4_DEFAULT_CFG`` over the same
            prompt encoding, written by ModelOpt's ``export_hf_checkpoint`` (needs nvidia-modelopt and the model
            whole on ``device``).

    Raises:
        FileNotFoundError, FileExistsError, ValueError (``QuantizeSourceError``, ``UnknownModelClassError``,
        ``EmptyPlanError``, ``CalibrationError``) before anything is written; ``workdir.Terminated`` on SIGTERM /
        SIGHUP after removing the work directory.
    """
    dtype = dtype or torch.bfloat16
    check_run_arguments(pipeline, dynamic, dtype, method)
    check_device(device)
    parse_size(max_shard_size)
    out = Path(out_dir)
    check_target(out, overwrite)
    started = time.perf_counter()
    src = open_text_source(source, subfolder)
    refuse_overlap(src.model_dir, out)
    if exclude is None and src.class_name not in TEXT_ENCODER_CLASSES:
        raise UnknownModelClassError(
            f"{src.model_dir}: architectures={src.class_name!r} has no NVFP4 text-encoder recipe here (known: "
            f"{', '.join(TEXT_ENCODER_CLASSES)}); pass the layers to keep in BF16 (--exclude PATTERN ... / "
            "exclude=[...])")
    quant, kept = _plan(src, exclude)
    if not quant:
        raise EmptyPlanError(f"{src.model_dir}: no Linear of this {src.class_name} would become NVFP4 ({len(kept)} "
                             "kept BF16 by the recipe / --exclude or in_features not a multiple of 16)")
    patterns = tuple(exclude) if exclude is not None else MODELOPT_LLM_DISABLED
    recipe = "given by the caller" if exclude is not None else TEXT_ENCODER_RECIPE
    run = _TextRun(src, out, quant, kept, list(prompts or DEFAULT_PROMPTS), call_kwargs, dtype, device, overwrite,
                   progress, patterns, recipe)
    remove_stale_work_dirs(out)
    with terminate_raises():
        if method == "modelopt":
            return _modelopt_route(run, pipeline, started)
        return _package_route(run, pipeline, dynamic, max_shard_size, started)
