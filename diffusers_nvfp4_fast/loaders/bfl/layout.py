"""Per-layer layout decisions of a single file: nibble order and scale layout from arguments, flags and the file's
convention; the block-scale shape check; what undeclared layers' shapes tell (docs/checkpoints.md, route 2)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ...format import BLOCK_SIZE, round_up
from ..safetensors_header import TensorInfo
from .metadata import HEADER_METADATA_KEY, Convention, LayerQuantInfo
from .naming import Segments

DECLARATIONS = ('scale_layout="128x4", nibble_order="hi_first" (ComfyUI / BFL files: comfy-kitchen\'s layout) or '
                'scale_layout="linear", nibble_order="lo_first" (diffusers\' BFLQuantizationConfig files, ModelOpt '
                'exports)')


@dataclass
class NVFP4Source:
    """One FP4 layer as stored (possibly fused), and the diffusers Linears it feeds."""

    module: str  # the stored module name, without the key prefix
    keys: dict[str, str]  # suffix -> stored key
    rows: int
    cols: int  # logical K
    targets: list[tuple[str, Segments]]
    nibble_order: str
    nibble_source: str
    scale_layout: str
    scale_source: str


def resolve_fact(
    fact: str, layer: str, info: LayerQuantInfo | None, file_flags: Mapping[str, str], argument: str | None,
    convention: Convention, problems: list[str],
) -> tuple[str, str]:
    """(value, where it came from) for 'nibble_order' or 'scale_layout': argument > layer metadata > file-wide
    metadata > the file's convention."""
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
    if explicit_layer:
        return explicit_layer, "metadata"
    if explicit_file:
        return explicit_file, "metadata (file-wide)"
    if convention.facts is None:  # undeclared, or two conventions: a problem; the plan goes on with the shapes
        return "undecided", "not declared"
    return convention.facts[fact], convention.source


def check_scale_shape(source: NVFP4Source, info: TensorInfo, key: str, problems: list[str]) -> None:
    n, c = source.rows, source.cols // BLOCK_SIZE
    linear, swizzled = (n, c), (round_up(n, 128), round_up(c, 4))
    shape = tuple(info.shape)
    if info.dtype not in ("F8_E4M3", "U8"):
        problems.append(f"{key}: dtype {info.dtype}, expected F8_E4M3 (or U8) block scales")
    if source.scale_layout == "undecided":
        return
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


def shape_verdict(shapes: dict[str, int]) -> str:
    """What the undeclared layers' scale shapes tell (``scale_layout_from_shape`` counts)."""
    told = {k: v for k, v in shapes.items() if k != "ambiguous"}
    parts = ", ".join(f"{v} {k}" for k, v in sorted(shapes.items()))
    if len(told) == 1 and next(iter(told)) in ("linear", "128x4", "128x4 (flat)"):
        layout = "linear" if "linear" in told else "128x4"
        return (f"Their block-scale shapes ({parts}) fit only the {layout} layout; the bytes cannot tell the nibble "
                "order (a swap keeps every value inside its 16-block).")
    return f"Their block-scale shapes ({parts}) do not tell the layout, and the bytes cannot tell the nibble order."
