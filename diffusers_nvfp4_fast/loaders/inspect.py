"""``diffusers-nvfp4-fast inspect``: what a checkpoint's header says, without reading weights.

Key families with dtypes and shapes, quantization markers and header metadata, per-layer scale-layout guesses from
shapes, the nibble order and where it comes from, missing ``input_scale``s, and a dry run of the loader (BFL-format
FLUX.2 files: inferred model config; ModelOpt export directories: every key, dtype, shape and scale check of
``load_modelopt_export``) with every problem it would raise. Attach its output (``--json`` for the
machine-readable form) when reporting a checkpoint that does not load or looks wrong.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ..format import BLOCK_SIZE, padded_scale_shape
from .common import scale_layout_from_shape
from .safetensors_header import SafetensorsHeader

# Only block indices are collapsed: BFL module names themselves contain numbers (img_mlp.0 / img_mlp.2).
_BLOCK_INDEX = re.compile(r"(blocks|layers)\.\d+\.")
_NIBBLE_NOTE = "nibble order cannot be detected from the bytes (a swap keeps every value inside its 16-block)"


def _family(key: str) -> str:
    return _BLOCK_INDEX.sub(r"\1.*.", key)


def guess_scale_layout(scale_shape: tuple[int, ...], packed_weight_shape: tuple[int, ...]) -> str:
    """'linear', '128x4', '128x4 (flat)', 'ambiguous' (both layouts have this shape) or 'neither' -- from shapes."""
    if len(packed_weight_shape) != 2:
        return "neither"
    return scale_layout_from_shape(scale_shape, packed_weight_shape[0], packed_weight_shape[1] * 2)


def _headers(path: Path) -> tuple[dict[str, tuple[Path, Any]], dict[str, dict[str, str]], dict[str, Any]]:
    """key -> (file, TensorInfo); file name -> __metadata__; and the directory's config facts (if a directory)."""
    from .modelopt_export import weight_files

    extra: dict[str, Any] = {}
    files = [path]
    if path.is_dir():
        files = weight_files(path)
        if (path / "config.json").is_file():
            cfg = json.loads((path / "config.json").read_text())
            extra["class"] = cfg.get("_class_name")
            extra["quantization_config"] = cfg.get("quantization_config")
        if (path / "hf_quant_config.json").is_file():
            extra["hf_quant_config"] = json.loads((path / "hf_quant_config.json").read_text())
    tensors: dict[str, tuple[Path, Any]] = {}
    metadata = {}
    for f in files:
        h = SafetensorsHeader(f)
        metadata[f.name] = h.metadata
        tensors.update({k: (f, v) for k, v in h.tensors.items()})
    return tensors, metadata, extra


def _naming(short_keys) -> str:
    if any(k.startswith(("double_blocks.", "single_blocks.")) for k in short_keys):
        return "BFL (double_blocks / single_blocks)"
    if any(k.startswith(("transformer_blocks.", "single_transformer_blocks.")) for k in short_keys):
        return "diffusers (transformer_blocks)"
    return "unknown"


def _dtype_and_family_facts(tensors: dict[str, tuple[Path, Any]], prefix: str) -> dict[str, Any]:
    by_dtype: dict[str, list[int]] = {}
    families: dict[str, dict[str, Any]] = {}
    for k, (_, info) in tensors.items():
        entry = by_dtype.setdefault(info.dtype, [0, 0])
        entry[0] += 1
        entry[1] += info.nbytes
        fam = families.setdefault(_family(k[len(prefix):]), {"count": 0, "dtypes": set(), "shapes": set()})
        fam["count"] += 1
        fam["dtypes"].add(info.dtype)
        fam["shapes"].add(tuple(info.shape))
    return {
        "dtypes": {d: {"tensors": c, "bytes": b} for d, (c, b) in sorted(by_dtype.items())},
        "families": {
            f: {"count": v["count"], "dtypes": sorted(v["dtypes"]),
                "shapes": [list(s) for s in sorted(v["shapes"])[:4]], "more_shapes": max(0, len(v["shapes"]) - 4)}
            for f, v in sorted(families.items())
        },
    }


def _metadata_facts(header: SafetensorsHeader, qmeta) -> dict[str, Any]:
    from .bfl.metadata import HEADER_METADATA_KEY

    formats: dict[str, int] = {}
    for info in qmeta.layers.values():
        formats[info.format] = formats.get(info.format, 0) + 1
    facts = {"markers": qmeta.markers, "header_quantization_metadata": qmeta.has_header, "declared_formats": formats,
             "file_flags": qmeta.file_flags}
    if HEADER_METADATA_KEY in header.metadata:
        try:
            hm = json.loads(header.metadata[HEADER_METADATA_KEY])
            facts["header_quantization_metadata_top_level"] = {k: v for k, v in hm.items() if k != "layers"}
        except (json.JSONDecodeError, AttributeError):
            pass
    return facts


def _nibble_order(is_dir: bool, declared, qmeta) -> tuple[str, str]:
    from .bfl.metadata import COMFY_NVFP4_CONVENTION

    if is_dir:
        return "lo_first", "ModelOpt export convention"
    if declared and "nibble_order" in declared.flags:
        return declared.flags["nibble_order"], "metadata"
    if qmeta and "nibble_order" in qmeta.file_flags:
        return qmeta.file_flags["nibble_order"], "metadata (file-wide)"
    return COMFY_NVFP4_CONVENTION["nibble_order"], "inferred ComfyUI convention"


def _layer_facts(path: Path, tensors: dict[str, tuple[Path, Any]], prefix: str, qmeta, check_scales: bool) -> list:
    """Per FP4 layer (packed weight + block scale): shapes, layout guess, declared flags, nibble order."""
    from .bfl.metadata import MARKER_SUFFIX

    layers: list[dict[str, Any]] = []
    for k, (f, info) in tensors.items():
        if not k.endswith(".weight_scale"):
            continue
        module = k[: -len(".weight_scale")]
        name = module[len(prefix):]
        w = tensors.get(module + ".weight")
        if w is None:
            layers.append({"layer": name, "scale_shape_guess": "no weight", "scale_shape": list(info.shape)})
            continue
        declared = qmeta.layers.get(name) if qmeta else None
        nibble, nibble_src = _nibble_order(path.is_dir(), declared, qmeta)
        layer = {
            "layer": name, "weight": [w[1].dtype, list(w[1].shape)], "scale": [info.dtype, list(info.shape)],
            "scale_shape_guess": guess_scale_layout(info.shape, w[1].shape),
            "declared": (declared.flags | {"format": declared.format}) if declared else None,
            "marker": (module + "." + MARKER_SUFFIX) in tensors,
            "input_scale": (module + ".input_scale") in tensors,
            "weight_scale_2": (module + ".weight_scale_2") in tensors,
            "nibble_order": nibble, "nibble_order_source": nibble_src,
        }
        if check_scales and w[1].dtype == "U8" and layer["scale_shape_guess"] in ("128x4", "128x4 (flat)", "ambiguous"):
            layer["padding_check"] = _padding_check(f, k, w[1].shape)
        layers.append(layer)
    return layers


def _dry_run(header: SafetensorsHeader) -> dict[str, Any]:
    from .bfl import plan_bfl_checkpoint

    try:
        dry = plan_bfl_checkpoint(header).facts()
    except Exception as e:  # the dry run must not hide the facts above
        return {"error": f"{type(e).__name__}: {e}"}
    keep = ("variant", "config_source", "config", "nibble_order", "nibble_order_source", "scale_layout",
            "scale_layout_source", "missing_input_scale", "problems")
    return {k: dry[k] for k in keep}


def _export_dry_run(model_dir: Path, check_scales: bool) -> dict[str, Any]:
    """``load_modelopt_export``'s own checks: every key, dtype and shape, the per-tensor scales, and with
    ``check_scales`` the block scales too."""
    from .modelopt_export import export_scale_problems, plan_modelopt_export

    try:
        plan = plan_modelopt_export(model_dir)
        problems = plan.problems or export_scale_problems(plan, block_scales=check_scales)
    except Exception as e:  # the dry run must not hide the facts above
        return {"error": f"{type(e).__name__}: {e}"}
    return {"variant": plan.cls.__name__, "loader": "load_modelopt_export", "nvfp4_layers": len(plan.quantized),
            "block_scales_checked": check_scales, "problems": problems}


def _diffusers_warning(facts: dict[str, Any]) -> str | None:
    """For a ComfyUI-style FP4 file (markers or ``_quantization_metadata``) laid out high nibble first or with 128x4
    scales: diffusers 0.42's ``BFLQuantizationConfig`` reads low nibble first and linear scales, without an error."""
    comfy_style = facts.get("markers") or facts.get("header_quantization_metadata")
    fp4 = [x for x in facts["nvfp4_layers"] if x.get("weight", [None])[0] == "U8"]
    dry = facts.get("loader_dry_run") or {}
    layouts = dry.get("scale_layout") or {}
    hi_first = any(x.get("nibble_order") == "hi_first" for x in fp4)
    if not (comfy_style and fp4 and (hi_first or layouts.get("128x4"))):
        return None
    return ("diffusers' BFLQuantizationConfig would misread this file: it reads FP4 values low nibble first and block "
            "scales in the linear [N, K/16] layout, while this file is laid out "
            f"{'high nibble first' if hi_first else 'low nibble first'} with "
            f"{'128x4' if layouts.get('128x4') else 'linear'} scales (per its metadata or ComfyUI's convention). "
            "Where no shape is padded (all of FLUX.2-dev) it loads without an error and computes wrong weights. "
            "Load it with diffusers_nvfp4_fast.load_nvfp4_transformer, which reads this layout.")


def inspect_checkpoint(path: str | Path, *, check_scales: bool = False) -> dict[str, Any]:
    """The header facts of a ``.safetensors`` file or a ModelOpt export directory, as a JSON-able dict.

    Reads headers and the few-byte ``comfy_quant`` markers only; ``check_scales`` also reads the block-scale
    tensors (not the weights) to test the 128x4 padding (nonzero padding after one unswizzle = swizzled twice).
    """
    from .bfl.metadata import detect_key_prefix, read_quant_metadata

    path = Path(path)
    tensors, file_metadata, extra = _headers(path)
    prefix = detect_key_prefix(list(tensors))
    naming = _naming([k[len(prefix):] for k in tensors])
    facts: dict[str, Any] = {
        "path": str(path), "kind": "directory" if path.is_dir() else "file",
        "files": sorted({str(f.name) for f, _ in tensors.values()}),
        "bytes": sum(f.stat().st_size for f in {f for f, _ in tensors.values()}),
        "tensors": len(tensors), "key_prefix": prefix, "naming": naming, **extra,
        **_dtype_and_family_facts(tensors, prefix),
        "header_metadata_keys": {name: sorted(meta) for name, meta in file_metadata.items() if meta},
    }
    problems: list[str] = []
    qmeta = header = None
    if not path.is_dir():
        header = SafetensorsHeader(path)
        qmeta = read_quant_metadata(header, prefix, problems)
        facts.update(_metadata_facts(header, qmeta))
    layers = _layer_facts(path, tensors, prefix, qmeta, check_scales)
    facts["nvfp4_layers"] = layers
    guesses: dict[str, int] = {}
    for layer in layers:
        guesses[layer["scale_shape_guess"]] = guesses.get(layer["scale_shape_guess"], 0) + 1
    facts["scale_shape_guesses"] = guesses
    facts["missing_input_scale"] = [x["layer"] for x in layers if not x.get("input_scale", True)]
    facts["nibble_note"] = _NIBBLE_NOTE
    if path.is_dir():
        facts["loader_dry_run"] = _export_dry_run(path, check_scales)
    elif header is not None and naming.startswith("BFL"):
        facts["loader_dry_run"] = _dry_run(header)
        facts["diffusers_warning"] = _diffusers_warning(facts)
    facts["metadata_problems"] = problems
    return facts


def _padding_check(file: Path, key: str, packed_shape) -> str:
    import torch

    from .bfl import unswizzle_checked

    scales = SafetensorsHeader(file).load([key])[key].view(torch.uint8)
    n, k = packed_shape[0], packed_shape[1] * 2
    if padded_scale_shape(n, k) == (n, k // BLOCK_SIZE):
        return "no padding (cannot tell)"
    _, problem = unswizzle_checked(scales, n, k // BLOCK_SIZE, key)
    return ("nonzero padding after one unswizzle (swizzled twice?)" if problem
            else "padding zero after one unswizzle (ok)")


def format_report(facts: dict[str, Any]) -> str:
    """Human-readable ``inspect`` output."""
    lines = [f"{facts['kind']}: {facts['path']}",
             f"  files: {', '.join(facts['files'])}  ({facts['bytes'] / 1e6:.1f} MB)"]
    lines.append(f"  tensors: {facts['tensors']}   key prefix: {facts['key_prefix'] or '(none)'}   "
                 f"naming: {facts['naming']}")
    if facts.get("class"):
        lines.append(f"  config.json class: {facts['class']}")
    if facts.get("quantization_config"):
        qc = facts["quantization_config"]
        lines.append(f"  quantization_config: quant_algo={qc.get('quant_algo')} ignore={qc.get('ignore')}")
    lines.append("  dtypes: " + ", ".join(f"{d} x{v['tensors']} ({v['bytes'] / 1e6:.1f} MB)"
                                          for d, v in facts["dtypes"].items()))
    if facts["header_metadata_keys"]:
        lines.append(f"  header __metadata__ keys: {facts['header_metadata_keys']}")
    if "markers" in facts:
        lines.append(
            f"  comfy_quant markers: {facts['markers']}   "
            f"_quantization_metadata: {facts['header_quantization_metadata']}"
            f"   declared formats: {facts['declared_formats'] or '{}'}   file-wide flags: {facts['file_flags'] or '{}'}"
        )
    lines.append("  key families:")
    width = max((len(f) for f in facts["families"]), default=10)
    for fam, v in facts["families"].items():
        shapes = " ".join(str(s) for s in v["shapes"]) + (f" (+{v['more_shapes']} more)" if v["more_shapes"] else "")
        lines.append(f"    {fam:<{width}}  x{v['count']:<4} {'/'.join(v['dtypes']):<8} {shapes}")
    layers = facts["nvfp4_layers"]
    lines.append(f"  NVFP4 layers (weight + weight_scale): {len(layers)}   "
                 f"scale layout by shape: {facts['scale_shape_guesses']}")
    nib: dict[str, int] = {}
    for layer in layers:
        label = f"{layer.get('nibble_order')} ({layer.get('nibble_order_source')})"
        nib[label] = nib.get(label, 0) + 1
    if nib:
        lines.append(f"  nibble order: {nib}; {facts['nibble_note']}")
    checks = [x["padding_check"] for x in layers if "padding_check" in x]
    if checks:
        lines.append(f"  128x4 padding check: {dict((c, checks.count(c)) for c in sorted(set(checks)))}")
    for layer in layers[:6]:
        lines.append(
            f"    {layer['layer']}: weight {layer.get('weight')} scale {layer.get('scale')} "
            f"-> {layer['scale_shape_guess']};"
            f" declared {layer.get('declared')}; input_scale {'yes' if layer.get('input_scale') else 'MISSING'}"
        )
    if len(layers) > 6:
        lines.append(f"    ... ({len(layers) - 6} more; --json lists all)")
    missing = facts["missing_input_scale"]
    shown = ", ".join(missing[:12]) + (" ..." if len(missing) > 12 else "")
    lines.append(f"  layers without input_scale: {len(missing)}" + (f": {shown}" if missing else ""))
    dry = facts.get("loader_dry_run")
    if dry:
        if "error" in dry:
            lines.append(f"  loader dry run: failed: {dry['error']}")
        elif dry.get("loader") == "load_modelopt_export":
            lines.append(f"  loader dry run: {dry['variant']}, {dry['nvfp4_layers']} NVFP4 layers; keys, dtypes, "
                         "shapes and per-tensor scales checked; block scales "
                         + ("checked" if dry["block_scales_checked"] else "not read (--check-scales reads them)"))
            probs = dry["problems"]
            lines.append(f"    problems: {len(probs)}" + "".join(f"\n      {p}" for p in probs[:30]))
        else:
            lines.append(f"  loader dry run: {dry['variant']} (config {dry['config_source']})")
            lines.append(f"    config: {json.dumps(dry['config'])}")
            lines.append(f"    nibble order {dry['nibble_order']} from {dry['nibble_order_source']}; "
                         f"scale layout {dry['scale_layout']} from {dry['scale_layout_source']}")
            if dry["missing_input_scale"]:
                lines.append(f"    loading needs input_scales= or dynamic_input_scale=True for "
                             f"{len(dry['missing_input_scale'])} layer(s): "
                             f"{', '.join(dry['missing_input_scale'][:12])}")
            probs = dry["problems"]
            lines.append(f"    problems: {len(probs)}" + "".join(f"\n      {p}" for p in probs[:30]))
    if facts["metadata_problems"]:
        lines.append("  metadata problems:" + "".join(f"\n    {p}" for p in facts["metadata_problems"]))
    if facts.get("diffusers_warning"):
        lines.append(f"  WARNING: {facts['diffusers_warning']}")
    return "\n".join(lines)


