"""Load an NVFP4 text encoder into the transformers class its pipeline uses, with ``NVFP4Linear`` layers that never
exist in BF16 (docs/checkpoints.md, "NVFP4 text encoders").

Two formats: a ModelOpt Hugging Face export directory (``export_hf_checkpoint`` of an ``mtq.quantize``d transformers
model: ``hf_quant_config.json`` and/or ``quantization_config``; linear E4M3 scales, low nibble first) and ComfyUI's
single files (``comfy_quant`` markers per layer, comfy-kitchen's layout: high nibble first, 128x4 scales). Both go
through the ModelOpt export reader's checks (``modelopt_export.plan_export_into``) once the stored keys are renamed
as transformers renames them; every problem is one ``NVFP4CheckpointError``, raised before a model is returned.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..format import BLOCK_SIZE, ScaleLayout
from .bfl.metadata import MARKER_SUFFIX, read_quant_metadata
from .common import raise_scale_problems, record_load_summary
from .errors import NVFP4CheckpointError
from .modelopt_export import (
    ExportPlan,
    QuantizationInfo,
    load_nvfp4_layer,
    plan_export_into,
    raise_plan_problems,
    read_json,
    read_quantization_info,
    resolve_dir,
    weight_files,
)
from .safetensors_header import CheckpointIndex, SafetensorsHeader
from .transformers_compat import checkpoint_key_renamer, empty_model

# The text encoders of the pipelines this package serves: class -> the pipelines that use it.
TEXT_ENCODER_CLASSES = {
    "Mistral3ForConditionalGeneration": "Flux2Pipeline (FLUX.2-dev)",
    "Qwen2_5_VLForConditionalGeneration": "QwenImagePipeline and the Edit pipelines",
    "Qwen3ForCausalLM": "Flux2KleinPipeline (FLUX.2-klein 4B / 9B)",
    "Qwen3VLForConditionalGeneration": "QwenImage21Pipeline (Qwen-Image 2.1)",
}
_MODEL_TYPES = {"mistral3": "Mistral3ForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                "qwen3": "Qwen3ForCausalLM", "qwen3_vl": "Qwen3VLForConditionalGeneration"}
# A ComfyUI file says nothing of its config: where the keys tell the family, the pipeline repo whose text_encoder
# config it is (a key present in the file, the hidden size, the repo).
_COMFY_DEFAULT_CONFIGS = (
    ("visual.merger.mlp.0.weight", 3584, "Qwen/Qwen-Image"),
    ("model.layers.0.self_attn.q_norm.weight", 2560, "black-forest-labs/FLUX.2-klein-4B"),
    ("model.layers.0.self_attn.q_norm.weight", 4096, "black-forest-labs/FLUX.2-klein-9B"),
    ("model.layers.0.self_attn.o_proj.weight", 5120, "black-forest-labs/FLUX.2-dev"),
)
COMFY_PRODUCER = "comfy"


class NoLogits(nn.Module):
    """Stands where ``lm_head`` was when a text encoder is loaded with ``lm_head=False``: a pipeline reads the hidden
    states, never the logits, so the head's ``vocab x hidden`` weights need no memory; logits have 0 columns."""

    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.in_features = in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], 0))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features=0 (loaded with lm_head=False)"


LM_HEAD = "lm_head"
NO_LM_HEAD_HINT = "a text encoder stored without its output head loads with lm_head=False (a pipeline never reads it)"


def drop_lm_head(model: nn.Module) -> None:
    """``model``'s ``lm_head`` Linear replaced by ``NoLogits`` (what ``lm_head=False`` loads)."""
    head = getattr(model, LM_HEAD, None)
    if isinstance(head, nn.Linear):
        setattr(model, LM_HEAD, NoLogits(head.in_features))


class RenamedIndex(CheckpointIndex):
    """A ``CheckpointIndex`` whose keys are the model's names (``rename`` of the stored ones), without ``skip``ped
    keys; two stored keys that rename to one name are a problem."""

    def __init__(self, files: Sequence[Path], rename: Callable[[str], str], skip: Callable[[str], bool],
                 problems: list[str]) -> None:
        super().__init__(files)
        self.stored: dict[str, str] = {}
        entries = {}
        for key, entry in self.entries.items():
            if skip(key):
                continue
            name = rename(key)
            if name in self.stored:
                problems.append(f"{key} and {self.stored[name]} in {entry[0].name} are both read as {name}")
            self.stored[name], entries[name] = key, entry
        self.entries = entries

    def file_key(self, key: str) -> str:
        return self.stored[key]


def text_encoder_class(config: Mapping[str, Any], source: str) -> type:
    """The transformers class of a text encoder config (``architectures``, else ``model_type``); one of
    ``TEXT_ENCODER_CLASSES``."""
    import transformers

    names = list(config.get("architectures") or []) or [_MODEL_TYPES.get(str(config.get("model_type")), "")]
    name = names[0]
    if name not in TEXT_ENCODER_CLASSES:
        raise NVFP4CheckpointError(
            f"{source}: architectures {config.get('architectures')!r} / model_type {config.get('model_type')!r} is "
            f"not a text encoder this loader reads ({', '.join(TEXT_ENCODER_CLASSES)})")
    return getattr(transformers, name)


def _config_dict(config: Mapping[str, Any] | str | os.PathLike) -> tuple[dict, str]:
    """(config dict, where it came from) from a dict, a config.json, a directory (its ``text_encoder/``, else
    itself) or a Hugging Face pipeline repo id (its ``text_encoder/config.json``)."""
    if isinstance(config, Mapping):
        return dict(config), "config= (dict)"
    path = Path(config)
    if path.is_file():
        return read_json(path), str(path)
    if path.is_dir():
        for candidate in (path / "text_encoder", path):
            if (candidate / "config.json").is_file():
                return read_json(candidate / "config.json"), str(candidate / "config.json")
        raise FileNotFoundError(f"{path}: no config.json (nor text_encoder/config.json)")
    from huggingface_hub import hf_hub_download

    return read_json(Path(hf_hub_download(str(config), "config.json", subfolder="text_encoder"))), \
        f"{config}/text_encoder"


def _drop_quantization(config: dict) -> dict:
    return {k: v for k, v in config.items() if k != "quantization_config"}


def _plan(model: nn.Module, model_dir: Path, qinfo: QuantizationInfo, files: Sequence[Path],
          scale_layout: ScaleLayout | None, dynamic_input_scale: bool,
          marked: Iterable[str] | None = None, lm_head: bool = True) -> ExportPlan:
    """The export reader's plan over the stored keys renamed as transformers renames them. ``marked``: the stored
    layers a ComfyUI file marks NVFP4 (markers or header); every other Linear is one the file keeps BF16.
    ``dynamic_input_scale``: NVFP4 layers stored without ``input_scale`` take their activation scale per call.
    ``lm_head`` False: the model's head is ``NoLogits`` and the file's ``lm_head.*`` tensors are not read."""
    problems: list[str] = []
    rename = checkpoint_key_renamer(model)

    def module(stored: str) -> str:  # the renames match key prefixes: a module name renames as its weight's key
        return rename(f"{stored}.weight").removesuffix(".weight")

    def skip(key: str) -> bool:
        marker = key.endswith("." + MARKER_SUFFIX) and marked is not None
        return marker or (not lm_head and rename(key).startswith(LM_HEAD + "."))

    if not lm_head:
        drop_lm_head(model)
    index = RenamedIndex(files, rename, skip, problems)
    if marked is not None:
        nvfp4 = {module(m) for m in marked}
        qinfo.exclude_patterns = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in nvfp4]
    else:
        qinfo.exclude_patterns = [rename(p) for p in qinfo.exclude_patterns]
    qinfo.dynamic_layers = [module(n) for n in qinfo.dynamic_layers]
    unscaled = [n for n in _without_input_scale(index) if n not in qinfo.dynamic_layers]
    if unscaled and dynamic_input_scale:
        qinfo.dynamic_layers += unscaled
    elif unscaled:
        problems.append(f"{len(unscaled)} NVFP4 layer(s) have no input_scale (e.g. {unscaled[0]}): pass "
                        "dynamic_input_scale=True to quantize their activations with a scale taken from each call's "
                        "own amax (docs/checkpoints.md)")
    plan = plan_export_into(model, model_dir, qinfo, index, scale_layout)
    plan.problems[:0] = problems
    plan.problems = [f"{p} ({NO_LM_HEAD_HINT})" if p.startswith(f"missing key {LM_HEAD}.") else p
                     for p in plan.problems]
    return plan


def _without_input_scale(index: CheckpointIndex) -> list[str]:
    """The stored NVFP4 layers (those with block scales) that have no ``input_scale``."""
    layers = [key.removesuffix(".weight_scale") for key in index.entries if key.endswith(".weight_scale")]
    return sorted(n for n in layers if f"{n}.input_scale" not in index)


def _materialize(plan: ExportPlan, dtype: torch.dtype, device, source, **facts) -> nn.Module:
    """Every tensor into the model planned on the meta device; tied weights tied again; nothing left on meta."""
    raise_plan_problems(plan)
    model = plan.model
    plain = plan.index.load(plan.plain_keys)
    model.load_state_dict({k: v.to(dtype) for k, v in plain.items()}, strict=False, assign=True)
    problems: list[str] = []
    swizzled = sum(load_nvfp4_layer(model, name, plan.index, stored, plan.qinfo, dtype, problems)
                   for name, stored in plan.quantized.items())
    raise_scale_problems(source, problems)
    tie_weights = getattr(model, "tie_weights", None)
    if callable(tie_weights) and not isinstance(getattr(model, LM_HEAD, None), NoLogits):
        tie_weights()  # a transformers model: an lm_head tied to the embeddings shares them again
    meta = [n for n, p in model.named_parameters() if p.is_meta] + [n for n, b in model.named_buffers() if b.is_meta]
    if meta:
        raise NVFP4CheckpointError(f"{source}: no data for {len(meta)} tensor(s) of {type(model).__name__}: "
                                   f"{', '.join(meta[:8])}{' ...' if len(meta) > 8 else ''}")
    model.eval()
    if device is not None:
        model.to(device)
    record_load_summary(model, source, scales_swizzled_on_load=swizzled, **facts)
    return model


def _modelopt_format(model_dir: Path, config: Mapping[str, Any]) -> bool:
    """Whether the export says it is in ModelOpt's HF export format (``quant_method: "modelopt"``, or ModelOpt's
    ``hf_quant_config.json``), whoever wrote it (ModelOpt, or ``quantize_text_encoder`` of this package)."""
    qc = config.get("quantization_config") or {}
    return qc.get("quant_method") == "modelopt" or (model_dir / "hf_quant_config.json").is_file()


def _load_export(model_dir: Path, dtype: torch.dtype, device, scale_layout: ScaleLayout | None,
                 dynamic_input_scale: bool, lm_head: bool) -> nn.Module:
    config = read_json(model_dir / "config.json")
    qinfo = read_quantization_info(model_dir, config)
    if qinfo.scale_layout is None and _modelopt_format(model_dir, config):
        qinfo.scale_layout = "linear"  # ModelOpt's HF export format stores linear [N, K/16] block scales
    cls = text_encoder_class(config, str(model_dir / "config.json"))
    model = empty_model(cls, _drop_quantization(config), dtype)
    plan = _plan(model, model_dir, qinfo, weight_files(model_dir, "model.safetensors.index.json"), scale_layout,
                 dynamic_input_scale, lm_head=lm_head)
    return _materialize(plan, dtype, device, model_dir, format="modelopt_export")


def _comfy_quant_info(header: SafetensorsHeader) -> tuple[QuantizationInfo, list[str]]:
    """ComfyUI's per-layer markers, read as the export reader's ``QuantizationInfo``: every marked layer ``nvfp4`` in
    comfy-kitchen's layout (high nibble first, 128x4 scales), every other Linear BF16; and the marked layers."""
    problems: list[str] = []
    meta = read_quant_metadata(header, "", problems)
    for layer in meta.layers.values():
        if layer.format != "nvfp4":
            problems.append(f"{layer.sources[0]}: format {layer.format!r}; this loader reads 'nvfp4' layers only")
        for fact, value in {**meta.file_flags, **layer.flags}.items():
            expected = {"nibble_order": "hi_first", "scale_layout": "128x4"}[fact]
            if value != expected:
                problems.append(f"{layer.sources[0]}: {fact}={value!r}; ComfyUI text encoders are read in "
                                f"comfy-kitchen's layout only ({fact}={expected!r})")
    if not meta.layers:
        problems.append(f"no {MARKER_SUFFIX} marker and no _quantization_metadata header: not a ComfyUI NVFP4 file")
    if problems:
        raise NVFP4CheckpointError(f"{header.path}: {len(problems)} problem(s):\n  " + "\n  ".join(problems))
    info = QuantizationInfo(quant_algo="NVFP4", group_size=BLOCK_SIZE, source=str(header.path),
                            producer=COMFY_PRODUCER, scale_layout="128x4", nibble_order="hi_first")
    return info, list(meta.layers)


def default_comfy_config(header: SafetensorsHeader) -> str:
    """The pipeline repo whose ``text_encoder`` config a ComfyUI file of a known family has (key and hidden size)."""
    embed = header.tensors.get("model.embed_tokens.weight")
    hidden = embed.shape[-1] if embed is not None and embed.shape else None
    for key, size, repo in _COMFY_DEFAULT_CONFIGS:
        if key in header.tensors and hidden == size:
            return repo
    raise NVFP4CheckpointError(
        f"{header.path}: the keys name no text encoder with a known config (hidden size {hidden}); pass config= "
        "(a pipeline repo id or directory, a config.json, or a dict with 'architectures' or 'model_type')")


def _load_comfy(file: Path, config, dtype: torch.dtype, device, dynamic_input_scale: bool,
                lm_head: bool) -> nn.Module:
    header = SafetensorsHeader(file)
    qinfo, marked = _comfy_quant_info(header)
    config_dict, config_source = _config_dict(config if config is not None else default_comfy_config(header))
    cls = text_encoder_class(config_dict, config_source)
    model = empty_model(cls, _drop_quantization(config_dict), dtype)
    plan = _plan(model, file, qinfo, [file], "128x4", dynamic_input_scale, marked, lm_head)
    return _materialize(plan, dtype, device, file, format="comfy_single_file", config_source=config_source)


def load_nvfp4_text_encoder(
    path_or_repo_id: str | os.PathLike,
    *,
    subfolder: str | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    filename: str | None = None,
    config: Mapping[str, Any] | str | os.PathLike | None = None,
    scale_layout: ScaleLayout | None = None,
    dynamic_input_scale: bool = False,
    lm_head: bool = True,
) -> nn.Module:
    """Load an NVFP4 text encoder as the transformers class its pipeline uses (``text_encoder=`` of
    ``Flux2Pipeline``, ``QwenImagePipeline``, ``Flux2KleinPipeline``, ``QwenImage21Pipeline``).

    A directory (or repo id) is read as a ModelOpt Hugging Face export; a ``.safetensors`` file (or ``filename=``
    inside a directory or repo) as a ComfyUI single file. Layers the file keeps BF16 (embeddings, ``lm_head``, vision
    towers) stay BF16; the NVFP4 ones become ``NVFP4Linear``.

    Args:
        path_or_repo_id: a ModelOpt export directory, a ComfyUI ``.safetensors`` file, or a Hugging Face repo id.
        subfolder: where the export (or ``filename``) is inside a repo or directory (``"text_encoder"``).
        dtype: dtype of the BF16 layers (default BF16).
        device: where to put the model (default: stays on CPU).
        filename: a single file inside ``path_or_repo_id``.
        config: a single file's model config: a pipeline repo id or directory (its ``text_encoder/config.json``; a
            directory may be the text encoder's own), a config.json, or a dict with ``architectures`` or
            ``model_type``. Default: the config of the pipeline whose text encoder the file's keys and hidden size
            name (docs/checkpoints.md).
        scale_layout: how an export's block scales are stored ("linear" or "128x4") where the file cannot tell.
        dynamic_input_scale: read NVFP4 layers stored without ``input_scale`` (ComfyUI files quantized for its
            dynamic activation scale): each call then quantizes the activation with a scale from its own amax.
            Without it such layers are an error that names them.
        lm_head: False leaves the output head out (``NoLogits`` in its place, the file's ``lm_head`` unread): a
            diffusers pipeline reads the hidden states only, and an untied head is ``vocab x hidden`` BF16 weights
            (1.02 GiB for Qwen2.5-VL-7B, 1.16 GiB for Qwen3-8B, 1.25 GiB for Mistral Small 3.1). The prompt
            embeddings are the same bytes; the model no longer gives logits (``generate`` is not for it).

    Raises:
        NVFP4CheckpointError: every problem of the checkpoint (file, key, value), before anything is returned.
    """
    dtype = dtype or torch.bfloat16
    path = Path(path_or_repo_id)
    if filename is not None or path.is_file():
        from .bfl import resolve_single_file

        if scale_layout is not None:
            raise TypeError("scale_layout= applies to ModelOpt export directories; a ComfyUI file's layout is "
                            "comfy-kitchen's (128x4 block scales)")
        return _load_comfy(resolve_single_file(path_or_repo_id, filename, subfolder), config, dtype, device,
                           dynamic_input_scale, lm_head)
    if config is not None:
        raise TypeError(f"config= applies to single files; {path_or_repo_id} is read as a ModelOpt export directory, "
                        "whose config.json is the config")
    return _load_export(resolve_dir(path_or_repo_id, subfolder), dtype, device, scale_layout, dynamic_input_scale,
                        lm_head)
