"""Install a processor on one attention instance and undo it without clobbering a later user choice."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def swap_processor(attn: nn.Module, new_processor) -> Callable[[], None]:
    """Set ``attn.processor = new_processor``; the returned undo puts the original object back, but only while
    ``new_processor`` is still installed (a processor the user set in between is theirs and stays)."""
    original = attn.processor
    attn.processor = new_processor

    def undo() -> None:
        if attn.processor is new_processor:
            attn.processor = original

    return undo
