"""Load NVIDIA ModelOpt NVFP4 exports of diffusers transformers into diffusers' own classes."""

from __future__ import annotations

import fnmatch
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from .format import BLOCK_SIZE, ScaleLayout, round_up
from .linear import NVFP4Linear

logger = logging.getLogger("diffusers_nvfp4_fast")

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
NVFP4_SUFFIXES = ("weight", "weight_scale", "weight_scale_2", "input_scale")


class NVFP4CheckpointError(ValueError):
    """A checkpoint that does not match the model it claims to be; the message lists every problem."""


@dataclass
class QuantizationInfo:
    """What the checkpoint says about its quantization."""

    quant_algo: str
    group_size: int
    exclude_patterns: list[str] = field(default_factory=list)
    source: str = ""


def read_quantization_info(model_dir: Path, config: dict) -> QuantizationInfo:
    """From ``config.json["quantization_config"]`` or, failing that, ``hf_quant_config.json``."""
    qc = config.get("quantization_config")
    if qc is not None:
        group_size = BLOCK_SIZE
        for group in (qc.get("config_groups") or {}).values():
            for part in ("weights", "input_activations"):
                if group.get(part) and group[part].get("group_size") is not None:
                    group_size = int(group[part]["group_size"])
        info = QuantizationInfo(
            quant_algo=str(qc.get("quant_algo", "")), group_size=group_size,
            exclude_patterns=list(qc.get("ignore") or qc.get("exclude_modules") or []),
            source=str(model_dir / "config.json"),
        )
    elif (model_dir / "hf_quant_config.json").is_file():
        nested = json.loads((model_dir / "hf_quant_config.json").read_text())
        q = nested.get("quantization", nested)
        info = QuantizationInfo(
            quant_algo=str(q.get("quant_algo", "")), group_size=int(q.get("group_size") or BLOCK_SIZE),
            exclude_patterns=list(q.get("exclude_modules") or q.get("ignore") or []),
            source=str(model_dir / "hf_quant_config.json"),
        )
    else:
        raise NVFP4CheckpointError(
            f"{model_dir}: no quantization_config in config.json and no hf_quant_config.json; "
            "this does not look like a ModelOpt NVFP4 export"
        )
    if info.quant_algo.upper() != "NVFP4":
        raise NVFP4CheckpointError(f"{info.source}: quant_algo is {info.quant_algo!r}, expected 'NVFP4'")
    if info.group_size != BLOCK_SIZE:
        raise NVFP4CheckpointError(f"{info.source}: group_size is {info.group_size}, NVFP4 uses {BLOCK_SIZE}")
    return info


def is_excluded(module_name: str, patterns: list[str]) -> bool:
    """True if the module or any parent module matches an exclude pattern.

    ModelOpt writes patterns for the module it quantized (``img_mod``) while the Linear inside serializes as
    ``img_mod.1``; matching every dotted prefix covers both spellings.
    """
    parts = module_name.split(".")
    prefixes = [".".join(parts[: i + 1]) for i in range(len(parts))]
    return any(fnmatch.fnmatchcase(p, pat) for p in prefixes for pat in patterns)


def _resolve_dir(path_or_repo_id: str | os.PathLike, subfolder: str | None) -> Path:
    path = Path(path_or_repo_id)
    if path.exists():
        model_dir = path / subfolder if subfolder else path
    else:
        from huggingface_hub import snapshot_download

        patterns = [f"{subfolder}/*"] if subfolder else None
        model_dir = Path(snapshot_download(str(path_or_repo_id), allow_patterns=patterns))
        model_dir = model_dir / subfolder if subfolder else model_dir
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json (is `subfolder` right?)")
    return model_dir


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / WEIGHTS_INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    if (model_dir / WEIGHTS_NAME).is_file():
        return [model_dir / WEIGHTS_NAME]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no .safetensors weights")
    return files


class _Header:
    """Key -> (file, dtype, shape) across single or sharded safetensors files, read without loading data."""

    def __init__(self, files: list[Path]) -> None:
        self.entries: dict[str, tuple[Path, torch.dtype, tuple[int, ...]]] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as h:
                for key in h.keys():
                    sl = h.get_slice(key)
                    self.entries[key] = (f, _SAFETENSORS_DTYPES[sl.get_dtype()], tuple(sl.get_shape()))

    def load(self, keys: list[str]) -> dict[str, torch.Tensor]:
        by_file: dict[Path, list[str]] = {}
        for k in keys:
            by_file.setdefault(self.entries[k][0], []).append(k)
        out = {}
        for f, ks in by_file.items():
            with safe_open(str(f), framework="pt") as h:
                for k in ks:
                    out[k] = h.get_tensor(k)
        return out


_SAFETENSORS_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def classify_scale_layout(shape: tuple[int, ...], out_features: int, in_features: int) -> ScaleLayout | None:
    """'linear' for ``[N, K/16]``, '128x4' for the padded swizzled shape, None if neither.

    When both shapes coincide (N % 128 == 0 and K/16 % 4 == 0) the bytes cannot tell; ModelOpt's default export is
    linear, so 'linear' is returned and swizzled exports must be declared by the caller.
    """
    c = in_features // BLOCK_SIZE
    if tuple(shape) == (out_features, c):
        return "linear"
    if tuple(shape) == (round_up(out_features, 128), round_up(c, 4)):
        return "128x4"
    return None


def _check_nvfp4_layer(name: str, linear: nn.Linear, header: _Header, problems: list[str]) -> ScaleLayout | None:
    n, k = linear.out_features, linear.in_features
    ent = header.entries
    for suffix in NVFP4_SUFFIXES:
        if f"{name}.{suffix}" not in ent:
            problems.append(f"missing key {name}.{suffix} (NVFP4 layer {name} [{n}x{k}])")
    if any(f"{name}.{s}" not in ent for s in NVFP4_SUFFIXES):
        return None

    def expect(suffix, dtypes, shapes):
        f, dtype, shape = ent[f"{name}.{suffix}"]
        if dtype not in dtypes:
            problems.append(f"{name}.{suffix} in {f.name}: dtype {dtype}, expected {' or '.join(map(str, dtypes))}")
        if shapes is not None and shape not in shapes:
            problems.append(f"{name}.{suffix} in {f.name}: shape {list(shape)}, expected {' or '.join(map(str, map(list, shapes)))}")
        return shape

    if k % BLOCK_SIZE:
        problems.append(f"{name}: in_features {k} is not a multiple of {BLOCK_SIZE}, cannot be NVFP4")
        return None
    expect("weight", (torch.uint8,), [(n, k // 2)])
    expect("weight_scale_2", (torch.float32,), [(), (1,)])
    expect("input_scale", (torch.float32,), [(), (1,)])
    scale_shape = expect("weight_scale", (torch.float8_e4m3fn, torch.uint8), None)
    layout = classify_scale_layout(scale_shape, n, k)
    if layout is None:
        problems.append(
            f"{name}.weight_scale in {ent[name + '.weight_scale'][0].name}: shape {list(scale_shape)} is neither linear "
            f"{[n, k // 16]} nor 128x4-swizzled {[round_up(n, 128), round_up(k // 16, 4)]}"
        )
    if linear.bias is not None:
        if f"{name}.bias" in ent:
            expect("bias", (torch.bfloat16, torch.float16, torch.float32), [(n,)])
        else:
            problems.append(f"missing key {name}.bias (layer {name} has a bias)")
    return layout


def _model_class(config: dict):
    import diffusers

    cls_name = config.get("_class_name")
    cls = getattr(diffusers, cls_name, None) if cls_name else None
    if cls is None:
        raise NVFP4CheckpointError(f"config.json names _class_name={cls_name!r}, which diffusers does not provide")
    return cls


def replace_linear(model: nn.Module, name: str, linear: nn.Linear, new: NVFP4Linear) -> None:
    """Put ``new`` where ``linear`` was, keeping diffusers' tensor-parallel block annotations."""
    for attr in ("_tp_packed_row_blocks", "_tp_packed_col_blocks"):
        if hasattr(linear, attr):
            setattr(new, attr, getattr(linear, attr))
    model.set_submodule(name, new)


def finish_model(model: nn.Module, source, device) -> None:
    """Refuse a model with tensors the checkpoint did not fill; eval mode; move to ``device``."""
    meta = [n for n, p in model.named_parameters() if p.is_meta] + [n for n, b in model.named_buffers() if b.is_meta]
    if meta:
        raise NVFP4CheckpointError(f"{source}: no data for {meta}")
    model.eval()
    if device is not None:
        model.to(device)


def load_nvfp4_transformer(
    path_or_repo_id: str | os.PathLike,
    *,
    subfolder: str | None = None,
    torch_dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    scale_layout: ScaleLayout | None = None,
    filename: str | None = None,
    **single_file_kwargs,
) -> nn.Module:
    """Load a ModelOpt NVFP4 diffusers export (FLUX.2 dev/klein, Qwen-Image) as its diffusers model class.

    A single ``.safetensors`` file (a local file path, or ``filename=`` inside a repo/directory) is read as the
    BFL / ComfyUI FLUX.2 NVFP4 format instead: see ``diffusers_nvfp4_fast.bfl.load_bfl_nvfp4_transformer`` for its
    extra keyword arguments (``config``, ``nibble_order``, ``input_scales``, ``dynamic_input_scale``).

    Quantized Linears become ``NVFP4Linear`` (never materialized in BF16); the rest load in ``torch_dtype``. Every
    key is checked (missing, unexpected, dtype, shape) and all problems are raised together in one
    ``NVFP4CheckpointError``. Block scales are converted to the 128x4 layout exactly once.

    Args:
        path_or_repo_id: local directory or Hugging Face repo id.
        subfolder: e.g. ``"transformer"`` inside a pipeline repo.
        torch_dtype: dtype of unquantized weights and biases.
        device: where to put the model (default: stays on CPU).
        scale_layout: force how stored block scales are read ("linear" or "128x4") when the shape cannot tell.
        filename: a single-file checkpoint inside ``path_or_repo_id`` (BFL format).
    """
    if filename is not None or Path(path_or_repo_id).is_file():
        from .bfl import load_bfl_nvfp4_transformer

        return load_bfl_nvfp4_transformer(
            path_or_repo_id, filename=filename, subfolder=subfolder, torch_dtype=torch_dtype, device=device,
            scale_layout=scale_layout, **single_file_kwargs,
        )
    if single_file_kwargs:
        raise TypeError(f"{sorted(single_file_kwargs)} only apply to single-file (BFL format) checkpoints")
    from accelerate import init_empty_weights

    model_dir = _resolve_dir(path_or_repo_id, subfolder)
    config = json.loads((model_dir / "config.json").read_text())
    qinfo = read_quantization_info(model_dir, config)
    cls = _model_class(config)
    model_config = {k: v for k, v in config.items() if k != "quantization_config"}
    with init_empty_weights(include_buffers=False):
        model = cls.from_config(model_config)

    header = _Header(_weight_files(model_dir))
    problems: list[str] = []
    quantized: dict[str, ScaleLayout | None] = {}
    disagreements = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        stored_nvfp4 = f"{name}.weight_scale" in header.entries or header.entries.get(
            f"{name}.weight", (None, None))[1] == torch.uint8
        if stored_nvfp4 == is_excluded(name, qinfo.exclude_patterns):
            disagreements.append(f"{name} ({'NVFP4' if stored_nvfp4 else 'BF16'} in the file)")
        if stored_nvfp4:
            quantized[name] = _check_nvfp4_layer(name, module, header, problems)
    if disagreements:
        logger.warning(
            "%d layer(s) are stored differently from what the exclude patterns in %s say; the stored tensors win: %s",
            len(disagreements), qinfo.source, ", ".join(disagreements[:8]) + (" ..." if len(disagreements) > 8 else ""),
        )

    expected_plain = {}
    for key, tensor in list(model.state_dict().items()):
        owner = key.rsplit(".", 1)[0]
        if owner in quantized:
            continue
        expected_plain[key] = tensor
    for key, t in expected_plain.items():
        ent = header.entries.get(key)
        if ent is None:
            if key in dict(model.named_parameters()):
                problems.append(f"missing key {key} (shape {list(t.shape)})")
            continue
        if tuple(ent[2]) != tuple(t.shape):
            problems.append(f"{key} in {ent[0].name}: shape {list(ent[2])}, expected {list(t.shape)}")
        if not ent[1].is_floating_point:
            problems.append(f"{key} in {ent[0].name}: dtype {ent[1]}, expected a floating-point dtype")
    nvfp4_keys = {f"{n}.{s}" for n in quantized for s in (*NVFP4_SUFFIXES, "bias")}
    for key, ent in header.entries.items():
        if key not in expected_plain and key not in nvfp4_keys:
            problems.append(f"unexpected key {key} in {ent[0].name} ({ent[1]}, {list(ent[2])})")
    if problems:
        raise NVFP4CheckpointError(
            f"{model_dir}: {len(problems)} problem(s) loading this NVFP4 checkpoint into {cls.__name__}:\n  "
            + "\n  ".join(problems)
        )

    plain = header.load([k for k in expected_plain if k in header.entries])
    model.load_state_dict({k: v.to(torch_dtype) for k, v in plain.items()}, strict=False, assign=True)
    counts = {"nvfp4": 0, "nvfp4_bytes": 0, "swizzled_on_load": 0}
    for name, stored_layout in quantized.items():
        linear = model.get_submodule(name)
        tensors = header.load([f"{name}.{s}" for s in NVFP4_SUFFIXES] + ([f"{name}.bias"] if linear.bias is not None else []))
        new = NVFP4Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, dtype=torch_dtype)
        new.load_nvfp4(
            tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"], tensors[f"{name}.weight_scale_2"],
            tensors[f"{name}.input_scale"], tensors.get(f"{name}.bias"), scale_layout=scale_layout or stored_layout,
        )
        counts["swizzled_on_load"] += new.swizzle_weight_scales_()
        replace_linear(model, name, linear, new)
        counts["nvfp4"] += 1
        counts["nvfp4_bytes"] += sum(b.numel() * b.element_size() for b in new.buffers())

    finish_model(model, model_dir, device)
    bf16_linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    total = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    logger.info(
        "Loaded %s from %s: %d NVFP4 linears (%.1f MB), %d BF16 linears, %.1f MB in all",
        cls.__name__, model_dir, counts["nvfp4"], counts["nvfp4_bytes"] / 1e6, bf16_linears, total / 1e6,
    )
    model._nvfp4_load_summary = {
        "class": cls.__name__, "nvfp4_linears": counts["nvfp4"], "bf16_linears": bf16_linears,
        "nvfp4_bytes": counts["nvfp4_bytes"], "total_bytes": total, "scales_swizzled_on_load": counts["swizzled_on_load"],
    }
    return model
