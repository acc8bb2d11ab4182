"""``diffusers-nvfp4-fast inspect``: what a checkpoint's header says, without reading weights.

Key families with dtypes and shapes, quantization markers and header metadata, per-layer scale-layout guesses from
shapes, the nibble order and where it comes from, missing ``input_scale``s, and a dry run of the loader: for every
single file the plan ``load_nvfp4_transformer`` makes (family and the keys that tell it, diffusers' key converter,
convention and its evidence, inferred config and what was assumed) plus its per-tensor scale checks; for ModelOpt
export directories every key, dtype, shape and scale check of ``load_modelopt_export``. ``refusals`` (the exit
status of the command) is every reason the loader would refuse. Attach the output (``--json`` for the
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
             "file_flags": qmeta.file_flags, "header_quantization": qmeta.diffusers_scheme}
    if HEADER_METADATA_KEY in header.metadata:
        try:
            hm = json.loads(header.metadata[HEADER_METADATA_KEY])
            facts["header_quantization_metadata_top_level"] = {k: v for k, v in hm.items() if k != "layers"}
        except (json.JSONDecodeError, AttributeError):
            pass
    return facts


def _layer_facts(path: Path, tensors: dict[str, tuple[Path, Any]], prefix: str, qmeta, sources: dict,
                 padding: dict[str, str]) -> list:
    """Per FP4 layer (packed weight + block scale): shapes, layout guess, declared flags, and the nibble order and scale
    layout the loader's dry run decided (``sources``: stored module -> ``NVFP4Source``)."""
    from .bfl.metadata import MARKER_SUFFIX

    layers: list[dict[str, Any]] = []
    for k, (_, info) in tensors.items():
        if not k.endswith(".weight_scale"):
            continue
        module = k[: -len(".weight_scale")]
        name = module[len(prefix):]
        w = tensors.get(module + ".weight")
        if w is None:
            layers.append({"layer": name, "scale_shape_guess": "no weight", "scale_shape": list(info.shape)})
            continue
        declared = qmeta.layers.get(name) if qmeta else None
        source = sources.get(name)
        if path.is_dir():
            nibble, nibble_src = "lo_first", "ModelOpt export convention"
        elif source is not None:
            nibble, nibble_src = source.nibble_order, source.nibble_source
        else:
            nibble, nibble_src = "undecided", "not declared by the file"
        layer = {
            "layer": name, "weight": [w[1].dtype, list(w[1].shape)], "scale": [info.dtype, list(info.shape)],
            "scale_shape_guess": guess_scale_layout(info.shape, w[1].shape),
            "declared": (declared.flags | {"format": declared.format}) if declared else None,
            "marker": (module + "." + MARKER_SUFFIX) in tensors,
            "input_scale": (module + ".input_scale") in tensors,
            "weight_scale_2": (module + ".weight_scale_2") in tensors,
            "nibble_order": nibble, "nibble_order_source": nibble_src,
            "scale_layout": source.scale_layout if source else None,
            "scale_layout_source": source.scale_source if source else None,
        }
        if name in padding:
            layer["padding_check"] = padding[name]
        layers.append(layer)
    return layers


_DRY_RUN_KEYS = ("family", "class", "family_evidence", "converter", "convention", "convention_evidence", "variant",
                 "config_source", "config", "assumed", "nibble_order", "nibble_order_source", "scale_layout",
                 "scale_layout_source", "missing_input_scale", "problems")


def _dry_run(header: SafetensorsHeader, check_scales: bool) -> tuple[dict[str, Any], Any, dict[str, str]]:
    """``load_nvfp4_transformer``'s own plan of the file (the same call, default arguments) and its scale checks: the
    per-tensor scales always (a few bytes each), the block scales with ``check_scales``. Returns (facts, plan or None,
    padding verdict per 128x4 layer)."""
    from .bfl import plan_bfl_checkpoint

    try:
        plan = plan_bfl_checkpoint(header)
    except Exception as e:  # the dry run must not hide the facts above
        return {"error": f"{type(e).__name__}: {e}"}, None, {}
    facts = {k: v for k, v in plan.facts().items() if k in _DRY_RUN_KEYS}
    facts["loader"] = "load_nvfp4_transformer (single file)"
    facts["block_scales_checked"] = check_scales
    padding: dict[str, str] = {}
    facts["scale_problems"] = [] if plan.problems else _plan_scale_problems(plan, header, check_scales, padding)
    return facts, plan, padding


def _plan_scale_problems(plan, header: SafetensorsHeader, block_scales: bool, padding: dict[str, str]) -> list[str]:
    """The loader's scale checks on a plan's FP4 layers: per-tensor scales from a few bytes each; with
    ``block_scales`` also the block scales (NaN / negative bytes, the 128x4 padding after one unswizzle)."""
    import torch

    from .bfl import stored_layer
    from .common import scale_problems

    problems: list[str] = []
    with header.open() as handle:
        for source in plan.nvfp4.values():
            name = source.keys["weight"][: -len(".weight")]
            if block_scales:
                tensors, problem = stored_layer(source, handle)
                if source.scale_layout == "128x4":
                    padding[source.module] = _padding_verdict(source, problem)
                problems += [problem] if problem else scale_problems(
                    name, tensors["weight_scale"], tensors["weight_scale_2"], tensors.get("input_scale"))
                continue
            ws2 = handle.get_tensor(source.keys["weight_scale_2"])
            input_scale = handle.get_tensor(source.keys["input_scale"]) if "input_scale" in source.keys else None
            # Without the block scales a zero weight_scale_2 cannot be judged (legal for an all-zero weight): pass
            # zero block bytes, so only NaN, Inf and negative values count here.
            problems += scale_problems(name, torch.zeros(1, dtype=torch.uint8), ws2, input_scale)
    return problems


def _padding_verdict(source, problem: str | None) -> str:
    n, k = source.rows, source.cols
    if padded_scale_shape(n, k) == (n, k // BLOCK_SIZE):
        return "no padding (cannot tell)"
    return "nonzero padding after one unswizzle (swizzled twice?)" if problem else \
        "padding zero after one unswizzle (ok)"


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


def refusals(facts: dict[str, Any]) -> list[str]:
    """Why ``load_nvfp4_transformer(path)`` (default arguments) would refuse the checkpoint ``inspect`` looked at;
    empty when it loads. Block scales count only where ``--check-scales`` read them."""
    dry = facts.get("loader_dry_run") or {}
    if "error" in dry:
        return [f"the dry run failed: {dry['error']}"]
    reasons = list(dry.get("problems", [])) + list(dry.get("scale_problems", []))
    missing = dry.get("missing_input_scale") or []
    if missing and not reasons:
        reasons.append(f"{len(missing)} NVFP4 layer(s) have no input_scale: pass input_scales= (your calibration) or "
                       "dynamic_input_scale=True (per-call scales, not the checkpoint's recipe)")
    return reasons


def _diffusers_warning(facts: dict[str, Any]) -> str | None:
    """For a ComfyUI-style FP4 file laid out high nibble first or with 128x4 scales: diffusers 0.42's
    ``BFLQuantizationConfig`` reads low nibble first and linear scales, without an error."""
    dry = facts.get("loader_dry_run") or {}
    if not (facts.get("markers") or facts.get("header_quantization_metadata")):
        return None
    hi_first = bool((dry.get("nibble_order") or {}).get("hi_first"))
    swizzled = bool((dry.get("scale_layout") or {}).get("128x4"))
    if not (hi_first or swizzled):
        return None
    return ("diffusers' BFLQuantizationConfig would misread this file: it reads FP4 values low nibble first and block "
            "scales in the linear [N, K/16] layout, while this file is laid out "
            f"{'high nibble first' if hi_first else 'low nibble first'} with "
            f"{'128x4' if swizzled else 'linear'} scales (per its metadata or ComfyUI's convention). "
            "Where no shape is padded (all of FLUX.2-dev) it loads without an error and computes wrong weights. "
            "Load it with diffusers_nvfp4_fast.load_nvfp4_transformer, which reads this layout.")


def inspect_checkpoint(path: str | Path, *, check_scales: bool = False) -> dict[str, Any]:
    """The header facts of a ``.safetensors`` file or a ModelOpt export directory and the loader's dry run, as a
    JSON-able dict; ``refusals`` lists why ``load_nvfp4_transformer(path)`` would refuse it (empty: it loads).

    Reads headers, the few-byte ``comfy_quant`` markers and per-tensor scales; ``check_scales`` also reads the
    block-scale tensors (not the weights) and applies the loader's checks to them (NaN and negative bytes, nonzero
    128x4 padding after one unswizzle = swizzled twice).
    """
    from .bfl.metadata import detect_key_prefix

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
    plan, padding = None, dict[str, str]()
    if path.is_dir():
        facts["loader_dry_run"] = _export_dry_run(path, check_scales)
    else:
        header = SafetensorsHeader(path)
        facts["loader_dry_run"], plan, padding = _dry_run(header, check_scales)
        if plan is not None:
            facts.update(_metadata_facts(header, plan.metadata))
    layers = _layer_facts(path, tensors, prefix, plan.metadata if plan is not None else None,
                          plan.nvfp4 if plan is not None else {}, padding)
    facts["nvfp4_layers"] = layers
    guesses: dict[str, int] = {}
    for layer in layers:
        guesses[layer["scale_shape_guess"]] = guesses.get(layer["scale_shape_guess"], 0) + 1
    facts["scale_shape_guesses"] = guesses
    facts["missing_input_scale"] = [x["layer"] for x in layers if not x.get("input_scale", True)]
    facts["nibble_note"] = _NIBBLE_NOTE
    if not path.is_dir():
        facts["diffusers_warning"] = _diffusers_warning(facts)
    facts["refusals"] = refusals(facts)
    return facts


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
    dry = facts.get("loader_dry_run") or {}
    if "error" in dry:
        lines.append(f"  loader dry run: failed: {dry['error']}")
    elif dry.get("loader") == "load_modelopt_export":
        lines.append(f"  loader dry run: {dry['variant']}, {dry['nvfp4_layers']} NVFP4 layers; keys, dtypes, "
                     "shapes and per-tensor scales checked; block scales "
                     + ("checked" if dry["block_scales_checked"] else "not read (--check-scales reads them)"))
    elif dry:
        lines += _single_file_dry_run_lines(dry)
    reasons = facts["refusals"]
    if reasons:
        lines.append(f"  verdict: load_nvfp4_transformer refuses this checkpoint ({len(reasons)} problem(s)):"
                     + "".join(f"\n      {p}" for p in reasons[:30])
                     + (f"\n      ... ({len(reasons) - 30} more; --json lists all)" if len(reasons) > 30 else ""))
    else:
        lines.append("  verdict: load_nvfp4_transformer loads it (problems: 0)")
    if facts.get("diffusers_warning"):
        lines.append(f"  WARNING: {facts['diffusers_warning']}")
    return "\n".join(lines)


def _single_file_dry_run_lines(dry: dict[str, Any]) -> list[str]:
    lines = [f"  family: {dry['family'] or 'unknown'}"
             + (f" ({dry['class']}), from {dry['family_evidence']}; names mapped by {dry['converter']}"
                if dry["family"] else f": {dry['family_evidence']}"),
             f"  convention: {dry['convention']}, from {dry['convention_evidence']}"]
    if not dry["family"]:
        return lines
    lines.append(f"  loader dry run: {dry['variant']} (config {dry['config_source']})")
    lines.append(f"    config: {json.dumps(dry['config'])}")
    if dry["assumed"]:
        lines.append("    not in the weights, assumed (config= overrides): "
                     + "; ".join(f"{k}={v}" for k, v in dry["assumed"].items()))
    lines.append(f"    nibble order {dry['nibble_order']} from {dry['nibble_order_source']}; "
                 f"scale layout {dry['scale_layout']} from {dry['scale_layout_source']}")
    lines.append("    scales checked: per-tensor; block scales "
                 + ("too" if dry["block_scales_checked"] else "not read (--check-scales reads them)"))
    if dry["missing_input_scale"]:
        lines.append(f"    loading needs input_scales= or dynamic_input_scale=True for "
                     f"{len(dry['missing_input_scale'])} layer(s): {', '.join(dry['missing_input_scale'][:12])}")
    return lines
