"""The ``Flux2Transformer2DModel`` config of a BFL file: inferred from tensor shapes, or given by the user."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import NVFP4CheckpointError

# FLUX.2 family members, for naming what was inferred (shapes decide; this table only labels them).
FLUX2_VARIANTS = {
    (8, 48, 6144): "FLUX.2-dev",
    (5, 20, 3072): "FLUX.2-klein-4B",
    (8, 24, 4096): "FLUX.2-klein-9B",
}


def infer_flux2_config(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """``Flux2Transformer2DModel`` config from diffusers parameter names -> logical shapes (FP4 weights as ``[N, K]``).

    Read from shapes: block counts, head dim (``norm_q``), width, in/out channels, text width, timestep channels,
    MLP ratio, guidance embedder presence. Not in the weights, so FLUX.2's values are assumed (and logged):
    ``patch_size=1``, ``axes_dims_rope = 4 x head_dim/4``, ``rope_theta=2000``, ``eps=1e-6``.
    """

    def need(name: str) -> tuple[int, ...]:
        if name not in shapes:
            raise NVFP4CheckpointError(
                f"cannot infer the FLUX.2 config: no tensor maps to {name}; is this a FLUX.2 transformer? "
                "(pass config=)"
            )
        return shapes[name]

    def count(prefix: str) -> int:
        idx = {int(k.split(".")[1]) for k in shapes if k.startswith(prefix + ".") and k.split(".")[1].isdigit()}
        if idx and idx != set(range(len(idx))):
            raise NVFP4CheckpointError(f"cannot infer the FLUX.2 config: {prefix} indices {sorted(idx)} are not 0..n-1")
        return len(idx)

    inner, in_channels = need("x_embedder.weight")
    num_layers, num_single = count("transformer_blocks"), count("single_transformer_blocks")
    head_key = ("transformer_blocks.0.attn.norm_q.weight" if num_layers
                else "single_transformer_blocks.0.attn.norm_q.weight")
    (head_dim,) = need(head_key)
    if inner % head_dim:
        raise NVFP4CheckpointError(
            f"cannot infer the FLUX.2 config: width {inner} is not a multiple of head dim {head_dim}"
        )
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


def init_defaults(cls: type[Any]) -> dict[str, Any]:
    import inspect

    params = inspect.signature(cls.__init__).parameters
    return {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}


def read_config_arg(config: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    if isinstance(config, Mapping):
        cfg = dict(config)
    else:
        p = Path(config)
        p = p / "config.json" if p.is_dir() else p
        cfg = json.loads(p.read_text())
    return {k: v for k, v in cfg.items() if not k.startswith("_") and k != "quantization_config"}
