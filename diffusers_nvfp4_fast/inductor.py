"""Inductor settings under which a compiled model gives the same bytes with fast paths on and off (docs/design.md §1).

Two things make compiled bytes differ between two compiles of the same model, with or without this plugin:
inductor fuses BF16 ops and keeps their FP32 intermediates unless told to round them as eager does, and it times
candidate reduction configs on the device at first run, so two compiles may pick different summation orders. A
third, seen on the H200 with whole Qwen-Image models, went away under torch's deterministic algorithms with fresh
memory filled (``fill_uninitialized=True``; docs/design.md §1, benchmarks/compile_determinism.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def exact_inductor(fill_uninitialized: bool = False) -> Iterator[None]:
    """Compile and run inside this block: inductor rounds every intermediate to its dtype where eager does
    (``emulate_precision_casts``) and picks reduction configs without timing them (``deterministic``).

    ``fill_uninitialized``: also turn on torch's deterministic algorithms (``warn_only``) with
    ``torch.utils.deterministic.fill_uninitialized_memory``, so that every new tensor is filled (NaN) before use. On the
    H200 this made three compiles of a Qwen-Image model give the same bytes where, without it, a compile with
    inductor's caches off gave other bytes in every run (docs/design.md §1). It costs a fill per allocation.

    Example::

        pipe.transformer.compile_repeated_blocks(fullgraph=True)
        with exact_inductor():
            image = pipe(prompt).images[0]  # compiles on the first call, inside the block

    Raises ``RuntimeError`` naming the torch version when its inductor has no deterministic mode.
    """
    import torch._inductor.config as inductor_config

    if not hasattr(inductor_config, "deterministic"):
        raise RuntimeError(f"torch {torch.__version__}: inductor has no `deterministic` setting; exact_inductor "
                           "needs a torch whose inductor can skip timing reduction configs")
    with inductor_config.patch(emulate_precision_casts=True, deterministic=True), \
            (_uninitialized_memory_filled() if fill_uninitialized else contextlib.nullcontext()):
        yield


@contextlib.contextmanager
def _uninitialized_memory_filled() -> Iterator[None]:
    import torch.utils.deterministic as deterministic

    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              deterministic.fill_uninitialized_memory)  # type: ignore[attr-defined]
    torch.use_deterministic_algorithms(True, warn_only=True)
    deterministic.fill_uninitialized_memory = True  # type: ignore[attr-defined]
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        deterministic.fill_uninitialized_memory = before[2]  # type: ignore[attr-defined]
