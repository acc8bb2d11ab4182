"""Load a ModelOpt NVFP4 diffusers export (a directory with config.json + safetensors) into diffusers' own class.

Quantized Linears become ``NVFP4Linear`` without ever existing in BF16. Every key is checked (missing, unexpected,
dtype, shape) before any weight is read, and all problems are raised together in one ``NVFP4CheckpointError``.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch
from torch import nn

from ..format import BLOCK_SIZE, ScaleLayout, padded_scale_shape, swap_nibbles
from ..linear import NVFP4Linear
from .common import (
    NVFP4_SUFFIXES,
    is_excluded,
    raise_scale_problems,
    record_load_summary,
    replace_linear,
    scale_layout_from_shape,
    scale_problems,
)
from .errors import NVFP4CheckpointError
from .finish import finish_model
from .safetensors_header import CheckpointIndex

logger = logging.getLogger("diffusers_nvfp4_fast")

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"


@dataclass
class QuantizationInfo:
    """What the checkpoint says about its quantization, including the layout facts a loader must not guess.

    ``scale_layout`` / ``nibble_order``: as the checkpoint states them (``save_pretrained`` of this package writes
    both), else None / "lo_first". ``dynamic_layers``: layers saved without a calibrated input scale.
    """

    quant_algo: str
    group_size: int
    exclude_patterns: list[str] = field(default_factory=list)
    source: str = ""
    producer: str = ""
    scale_layout: str | None = None
    nibble_order: str = "lo_first"
    dynamic_layers: list[str] = field(default_factory=list)


def _layout_facts(info: QuantizationInfo, q: dict) -> QuantizationInfo:
    producer = q.get("producer")
    info.producer = str(producer.get("name", "")) if isinstance(producer, dict) else ""
    info.scale_layout = q.get("weight_scale_layout")
    info.nibble_order = q.get("nibble_order") or "lo_first"
    info.dynamic_layers = list(q.get("dynamic_input_scale") or [])
    if info.scale_layout not in (None, "128x4", "linear"):
        raise NVFP4CheckpointError(
            f"{info.source}: weight_scale_layout {info.scale_layout!r} is not '128x4' or 'linear'"
        )
    if info.nibble_order not in ("lo_first", "hi_first"):
        raise NVFP4CheckpointError(f"{info.source}: nibble_order {info.nibble_order!r} is not 'lo_first' or 'hi_first'")
    return info


def _group_size(qc: dict) -> int:
    group_size = BLOCK_SIZE
    for group in (qc.get("config_groups") or {}).values():
        for part in ("weights", "input_activations"):
            if group.get(part) and group[part].get("group_size") is not None:
                group_size = int(group[part]["group_size"])
    return group_size


def read_quantization_info(model_dir: Path, config: dict) -> QuantizationInfo:
    """From ``config.json["quantization_config"]`` or, failing that, ``hf_quant_config.json``."""
    qc = config.get("quantization_config")
    if qc is not None:
        info = QuantizationInfo(
            quant_algo=str(qc.get("quant_algo", "")), group_size=_group_size(qc),
            exclude_patterns=list(qc.get("ignore") or qc.get("exclude_modules") or []),
            source=str(model_dir / "config.json"),
        )
    elif (model_dir / "hf_quant_config.json").is_file():
        nested = read_json(model_dir / "hf_quant_config.json")
        q = nested.get("quantization", nested)
        info = QuantizationInfo(
            quant_algo=str(q.get("quant_algo", "")), group_size=int(q.get("group_size") or BLOCK_SIZE),
            exclude_patterns=list(q.get("exclude_modules") or q.get("ignore") or []),
            source=str(model_dir / "hf_quant_config.json"),
        )
    else:
        raise NVFP4CheckpointError(
            f"{model_dir}: no quantization_config in config.json and no hf_quant_config.json; "
            "this does not look like a ModelOpt NVFP4 export"
        )
    if info.quant_algo.upper() != "NVFP4":
        raise NVFP4CheckpointError(f"{info.source}: quant_algo is {info.quant_algo!r}, expected 'NVFP4'")
    if info.group_size != BLOCK_SIZE:
        raise NVFP4CheckpointError(f"{info.source}: group_size is {info.group_size}, NVFP4 uses {BLOCK_SIZE}")
    return _layout_facts(info, qc if qc is not None else {**nested, **q})


def resolve_dir(path_or_repo_id: str | os.PathLike, subfolder: str | None) -> Path:
    """A local directory, or a Hugging Face snapshot of the repo (only ``subfolder`` when given)."""
    path = Path(path_or_repo_id)
    if path.exists():
        model_dir = path / subfolder if subfolder else path
    else:
        from huggingface_hub import snapshot_download

        patterns = [f"{subfolder}/*"] if subfolder else None
        try:
            model_dir = Path(snapshot_download(str(path_or_repo_id), allow_patterns=patterns))
        except (OSError, ValueError) as e:  # not found, offline, invalid id: huggingface_hub's errors derive from them
            raise FileNotFoundError(f"{path_or_repo_id}: no such local file or directory, and no Hugging Face repo "
                                    f"could be downloaded ({type(e).__name__}: {e})") from e
        model_dir = model_dir / subfolder if subfolder else model_dir
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json (is `subfolder` right?)")
    return model_dir


def weight_files(model_dir: Path, index_name: str = WEIGHTS_INDEX_NAME) -> list[Path]:
    """The safetensors files of an export: the shards of its index ``index_name`` (diffusers' by default;
    transformers' ``model.safetensors.index.json`` for a text encoder), the single weights file, or every
    ``*.safetensors``."""
    index = model_dir / index_name
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise NVFP4CheckpointError(f"{index}: no 'weight_map' object")
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise NVFP4CheckpointError(f"{index}: lists {len(missing)} shard(s) that are not in {model_dir}: "
                                       f"{', '.join(missing)} (an incomplete download or copy?)")
        return files
    if (model_dir / WEIGHTS_NAME).is_file():
        return [model_dir / WEIGHTS_NAME]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        bins = sorted(f.name for f in model_dir.glob("*.bin"))
        raise NVFP4CheckpointError(f"{model_dir}: no .safetensors weights" + (
            f" ({', '.join(bins)}: this loader reads safetensors only)" if bins else ""))
    return files


def read_json(path: Path) -> dict:
    """A checkpoint's JSON file as a dict; ``NVFP4CheckpointError`` naming the file otherwise."""
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise NVFP4CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise NVFP4CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _stored_layout(name: str, shape: tuple[int, ...], n: int, k: int, declared: str | None, info: QuantizationInfo,
                   problems: list[str]) -> ScaleLayout | None:
    """The layout of one layer's stored block scales: what the checkpoint (or the caller) declares, checked against
    the shape; else what the shape proves; else ModelOpt's export default (linear) for a ModelOpt export. A shape
    that fits both layouts in a checkpoint that says nothing is never guessed: it is a problem naming the choice."""
    guess = scale_layout_from_shape(shape, n, k)
    where = f"{name}.weight_scale"
    if guess == "neither" or guess == "128x4 (flat)":
        problems.append(f"{where}: shape {list(shape)} is neither linear {[n, k // 16]} nor 128x4-swizzled "
                        f"{list(padded_scale_shape(n, k))}")
        return None
    if declared is not None:
        if guess not in (declared, "ambiguous"):
            problems.append(f"{where}: shape {list(shape)} is the {guess} shape, but the scales are declared "
                            f"{declared} ({'argument' if declared != info.scale_layout else info.source})")
            return None
        return cast(ScaleLayout, declared)  # a ScaleLayout argument, or checked by _layout_facts
    if guess != "ambiguous":
        return cast(ScaleLayout, guess)  # 'neither', '128x4 (flat)' and 'ambiguous' are excluded
    if info.producer == "modelopt":
        return "linear"
    problems.append(f"{where}: shape {list(shape)} fits both the linear and the 128x4 layout, and {info.source} does "
                    "not say which one it stores: pass scale_layout='linear' (ModelOpt's export default) or "
                    "scale_layout='128x4'")
    return None


def _check_nvfp4_layer(name: str, linear: nn.Linear, index: CheckpointIndex, declared: str | None,
                       info: QuantizationInfo, problems: list[str]) -> ScaleLayout | None:
    """Check one quantized layer's keys, dtypes and shapes; returns the stored scale layout (None on problems)."""
    n, k = linear.out_features, linear.in_features
    dynamic = name in info.dynamic_layers  # its activation scale is taken per call: a stored input_scale is unused
    missing = [s for s in NVFP4_SUFFIXES if f"{name}.{s}" not in index and not (dynamic and s == "input_scale")]
    problems.extend(f"missing key {name}.{s} (NVFP4 layer {name} [{n}x{k}])" for s in missing)
    if missing:
        return None

    def expect(suffix: str, dtypes: tuple[torch.dtype, ...], shapes) -> tuple[int, ...]:
        path, info = index.entries[f"{name}.{suffix}"]
        if info.torch_dtype not in dtypes:
            problems.append(f"{name}.{suffix} in {path.name}: dtype {info.torch_dtype or info.dtype}, expected "
                            f"{' or '.join(map(str, dtypes))}")
        if shapes is not None and info.shape not in shapes:
            problems.append(f"{name}.{suffix} in {path.name}: shape {list(info.shape)}, expected "
                            f"{' or '.join(str(list(s)) for s in shapes)}")
        return info.shape

    if k % BLOCK_SIZE:
        problems.append(f"{name}: in_features {k} is not a multiple of {BLOCK_SIZE}, cannot be NVFP4")
        return None
    expect("weight", (torch.uint8,), [(n, k // 2)])
    expect("weight_scale_2", (torch.float32,), [(), (1,)])
    if f"{name}.input_scale" in index:
        expect("input_scale", (torch.float32,), [(), (1,)])
    scale_shape = expect("weight_scale", (torch.float8_e4m3fn, torch.uint8), None)
    layout = _stored_layout(name, scale_shape, n, k, declared, info, problems)
    if linear.bias is not None:
        if f"{name}.bias" in index:
            expect("bias", (torch.bfloat16, torch.float16, torch.float32), [(n,)])
        else:
            problems.append(f"missing key {name}.bias (layer {name} has a bias)")
    return layout


def _model_class(config: dict, path: Path):
    import diffusers

    cls_name = config.get("_class_name")
    if not cls_name:
        raise NVFP4CheckpointError(f"{path}: no _class_name (the diffusers model class, e.g. "
                                   "'Flux2Transformer2DModel'); is this a diffusers model directory?")
    cls = getattr(diffusers, str(cls_name), None)
    if cls is None:
        raise NVFP4CheckpointError(f"{path}: _class_name={cls_name!r}, which diffusers does not provide")
    return cls


def _stored_as_nvfp4(name: str, index: CheckpointIndex) -> bool:
    weight = index.info(f"{name}.weight")
    return f"{name}.weight_scale" in index or (weight is not None and weight.dtype == "U8")


def _plan_quantized(model: nn.Module, index: CheckpointIndex, qinfo: QuantizationInfo, scale_layout: str | None,
                    problems: list[str]) -> dict:
    """Quantized Linear name -> stored scale layout, checking each; warns where the file and the patterns disagree.
    ``scale_layout`` is the caller's declaration; contradicting the checkpoint's own is a problem."""
    if scale_layout is not None and qinfo.scale_layout not in (None, scale_layout):
        problems.append(f"scale_layout={scale_layout!r} was passed, but {qinfo.source} says the block scales are "
                        f"{qinfo.scale_layout!r}")
    declared = scale_layout or qinfo.scale_layout
    quantized: dict[str, ScaleLayout | None] = {}
    disagreements = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        stored_nvfp4 = _stored_as_nvfp4(name, index)
        if stored_nvfp4 == is_excluded(name, qinfo.exclude_patterns):
            disagreements.append(f"{name} ({'NVFP4' if stored_nvfp4 else 'BF16'} in the file)")
        if stored_nvfp4:
            quantized[name] = _check_nvfp4_layer(name, module, index, declared, qinfo, problems)
    if disagreements:
        shown = ", ".join(disagreements[:8]) + (" ..." if len(disagreements) > 8 else "")
        logger.warning("%d layer(s) are stored differently from what the exclude patterns in %s say; "
                       "the stored tensors win: %s", len(disagreements), qinfo.source, shown)
    return quantized


def _check_plain_keys(model: nn.Module, index: CheckpointIndex, quantized: dict, problems: list[str]) -> list[str]:
    """Check every non-quantized tensor of the model against the file; returns the keys to load."""
    expected = {k: t for k, t in model.state_dict().items() if k.rsplit(".", 1)[0] not in quantized}
    params = dict(model.named_parameters())
    for key, t in expected.items():
        entry = index.entries.get(key)
        if entry is None:
            if key in params:
                problems.append(f"missing key {key} (shape {list(t.shape)})")
            continue
        path, info = entry
        if info.shape != tuple(t.shape):
            problems.append(f"{key} in {path.name}: shape {list(info.shape)}, expected {list(t.shape)}")
        if info.torch_dtype is None or not info.torch_dtype.is_floating_point:
            problems.append(f"{key} in {path.name}: dtype {info.dtype}, expected a floating-point dtype")
    nvfp4_keys = {f"{n}.{s}" for n in quantized for s in (*NVFP4_SUFFIXES, "bias")}
    for key, (path, info) in index.entries.items():
        if key not in expected and key not in nvfp4_keys:
            problems.append(f"unexpected key {key} in {path.name} ({info.dtype}, {list(info.shape)})")
    return [k for k in expected if k in index]


def build_nvfp4_layer(linear: nn.Linear, name: str, tensors: dict[str, torch.Tensor], layout: ScaleLayout,
                      qinfo: QuantizationInfo, torch_dtype: torch.dtype,
                      problems: list[str]) -> tuple[NVFP4Linear, bool]:
    """The ``NVFP4Linear`` that replaces ``linear`` (its ``in_features``, ``out_features`` and bias), holding one
    layer's stored tensors (``tensors``: suffix -> tensor, ``bias`` when it has one), block scales swizzled to 128x4;
    and whether they were swizzled. Unusable scale values are added to ``problems``. Every route that reads a stored
    layer builds it here (``load_nvfp4_transformer`` and diffusers' ``from_pretrained``, docs/checkpoints.md)."""
    dynamic = name in qinfo.dynamic_layers
    problems += scale_problems(name, tensors["weight_scale"], tensors["weight_scale_2"],
                               None if dynamic else tensors["input_scale"])
    packed = tensors["weight"].view(torch.uint8)
    new = NVFP4Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, dtype=torch_dtype)
    input_scale = tensors.get("input_scale", torch.ones((), dtype=torch.float32))  # a dynamic layer may have none
    new.load_nvfp4(swap_nibbles(packed) if qinfo.nibble_order == "hi_first" else packed, tensors["weight_scale"],
                   tensors["weight_scale_2"], input_scale, tensors.get("bias"), scale_layout=layout)
    new.dynamic_input_scale = dynamic
    return new, new.swizzle_weight_scales_()


def load_nvfp4_layer(model: nn.Module, name: str, index: CheckpointIndex, layout: ScaleLayout,
                      qinfo: QuantizationInfo, torch_dtype: torch.dtype, problems: list[str]) -> bool:
    """Replace Linear ``name`` by an ``NVFP4Linear`` holding the stored tensors; True if its scales were swizzled.
    Unusable scale values are added to ``problems``."""
    linear = cast(nn.Linear, model.get_submodule(name))  # _plan_quantized found it as an nn.Linear
    suffixes = [s for s in (*NVFP4_SUFFIXES, *(["bias"] if linear.bias is not None else []))
                if f"{name}.{s}" in index]  # _check_nvfp4_layer found every key the layer needs
    stored = index.load([f"{name}.{s}" for s in suffixes])
    new, swizzled = build_nvfp4_layer(linear, name, {s: stored[f"{name}.{s}"] for s in suffixes}, layout, qinfo,
                                      torch_dtype, problems)
    replace_linear(model, name, linear, new)
    return swizzled


def refuse_lora_keys(model_dir: Path, index: CheckpointIndex) -> None:
    """A model saved with a LoRA loaded stores peft's wrappers (``base_layer``, ``lora_A``, ``lora_B``): say so, rather
    than list every one of its keys as unexpected."""
    lora = [k for k in index.entries if ".base_layer." in k or ".lora_A." in k or ".lora_B." in k]
    if lora:
        raise NVFP4CheckpointError(
            f"{model_dir}: this checkpoint holds a LoRA-wrapped model ({len(lora)} peft keys such as {lora[0]}): it "
            "was saved with a LoRA loaded. Save the model again after pipe.unload_lora_weights(), and the LoRA itself "
            "with pipe.save_lora_weights(...)"
        )


@dataclass
class ExportPlan:
    """What ``load_modelopt_export`` will do, found from config.json and the headers before any weight is read.

    ``model``: the diffusers class built on the meta device; ``quantized``: layer name -> stored scale layout;
    ``problems``: every key, dtype and shape problem (empty when the checkpoint loads)."""

    model_dir: Path
    cls: type
    model: nn.Module
    index: CheckpointIndex
    qinfo: QuantizationInfo
    quantized: dict
    plain_keys: list[str]
    problems: list[str]


def plan_export_into(model: nn.Module, model_dir: Path, qinfo: QuantizationInfo, index: CheckpointIndex,
                     scale_layout: ScaleLayout | None = None) -> ExportPlan:
    """Check every key of the export in ``model_dir`` (its headers: ``index``) against ``model``, the diffusers class
    built on the meta device (by this loader, or by diffusers' ``from_pretrained``)."""
    refuse_lora_keys(model_dir, index)
    problems: list[str] = []
    quantized = _plan_quantized(model, index, qinfo, scale_layout, problems)
    plain_keys = _check_plain_keys(model, index, quantized, problems)
    return ExportPlan(model_dir, type(model), model, index, qinfo, quantized, plain_keys, problems)


def raise_plan_problems(plan: ExportPlan) -> None:
    """Refuse, before any weight is read, an export whose keys, dtypes or shapes do not fit its class."""
    if plan.problems:
        raise NVFP4CheckpointError(
            f"{plan.model_dir}: {len(plan.problems)} problem(s) loading this NVFP4 checkpoint into "
            f"{plan.cls.__name__}:\n  " + "\n  ".join(plan.problems)
        )


def plan_modelopt_export(model_dir: Path, scale_layout: ScaleLayout | None = None) -> ExportPlan:
    """Check every key of the export in ``model_dir`` against its diffusers class (headers only)."""
    from accelerate import init_empty_weights

    config = read_json(model_dir / "config.json")
    qinfo = read_quantization_info(model_dir, config)
    cls = _model_class(config, model_dir / "config.json")
    with init_empty_weights(include_buffers=False):
        model = cls.from_config({k: v for k, v in config.items() if k != "quantization_config"})
    return plan_export_into(model, model_dir, qinfo, CheckpointIndex(weight_files(model_dir)), scale_layout)


def export_scale_problems(plan: ExportPlan, *, block_scales: bool) -> list[str]:
    """The loader's scale checks without loading weights: the per-tensor scales always (a few bytes per layer), the
    block scales (1/16 of the weight bytes) when ``block_scales``; those checks are skipped otherwise."""
    problems: list[str] = []
    for name in plan.quantized:
        keys = [f"{name}.weight_scale_2", f"{name}.input_scale"] + ([f"{name}.weight_scale"] if block_scales else [])
        t = plan.index.load([key for key in keys if key in plan.index])
        dynamic = name in plan.qinfo.dynamic_layers
        blocks = t.get(f"{name}.weight_scale", torch.zeros(1, dtype=torch.uint8))
        problems += scale_problems(name, blocks, t[f"{name}.weight_scale_2"],
                                   None if dynamic else t[f"{name}.input_scale"])
    return problems


def load_modelopt_export(
    path_or_repo_id: str | os.PathLike,
    *,
    subfolder: str | None = None,
    torch_dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    scale_layout: ScaleLayout | None = None,
) -> nn.Module:
    """Load a ModelOpt NVFP4 diffusers export (FLUX.2 dev/klein, Qwen-Image) as its diffusers model class.

    Args:
        path_or_repo_id: local directory or Hugging Face repo id.
        subfolder: e.g. ``"transformer"`` inside a pipeline repo.
        torch_dtype: dtype of unquantized weights and biases.
        device: where to put the model (default: stays on CPU).
        scale_layout: how the stored block scales are laid out ("linear" or "128x4"), for a checkpoint that does not
            say it and whose shapes fit both layouts; contradicting what the checkpoint says is an error.
    """
    plan = plan_modelopt_export(resolve_dir(path_or_repo_id, subfolder), scale_layout)
    raise_plan_problems(plan)
    model = plan.model
    problems: list[str] = []
    plain = plan.index.load(plan.plain_keys)
    model.load_state_dict({k: v.to(torch_dtype) for k, v in plain.items()}, strict=False, assign=True)
    swizzled = sum(load_nvfp4_layer(model, name, plan.index, stored, plan.qinfo, torch_dtype, problems)
                   for name, stored in plan.quantized.items())
    raise_scale_problems(plan.model_dir, problems)
    finish_model(model, plan.model_dir, device)
    record_load_summary(model, plan.model_dir, format="modelopt_export", scales_swizzled_on_load=swizzled)
    return model
