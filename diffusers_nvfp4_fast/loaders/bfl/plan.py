"""Load the BFL / ComfyUI FLUX.2 NVFP4 single-file checkpoint into diffusers' ``Flux2Transformer2DModel``.

The layout of the official ``black-forest-labs/FLUX.2-dev-NVFP4`` files is *inferred* (docs/design.md §4), so
every fact this loader relies on is either read from the file or checked against it, and every inferred default
can be overridden by an argument:

=====================  =========================================================================================
fact                   how it is established
=====================  =========================================================================================
key names              BFL names, mapped to diffusers names by diffusers' own FLUX.2 converter
                       (``convert_flux2_transformer_checkpoint_to_diffusers``), probed key by key: the row
                       split of fused ``qkv`` and the ``norm_out`` half swap are read off what it returns.
which layers are FP4   per-layer ``<layer>.comfy_quant`` markers (uint8 JSON ``{"format": "nvfp4"}``) and/or the
                       header's ``_quantization_metadata`` JSON; cross-checked with the stored dtypes.
scale layout           metadata flag if present, else ComfyUI's convention (128x4 swizzled); cross-checked with
                       the shape; after unswizzling, padding must be zero (catches double swizzles where the
                       shape has padding). Scales are converted to linear once, split, and swizzled once.
nibble order           metadata flag if present, else ComfyUI's convention (high nibble first). Not detectable
                       from the bytes: a swap keeps every value inside its 16-block.
model config           inferred from shapes (dev / klein-4B / klein-9B / anything of that family), or ``config=``.
missing input_scale    never 1.0: an error, unless ``input_scales=`` or ``dynamic_input_scale=True`` says what to do.
=====================  =========================================================================================

Metadata flags this loader understands, per layer (marker or ``layers`` entry) or file-wide (top level of
``_quantization_metadata``): ``"nibble_order": "hi_first" | "lo_first"`` or ``"hi_first": bool``;
``"scale_layout": "128x4" | "swizzled" | "linear"`` or ``"swizzled": bool``; ``"group_size": 16``. Contradictions
between sources are errors.

This module decides everything from the header, before any weight is read (``plan_bfl_checkpoint``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from ...format import BLOCK_SIZE, ScaleLayout, round_up
from ..errors import NVFP4CheckpointError
from ..safetensors_header import FLOAT_DTYPES, SafetensorsHeader, TensorInfo
from .config import flux2_variant, infer_flux2_config, init_defaults, read_config_arg
from .metadata import (
    COMFY_NVFP4_CONVENTION,
    HEADER_METADATA_KEY,
    MARKER_SUFFIX,
    NVFP4_LAYER_SUFFIXES,
    LayerQuantInfo,
    NibbleOrder,
    QuantMetadata,
    detect_key_prefix,
    read_quant_metadata,
)
from .naming import Segments, diffusers_targets, segment_rows

PLAIN_PARAM_SUFFIXES = ("weight", "bias", "scale")


@dataclass
class NVFP4Source:
    """One FP4 layer as stored (possibly fused), and the diffusers Linears it feeds."""

    bfl_name: str
    keys: dict[str, str]  # suffix -> stored key
    rows: int
    cols: int  # logical K
    targets: list[tuple[str, Segments]]
    nibble_order: str
    nibble_source: str
    scale_layout: str
    scale_source: str


@dataclass
class BflPlan:
    """What ``load_bfl_nvfp4_transformer`` will do with a file, decided from the header alone."""

    file: Path
    prefix: str
    config: dict[str, Any]
    config_source: str
    variant: str
    plain: dict[str, tuple[str, Segments]]  # diffusers param -> (stored key, segments)
    nvfp4: dict[str, NVFP4Source]  # BFL name -> source
    missing_input_scale: list[str]  # diffusers Linear names
    metadata: QuantMetadata
    problems: list[str]

    def _count(self, attr: str) -> dict[str, int]:
        counts: dict[str, int] = {}
        for s in self.nvfp4.values():
            counts[getattr(s, attr)] = counts.get(getattr(s, attr), 0) + 1
        return counts

    def facts(self) -> dict[str, Any]:
        """A JSON-able summary (also what ``inspect`` prints)."""
        count = self._count
        return {
            "file": str(self.file), "key_prefix": self.prefix, "variant": self.variant,
            "config_source": self.config_source, "config": self.config, "nvfp4_layers": len(self.nvfp4),
            "plain_tensors": len(self.plain),
            "markers": self.metadata.markers, "header_metadata": self.metadata.has_header,
            "nibble_order": count("nibble_order"), "nibble_order_source": count("nibble_source"),
            "scale_layout": count("scale_layout"), "scale_layout_source": count("scale_source"),
            "missing_input_scale": list(self.missing_input_scale), "problems": list(self.problems),
        }


def _resolve_fact(
    fact: str, layer: str, info: LayerQuantInfo | None, file_flags: Mapping[str, str], argument: str | None,
    problems: list[str],
) -> tuple[str, str]:
    """(value, where it came from) for 'nibble_order' or 'scale_layout': argument > layer metadata > file >
    convention."""
    explicit_layer = info.flags.get(fact) if info else None
    explicit_file = file_flags.get(fact)
    if explicit_layer and explicit_file and explicit_layer != explicit_file:
        assert info is not None  # explicit_layer came from it
        problems.append(
            f"conflicting {fact} for layer {layer}: the file-wide flags of header {HEADER_METADATA_KEY} say "
            f"{explicit_file!r}, {info.sources[0]} says {explicit_layer!r}"
        )
    explicit = explicit_layer or explicit_file
    if argument is not None:
        if explicit and explicit != argument:
            problems.append(f"{fact}={argument!r} was passed, but the file's metadata says {explicit!r} "
                            f"for layer {layer}")
        return argument, "argument"
    if explicit:
        return explicit, "metadata"
    return COMFY_NVFP4_CONVENTION[fact], "inferred ComfyUI convention"


def _check_scale_shape(source: NVFP4Source, info: TensorInfo, key: str, problems: list[str]) -> None:
    n, c = source.rows, source.cols // BLOCK_SIZE
    linear, swizzled = (n, c), (round_up(n, 128), round_up(c, 4))
    shape = tuple(info.shape)
    if info.dtype not in ("F8_E4M3", "U8"):
        problems.append(f"{key}: dtype {info.dtype}, expected F8_E4M3 (or U8) block scales")
    if source.scale_layout == "128x4":
        flat_ok = len(shape) == 1 and shape[0] == swizzled[0] * swizzled[1]
        if shape != swizzled and not flat_ok:
            hint = (" -- that is the linear [N, K/16] shape: if the file stores linear scales, "
                    "pass scale_layout='linear'"
                    if shape == linear else "")
            problems.append(
                f"{key}: shape {list(shape)}, but the scales are taken as 128x4-swizzled ({source.scale_source}), "
                f"which for a [{n}, {source.cols}] weight means {list(swizzled)}{hint}"
            )
    elif shape != linear:
        hint = (" -- that is the padded 128x4 shape: if the file stores swizzled scales, pass scale_layout='128x4'"
                if shape == swizzled else "")
        problems.append(
            f"{key}: shape {list(shape)}, but the scales are taken as linear ({source.scale_source}), "
            f"which for a [{n}, {source.cols}] weight means {list(linear)}{hint}"
        )


class _Planner:
    """The steps of ``plan_bfl_checkpoint``; every step appends what it finds wrong to ``problems``."""

    def __init__(self, header: SafetensorsHeader, scale_layout: ScaleLayout | None, nibble_order: NibbleOrder | None):
        self.header = header
        self.scale_layout, self.nibble_order = scale_layout, nibble_order
        self.problems: list[str] = []
        self.prefix = detect_key_prefix(list(header.tensors))
        self.meta = read_quant_metadata(header, self.prefix, self.problems)
        self.plain: dict[str, tuple[str, Segments]] = {}
        self.nvfp4: dict[str, NVFP4Source] = {}
        self.logical: dict[str, tuple[int, ...]] = {}  # diffusers parameter -> shape (FP4 weights as [N, K])

    def modules(self) -> dict[str, dict[str, str]]:
        """BFL module name -> {suffix: stored key}; metadata entries without a weight are problems."""
        by_module: dict[str, dict[str, str]] = {}
        for key in self.header.tensors:
            module, _, suffix = key[len(self.prefix):].rpartition(".")
            by_module.setdefault(module, {})[suffix] = key
        for layer in self.meta.layers:
            if layer not in by_module or "weight" not in by_module[layer]:
                self.problems.append(f"metadata names layer {layer}, but the file has no {self.prefix}{layer}.weight")
        return by_module

    def targets_of(self, key: str, bfl_key: str) -> tuple[tuple[str, Segments], ...]:
        try:
            return diffusers_targets(bfl_key)
        except Exception as e:  # the converter raises KeyError for names it has no rule for
            self.problems.append(f"unexpected key {key}: diffusers' FLUX.2 converter has no rule for it "
                                 f"({type(e).__name__}: {e})")
            return ()

    def is_nvfp4(self, module: str, suffixes: dict[str, str]) -> bool | None:
        """Whether a module is stored as NVFP4 (True), plainly (False), or cannot be planned (None, problem noted)."""
        info = self.meta.layers.get(module)
        weight_key = suffixes.get("weight")
        weight = self.header.tensors.get(weight_key) if weight_key else None
        packed = weight is not None and weight.dtype == "U8"
        if info is not None and info.format != "nvfp4":
            self.problems.append(f"layer {module}: quantization format {info.format!r} ({info.sources[0]}) is not "
                                 "supported; only 'nvfp4' is")
            return None
        declared = self.scale_layout and self.nibble_order and "weight_scale" in suffixes
        if packed and info is None and not declared:
            self.problems.append(
                f"{weight_key}: U8 (packed FP4?) but no {MARKER_SUFFIX} marker or {HEADER_METADATA_KEY} entry says "
                "how it is laid out; pass scale_layout= and nibble_order= to declare it"
            )
            return None
        if info is not None and weight is not None and not packed:
            self.problems.append(f"{weight_key}: dtype {weight.dtype} {list(weight.shape)}, but layer {module} is "
                                 f"marked nvfp4 ({info.sources[0]}): expected U8 packed FP4")
            return None
        if info is not None or packed:
            return None if weight is None else True  # no weight: reported by modules()
        return False

    def add_nvfp4(self, module: str, suffixes: dict[str, str]) -> None:
        weight_key = suffixes["weight"]
        weight = self.header.tensors[weight_key]
        t: TensorInfo | None  # a header entry here, a .get() result further down
        for suffix, key in suffixes.items():
            if suffix not in NVFP4_LAYER_SUFFIXES:
                t = self.header.tensors[key]
                self.problems.append(f"unexpected key {key} ({t.dtype}, {list(t.shape)}) in NVFP4 layer {module}")
        if len(weight.shape) != 2:
            self.problems.append(f"{weight_key}: shape {list(weight.shape)}, expected 2-D packed [N, K/2]")
            return
        targets = self.targets_of(weight_key, f"{module}.weight")
        if not targets:
            return
        info = self.meta.layers.get(module)
        nib, nib_src = _resolve_fact("nibble_order", module, info, self.meta.file_flags, self.nibble_order,
                                     self.problems)
        lay, lay_src = _resolve_fact("scale_layout", module, info, self.meta.file_flags, self.scale_layout,
                                     self.problems)
        source = NVFP4Source(module, dict(suffixes), weight.shape[0], weight.shape[1] * 2,
                             [(k.removesuffix(".weight"), segs) for k, segs in targets], nib, nib_src, lay, lay_src)
        for suffix in ("weight_scale", "weight_scale_2"):
            if suffix not in suffixes:
                self.problems.append(f"missing key {self.prefix}{module}.{suffix} (NVFP4 layer, U8 weight "
                                     f"{list(weight.shape)})")
        if "weight_scale" in suffixes:
            key = suffixes["weight_scale"]
            _check_scale_shape(source, self.header.tensors[key], key, self.problems)
        for suffix in ("weight_scale_2", "input_scale"):
            t = self.header.tensors.get(suffixes.get(suffix, ""))
            if t is not None and (t.dtype != "F32" or t.shape not in ((), (1,))):
                self.problems.append(f"{suffixes[suffix]}: dtype {t.dtype} shape {list(t.shape)}, "
                                     "expected an F32 scalar")
        self.nvfp4[module] = source
        for target, segs in source.targets:
            self.logical[f"{target}.weight"] = (segment_rows(source.rows, segs), source.cols)

    def add_plain(self, module: str, suffixes: dict[str, str]) -> None:
        for suffix, key in suffixes.items():
            t = self.header.tensors[key]
            if suffix not in PLAIN_PARAM_SUFFIXES:
                self.problems.append(f"unexpected key {key} ({t.dtype}, {list(t.shape)}): "
                                     f"{module} is not an NVFP4 layer")
                continue
            if t.dtype not in FLOAT_DTYPES:
                self.problems.append(f"{key}: dtype {t.dtype}, expected a floating-point dtype "
                                     f"({', '.join(FLOAT_DTYPES)})")
                continue
            for target, segs in self.targets_of(key, f"{module}.{suffix}"):
                self.plain[target] = (key, segs)
                self.logical[target] = (segment_rows(t.shape[0], segs), *t.shape[1:]) if t.shape else ()

    def config(self, config) -> tuple[dict[str, Any], str]:
        if config is not None:
            return read_config_arg(config), "argument"
        try:
            return infer_flux2_config(self.logical), "inferred from shapes"
        except NVFP4CheckpointError as e:
            self.problems.append(str(e))
            return {}, "inferred from shapes"

    def check_against_model(self, cfg: dict[str, Any]) -> list[str]:
        """Compare every mapped tensor with the model ``cfg`` builds; returns the NVFP4 Linears without input_scale."""
        from accelerate import init_empty_weights
        from diffusers import Flux2Transformer2DModel

        with init_empty_weights(include_buffers=False):
            model = Flux2Transformer2DModel.from_config(cfg)
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        covered = self._check_plain_targets(expected, type(model).__name__)
        linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        missing_scales = []
        for source in self.nvfp4.values():
            for target, segs in source.targets:
                missing_scales += self._check_nvfp4_target(source, target, segs, linears.get(target), covered)
        for name in sorted({n for n, _ in model.named_parameters()} - covered):
            self.problems.append(f"missing: no tensor in {self.header.path.name} maps to {name} {list(expected[name])}")
        return missing_scales

    def _check_plain_targets(self, expected: dict[str, tuple[int, ...]], model_name: str) -> set[str]:
        covered = set()
        for target, (key, _) in self.plain.items():
            if target not in expected:
                self.problems.append(f"unexpected key {key}: maps to {target}, which {model_name} does not have")
                continue
            covered.add(target)
            if self.logical[target] != expected[target]:
                self.problems.append(f"{key}: maps to {target} with shape {list(self.logical[target])}, expected "
                                     f"{list(expected[target])}")
        return covered

    def _check_nvfp4_target(self, source: NVFP4Source, target: str, segs: Segments, lin: nn.Linear | None,
                            covered: set[str]) -> list[str]:
        if lin is None:
            self.problems.append(f"NVFP4 layer {source.bfl_name}: maps to {target}, which is not a Linear in the model")
            return []
        covered.update(f"{target}.{n}" for n, _ in lin.named_parameters())
        shape = (segment_rows(source.rows, segs), source.cols)
        if shape != (lin.out_features, lin.in_features):
            self.problems.append(f"{source.keys['weight']}: maps to {target} as [{shape[0]}, {shape[1]}] (unpacked), "
                                 f"expected [{lin.out_features}, {lin.in_features}]")
        if lin.bias is not None and "bias" not in source.keys:
            self.problems.append(f"missing key {self.prefix}{source.bfl_name}.bias (layer {target} has a bias)")
        return [] if "input_scale" in source.keys else [target]

    def uncovered_scales(self, missing: list[str], input_scales: Mapping[str, float] | None) -> list[str]:
        """The layers still without an input scale once ``input_scales`` is applied; names it cannot use are
        problems."""
        if input_scales is None:
            return missing
        all_fp4 = {t for s in self.nvfp4.values() for t, _ in s.targets}
        extra = sorted(set(input_scales) - set(missing))
        have = [n for n in extra if n in all_fp4]
        unknown = [n for n in extra if n not in all_fp4]
        if have:
            self.problems.append(
                f"input_scales names layers whose input_scale is in the checkpoint (remove them): {have}"
            )
        if unknown:
            self.problems.append(f"input_scales names layers that are not NVFP4 layers of this checkpoint: {unknown}")
        return [n for n in missing if n not in input_scales]


def plan_bfl_checkpoint(
    header: SafetensorsHeader,
    *,
    config: Mapping[str, Any] | str | os.PathLike | None = None,
    scale_layout: ScaleLayout | None = None,
    nibble_order: NibbleOrder | None = None,
    input_scales: Mapping[str, float] | None = None,
    dynamic_input_scale: bool = False,
) -> BflPlan:
    """Decide, from the header alone, how every tensor of a BFL FLUX.2 file maps onto ``Flux2Transformer2DModel``.

    Problems (missing/unexpected keys, dtypes, shapes, metadata contradictions) are collected in ``plan.problems``;
    nothing is raised for them here, so ``inspect`` can show them all. Missing input scales are listed in
    ``plan.missing_input_scale`` (minus those ``input_scales`` or ``dynamic_input_scale`` cover).
    """
    from diffusers import Flux2Transformer2DModel

    if scale_layout not in (None, "128x4", "linear"):
        raise ValueError(f"scale_layout must be None, '128x4' or 'linear', got {scale_layout!r}")
    if nibble_order not in (None, "hi_first", "lo_first"):
        raise ValueError(f"nibble_order must be None, 'hi_first' or 'lo_first', got {nibble_order!r}")
    planner = _Planner(header, scale_layout, nibble_order)
    for module, suffixes in planner.modules().items():
        kind = planner.is_nvfp4(module, suffixes)
        if kind is True:
            planner.add_nvfp4(module, suffixes)
        elif kind is False:
            planner.add_plain(module, suffixes)
    cfg, config_source = planner.config(config)
    variant = flux2_variant({**init_defaults(Flux2Transformer2DModel), **cfg}) if cfg else "unknown"
    missing = planner.check_against_model(cfg) if cfg else []
    missing = planner.uncovered_scales(missing, input_scales)
    if dynamic_input_scale:
        missing = []
    return BflPlan(header.path, planner.prefix, cfg, config_source, variant, planner.plain, planner.nvfp4, missing,
                   planner.meta, planner.problems)
