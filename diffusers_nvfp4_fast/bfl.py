"""Load the BFL / ComfyUI FLUX.2 NVFP4 single-file checkpoint into diffusers' ``Flux2Transformer2DModel``.

The layout of the official ``black-forest-labs/FLUX.2-dev-NVFP4`` files is *inferred* (DESIGN.md section 4), so
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
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from .format import BLOCK_SIZE, ScaleLayout, decode_nvfp4, round_up, swap_nibbles, unswizzle_scales
from .linear import NVFP4Linear
from .loading import NVFP4CheckpointError, finish_model, replace_linear

logger = logging.getLogger("diffusers_nvfp4_fast")

NibbleOrder = Literal["hi_first", "lo_first"]

INPUT_SCALE_DIVISOR = 448.0 * 6.0  # ModelOpt: input_scale = amax / (E4M3_MAX * E2M1_MAX)
MARKER_SUFFIX = "comfy_quant"
HEADER_METADATA_KEY = "_quantization_metadata"
# Prefixes ComfyUI-saved files put in front of every diffusion-model key.
KNOWN_KEY_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
# ComfyUI's "nvfp4" format as comfy-kitchen writes it (TensorCoreNVFP4Layout, pack_uint4(hi_first=True), cuBLAS
# 128x4 block scales). Inferred, not read from the real file: used only where the file itself says nothing.
COMFY_NVFP4_CONVENTION: dict[str, str] = {"nibble_order": "hi_first", "scale_layout": "128x4"}
NVFP4_LAYER_SUFFIXES = ("weight", "weight_scale", "weight_scale_2", "input_scale", MARKER_SUFFIX, "bias")
PLAIN_PARAM_SUFFIXES = ("weight", "bias", "scale")
INPUT_SCALES_FORMAT = "diffusers-nvfp4-fast/input_scales"

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")

# FLUX.2 family members, for naming what was inferred (shapes decide; this table only labels them).
FLUX2_VARIANTS = {
    (8, 48, 6144): "FLUX.2-dev",
    (5, 20, 3072): "FLUX.2-klein-4B",
    (8, 24, 4096): "FLUX.2-klein-9B",
}


# ---------------------------------------------------------------------------------------------------------------
# Reading a safetensors file's header (no tensor data) and the quantization metadata.
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry: safetensors dtype string (``"U8"``, ``"BF16"``...), shape, byte range."""

    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return self.offsets[1] - self.offsets[0]


class SafetensorsHeader:
    """The JSON header of a ``.safetensors`` file, parsed without touching tensor data.

    Unlike ``safe_open`` this keeps dtypes torch may not know (reported, not crashed on) and the raw
    ``__metadata__`` strings.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise NVFP4CheckpointError(f"{self.path}: {size} bytes, too short to be a safetensors file")
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, 512 * 1024 * 1024):
                raise NVFP4CheckpointError(f"{self.path}: header length {n} does not fit the file; not a safetensors file")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise NVFP4CheckpointError(f"{self.path}: the safetensors header is not valid JSON ({e})") from e
        self.data_start = 8 + n
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.tensors: dict[str, TensorInfo] = {
            k: TensorInfo(str(v["dtype"]), tuple(int(d) for d in v["shape"]), tuple(int(o) for o in v["data_offsets"]))
            for k, v in header.items()
        }

    def read_bytes(self, key: str) -> bytes:
        """Raw bytes of one (small) tensor, e.g. a ``comfy_quant`` marker."""
        info = self.tensors[key]
        with open(self.path, "rb") as f:
            f.seek(self.data_start + info.offsets[0])
            return f.read(info.nbytes)

    def load(self, keys: Sequence[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        out = {}
        with safe_open(str(self.path), framework="pt") as h:
            for k in keys:
                out[k] = h.get_tensor(k)
        return out

    def open(self):
        """A ``safe_open`` handle (context manager) for reading tensors one at a time."""
        from safetensors import safe_open

        return safe_open(str(self.path), framework="pt")


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
    _read_flag(spec, where, problems, out, "scale_layout", {"scale_layout": _LAYOUT_ALIASES, "block_scale_layout": _LAYOUT_ALIASES},
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
                f"conflicting formats for layer {layer}: {known.sources[0]} says {known.format!r}, {source} says {fmt!r}"
            )
        for k, v in flags.items():
            if k in known.flags and known.flags[k] != v:
                problems.append(
                    f"conflicting {k} for layer {layer}: {known.sources[0]} says {known.flags[k]!r}, {source} says {v!r}"
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
            add(layer.removesuffix(".weight"), spec, f"header {HEADER_METADATA_KEY}")
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
    return QuantMetadata(layers, file_flags, has_header, markers)


# ---------------------------------------------------------------------------------------------------------------
# BFL -> diffusers names, learned from diffusers' own converter.
# ---------------------------------------------------------------------------------------------------------------

# Rows of the probe tensor fed to the converter: divisible by 2, 3, 4 and 6, so chunk(2) / chunk(3) splits show up
# as exact fractions of the source rows.
_PROBE_ROWS = 12
Segments = tuple[tuple[int, int], ...]


@functools.cache
def diffusers_targets(bfl_key: str) -> tuple[tuple[str, Segments], ...]:
    """Where diffusers' FLUX.2 converter puts one BFL tensor: ``((diffusers_key, row_segments), ...)``.

    The converter is run on a probe tensor ``arange(12)`` under the given key; the rows each output receives are
    read back as segments in units of 1/12 of the source rows (``((0, 4),)`` is the first third, ``((6, 12), (0, 6))``
    the two halves swapped). Raises KeyError (with diffusers' message) for keys the converter does not know.
    """
    try:
        from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers as convert
    except ImportError as e:  # pragma: no cover - diffusers without FLUX.2 single-file support
        raise ImportError("this diffusers has no convert_flux2_transformer_checkpoint_to_diffusers (need >= 0.42)") from e
    out = convert({bfl_key: torch.arange(_PROBE_ROWS)})
    targets = []
    for key, probe in out.items():
        rows = probe.tolist()
        segments, start = [], 0
        for i in range(1, len(rows) + 1):
            if i == len(rows) or rows[i] != rows[i - 1] + 1:
                segments.append((rows[start], rows[i - 1] + 1))
                start = i
        targets.append((key, tuple(segments)))
    return tuple(targets)


def take_rows(t: torch.Tensor, segments: Segments, what: str) -> torch.Tensor:
    """Rows of ``t`` selected by probe segments (see ``diffusers_targets``)."""
    n = t.shape[0]
    if segments == ((0, _PROBE_ROWS),):
        return t
    parts = []
    for s, e in segments:
        if (n * s) % _PROBE_ROWS or (n * e) % _PROBE_ROWS:
            raise NVFP4CheckpointError(f"{what}: {n} rows cannot be split at {s}/{_PROBE_ROWS} and {e}/{_PROBE_ROWS}")
        parts.append(t[n * s // _PROBE_ROWS: n * e // _PROBE_ROWS])
    return torch.cat(parts, 0).contiguous() if len(parts) > 1 else parts[0].contiguous()


def _segment_rows(n: int, segments: Segments) -> int:
    return sum(n * (e - s) for s, e in segments) // _PROBE_ROWS


# ---------------------------------------------------------------------------------------------------------------
# Model config.
# ---------------------------------------------------------------------------------------------------------------


def infer_flux2_config(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """``Flux2Transformer2DModel`` config from diffusers parameter names -> logical shapes (FP4 weights as ``[N, K]``).

    Read from shapes: block counts, head dim (``norm_q``), width, in/out channels, text width, timestep channels,
    MLP ratio, guidance embedder presence. Not in the weights, so FLUX.2's values are assumed (and logged):
    ``patch_size=1``, ``axes_dims_rope = 4 x head_dim/4``, ``rope_theta=2000``, ``eps=1e-6``.
    """

    def need(name: str) -> tuple[int, ...]:
        if name not in shapes:
            raise NVFP4CheckpointError(
                f"cannot infer the FLUX.2 config: no tensor maps to {name}; is this a FLUX.2 transformer? (pass config=)"
            )
        return shapes[name]

    def count(prefix: str) -> int:
        idx = {int(k.split(".")[1]) for k in shapes if k.startswith(prefix + ".") and k.split(".")[1].isdigit()}
        if idx and idx != set(range(len(idx))):
            raise NVFP4CheckpointError(f"cannot infer the FLUX.2 config: {prefix} indices {sorted(idx)} are not 0..n-1")
        return len(idx)

    inner, in_channels = need("x_embedder.weight")
    num_layers, num_single = count("transformer_blocks"), count("single_transformer_blocks")
    head_key = "transformer_blocks.0.attn.norm_q.weight" if num_layers else "single_transformer_blocks.0.attn.norm_q.weight"
    (head_dim,) = need(head_key)
    if inner % head_dim:
        raise NVFP4CheckpointError(f"cannot infer the FLUX.2 config: width {inner} is not a multiple of head dim {head_dim}")
    if num_layers:
        mlp_in = need("transformer_blocks.0.ff.linear_in.weight")[0]
        mlp_hidden = mlp_in // 2  # SwiGLU: linear_in produces gate and value
    else:
        mlp_hidden = (need("single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight")[0] - 3 * inner) // 2
    out_rows = need("proj_out.weight")[0]
    if head_dim % 8:
        raise NVFP4CheckpointError(f"cannot infer axes_dims_rope for head dim {head_dim}; pass config=")
    return {
        "patch_size": 1,
        "in_channels": in_channels,
        "out_channels": out_rows if out_rows != in_channels else None,
        "num_layers": num_layers,
        "num_single_layers": num_single,
        "attention_head_dim": head_dim,
        "num_attention_heads": inner // head_dim,
        "joint_attention_dim": need("context_embedder.weight")[1],
        "timestep_guidance_channels": need("time_guidance_embed.timestep_embedder.linear_1.weight")[1],
        "mlp_ratio": mlp_hidden / inner,
        "axes_dims_rope": [head_dim // 4] * 4,
        "rope_theta": 2000,
        "eps": 1e-6,
        "guidance_embeds": "time_guidance_embed.guidance_embedder.linear_1.weight" in shapes,
    }


def flux2_variant(config: Mapping[str, Any]) -> str:
    """'FLUX.2-dev', 'FLUX.2-klein-4B', 'FLUX.2-klein-9B', or 'FLUX.2-family (custom ...)'."""
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    key = (config["num_layers"], config["num_single_layers"], inner)
    return FLUX2_VARIANTS.get(key, f"FLUX.2-family (custom: {key[0]} double + {key[1]} single blocks, width {inner})")


def _init_defaults(cls: type) -> dict[str, Any]:
    import inspect

    params = inspect.signature(cls.__init__).parameters
    return {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}


def _read_config_arg(config: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    if isinstance(config, Mapping):
        cfg = dict(config)
    else:
        p = Path(config)
        p = p / "config.json" if p.is_dir() else p
        cfg = json.loads(p.read_text())
    return {k: v for k, v in cfg.items() if not k.startswith("_") and k != "quantization_config"}


# ---------------------------------------------------------------------------------------------------------------
# Input scales supplied by the user (option A).
# ---------------------------------------------------------------------------------------------------------------


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


def _missing_input_scale_message(file: Path, names: list[str]) -> str:
    shown = "\n  ".join(names[:40]) + ("\n  ..." if len(names) > 40 else "")
    return (
        f"{file}: {len(names)} NVFP4 layer(s) have no input_scale (the activation scale the checkpoint was "
        f"calibrated with), e.g. the '-mixed' FLUX.2 file. Using 1.0 would saturate activations, so nothing was "
        f"loaded. Choose one:\n"
        f"  (A) input_scales={{layer: value}} or input_scales='scales.json' -- your own calibration; "
        f"diffusers_nvfp4_fast.bfl.calibrate_input_scales(...) records one over a few prompts and writes that file;\n"
        f"  (B) dynamic_input_scale=True -- per-call amax/2688 of each layer's actual input (not the checkpoint's "
        f"recipe: results depend on the batch).\n"
        f"Layers (diffusers names):\n  {shown}"
    )


# ---------------------------------------------------------------------------------------------------------------
# The plan: everything decided from the header, before any weight is read.
# ---------------------------------------------------------------------------------------------------------------


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
            "file": str(self.file), "key_prefix": self.prefix, "variant": self.variant, "config_source": self.config_source,
            "config": self.config, "nvfp4_layers": len(self.nvfp4), "plain_tensors": len(self.plain),
            "markers": self.metadata.markers, "header_metadata": self.metadata.has_header,
            "nibble_order": count("nibble_order"), "nibble_order_source": count("nibble_source"),
            "scale_layout": count("scale_layout"), "scale_layout_source": count("scale_source"),
            "missing_input_scale": list(self.missing_input_scale), "problems": list(self.problems),
        }


def _resolve_fact(
    fact: str, layer: str, info: LayerQuantInfo | None, file_flags: Mapping[str, str], argument: str | None,
    problems: list[str],
) -> tuple[str, str]:
    """(value, where it came from) for 'nibble_order' or 'scale_layout': argument > layer metadata > file > convention."""
    explicit_layer = info.flags.get(fact) if info else None
    explicit_file = file_flags.get(fact)
    if explicit_layer and explicit_file and explicit_layer != explicit_file:
        problems.append(
            f"conflicting {fact} for layer {layer}: header {HEADER_METADATA_KEY} says {explicit_file!r} for the file, "
            f"{info.sources[0]} says {explicit_layer!r}"
        )
    explicit = explicit_layer or explicit_file
    if argument is not None:
        if explicit and explicit != argument:
            problems.append(f"{fact}={argument!r} was passed, but the file's metadata says {explicit!r} for layer {layer}")
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
            hint = (" -- that is the linear [N, K/16] shape: if the file stores linear scales, pass scale_layout='linear'"
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
    from accelerate import init_empty_weights
    from diffusers import Flux2Transformer2DModel

    if scale_layout not in (None, "128x4", "linear"):
        raise ValueError(f"scale_layout must be None, '128x4' or 'linear', got {scale_layout!r}")
    if nibble_order not in (None, "hi_first", "lo_first"):
        raise ValueError(f"nibble_order must be None, 'hi_first' or 'lo_first', got {nibble_order!r}")
    problems: list[str] = []
    prefix = detect_key_prefix(list(header.tensors))
    meta = read_quant_metadata(header, prefix, problems)

    by_module: dict[str, dict[str, str]] = {}
    for key in header.tensors:
        module, _, suffix = key[len(prefix):].rpartition(".")
        by_module.setdefault(module, {})[suffix] = key
    for layer in meta.layers:
        if layer not in by_module or "weight" not in by_module[layer]:
            problems.append(f"metadata names layer {layer}, but the file has no {prefix}{layer}.weight")

    plain: dict[str, tuple[str, Segments]] = {}
    nvfp4: dict[str, NVFP4Source] = {}
    logical: dict[str, tuple[int, ...]] = {}

    def targets_of(key: str, bfl_key: str) -> tuple[tuple[str, Segments], ...]:
        try:
            return diffusers_targets(bfl_key)
        except Exception as e:  # the converter raises KeyError for names it has no rule for
            problems.append(f"unexpected key {key}: diffusers' FLUX.2 converter has no rule for it ({type(e).__name__}: {e})")
            return ()

    for module, suffixes in by_module.items():
        info = meta.layers.get(module)
        weight_key = suffixes.get("weight")
        weight = header.tensors.get(weight_key) if weight_key else None
        packed = weight is not None and weight.dtype == "U8"
        declared_fp4 = info is not None and info.format == "nvfp4"
        if info is not None and info.format != "nvfp4":
            problems.append(
                f"layer {module}: quantization format {info.format!r} ({info.sources[0]}) is not supported; only 'nvfp4' is"
            )
            continue
        if packed and info is None and not (scale_layout and nibble_order and "weight_scale" in suffixes):
            problems.append(
                f"{weight_key}: U8 (packed FP4?) but no {MARKER_SUFFIX} marker or {HEADER_METADATA_KEY} entry says how it "
                "is laid out; pass scale_layout= and nibble_order= to declare it"
            )
            continue
        if declared_fp4 and weight is not None and not packed:
            problems.append(
                f"{weight_key}: dtype {weight.dtype} {list(weight.shape)}, but layer {module} is marked nvfp4 "
                f"({info.sources[0]}): expected U8 packed FP4"
            )
            continue
        if declared_fp4 or packed:
            if weight is None:
                continue  # reported above ("metadata names layer ...")
            for suffix, key in suffixes.items():
                if suffix not in NVFP4_LAYER_SUFFIXES:
                    t = header.tensors[key]
                    problems.append(f"unexpected key {key} ({t.dtype}, {list(t.shape)}) in NVFP4 layer {module}")
            if len(weight.shape) != 2:
                problems.append(f"{weight_key}: shape {list(weight.shape)}, expected 2-D packed [N, K/2]")
                continue
            targets = targets_of(weight_key, f"{module}.weight")
            if not targets:
                continue
            nib, nib_src = _resolve_fact("nibble_order", module, info, meta.file_flags, nibble_order, problems)
            lay, lay_src = _resolve_fact("scale_layout", module, info, meta.file_flags, scale_layout, problems)
            source = NVFP4Source(
                module, dict(suffixes), weight.shape[0], weight.shape[1] * 2,
                [(k.removesuffix(".weight"), segs) for k, segs in targets], nib, nib_src, lay, lay_src,
            )
            for suffix in ("weight_scale", "weight_scale_2"):
                if suffix not in suffixes:
                    problems.append(f"missing key {prefix}{module}.{suffix} (NVFP4 layer, U8 weight {list(weight.shape)})")
            if "weight_scale" in suffixes:
                _check_scale_shape(source, header.tensors[suffixes["weight_scale"]], suffixes["weight_scale"], problems)
            for suffix in ("weight_scale_2", "input_scale"):
                t = header.tensors.get(suffixes.get(suffix, ""))
                if t is not None and (t.dtype != "F32" or t.shape not in ((), (1,))):
                    problems.append(f"{suffixes[suffix]}: dtype {t.dtype} shape {list(t.shape)}, expected an F32 scalar")
            nvfp4[module] = source
            for target, segs in source.targets:
                logical[f"{target}.weight"] = (_segment_rows(source.rows, segs), source.cols)
            continue
        for suffix, key in suffixes.items():
            t = header.tensors[key]
            if suffix not in PLAIN_PARAM_SUFFIXES:
                problems.append(f"unexpected key {key} ({t.dtype}, {list(t.shape)}): {module} is not an NVFP4 layer")
                continue
            if t.dtype not in FLOAT_DTYPES:
                problems.append(f"{key}: dtype {t.dtype}, expected a floating-point dtype ({', '.join(FLOAT_DTYPES)})")
                continue
            for target, segs in targets_of(key, f"{module}.{suffix}"):
                plain[target] = (key, segs)
                logical[target] = (_segment_rows(t.shape[0], segs), *t.shape[1:]) if t.shape else ()

    config_source = "argument"
    if config is None:
        try:
            cfg = infer_flux2_config(logical)
            config_source = "inferred from shapes"
        except NVFP4CheckpointError as e:
            problems.append(str(e))
            cfg = {}
    else:
        cfg = _read_config_arg(config)
    variant = flux2_variant({**_init_defaults(Flux2Transformer2DModel), **cfg}) if cfg else "unknown"

    missing_scales: list[str] = []
    if cfg:
        with init_empty_weights(include_buffers=False):
            model = Flux2Transformer2DModel.from_config(cfg)
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        params = {n for n, _ in model.named_parameters()}
        linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        covered = set()
        for target, (key, _) in plain.items():
            if target not in expected:
                problems.append(f"unexpected key {key}: maps to {target}, which {type(model).__name__} does not have")
                continue
            covered.add(target)
            if logical[target] != expected[target]:
                problems.append(f"{key}: maps to {target} with shape {list(logical[target])}, expected {list(expected[target])}")
        for source in nvfp4.values():
            for target, segs in source.targets:
                lin = linears.get(target)
                if lin is None:
                    problems.append(f"NVFP4 layer {source.bfl_name}: maps to {target}, which is not a Linear in the model")
                    continue
                covered.update(f"{target}.{n}" for n, _ in lin.named_parameters())
                shape = (_segment_rows(source.rows, segs), source.cols)
                if shape != (lin.out_features, lin.in_features):
                    problems.append(
                        f"{source.keys['weight']}: maps to {target} as [{shape[0]}, {shape[1]}] (unpacked), "
                        f"expected [{lin.out_features}, {lin.in_features}]"
                    )
                if lin.bias is not None and "bias" not in source.keys:
                    problems.append(f"missing key {prefix}{source.bfl_name}.bias (layer {target} has a bias)")
                if "input_scale" not in source.keys:
                    missing_scales.append(target)
        for name in sorted(params - covered):
            problems.append(f"missing: no tensor in {header.path.name} maps to {name} {list(expected[name])}")

    if input_scales is not None:
        lacking = set(missing_scales)
        all_fp4 = {t for s in nvfp4.values() for t, _ in s.targets}
        extra = sorted(set(input_scales) - lacking)
        if extra:
            have = [n for n in extra if n in all_fp4]
            unknown = [n for n in extra if n not in all_fp4]
            if have:
                problems.append(f"input_scales names layers whose input_scale is in the checkpoint (remove them): {have}")
            if unknown:
                problems.append(f"input_scales names layers that are not NVFP4 layers of this checkpoint: {unknown}")
        missing_scales = [n for n in missing_scales if n not in input_scales]
    if dynamic_input_scale:
        missing_scales = []
    return BflPlan(header.path, prefix, cfg, config_source, variant, plain, nvfp4, missing_scales, meta, problems)


# ---------------------------------------------------------------------------------------------------------------
# Loading.
# ---------------------------------------------------------------------------------------------------------------


def resolve_single_file(path_or_repo_id: str | os.PathLike, filename: str | None, subfolder: str | None) -> Path:
    """A local file, a file inside a local directory, or ``hf_hub_download(repo_id, filename, subfolder=...)``."""
    path = Path(path_or_repo_id)
    if path.is_file() and filename is None:
        return path
    if filename is None:
        raise FileNotFoundError(f"{path_or_repo_id}: not a file (pass filename= for a file inside a repo or directory)")
    local = path / (subfolder or "") / filename
    if path.is_dir():
        if not local.is_file():
            raise FileNotFoundError(f"{local}: no such file")
        return local
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(str(path_or_repo_id), filename, subfolder=subfolder))


def _unswizzle_checked(scales: torch.Tensor, rows: int, cols: int, key: str) -> tuple[torch.Tensor, str | None]:
    """128x4 -> linear ``[rows, cols]``; a problem string if the padding is not zero after one unswizzle.

    Every writer we know zero-fills the padding before swizzling, so nonzero padding after one unswizzle means the
    bytes were not (only once) swizzled: most likely swizzled twice. Without padding (N % 128 == 0 and K/16 % 4 == 0,
    all of FLUX.2-dev) this check cannot see anything.
    """
    rp, cp = round_up(rows, 128), round_up(cols, 4)
    full = unswizzle_scales(scales.reshape(rp, cp), rp, cp)
    pad = torch.cat([full[rows:].flatten(), full[:rows, cols:].flatten()])
    if pad.numel() and bool(pad.any()):
        return full[:rows, :cols].contiguous(), (
            f"{key}: {int((pad != 0).sum())} of {pad.numel()} padding bytes are nonzero after unswizzling the 128x4 "
            f"scales once: they look swizzled twice (or are not 128x4 at all); refusing to guess"
        )
    return full[:rows, :cols].contiguous(), None


def load_bfl_nvfp4_transformer(
    path_or_repo_id: str | os.PathLike,
    *,
    filename: str | None = None,
    subfolder: str | None = None,
    config: Mapping[str, Any] | str | os.PathLike | None = None,
    torch_dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    scale_layout: ScaleLayout | None = None,
    nibble_order: NibbleOrder | None = None,
    input_scales: Mapping[str, float | torch.Tensor] | str | os.PathLike | None = None,
    dynamic_input_scale: bool = False,
) -> nn.Module:
    """Load a BFL / ComfyUI FLUX.2 NVFP4 single file as ``Flux2Transformer2DModel`` with ``NVFP4Linear`` layers.

    Usually reached through ``load_nvfp4_transformer(file)`` or ``load_nvfp4_transformer(repo_id, filename=...)``.

    Args:
        path_or_repo_id: a ``.safetensors`` file, a directory (with ``filename``) or a Hugging Face repo id.
        filename, subfolder: the file inside a repo or directory.
        config: ``Flux2Transformer2DModel`` config (dict, or a config.json path/dir); default: inferred from shapes.
        torch_dtype: dtype of the BF16 layers (norms, embedders, unquantized Linears).
        device: where to put the model (default: CPU).
        scale_layout, nibble_order: declare how FP4 layers are stored when the file says nothing (defaults: ComfyUI's
            convention, 128x4 and hi_first); contradicting the file's own metadata is an error.
        input_scales: for layers without ``input_scale``: ``{diffusers layer name: value}`` or a JSON side file.
        dynamic_input_scale: for layers without ``input_scale`` (and not in ``input_scales``): compute the activation
            scale per call from the input (``NVFP4Linear.dynamic_input_scale``). Not the checkpoint's recipe.

    Raises:
        NVFP4CheckpointError: listing every problem found (keys, dtypes, shapes, metadata, double-swizzled scales,
            missing input scales with the options to resolve them).
    """
    file = resolve_single_file(path_or_repo_id, filename, subfolder)
    user_scales = read_input_scales(input_scales) if input_scales is not None else {}
    header = SafetensorsHeader(file)
    plan = plan_bfl_checkpoint(
        header, config=config, scale_layout=scale_layout, nibble_order=nibble_order,
        input_scales=user_scales if input_scales is not None else None, dynamic_input_scale=dynamic_input_scale,
    )
    if plan.problems:
        raise NVFP4CheckpointError(
            f"{file}: {len(plan.problems)} problem(s) loading this BFL-format NVFP4 checkpoint into Flux2Transformer2DModel "
            f"(run `diffusers-nvfp4-fast inspect {file}` to see the file's layout):\n  " + "\n  ".join(plan.problems)
        )
    if plan.missing_input_scale:
        raise NVFP4CheckpointError(_missing_input_scale_message(file, plan.missing_input_scale))
    return _materialize(plan, header, torch_dtype, device, user_scales)


def _materialize(
    plan: BflPlan, header: SafetensorsHeader, torch_dtype: torch.dtype, device, user_scales: dict[str, float],
) -> nn.Module:
    from accelerate import init_empty_weights
    from diffusers import Flux2Transformer2DModel

    with init_empty_weights(include_buffers=False):
        model = Flux2Transformer2DModel.from_config(plan.config)
    by_key: dict[str, list[tuple[str, Segments]]] = {}
    for target, (key, segs) in plan.plain.items():
        by_key.setdefault(key, []).append((target, segs))
    with header.open() as handle:
        # One stored tensor at a time, so the peak is one fused tensor plus its parts, not the whole file.
        for key, targets in by_key.items():
            tensor = handle.get_tensor(key)
            state = {target: take_rows(tensor, segs, key).to(torch_dtype) for target, segs in targets}
            model.load_state_dict(state, strict=False, assign=True)
        return _materialize_nvfp4(plan, handle, model, torch_dtype, device, user_scales)


def _materialize_nvfp4(
    plan: BflPlan, handle, model: nn.Module, torch_dtype: torch.dtype, device, user_scales: dict[str, float],
) -> nn.Module:
    problems: list[str] = []
    sources = {"checkpoint": 0, "input_scales": 0, "dynamic": 0}
    nvfp4_bytes = 0
    for source in plan.nvfp4.values():
        k = source.keys
        tensors = {k[s]: handle.get_tensor(k[s]) for s in ("weight", "weight_scale", "weight_scale_2", "input_scale", "bias")
                   if s in k}
        packed = tensors[k["weight"]].view(torch.uint8)
        if source.nibble_order == "hi_first":
            packed = swap_nibbles(packed)
        scales = tensors[k["weight_scale"]].view(torch.uint8)
        c = source.cols // BLOCK_SIZE
        if source.scale_layout == "128x4":
            scales, problem = _unswizzle_checked(scales, source.rows, c, k["weight_scale"])
            if problem:
                problems.append(problem)
                continue
        weight_scale_2 = tensors[k["weight_scale_2"]].reshape(())
        stored_input_scale = tensors[k["input_scale"]].reshape(()) if "input_scale" in k else None
        for target, segs in source.targets:
            linear = model.get_submodule(target)
            what = f"{k['weight']} -> {target}"
            new = NVFP4Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, dtype=torch_dtype)
            if stored_input_scale is not None:
                input_scale, how = stored_input_scale, "checkpoint"
            elif target in user_scales:
                input_scale, how = torch.tensor(user_scales[target], dtype=torch.float32), "input_scales"
            else:
                # dynamic_input_scale: the static scale must never be used, so make any use loud (NaN), not 1.0.
                input_scale, how = torch.tensor(float("nan"), dtype=torch.float32), "dynamic"
            bias = take_rows(tensors[k["bias"]], segs, what) if "bias" in k else None
            new.load_nvfp4(
                take_rows(packed, segs, what), take_rows(scales, segs, what), weight_scale_2, input_scale, bias,
                scale_layout="linear",
            )
            new.swizzle_weight_scales_()
            new.dynamic_input_scale = how == "dynamic"
            new.input_scale_source = how
            sources[how] += 1
            replace_linear(model, target, linear, new)
            nvfp4_bytes += sum(b.numel() * b.element_size() for b in new.buffers())
    if problems:
        raise NVFP4CheckpointError(f"{plan.file}: {len(problems)} problem(s) in the block scales:\n  " + "\n  ".join(problems))
    finish_model(model, plan.file, device)
    if sources["dynamic"]:
        logger.warning(
            "%d NVFP4 layer(s) have no input_scale and use a per-call dynamic activation scale (dynamic_input_scale=True); "
            "this is not the checkpoint's recipe", sources["dynamic"],
        )
    n_fp4 = sum(sources.values())
    bf16_linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    total = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    facts = plan.facts()
    logger.info(
        "Loaded %s (%s, config %s) from %s: %d NVFP4 linears (%.1f MB), %d BF16 linears, %.1f MB in all; "
        "nibble order %s, scale layout %s; input scales %s",
        "Flux2Transformer2DModel", plan.variant, plan.config_source, plan.file, n_fp4, nvfp4_bytes / 1e6, bf16_linears,
        total / 1e6, facts["nibble_order_source"], facts["scale_layout_source"], sources,
    )
    model._nvfp4_load_summary = {
        "class": "Flux2Transformer2DModel", "format": "bfl", "variant": plan.variant, "nvfp4_linears": n_fp4,
        "bf16_linears": bf16_linears, "nvfp4_bytes": nvfp4_bytes, "total_bytes": total, "input_scale_sources": sources,
        "nibble_order": facts["nibble_order"], "scale_layout": facts["scale_layout"],
    }
    return model


# ---------------------------------------------------------------------------------------------------------------
# Calibrating missing input scales (option A).
# ---------------------------------------------------------------------------------------------------------------


def calibrate_input_scales(
    pipe_or_transformer: Any,
    prompts_or_run: Sequence[str] | Callable[[], Any],
    out_path: str | os.PathLike | None = None,
    *,
    layers: Sequence[str] | None = None,
    apply: bool = True,
    call_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, float]:
    """Record activation amax for NVFP4 layers lacking an ``input_scale`` and turn it into ``amax / 2688``.

    The layers (default: every ``NVFP4Linear`` with ``dynamic_input_scale=True``, i.e. loaded without a checkpoint
    scale) run with dequantized weights in BF16 during the runs, the way ModelOpt's max calibration sees unquantized
    activations; all other layers run as they are. Save the result with ``out_path`` and reuse it with
    ``load_nvfp4_transformer(file, input_scales=out_path)``.

    Args:
        pipe_or_transformer: a pipeline (``.transformer`` is used) or the transformer.
        prompts_or_run: prompts (each runs ``pipe(prompt=p, **call_kwargs)``) or a callable doing the runs.
        out_path: JSON side file to write (``{"format", "version", "input_scales": {...}, "amax": {...}}``).
        layers: diffusers layer names to calibrate instead of the default set.
        apply: set the scales on the layers and switch their ``dynamic_input_scale`` off (default True).

    Returns:
        ``{layer name: input_scale}``.
    """
    model = getattr(pipe_or_transformer, "transformer", pipe_or_transformer)
    model = getattr(model, "_orig_mod", model)
    modules = {n: m for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    names = list(layers) if layers is not None else [n for n, m in modules.items() if m.dynamic_input_scale]
    unknown = [n for n in names if n not in modules]
    if unknown:
        raise ValueError(f"not NVFP4Linear layers of {type(model).__name__}: {unknown}")
    if not names:
        raise ValueError("no layers to calibrate: no NVFP4Linear has dynamic_input_scale=True (pass layers=)")
    if callable(prompts_or_run):
        run = prompts_or_run
    else:
        if not hasattr(pipe_or_transformer, "transformer"):
            raise TypeError("prompts need a pipeline to run; with a bare transformer pass a callable that runs it")
        prompts = [prompts_or_run] if isinstance(prompts_or_run, str) else list(prompts_or_run)

        def run() -> None:
            for p in prompts:
                pipe_or_transformer(prompt=p, **dict(call_kwargs or {}))

    amax: dict[str, torch.Tensor | None] = dict.fromkeys(names)

    def calibrating_forward(name: str, module: NVFP4Linear) -> Callable[[torch.Tensor], torch.Tensor]:
        # e2m1 * e4m3 is exact; times weight_scale_2 is the weight the checkpoint encodes (up to one FP32 rounding).
        weight = decode_nvfp4(module.weight, module.weight_scale, scale_layout=module.scale_layout, dtype=torch.float32)
        weight = weight * module.weight_scale_2
        cast: dict[torch.dtype, torch.Tensor] = {}

        def forward(x: torch.Tensor) -> torch.Tensor:
            seen = x.detach().abs().amax().to(torch.float32)
            amax[name] = seen if amax[name] is None else torch.maximum(amax[name], seen)
            if x.dtype not in cast:
                cast[x.dtype] = weight.to(x.dtype)
            return nn.functional.linear(x, cast[x.dtype], module.bias)

        return forward

    for name in names:
        modules[name].forward = calibrating_forward(name, modules[name])
    try:
        with torch.no_grad():
            run()
    finally:
        for name in names:
            del modules[name].forward  # back to the class's forward
    never = [n for n, a in amax.items() if a is None or not bool(torch.isfinite(a)) or float(a) == 0.0]
    if never:
        raise RuntimeError(f"calibration saw no usable (nonzero, finite) input for {len(never)} layer(s): {never[:20]}")
    scales = {n: float((a.cpu() / INPUT_SCALE_DIVISOR).item()) for n, a in amax.items()}
    if out_path is not None:
        Path(out_path).write_text(json.dumps({
            "format": INPUT_SCALES_FORMAT, "version": 1,
            "note": "input_scale = amax / (448 * 6) per layer, recorded by diffusers_nvfp4_fast.calibrate_input_scales",
            "input_scales": scales, "amax": {n: float(a.item()) for n, a in amax.items()},
        }, indent=1))
    if apply:
        with torch.no_grad():
            for name, value in scales.items():
                m = modules[name]
                m.input_scale = torch.tensor(value, dtype=torch.float32, device=m.weight.device)
                m.refresh_derived_scales_()
                m.dynamic_input_scale = False
                m.input_scale_source = "calibrated"
    logger.info("Calibrated input_scale for %d layer(s)%s", len(scales), f", wrote {out_path}" if out_path else "")
    return scales
