"""Plan the load of an NVFP4 single file (BFL / ComfyUI / diffusers' BFL files) into its diffusers class.

Every fact this loader relies on is read from the file, proven for the convention the file declares, or stated as an
assumption that an argument can override (docs/checkpoints.md, docs/design.md §4):

=====================  =========================================================================================
fact                   how it is established
=====================  =========================================================================================
model family           the keys (``families.detect_family``): FLUX.2, Qwen-Image (+ Edit / Edit-2509 / Edit-2511 /
                       Layered) or Qwen-Image 2.1; ``config=``'s ``_class_name`` must agree.
key names              diffusers' own single-file converter of the class, probed key by key (``naming``): FLUX.2's
                       fused ``qkv`` row split and ``norm_out`` half swap, Qwen-Image 2.1's fused ``gate_up``.
which layers are FP4   ``<layer>.comfy_quant`` markers and/or the header's ``_quantization_metadata`` (ComfyUI), or
                       the header ``quantization='nvfp4'`` (diffusers' BFL files), cross-checked with the dtypes.
convention             per layer: argument > layer flag > file-wide flag > the file's convention (ComfyUI: high
                       nibble first, 128x4 scales; diffusers' BFL files: low nibble first, linear scales). A packed
                       weight nothing declares is refused, naming both declarations.
scale layout           checked against the shape; after unswizzling, padding must be zero (catches double swizzles
                       where the shape has padding). Scales are converted to linear once, split, swizzled once.
model config           inferred from shapes per family (assumed values named), and/or ``config=`` (its keys win).
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from ...format import ScaleLayout
from ..common import scale_layout_from_shape
from ..errors import NVFP4CheckpointError
from ..safetensors_header import FLOAT_DTYPES, SafetensorsHeader, TensorInfo
from .config import ConfigArg, init_defaults, read_config_arg
from .families import QWEN_ZERO_COND_T_MARKER, Family, detect_family, family_problem
from .layout import DECLARATIONS, NVFP4Source, check_scale_shape, resolve_fact, shape_verdict
from .metadata import (
    COMFY,
    CONFLICTING,
    NVFP4_LAYER_SUFFIXES,
    Convention,
    NibbleOrder,
    QuantMetadata,
    conflict_problem,
    detect_key_prefix,
    file_convention,
    read_quant_metadata,
)
from .naming import IDENTITY, Segments, converter_name, diffusers_targets, segment_rows

PLAIN_PARAM_SUFFIXES = ("weight", "bias", "scale")

@dataclass
class BflPlan:
    """What ``load_bfl_nvfp4_transformer`` will do with a file, decided from the header alone."""

    file: Path
    prefix: str
    config: dict[str, Any]
    config_source: str
    variant: str
    plain: dict[str, tuple[str, Segments]]  # diffusers param -> (stored key, segments)
    nvfp4: dict[str, NVFP4Source]  # stored module name -> source
    missing_input_scale: list[str]  # diffusers Linear names
    metadata: QuantMetadata
    problems: list[str]
    family: Family | None = None
    family_evidence: str = ""
    convention: Convention | None = None
    assumed: dict[str, str] = field(default_factory=dict)
    mapping: str = ""  # the class whose single-file converter maps the keys, or naming.IDENTITY

    @property
    def class_name(self) -> str:
        return self.family.class_name if self.family else "an unknown class"

    def _count(self, attr: str) -> dict[str, int]:
        counts: dict[str, int] = {}
        for s in self.nvfp4.values():
            counts[getattr(s, attr)] = counts.get(getattr(s, attr), 0) + 1
        return counts

    def facts(self) -> dict[str, Any]:
        """A JSON-able summary (also what ``inspect`` prints)."""
        count = self._count
        convention = self.convention
        return {
            "file": str(self.file), "key_prefix": self.prefix,
            "family": self.family.name if self.family else None, "class": self.family.class_name if self.family
            else None, "family_evidence": self.family_evidence,
            "converter": converter_name(self.mapping) if self.mapping else None,
            "convention": convention.name if convention else None,
            "convention_evidence": convention.evidence if convention else None,
            "variant": self.variant, "config_source": self.config_source, "config": self.config,
            "assumed": dict(self.assumed), "nvfp4_layers": len(self.nvfp4), "plain_tensors": len(self.plain),
            "markers": self.metadata.markers, "header_metadata": self.metadata.has_header,
            "nibble_order": count("nibble_order"), "nibble_order_source": count("nibble_source"),
            "scale_layout": count("scale_layout"), "scale_layout_source": count("scale_source"),
            "missing_input_scale": list(self.missing_input_scale), "problems": list(self.problems),
        }


class _Planner:
    """The steps of ``plan_bfl_checkpoint``; every step appends what it finds wrong to ``problems``."""

    def __init__(self, header: SafetensorsHeader, scale_layout: ScaleLayout | None, nibble_order: NibbleOrder | None):
        self.header = header
        self.scale_layout, self.nibble_order = scale_layout, nibble_order
        self.problems: list[str] = []
        self.prefix = detect_key_prefix(list(header.tensors))
        self.meta = read_quant_metadata(header, self.prefix, self.problems)
        self.convention = file_convention(self.meta, self.problems)
        self.family: Family | None = None
        self.mapping = ""  # the class whose single-file converter maps the keys, or IDENTITY
        self.markers: dict[str, str] = {}  # family marker key -> stored key
        self.plain: dict[str, tuple[str, Segments]] = {}
        self.nvfp4: dict[str, NVFP4Source] = {}
        self.conflict_noted = False
        self.undeclared: dict[str, str] = {}  # stored weight key -> what its scale shape says
        self.logical: dict[str, tuple[int, ...]] = {}  # diffusers parameter -> shape (FP4 weights as [N, K])

    def modules(self) -> dict[str, dict[str, str]]:
        """Stored module name -> {suffix: stored key}; metadata entries without a weight are problems."""
        by_module: dict[str, dict[str, str]] = {}
        family_markers = self.family.markers if self.family else ()
        for key in self.header.tensors:
            short = key[len(self.prefix):]
            if short in family_markers:
                self.markers[short] = key
                continue
            module, _, suffix = short.rpartition(".")
            by_module.setdefault(module, {})[suffix] = key
        for layer in self.meta.layers:
            if layer not in by_module or "weight" not in by_module[layer]:
                self.problems.append(f"metadata names layer {layer}, but the file has no {self.prefix}{layer}.weight")
        return by_module

    def targets_of(self, key: str, short_key: str) -> tuple[tuple[str, Segments], ...]:
        try:
            return diffusers_targets(self.mapping, short_key)
        except Exception as e:  # FLUX.2's converter raises KeyError for names it has no rule for
            self.problems.append(f"unexpected key {key}: {converter_name(self.mapping)} has no rule for it "
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
        # ComfyUI declares FP4 layers one by one (markers, header entries); diffusers' BFL header covers the file.
        declared = (self.scale_layout and self.nibble_order) or self.convention.name not in ("no", COMFY)
        if packed and info is None and not declared:
            assert weight_key is not None and weight is not None
            scale = self.header.tensors.get(suffixes.get("weight_scale", ""))
            self.undeclared[weight_key] = ("no weight_scale" if scale is None or len(weight.shape) != 2 else
                                           scale_layout_from_shape(scale.shape, weight.shape[0], weight.shape[1] * 2))
            return True  # planned with its layout undecided, so the config and the key checks still run
        if info is not None and weight is not None and not packed:
            self.problems.append(f"{weight_key}: dtype {weight.dtype} {list(weight.shape)}, but layer {module} is "
                                 f"marked nvfp4 ({info.sources[0]}): expected U8 packed FP4")
            return None
        if info is not None or packed:
            return None if weight is None else True  # no weight: reported by modules()
        return False

    def report_undeclared(self) -> None:
        if not self.undeclared:
            return
        shapes: dict[str, int] = {}
        for verdict in self.undeclared.values():
            shapes[verdict] = shapes.get(verdict, 0) + 1
        keys = sorted(self.undeclared)
        shown = ", ".join(keys[:6]) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")
        evidence = self.convention.evidence + (", none naming these layers" if self.convention.name == COMFY else "")
        self.problems.append(
            f"{len(keys)} U8 (packed FP4) weight(s) without a declaration of their layout ({evidence}): {shown}. "
            f"{shape_verdict(shapes)} Declare the layout: {DECLARATIONS}"
        )

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
        nib, nib_src = resolve_fact("nibble_order", module, info, self.meta.file_flags, self.nibble_order,
                                     self.convention, self.problems)
        lay, lay_src = resolve_fact("scale_layout", module, info, self.meta.file_flags, self.scale_layout,
                                     self.convention, self.problems)
        source = NVFP4Source(module, dict(suffixes), weight.shape[0], weight.shape[1] * 2,
                             [(k.removesuffix(".weight"), segs) for k, segs in targets], nib, nib_src, lay, lay_src)
        for suffix in ("weight_scale", "weight_scale_2"):
            if suffix not in suffixes:
                self.problems.append(f"missing key {self.prefix}{module}.{suffix} (NVFP4 layer, U8 weight "
                                     f"{list(weight.shape)})")
        if "weight_scale" in suffixes:
            key = suffixes["weight_scale"]
            check_scale_shape(source, self.header.tensors[key], key, self.problems)
        for suffix in ("weight_scale_2", "input_scale"):
            t = self.header.tensors.get(suffixes.get(suffix, ""))
            if t is not None and (t.dtype != "F32" or t.shape not in ((), (1,))):
                self.problems.append(f"{suffixes[suffix]}: dtype {t.dtype} shape {list(t.shape)}, "
                                     "expected an F32 scalar")
        if "not declared" in (nib_src, lay_src) and self.convention.name == CONFLICTING and not self.conflict_noted:
            self.problems.append(conflict_problem(self.convention))
            self.conflict_noted = True
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
            for target, segs in self.targets_of(key, f"{module}.{suffix}" if module else suffix):
                self.plain[target] = (key, segs)
                self.logical[target] = (segment_rows(t.shape[0], segs), *t.shape[1:]) if t.shape else ()

    def config(self, arg: ConfigArg | None) -> tuple[dict[str, Any], str, dict[str, str]]:
        """(config, where it came from, assumed values): inferred from shapes, with ``config=``'s keys on top."""
        assert self.family is not None
        try:
            inferred = self.family.infer(self.logical)
        except NVFP4CheckpointError as e:
            if arg is None:
                self.problems.append(str(e))
                return {}, "inferred from shapes", {}
            return dict(arg.config), arg.source, {}
        config, assumed = inferred.config, dict(inferred.assumed)
        if QWEN_ZERO_COND_T_MARKER in self.markers:
            config["zero_cond_t"] = True
            assumed.pop("zero_cond_t", None)
        if arg is None:
            return config, "inferred from shapes", assumed
        for key in arg.config:
            assumed.pop(key, None)
        return {**config, **arg.config}, f"inferred from shapes, then {arg.source}", assumed

    def check_against_model(self, cfg: dict[str, Any]) -> list[str]:
        """Compare every mapped tensor with the model ``cfg`` builds; returns the NVFP4 Linears without input_scale."""
        import diffusers
        from accelerate import init_empty_weights

        assert self.family is not None
        cls = getattr(diffusers, self.family.class_name)
        try:
            with init_empty_weights(include_buffers=False):
                model = cls.from_config(cfg)
        except Exception as e:  # a config= the class cannot build from
            self.problems.append(f"{self.family.class_name} cannot be built from the config ({type(e).__name__}: {e})")
            return []
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        covered = self._check_plain_targets(expected, type(model).__name__)
        linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        missing_scales = []
        for source in self.nvfp4.values():
            for target, segs in source.targets:
                missing_scales += self._check_nvfp4_target(source, target, segs, linears.get(target), covered)
        for name in sorted({n for n, _ in model.named_parameters()} - covered):
            self.problems.append(f"missing: no tensor in {self.header.path.name} maps to {name} {list(expected[name])}")
        if cfg.get("zero_cond_t") is False and QWEN_ZERO_COND_T_MARKER in self.markers:
            self.problems.append(f"the file has ComfyUI's {self.markers[QWEN_ZERO_COND_T_MARKER]} (Qwen-Image-Edit-"
                                 "2511: zero_cond_t=True), but the config sets zero_cond_t=False")
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
            self.problems.append(f"NVFP4 layer {source.module}: maps to {target}, which is not a Linear in the model")
            return []
        covered.update(f"{target}.{n}" for n, _ in lin.named_parameters())
        shape = (segment_rows(source.rows, segs), source.cols)
        if shape != (lin.out_features, lin.in_features):
            self.problems.append(f"{source.keys['weight']}: maps to {target} as [{shape[0]}, {shape[1]}] (unpacked), "
                                 f"expected [{lin.out_features}, {lin.in_features}]")
        if lin.bias is not None and "bias" not in source.keys:
            self.problems.append(f"missing key {self.prefix}{source.module}.bias (layer {target} has a bias)")
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
    """Decide, from the header alone, how every tensor of a single file maps onto its diffusers class.

    Problems (family, missing/unexpected keys, dtypes, shapes, metadata contradictions, undeclared layouts) are
    collected in ``plan.problems``; nothing is raised for them here, so ``inspect`` can show them all. Missing input
    scales are listed in ``plan.missing_input_scale`` (minus those ``input_scales`` or ``dynamic_input_scale`` cover).
    """
    if scale_layout not in (None, "128x4", "linear"):
        raise ValueError(f"scale_layout must be None, '128x4' or 'linear', got {scale_layout!r}")
    if nibble_order not in (None, "hi_first", "lo_first"):
        raise ValueError(f"nibble_order must be None, 'hi_first' or 'lo_first', got {nibble_order!r}")
    arg = read_config_arg(config) if config is not None else None
    planner = _Planner(header, scale_layout, nibble_order)
    detected = detect_family([k[len(planner.prefix):] for k in header.tensors])
    family, problem = family_problem(detected, arg.class_name if arg else None)
    planner.family = family
    planner.mapping = IDENTITY if detected.diffusers_names else family.class_name if family else ""
    if family is None:
        planner.problems.append(problem or "no family")
        return BflPlan(header.path, planner.prefix, {}, "not read", "unknown", {}, {}, [], planner.meta,
                       planner.problems, None, detected.evidence, planner.convention)
    for module, suffixes in planner.modules().items():
        kind = planner.is_nvfp4(module, suffixes)
        if kind is True:
            planner.add_nvfp4(module, suffixes)
        elif kind is False:
            planner.add_plain(module, suffixes)
    planner.report_undeclared()
    evidence = detected.evidence if detected.family else f"config= names {family.class_name}"
    cfg, config_source, assumed = planner.config(arg)
    import diffusers

    full = {**init_defaults(getattr(diffusers, family.class_name)), **cfg}
    variant = family.variant(full) if cfg else "unknown"
    missing = planner.check_against_model(cfg) if cfg else []
    missing = planner.uncovered_scales(missing, input_scales)
    if dynamic_input_scale:
        missing = []
    return BflPlan(header.path, planner.prefix, cfg, config_source, variant, planner.plain, planner.nvfp4, missing,
                   planner.meta, planner.problems, family, evidence, planner.convention, assumed, planner.mapping)
