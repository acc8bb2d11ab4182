"""Process-wide state that changes what a model's call computes, read through probes that the modules owning it
register (ground floor: imports only the standard library).

The CUDA-graph runner keys its graphs on ``read_all()`` (docs/design.md §8, "CUDA graphs"), so it reaches that state
without importing its owners: ``ops/verify.py`` registers the count of failed verifications (a failure sends a site
kind to its unfused path, which a graph captured before would not follow).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

_PROBES: dict[str, Callable[[], Hashable]] = {}


def register(name: str, probe: Callable[[], Hashable]) -> None:
    """Read ``probe()`` into every later ``read_all()``; a second registration under ``name`` replaces the first."""
    _PROBES[name] = probe


def registered() -> tuple[str, ...]:
    """The names of the registered probes, in the order ``read_all`` reads them."""
    return tuple(_PROBES)


def read_all() -> tuple:
    """Every registered probe's value now, in registration order (hashable)."""
    return tuple(probe() for probe in _PROBES.values())
