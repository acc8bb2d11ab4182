"""A progress bar over a module's blocks during one of its calls, opened only when someone says slow work is under
way (ground floor: torch and tqdm; what the work is, the caller says: ``preparation.py`` for the NVFP4 kernels).

No hook is put inside the model: a forward pre-hook and an always-called forward hook sit on the model itself (hooks
there run outside CUDA graphs and do not touch the fused sites' gates), and only during a call one process-wide
forward hook counts the blocks that finished, by identity. Inside a torch.compile trace or a CUDA-graph capture the
hooks do nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook

BarFactory = Callable[[int], Any]  # total -> a tqdm-like bar (update, set_description, set_postfix_str, close)


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: modules whose class diffusers lists in ``_repeated_blocks`` (what
    ``compile_repeated_blocks`` compiles), else the members of the model's own ``nn.ModuleList`` children."""
    names = set(getattr(model, "_repeated_blocks", None) or ())
    if names:
        return [m for m in model.modules() if type(m).__name__ in names]
    return [m for child in model.children() if isinstance(child, nn.ModuleList) for m in child]


def tqdm_bar(total: int) -> Any:
    """A tqdm bar as diffusers opens one for a bare model (``tqdm.auto``)."""
    from tqdm.auto import tqdm

    return tqdm(total=total)


def outside_trace_and_capture() -> bool:
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


class CallProgress:
    """Counts ``blocks`` done during each call of ``model`` and shows them on a bar once ``show`` is called.

    Args:
        model: the module whose calls are watched (a compile wrapper's calls pass through it uncounted).
        blocks: the modules counted; the bar's total is their number.
        make_bar: opens the bar (``pipe.progress_bar`` for a pipeline, so its settings hold; ``tqdm_bar`` otherwise).
        on_call_end: called after each watched call; False stops watching (the hooks are taken out).
    """

    def __init__(self, model: nn.Module, blocks: list[nn.Module], make_bar: BarFactory,
                 on_call_end: Callable[[], bool]) -> None:
        self.model, self.make_bar, self.on_call_end = model, make_bar, on_call_end
        self._index = {id(b): i for i, b in enumerate(blocks)}
        self.done: set[int] = set()
        self.in_call = False
        self.bar: Any = None
        self._global: Any = None
        self._handles = [model.register_forward_pre_hook(self._start),
                         model.register_forward_hook(self._end, always_call=True)]

    @property
    def total(self) -> int:
        return len(self._index)

    def _start(self, module: nn.Module, args: tuple) -> None:
        if self.in_call or not outside_trace_and_capture():
            return
        self.in_call, self.done = True, set()
        self._global = register_module_forward_hook(self._block_done)

    def _block_done(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not outside_trace_and_capture():  # first: a trace must not see the block's identity (a graph per block)
            return
        i = self._index.get(id(module))
        if i is None or i in self.done:
            return
        self.done.add(i)
        if self.bar is not None:
            self.bar.update(1)

    def _end(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not self.in_call or not outside_trace_and_capture():
            return
        self._global.remove()
        self.in_call, self._global = False, None
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if not self.on_call_end():
            self.remove()

    def show(self, description: str) -> None:
        """Open the bar now (blocks done so far already counted) with ``description``; no-op outside a call or when
        it is open."""
        if not self.in_call or self.bar is not None:
            return
        self.bar = self.make_bar(self.total)
        if hasattr(self.bar, "unit"):
            self.bar.unit = "block"
        self.bar.set_description(description)
        if self.done:
            self.bar.update(len(self.done))

    def set_postfix(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(text)

    def remove(self) -> None:
        """Take every hook out (idempotent)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._global is not None:
            self._global.remove()
            self._global, self.in_call = None, False
