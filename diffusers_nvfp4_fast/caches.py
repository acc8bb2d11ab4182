"""Every process-wide cache of the package and its kernels, registered with its eviction policy, and ``reset_all``
(ground floor: imports only the standard library).

A cache is a table whose entries the process builds on demand (verdicts, launch plans, recorded binaries, descriptor
fields): each module that keeps one registers it here where it defines it, with one line saying when entries go.
``kernels/`` cannot import the package, so its caches are declared in ``kernels/caches.py`` and read from there once
the kernels are imported (docs/design.md §2). Tests start from empty caches with ``reset_all()`` or ``reset(name)``
instead of reaching into module globals.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Protocol, TypeVar


class Clearable(Protocol):
    def clear(self) -> None: ...

    def __len__(self) -> int: ...


Table = TypeVar("Table", bound=Clearable)


@dataclass(frozen=True)
class Cache:
    name: str
    table: Clearable
    eviction: str  # when entries leave the table, in one line


_CACHES: dict[str, Cache] = {}
# Where the kernels declare theirs (kernels/caches.py), under the names the kernels are imported as.
_KERNEL_DECLARATIONS = ("diffusers_nvfp4_fast.kernels.caches", "kernels.caches")


def register(name: str, table: Table, eviction: str) -> Table:
    """Register ``table`` as the cache ``name`` (a second registration under ``name`` replaces the first); returns it,
    so a module writes ``_PLANS = caches.register("ops.linear.plans", {}, "...")``."""
    if not eviction:
        raise ValueError(f"cache {name!r}: say when its entries are evicted")
    _CACHES[name] = Cache(name, table, eviction)
    return table


def unregister(name: str) -> None:
    """Forget the package cache ``name`` (a table registered for a while, as by a test)."""
    _CACHES.pop(name, None)


def registered() -> dict[str, Cache]:
    """Every registered cache by name: the package's, then those the imported kernels declared (read from
    ``kernels/caches.py`` where it is imported; the kernels are never imported from here)."""
    found = dict(_CACHES)
    for module_name in _KERNEL_DECLARATIONS:
        module = sys.modules.get(module_name)
        for name, (table, eviction) in getattr(module, "DECLARED", {}).items():
            found.setdefault(name, Cache(name, table, eviction))
    return found


def reset(name: str) -> None:
    """Empty the cache ``name``; KeyError naming the registered ones if there is none of that name."""
    caches = registered()
    if name not in caches:
        raise KeyError(f"no cache named {name!r}; registered: {', '.join(sorted(caches))}")
    caches[name].table.clear()


def reset_all() -> None:
    """Empty every registered cache (tests; the process then rebuilds entries on demand, as after its start)."""
    for cache in registered().values():
        cache.table.clear()
