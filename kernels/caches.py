"""The kernels' process-wide caches, declared where they are defined with their eviction policy. ``kernels/`` cannot
import the package, so the package's cache registry (``diffusers_nvfp4_fast.caches``) reads this table once the
kernels are imported (docs/design.md §2); standard library only."""

from __future__ import annotations

from typing import TypeVar

Table = TypeVar("Table")

# name -> (the table: anything with clear() and len(), its eviction policy in one line)
DECLARED: dict[str, tuple[object, str]] = {}


def declare(name: str, table: Table, eviction: str) -> Table:
    """Declare ``table`` (emptied by ``clear()``) as the process-wide cache ``name``; returns it."""
    DECLARED[name] = (table, eviction)
    return table
