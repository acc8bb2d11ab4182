"""The diffusers config of a single-file checkpoint: inferred from tensor shapes per model family, or given by the
user (``config=``: a dict, a config.json, a diffusers directory or repo id), or both (the user's keys win).

Each family's inference returns the config and, apart, the values the weights do not hold (``assumed``): they are
diffusers' defaults for that class, named in the load summary and in ``inspect``, and ``config=`` overrides them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import NVFP4CheckpointError

Shapes = Mapping[str, tuple[int, ...]]
CONFIG_HINT = "pass config= (a dict, a config.json, or a diffusers directory or repo id)"

# Family members, for naming what was inferred (shapes decide; these tables only label them).
FLUX2_VARIANTS = {
    (8, 48, 6144): "FLUX.2-dev",
    (5, 20, 3072): "FLUX.2-klein-4B",
    (8, 24, 4096): "FLUX.2-klein-9B",
}
_KLEIN_BASE_NOTE = " (or its -base twin: the same shapes)"
QWEN_SIZES = {(60, 3072): "Qwen-Image"}
QWEN21_SIZES = {(32, 4096): "Qwen-Image 2.1"}


@dataclass
class Inferred:
    """A config read from shapes, and what in it the weights cannot tell (key -> why that value)."""

    config: dict[str, Any]
    assumed: dict[str, str] = field(default_factory=dict)


class _Shapes:
    """Lookups that fail with one clear message naming the family, the missing parameter and what to pass."""

    def __init__(self, shapes: Shapes, family: str):
        self.shapes, self.family = shapes, family

    def fail(self, why: str) -> NVFP4CheckpointError:
        return NVFP4CheckpointError(f"cannot infer the {self.family} config: {why}; {CONFIG_HINT}")

    def need(self, name: str) -> tuple[int, ...]:
        if name not in self.shapes:
            raise self.fail(f"no tensor maps to {name}")
        return self.shapes[name]

    def has(self, name: str) -> bool:
        return name in self.shapes

    def count(self, prefix: str) -> int:
        idx = {int(k.split(".")[1]) for k in self.shapes
               if k.startswith(prefix + ".") and k.split(".")[1].isdigit()}
        if idx and idx != set(range(len(idx))):
            raise self.fail(f"{prefix} indices {sorted(idx)} are not 0..n-1")
        return len(idx)

    def heads(self, inner: int, head_key: str) -> tuple[int, int]:
        (head_dim,) = self.need(head_key)
        if inner % head_dim:
            raise self.fail(f"width {inner} is not a multiple of head dim {head_dim}")
        return head_dim, inner // head_dim


def infer_flux2_config(shapes: Shapes) -> dict[str, Any]:
    """``Flux2Transformer2DModel`` config from diffusers parameter names -> logical shapes (FP4 weights as ``[N, K]``).
    (``infer_flux2`` with the assumed values dropped.)"""
    return infer_flux2(shapes).config


def infer_flux2(shapes: Shapes) -> Inferred:
    """Read from shapes: block counts, head dim (``norm_q``), width, in/out channels, text width, timestep channels,
    MLP ratio, guidance embedder presence. Not in the weights: ``patch_size=1``, ``axes_dims_rope = 4 x head_dim/4``,
    ``rope_theta=2000``, ``eps=1e-6``."""
    s = _Shapes(shapes, "FLUX.2")
    inner, in_channels = s.need("x_embedder.weight")
    num_layers, num_single = s.count("transformer_blocks"), s.count("single_transformer_blocks")
    head_dim, heads = s.heads(inner, "transformer_blocks.0.attn.norm_q.weight" if num_layers
                              else "single_transformer_blocks.0.attn.norm_q.weight")
    if num_layers:
        mlp_hidden = s.need("transformer_blocks.0.ff.linear_in.weight")[0] // 2  # SwiGLU: gate and value
    else:
        mlp_hidden = (s.need("single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight")[0] - 3 * inner) // 2
    out_rows = s.need("proj_out.weight")[0]
    if head_dim % 8:
        raise s.fail(f"axes_dims_rope cannot be derived for head dim {head_dim}")
    config = {
        "patch_size": 1, "in_channels": in_channels, "out_channels": out_rows if out_rows != in_channels else None,
        "num_layers": num_layers, "num_single_layers": num_single, "attention_head_dim": head_dim,
        "num_attention_heads": heads, "joint_attention_dim": s.need("context_embedder.weight")[1],
        "timestep_guidance_channels": s.need("time_guidance_embed.timestep_embedder.linear_1.weight")[1],
        "mlp_ratio": mlp_hidden / inner, "axes_dims_rope": [head_dim // 4] * 4, "rope_theta": 2000, "eps": 1e-6,
        "guidance_embeds": s.has("time_guidance_embed.guidance_embedder.linear_1.weight"),
    }
    assumed = {"patch_size": "1 (FLUX.2's)", "axes_dims_rope": f"{[head_dim // 4] * 4} (4 x head_dim/4, FLUX.2's)",
               "rope_theta": "2000 (FLUX.2's)", "eps": "1e-6 (FLUX.2's)"}
    return Inferred(config, assumed)


def infer_qwen(shapes: Shapes) -> Inferred:
    """``QwenImageTransformer2DModel`` (Qwen-Image and its Edit / Edit-2509 / Edit-2511 / Layered checkpoints).

    Read from shapes: blocks, width, head dim, in channels, text width, out channels (``proj_out`` rows / 4),
    ``use_additional_t_cond`` (``time_text_embed.addition_t_embedding``, Qwen-Image-Layered). ``zero_cond_t``
    (Edit-2511: condition-image tokens modulated from t = 0) holds no tensor: it is read from ComfyUI's
    ``__index_timestep_zero__`` marker where the file has one (``plan``), else assumed False. Not in the weights:
    ``patch_size=2``, ``axes_dims_rope=(16, 56, 56)`` (head dim 128), ``guidance_embeds=False``, and
    ``use_layer3d_rope``, taken equal to ``use_additional_t_cond`` (both are on in Qwen-Image-Layered, the only
    public checkpoint with ``addition_t_embedding``)."""
    s = _Shapes(shapes, "Qwen-Image")
    inner, in_channels = s.need("img_in.weight")
    head_dim, heads = s.heads(inner, "transformer_blocks.0.attn.norm_q.weight")
    out_rows = s.need("proj_out.weight")[0]
    if out_rows % 4:
        raise s.fail(f"proj_out has {out_rows} rows, not patch_size^2 = 4 times the output channels")
    if head_dim != 128:
        raise s.fail(f"axes_dims_rope is known only for head dim 128 (16, 56, 56), not {head_dim}")
    layered = s.has("time_text_embed.addition_t_embedding.weight")
    config = {
        "patch_size": 2, "in_channels": in_channels, "out_channels": out_rows // 4,
        "num_layers": s.count("transformer_blocks"), "attention_head_dim": head_dim, "num_attention_heads": heads,
        "joint_attention_dim": s.need("txt_in.weight")[1], "guidance_embeds": False, "axes_dims_rope": [16, 56, 56],
        "zero_cond_t": False, "use_additional_t_cond": layered, "use_layer3d_rope": layered,
    }
    assumed = {
        "patch_size": "2 (Qwen-Image's)", "axes_dims_rope": "[16, 56, 56] (Qwen-Image's)",
        "guidance_embeds": "False (Qwen-Image's)",
        "zero_cond_t": "False: no tensor depends on it; Qwen-Image-Edit-2511 needs True (ComfyUI's files say so with "
                       "__index_timestep_zero__; else pass config={'zero_cond_t': True})",
        "use_layer3d_rope": f"{layered} (= use_additional_t_cond, as in Qwen-Image-Layered)",
    }
    return Inferred(config, assumed)


def infer_qwen21(shapes: Shapes) -> Inferred:
    """``QwenImage21Transformer2DModel``. Read from shapes: blocks, width, head dim, in/out channels, text width, MLP
    ratio. Not in the weights: ``patch_size=1``, ``axes_dims_rope=(16, 56, 56)``, ``eps=1e-6``,
    ``causal_condition=True`` (diffusers 0.42.1's defaults; no public config was checked)."""
    s = _Shapes(shapes, "Qwen-Image 2.1")
    inner, in_channels = s.need("img_in.weight")
    head_dim, heads = s.heads(inner, "transformer_blocks.0.attn.norm_q.weight")
    hidden = s.need("transformer_blocks.0.img_mlp.gate_layer.weight")[0]
    if hidden % inner:
        raise s.fail(f"the feed-forward width {hidden} is not a whole multiple of the width {inner} (mlp_ratio)")
    if head_dim != 128:
        raise s.fail(f"axes_dims_rope is known only for head dim 128 (16, 56, 56), not {head_dim}")
    config = {
        "patch_size": 1, "in_channels": in_channels, "out_channels": s.need("proj_out.weight")[0],
        "num_layers": s.count("transformer_blocks"), "attention_head_dim": head_dim, "num_attention_heads": heads,
        "context_in_dim": s.need("txt_in.in_layer.weight")[1], "mlp_ratio": hidden // inner,
        "axes_dims_rope": [16, 56, 56], "eps": 1e-6, "causal_condition": True,
    }
    assumed = {"patch_size": "1 (diffusers' default)", "axes_dims_rope": "[16, 56, 56] (diffusers' default)",
               "eps": "1e-6 (diffusers' default)", "causal_condition": "True (diffusers' default)"}
    return Inferred(config, assumed)


def flux2_variant(config: Mapping[str, Any]) -> str:
    """'FLUX.2-dev', 'FLUX.2-klein-4B', 'FLUX.2-klein-9B', or 'FLUX.2-family (custom ...)'."""
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    key = (config["num_layers"], config["num_single_layers"], inner)
    return FLUX2_VARIANTS.get(key, f"FLUX.2-family (custom: {key[0]} double + {key[1]} single blocks, width {inner})")


def flux2_variant_label(config: Mapping[str, Any]) -> str:
    """``flux2_variant`` plus what the shapes cannot tell apart (klein and klein-base)."""
    name = flux2_variant(config)
    return name + _KLEIN_BASE_NOTE if "klein" in name else name


def qwen_variant(config: Mapping[str, Any]) -> str:
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    size = QWEN_SIZES.get((config["num_layers"], inner),
                          f"Qwen-Image family (custom: {config['num_layers']} blocks, width {inner})")
    if config.get("use_additional_t_cond"):
        return f"{size}: Qwen-Image-Layered (addition_t_embedding)"
    if config.get("zero_cond_t"):
        return f"{size}: Qwen-Image-Edit-2511 (zero_cond_t)"
    return f"{size} (or Qwen-Image-Edit / -Edit-2509: the same shapes; the weights cannot tell them apart)"


def qwen21_variant(config: Mapping[str, Any]) -> str:
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    return QWEN21_SIZES.get((config["num_layers"], inner),
                            f"Qwen-Image 2.1 family (custom: {config['num_layers']} blocks, width {inner})")


def init_defaults(cls: type[Any]) -> dict[str, Any]:
    import inspect

    params = inspect.signature(cls.__init__).parameters
    return {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}


@dataclass
class ConfigArg:
    """What ``config=`` gave: the config keys, the class it names (``_class_name``) and where it came from."""

    config: dict[str, Any]
    class_name: str | None
    source: str


def _download_config(repo_id: str, subfolder: str | None, default_subfolder: str) -> Path:
    """A repo's transformer config: ``<subfolder>/config.json`` when one is named, else
    ``<default_subfolder>/config.json`` (a pipeline repo), else ``config.json``."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import EntryNotFoundError

    if subfolder:
        return Path(hf_hub_download(repo_id, "config.json", subfolder=subfolder))
    try:
        return Path(hf_hub_download(repo_id, "config.json", subfolder=default_subfolder))
    except EntryNotFoundError:
        return Path(hf_hub_download(repo_id, "config.json"))


def read_config_arg(config: Mapping[str, Any] | str | os.PathLike, *, default_subfolder: str = "transformer",
                    download: Callable[[str, str | None, str], Path] = _download_config) -> ConfigArg:
    """``config=`` as a dict, a config.json file, a directory holding one (or ``<default_subfolder>/config.json``,
    as in a pipeline), or a Hugging Face repo id (the same two places), ``"org/name/subfolder"`` naming the folder."""
    if isinstance(config, Mapping):
        raw, source = dict(config), "config= (a dict)"
    else:
        p = Path(config)
        if p.is_dir():
            p = p / "config.json" if (p / "config.json").is_file() else p / default_subfolder / "config.json"
        elif not p.exists():
            parts = str(config).split("/")
            p = download("/".join(parts[:2]), "/".join(parts[2:]) or None, default_subfolder)
        if not p.is_file():
            raise NVFP4CheckpointError(f"config={str(config)!r}: no config.json there (nor in {default_subfolder}/)")
        raw, source = json.loads(p.read_text()), f"config= ({p})"
    class_name = raw.get("_class_name")
    keys = {k: v for k, v in raw.items() if not k.startswith("_") and k != "quantization_config"}
    return ConfigArg(keys, class_name if isinstance(class_name, str) else None, source)
