"""Inductor settings under which a compiled model gives the same bytes with fast paths on and off (docs/design.md §1).

Two things make compiled bytes differ between two compiles of the same model, with or without this plugin:
inductor fuses BF16 ops and keeps their FP32 intermediates unless told to round them as eager does, and it times
candidate reduction configs on the device at first run, so two compiles may pick different summation orders. A
third, seen on the H200 with whole Qwen-Image models, is not located yet (docs/design.md §1,
benchmarks/compile_determinism.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def exact_inductor() -> Iterator[None]:
    """Compile and run inside this block: inductor rounds every intermediate to its dtype where eager does
    (``emulate_precision_casts``) and picks reduction configs without timing them (``deterministic``).

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
    with inductor_config.patch(emulate_precision_casts=True, deterministic=True):
        yield
