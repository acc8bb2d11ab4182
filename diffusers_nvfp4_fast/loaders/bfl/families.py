"""The model families a single file can hold, recognised from its keys (without the key prefix).

Detection keys: FLUX.2 and Qwen-Image 2.1 by the keys diffusers 0.42.1 itself recognises them by
(``single_file_utils.CHECKPOINT_KEY_NAMES["flux2"]`` / ``["qwen-image-2.1"]``), or FLUX.2 by diffusers' own names;
Qwen-Image, for which diffusers has no detection key, by ``txt_norm.weight`` beside ``transformer_blocks.N.img_mod.1``
(its names in diffusers and in ComfyUI alike). ``config=`` with a ``_class_name`` picks the family too and must agree.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .config import (
    Inferred,
    Shapes,
    flux2_variant_label,
    infer_flux2,
    infer_qwen,
    infer_qwen21,
    qwen21_variant,
    qwen_variant,
)

# ComfyUI's Qwen-Image model registers this empty buffer for Qwen-Image-Edit-2511's reference method
# ("index_timestep_zero"): the file says zero_cond_t=True with it.
QWEN_ZERO_COND_T_MARKER = "__index_timestep_zero__"


@dataclass(frozen=True)
class Family:
    """One model family: its diffusers class, how its config is read from shapes, how its size is labelled."""

    name: str
    class_name: str
    infer: Callable[[Shapes], Inferred]
    variant: Callable[[Mapping[str, Any]], str]
    markers: tuple[str, ...] = ()  # non-parameter keys the family's files may carry (consumed, never loaded)


FLUX2 = Family("FLUX.2", "Flux2Transformer2DModel", infer_flux2, flux2_variant_label)
QWEN = Family("Qwen-Image", "QwenImageTransformer2DModel", infer_qwen, qwen_variant, (QWEN_ZERO_COND_T_MARKER,))
QWEN21 = Family("Qwen-Image 2.1", "QwenImage21Transformer2DModel", infer_qwen21, qwen21_variant)
FAMILIES = (FLUX2, QWEN, QWEN21)
BY_CLASS = {f.class_name: f for f in FAMILIES}


@dataclass(frozen=True)
class Detection:
    family: Family | None
    evidence: str
    diffusers_names: bool = False  # the file already has diffusers' names: no converter (FLUX.2's would rename them)


def _block_key(keys: Sequence[str], prefix: str, suffix: str) -> str | None:
    return next((k for k in keys if k.startswith(prefix) and k.endswith(suffix)), None)


def detect_family(keys: Sequence[str]) -> Detection:
    """The family of a file from its keys (prefix already removed), with the keys that decided it."""
    present = set(keys)
    if "single_stream_modulation.lin.weight" in present:
        return Detection(FLUX2, "key single_stream_modulation.lin.weight (BFL names; the key diffusers recognises "
                                "FLUX.2 by)")
    if "single_stream_modulation.linear.weight" in present:
        return Detection(FLUX2, "key single_stream_modulation.linear.weight (diffusers' FLUX.2 names)", True)
    if "txt_in.text_norm.weight" in present:
        return Detection(QWEN21, "key txt_in.text_norm.weight (the key diffusers recognises Qwen-Image 2.1 by)")
    img_mod = _block_key(keys, "transformer_blocks.", ".img_mod.1.weight")
    if "txt_norm.weight" in present and img_mod is not None:
        return Detection(QWEN, f"keys txt_norm.weight and {img_mod} (QwenImageTransformer2DModel's names)")
    return Detection(None, "none of the keys that name a supported family: single_stream_modulation.lin.weight "
                           "(FLUX.2), txt_in.text_norm.weight (Qwen-Image 2.1), txt_norm.weight with "
                           "transformer_blocks.N.img_mod.1.weight (Qwen-Image)")


def family_problem(detected: Detection, class_name: str | None) -> tuple[Family | None, str | None]:
    """The family to load as, given the keys' verdict and ``config=``'s ``_class_name``; a problem if they disagree or
    nothing decides."""
    named = BY_CLASS.get(class_name) if class_name else None
    if class_name and named is None:
        return None, (f"config= names class {class_name}, which this loader does not build from single files "
                      f"(supported: {', '.join(BY_CLASS)})")
    if detected.family is None:
        if named is not None:
            return named, None
        return None, (f"cannot tell which transformer this file holds: it has {detected.evidence}. Supported: "
                      f"{', '.join(f'{f.name} ({f.class_name})' for f in FAMILIES)}; pass config= with the "
                      "_class_name of the model it holds")
    if named is not None and named is not detected.family:
        return None, (f"config= is a {named.class_name} config, but the file's keys are {detected.family.name}'s "
                      f"({detected.evidence})")
    return detected.family, None
