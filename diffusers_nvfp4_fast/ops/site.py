"""The site kinds: the names under which ``fast_path_report`` counts fused calls, fallbacks and verifications
(docs/design.md §8). Users and tests read these strings; each is declared here once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

SiteKind = Literal[
    "flux2_token_cat",  # FLUX.2 single-stream quantize(cat([attn, mlp])) into to_out
    "flux2_token_cat_swiglu",  # the same with SwiGLU folded in (counted under flux2_token_cat's heading)
    "flux2_swiglu",  # FLUX.2 double-stream quantize(swiglu(h)) into ff.linear_out
    "flux2_rotary",  # FLUX.2 query/key rotary embedding
    "flux2_qk_rotary",  # FLUX.2 query/key RMSNorm + rotary embedding
    "flux2_resnorm",  # FLUX.2 double-stream residual + norm2 + modulate + quantize into ff.linear_in
    "flux2_adaln",  # FLUX.2 norm1 + modulate + quantize into the attention's input projections
    "qwen_resnorm",  # Qwen-Image residual + norm2 + modulate + quantize into FC1
    "qwen_gelu",  # Qwen-Image quantize(gelu(FC1 output)) into FC2
    "qwen_adaln",  # Qwen-Image norm1 + modulate + quantize into query/key/value
    "qwen_qk_rotary",  # Qwen-Image query/key RMSNorm + rotary embedding
    "qwen_bias_deferral",  # Qwen-Image attention output bias added inside the residual-norm kernel
    "qwen21_adaln",  # Qwen-Image 2.1 norm1 + x * (1 + scale) + quantize into query/key/value
    "qwen21_resnorm",  # Qwen-Image 2.1 residual + tanh(gate) * attn + norm2 + x * (1 + scale) + quantize into
    # gate_layer and proj (one quantized input serves both)
    "qwen21_swiglu",  # Qwen-Image 2.1 quantize(silu(gate_layer(x)) * proj(x)) into out
    "qwen21_qk_rotary",  # Qwen-Image 2.1 query/key RMSNorm + rotary embedding
]
SITE_KINDS: tuple[SiteKind, ...] = get_args(SiteKind)


@dataclass(frozen=True)
class Site:
    """Where a fused call counts: the model's stats (``verify.new_stats``) and the site kind."""

    stats_id: int
    kind: SiteKind


def sites_for(stats_id: int) -> dict[SiteKind, Site]:
    """Every site kind's ``Site`` on the stats of ``stats_id``: what a patched model's objects count under."""
    return {kind: Site(stats_id, kind) for kind in SITE_KINDS}
