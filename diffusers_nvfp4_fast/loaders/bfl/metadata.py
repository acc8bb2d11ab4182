"""What a single file says about its quantization: key prefix, per-layer ``comfy_quant`` markers and the
``_quantization_metadata`` header (ComfyUI), the header key ``quantization`` (diffusers' BFL files), the layout flags
(nibble order, scale layout) normalized and cross-checked, and the convention they name. Contradictions are collected
as problems, not raised, so ``inspect`` can show them all.

ComfyUI's format (docs/checkpoints.md, proven against comfy-kitchen 0.2.40 by tests/test_loader_comfy.py): ComfyUI's
``comfy/utils.py`` ``convert_old_quants`` turns the header ``{"layers": {<full key>: {"format": ...}}}`` into
``<layer>.comfy_quant`` tensors (UTF-8 JSON, uint8), the markers files may also carry themselves; a layer marked
``nvfp4`` is read by comfy-kitchen's ``TensorCoreNVFP4Layout``: packed weight high nibble first
(``float_utils.pack_uint4(hi_first=True)``), ``weight_scale`` E4M3 in the 128x4 layout (``float_utils.to_blocked``),
``weight_scale_2`` the FP32 per-tensor scale that multiplies the decoded values.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ...format import BLOCK_SIZE
from ..safetensors_header import SafetensorsHeader

NibbleOrder = Literal["hi_first", "lo_first"]

MARKER_SUFFIX = "comfy_quant"
HEADER_METADATA_KEY = "_quantization_metadata"
# Prefixes ComfyUI-saved files put in front of every diffusion-model key.
KNOWN_KEY_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
# ComfyUI's "nvfp4" format as comfy-kitchen 0.2.40 writes and reads it (tensor/nvfp4.py TensorCoreNVFP4Layout):
# the default for layers a comfy_quant marker or _quantization_metadata names without layout flags.
COMFY_NVFP4_CONVENTION: dict[str, str] = {"nibble_order": "hi_first", "scale_layout": "128x4"}
# diffusers 0.42's BFL files: scripts/quantize_flux2_bfl.py writes the header {"format": "pt", "quantization": scheme};
# quantizers/bfl/utils.py quantize_nvfp4 / dequantize_nvfp4 pack low nibble first with linear [N, K/16] scales.
DIFFUSERS_QUANTIZATION_KEY = "quantization"
DIFFUSERS_NVFP4_CONVENTION: dict[str, str] = {"nibble_order": "lo_first", "scale_layout": "linear"}
COMFY = "ComfyUI (comfy-kitchen TensorCoreNVFP4Layout)"
CONFLICTING = "conflicting"
DIFFUSERS_BFL = "diffusers BFLQuantizationConfig"
NVFP4_LAYER_SUFFIXES = ("weight", "weight_scale", "weight_scale_2", "input_scale", MARKER_SUFFIX, "bias")


def detect_key_prefix(keys: Sequence[str]) -> str:
    """The ComfyUI prefix (``model.diffusion_model.``) if every key carries it, else ''."""
    for prefix in KNOWN_KEY_PREFIXES:
        if keys and all(k.startswith(prefix) for k in keys):
            return prefix
    return ""


_LAYOUT_ALIASES = {"128x4": "128x4", "swizzled": "128x4", "linear": "linear"}


_NIBBLE_ORDERS = {"hi_first": "hi_first", "lo_first": "lo_first"}


def _read_flag(
    spec: Mapping[str, Any], where: str, problems: list[str], out: dict[str, str], name: str,
    string_keys: Mapping[str, Mapping[str, str]], bool_key: tuple[str, str, str], allowed: str, what: str,
    fold_case: bool,
) -> None:
    """One layout fact that metadata may state as a string (several spellings) or as a boolean; all stated values
    must agree. ``bool_key`` is (key, value when true, value when false)."""
    values = set()
    for key, aliases in string_keys.items():
        if key in spec:
            v = spec[key]
            word = v.lower() if fold_case and isinstance(v, str) else v
            if isinstance(word, str) and word in aliases:
                values.add(aliases[word])
            else:
                problems.append(f"{where}: {key}={v!r} is not {allowed}")
    key, if_true, if_false = bool_key
    if key in spec:
        v = spec[key]
        if isinstance(v, bool):
            values.add(if_true if v else if_false)
        else:
            problems.append(f"{where}: {key}={v!r} is not a boolean")
    if len(values) > 1:
        problems.append(f"{where}: contradictory {what} flags {dict(spec)}")
    elif values:
        out[name] = values.pop()


def _parse_flags(spec: Mapping[str, Any], where: str, problems: list[str]) -> dict[str, str]:
    """The layout flags of one metadata object, normalized; invalid or self-contradictory values are problems."""
    out: dict[str, str] = {}
    _read_flag(spec, where, problems, out, "nibble_order", {"nibble_order": _NIBBLE_ORDERS},
               ("hi_first", "hi_first", "lo_first"), "'hi_first' or 'lo_first'", "nibble-order", False)
    _read_flag(spec, where, problems, out, "scale_layout",
               {"scale_layout": _LAYOUT_ALIASES, "block_scale_layout": _LAYOUT_ALIASES},
               ("swizzled", "128x4", "linear"), "'128x4', 'swizzled' or 'linear'", "scale-layout", True)
    for k in ("group_size", "block_size"):
        if k in spec and spec[k] != BLOCK_SIZE:
            problems.append(f"{where}: {k}={spec[k]!r}, NVFP4 uses {BLOCK_SIZE}")
    return out


@dataclass
class LayerQuantInfo:
    """What the file's metadata says about one layer (BFL name, without the key prefix)."""

    format: str
    flags: dict[str, str] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)


@dataclass
class QuantMetadata:
    layers: dict[str, LayerQuantInfo]
    file_flags: dict[str, str]
    has_header: bool
    markers: int
    diffusers_scheme: str | None = None  # the header's "quantization" value (diffusers' BFL files)


@dataclass(frozen=True)
class Convention:
    """The packing convention a file declares: its name, its layout facts (None: the file names none) and why."""

    name: str
    facts: dict[str, str] | None
    evidence: str
    source: str = ""  # how a decision taken from it is labelled


def conflict_problem(convention: Convention) -> str:
    return (f"the file carries both ComfyUI's quantization metadata and diffusers' BFL header ({convention.evidence}), "
            "whose conventions differ (high nibble first and 128x4 scales vs low nibble first and linear scales); "
            'pass scale_layout="128x4", nibble_order="hi_first" or scale_layout="linear", nibble_order="lo_first" '
            "to say which")


def file_convention(meta: QuantMetadata, problems: list[str]) -> Convention:
    """ComfyUI's (markers or ``_quantization_metadata``), diffusers' BFL one (header ``quantization``), or none."""
    comfy = []
    if meta.markers:
        comfy.append(f"{meta.markers} {MARKER_SUFFIX} marker(s)")
    if meta.has_header:
        comfy.append(f"header {HEADER_METADATA_KEY}")
    scheme = meta.diffusers_scheme
    diffusers = f"header {DIFFUSERS_QUANTIZATION_KEY}={scheme!r} (diffusers' scripts/quantize_flux2_bfl.py)"
    if scheme is not None and scheme != "nvfp4":
        problems.append(f"{diffusers}: a diffusers BFL file in the {scheme!r} scheme; only 'nvfp4' is read here")
    if comfy and scheme is not None:  # a problem only where no argument or flag decides (the planner's call)
        return Convention(CONFLICTING, None, f"{' and '.join(comfy)}; {diffusers}")
    if comfy:
        return Convention(COMFY, dict(COMFY_NVFP4_CONVENTION), " and ".join(comfy), "ComfyUI convention")
    if scheme is not None:
        return Convention(DIFFUSERS_BFL, dict(DIFFUSERS_NVFP4_CONVENTION), diffusers, "diffusers BFL convention")
    return Convention("no", None, f"no {MARKER_SUFFIX} marker, no {HEADER_METADATA_KEY} header, no header "
                                  f"{DIFFUSERS_QUANTIZATION_KEY} key")


def read_quant_metadata(header: SafetensorsHeader, prefix: str, problems: list[str]) -> QuantMetadata:
    """Per-layer markers and the ``_quantization_metadata`` header, merged; disagreements are problems."""
    layers: dict[str, LayerQuantInfo] = {}
    file_flags: dict[str, str] = {}

    def add(layer: str, spec: Any, source: str) -> None:
        where = f"{source} for layer {layer}"
        if not isinstance(spec, dict) or not isinstance(spec.get("format"), str):
            problems.append(f"{where}: expected a JSON object with a string 'format', got {spec!r}")
            return
        flags = _parse_flags(spec, where, problems)
        fmt = spec["format"].lower()
        known = layers.get(layer)
        if known is None:
            layers[layer] = LayerQuantInfo(fmt, flags, [source])
            return
        if known.format != fmt:
            problems.append(
                f"conflicting formats for layer {layer}: {known.sources[0]} says {known.format!r}, "
                f"{source} says {fmt!r}"
            )
        for k, v in flags.items():
            if k in known.flags and known.flags[k] != v:
                problems.append(
                    f"conflicting {k} for layer {layer}: {known.sources[0]} says {known.flags[k]!r}, "
                    f"{source} says {v!r}"
                )
            known.flags.setdefault(k, v)
        known.sources.append(source)

    has_header = HEADER_METADATA_KEY in header.metadata
    if has_header:
        try:
            meta = json.loads(header.metadata[HEADER_METADATA_KEY])
        except json.JSONDecodeError as e:
            problems.append(f"{header.path.name}: header {HEADER_METADATA_KEY} is not valid JSON ({e})")
            meta = {}
        if not isinstance(meta, dict):
            problems.append(f"{header.path.name}: header {HEADER_METADATA_KEY} is not a JSON object")
            meta = {}
        file_flags = _parse_flags(meta, f"header {HEADER_METADATA_KEY}", problems)
        entries = meta.get("layers", {})
        if not isinstance(entries, dict):
            problems.append(f"header {HEADER_METADATA_KEY}: 'layers' is not an object")
            entries = {}
        for name, spec in entries.items():
            layer = name[len(prefix):] if prefix and name.startswith(prefix) else name
            add(layer.removesuffix(".weight"), spec, f"header {HEADER_METADATA_KEY} layers[{name!r}]")
    markers = 0
    for key, info in header.tensors.items():
        if not key.endswith("." + MARKER_SUFFIX):
            continue
        markers += 1
        layer = key[len(prefix): -len(MARKER_SUFFIX) - 1]
        if info.dtype != "U8" or len(info.shape) != 1:
            problems.append(f"marker {key}: dtype {info.dtype} shape {list(info.shape)}, expected a 1-D U8 JSON string")
            continue
        try:
            spec = json.loads(header.read_bytes(key).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            problems.append(f"marker {key}: not UTF-8 JSON ({e})")
            continue
        add(layer, spec, f"marker {key}")
    scheme = header.metadata.get(DIFFUSERS_QUANTIZATION_KEY)
    return QuantMetadata(layers, file_flags, has_header, markers, scheme.lower() if scheme is not None else None)
