"""Read an NVFP4 single file (BFL / ComfyUI, diffusers' BFL files, a declared ModelOpt file) into its diffusers class
(``Flux2Transformer2DModel``, ``QwenImageTransformer2DModel``, ``QwenImage21Transformer2DModel``), following a
``BflPlan``."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from ...format import BLOCK_SIZE, ScaleLayout, round_up, swap_nibbles, unswizzle_scales
from ...linear import NVFP4Linear
from ..common import record_load_summary, replace_linear, scale_problems
from ..errors import NVFP4CheckpointError
from ..finish import finish_model
from ..safetensors_header import SafetensorsHeader
from .input_scales import missing_input_scale_message, read_input_scales
from .layout import NVFP4Source
from .metadata import NibbleOrder
from .naming import Segments, take_rows
from .plan import BflPlan, plan_bfl_checkpoint

logger = logging.getLogger("diffusers_nvfp4_fast")


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


def unswizzle_checked(scales: torch.Tensor, rows: int, cols: int, key: str) -> tuple[torch.Tensor, str | None]:
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
    """Load an NVFP4 single file into its diffusers class, with ``NVFP4Linear`` layers.

    Reads FLUX.2 (dev, klein 4B/9B and -base), Qwen-Image (and its Edit / Edit-2509 / Edit-2511 / Layered
    checkpoints) and Qwen-Image 2.1 files in ComfyUI's / BFL's format (comfy-kitchen's layout), in the format of
    diffusers' ``BFLQuantizationConfig`` (header ``quantization='nvfp4'``), or any layout declared by the arguments
    (a ModelOpt export's safetensors file: ``scale_layout="linear", nibble_order="lo_first"``). Usually reached
    through ``load_nvfp4_transformer(file)`` or ``load_nvfp4_transformer(repo_id, filename=...)``.

    Args:
        path_or_repo_id: a ``.safetensors`` file, a directory (with ``filename``) or a Hugging Face repo id.
        filename, subfolder: the file inside a repo or directory.
        config: the model config, for what the shapes cannot tell: a dict (only the keys to set, or a whole config),
            a config.json, a diffusers directory or repo id (its ``transformer/config.json`` or ``config.json``);
            its keys override the values inferred from shapes, and its ``_class_name`` must match the file.
        torch_dtype: dtype of the BF16 layers (norms, embedders, unquantized Linears).
        device: where to put the model (default: CPU).
        scale_layout, nibble_order: declare how FP4 layers are stored where the file says nothing (both needed),
            or override the convention it declares; contradicting its explicit flags is an error.
        input_scales: for layers without ``input_scale``: ``{diffusers layer name: value}`` or a JSON side file.
        dynamic_input_scale: for layers without ``input_scale`` (and not in ``input_scales``): compute the activation
            scale per call from the input (``NVFP4Linear.dynamic_input_scale``). Not the checkpoint's recipe.

    Raises:
        NVFP4CheckpointError: listing every problem found (family, keys, dtypes, shapes, metadata, undeclared layouts
            with the declarations to pass, double-swizzled scales, missing input scales with the options).
    """
    file = resolve_single_file(path_or_repo_id, filename, subfolder)
    user_scales = read_input_scales(input_scales) if input_scales is not None else {}
    header = SafetensorsHeader(file)
    plan = plan_bfl_checkpoint(
        header, config=config, scale_layout=scale_layout, nibble_order=nibble_order,
        input_scales=user_scales if input_scales is not None else None, dynamic_input_scale=dynamic_input_scale,
    )
    if plan.problems:
        raise NVFP4CheckpointError(problems_message(plan))
    if plan.missing_input_scale:
        raise NVFP4CheckpointError(missing_input_scale_message(file, plan.missing_input_scale))
    return _materialize(plan, header, torch_dtype, device, user_scales)


def problems_message(plan: BflPlan) -> str:
    """The error of a plan with problems: the file, what it was read as, and every problem."""
    what = (f"as {plan.family.name} ({plan.class_name})" if plan.family else "(family unknown)")
    return (f"{plan.file}: {len(plan.problems)} problem(s) loading this NVFP4 single file {what} "
            f"(run `diffusers-nvfp4-fast inspect {plan.file}` to see the file's layout):\n  "
            + "\n  ".join(plan.problems))


def _materialize(
    plan: BflPlan, header: SafetensorsHeader, torch_dtype: torch.dtype, device, user_scales: dict[str, float],
) -> nn.Module:
    import diffusers
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = getattr(diffusers, plan.class_name).from_config(plan.config)
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


def stored_layer(source: NVFP4Source, handle) -> tuple[dict[str, torch.Tensor], str | None]:
    """One stored FP4 layer as our layout (low nibble first, linear scales); a problem string for bad scales."""
    k = source.keys
    tensors: dict[str, torch.Tensor]
    tensors = {s: handle.get_tensor(k[s]) for s in ("weight", "weight_scale", "weight_scale_2", "input_scale", "bias")
               if s in k}
    packed = tensors["weight"].view(torch.uint8)
    tensors["weight"] = swap_nibbles(packed) if source.nibble_order == "hi_first" else packed
    scales = tensors["weight_scale"].view(torch.uint8)
    problem = None
    if source.scale_layout == "128x4":
        scales, problem = unswizzle_checked(scales, source.rows, source.cols // BLOCK_SIZE, k["weight_scale"])
    tensors["weight_scale"] = scales
    return tensors, problem


def _input_scale(
    tensors: dict[str, torch.Tensor], target: str, user_scales: dict[str, float],
) -> tuple[torch.Tensor, str]:
    """(input_scale, where it came from): the checkpoint, the user's ``input_scales``, or 'dynamic'."""
    if "input_scale" in tensors:
        return tensors["input_scale"].reshape(()), "checkpoint"
    if target in user_scales:
        return torch.tensor(user_scales[target], dtype=torch.float32), "input_scales"
    # dynamic_input_scale: the static scale must never be used, so make any use loud (NaN), not 1.0.
    return torch.tensor(float("nan"), dtype=torch.float32), "dynamic"


def _nvfp4_target(linear: nn.Linear, tensors: dict[str, torch.Tensor], segs: Segments, what: str,
                  input_scale: torch.Tensor, torch_dtype: torch.dtype) -> NVFP4Linear:
    new = NVFP4Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, dtype=torch_dtype)
    bias = take_rows(tensors["bias"], segs, what) if "bias" in tensors else None
    new.load_nvfp4(take_rows(tensors["weight"], segs, what), take_rows(tensors["weight_scale"], segs, what),
                   tensors["weight_scale_2"].reshape(()), input_scale, bias, scale_layout="linear")
    new.swizzle_weight_scales_()
    return new


def _materialize_nvfp4(
    plan: BflPlan, handle, model: nn.Module, torch_dtype: torch.dtype, device, user_scales: dict[str, float],
) -> nn.Module:
    problems: list[str] = []
    sources = {"checkpoint": 0, "input_scales": 0, "dynamic": 0}
    for source in plan.nvfp4.values():
        tensors, problem = stored_layer(source, handle)
        if problem:
            problems.append(problem)
            continue
        problems += scale_problems(source.keys["weight"].removesuffix(".weight"), tensors["weight_scale"],
                                   tensors["weight_scale_2"], tensors.get("input_scale"))
        for target, segs in source.targets:
            linear = cast(nn.Linear, model.get_submodule(target))  # the plan checked it is a Linear
            input_scale, how = _input_scale(tensors, target, user_scales)
            new = _nvfp4_target(linear, tensors, segs, f"{source.keys['weight']} -> {target}", input_scale, torch_dtype)
            new.dynamic_input_scale = how == "dynamic"
            new.input_scale_source = how
            sources[how] += 1
            replace_linear(model, target, linear, new)
    if problems:
        raise NVFP4CheckpointError(
            f"{plan.file}: {len(problems)} problem(s) in NVFP4 scales:\n  " + "\n  ".join(problems)
        )
    finish_model(model, plan.file, device)
    if sources["dynamic"]:
        logger.warning(
            "%d NVFP4 layer(s) have no input_scale and use a per-call dynamic activation scale "
            "(dynamic_input_scale=True); "
            "this is not the checkpoint's recipe", sources["dynamic"],
        )
    facts = plan.facts()
    record_load_summary(model, plan.file, format="single_file", family=facts["family"], variant=plan.variant,
                        converter=facts["converter"], convention=facts["convention"],
                        config_source=plan.config_source, assumed=facts["assumed"], input_scale_sources=sources,
                        nibble_order=facts["nibble_order"], scale_layout=facts["scale_layout"])
    logger.info("%s as %s via %s (config %s; assumed %s): %s convention (%s); nibble order %s, scale layout %s; "
                "input scales %s", plan.variant, plan.class_name, facts["converter"], plan.config_source,
                facts["assumed"] or "nothing", facts["convention"], facts["convention_evidence"],
                facts["nibble_order_source"], facts["scale_layout_source"], sources)
    return model
