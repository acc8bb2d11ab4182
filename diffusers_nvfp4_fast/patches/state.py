"""The one piece of state a fused block forward reads, kept on the block while the fast paths are on."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from torch import nn

from ..ops.site import Site, SiteKind

if TYPE_CHECKING:
    from .adaln import SharedInputConsumers

_ATTR = "_nvfp4_block_state"


@dataclass
class BlockState:
    """sites: where this model's calls count (``ops.site.sites_for``); adaln: stream -> its norm1 site (only the
    streams whose projections can share one quantized input); bias_site: Qwen-Image's attention output bias may move
    into the residual-norm kernel; defer_bias: whether it does in the current call (set by the block forward around
    its attention call, read by ``QwenDeferredBiasAttnProcessor``); ff_inputs: Qwen-Image 2.1's feed-forward
    projections that share the residual-norm output (None: that site is not installed); installed: the site kinds
    installed on the block, one entry per site (Qwen-Image 2.1 counts each once per trace under torch.compile)."""

    sites: dict[SiteKind, Site]
    adaln: dict[str, SharedInputConsumers] = field(default_factory=dict)
    bias_site: bool = False
    defer_bias: bool = False
    ff_inputs: SharedInputConsumers | None = None
    installed: list[SiteKind] = field(default_factory=list)


def install_state(block: nn.Module, state: BlockState) -> None:
    block.__dict__[_ATTR] = state  # not an nn.Module attribute: no registration, found without __getattr__


def remove_state(block: nn.Module) -> None:
    block.__dict__.pop(_ATTR, None)


def block_state(block: nn.Module) -> BlockState:
    """The state of a block whose forward is a fused one (``install_state`` ran)."""
    return cast(BlockState, block.__dict__[_ATTR])
