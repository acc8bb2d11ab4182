"""Per-instance swaps with undo: a module's own ``forward`` (under any diffusers hooks) and an attention's processor
(ground floor: imports only torch; the patches and the graph runner use them, docs/design.md §5).

Forwards: a diffusers ``HookRegistry`` captures the bound ``forward`` it finds when a hook is registered and writes
it back on removal; accelerate's ``add_hook_to_module`` keeps it as ``module._old_forward`` and calls that at every
call. Setting ``module.forward`` while hooks are registered would silently bypass them, and a class-level patch is
invisible once a hook captured the bound method. So the innermost captured forward is swapped instead.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def _innermost_ref(module: nn.Module):
    registry = getattr(module, "_diffusers_hook", None)
    fn_refs = getattr(registry, "_fn_refs", None)
    if not fn_refs:
        return None
    return fn_refs[0]


def _accelerate_wrapped(module: nn.Module) -> bool:
    """An accelerate hook wraps the module's forward, and no diffusers hook sits below it."""
    return "_hf_hook" in module.__dict__ and "_old_forward" in module.__dict__ and _innermost_ref(module) is None


def current_inner_forward(module: nn.Module) -> Callable:
    """The forward that does the module's own work: below every hook, else the instance/class forward."""
    ref = _innermost_ref(module)
    if ref is not None:
        return ref.original_forward if getattr(ref, "original_forward", None) is not None else ref.forward
    if _accelerate_wrapped(module):
        return module.__dict__["_old_forward"]
    return module.forward


def _set_inner_forward(module: nn.Module, fn: Callable) -> None:
    ref = _innermost_ref(module)
    if ref is not None:
        if getattr(ref, "original_forward", None) is not None:
            ref.original_forward = fn
        else:
            ref.forward = fn
    elif _accelerate_wrapped(module):
        module.__dict__["_old_forward"] = fn
    else:
        module.forward = fn


def swap_forward(module: nn.Module, new_forward: Callable) -> Callable[[], None]:
    """Install ``new_forward`` (already bound) as the module's own forward; returns an undo callable.

    The undo finds wherever the patched forward lives by then (hooks may have been added or removed meanwhile)
    and puts back the original object; with no hooks left, an instance attribute that was not there before is
    deleted so the class method shows through again.
    """
    original = current_inner_forward(module)
    had_instance_attr = "forward" in module.__dict__ and _innermost_ref(module) is None \
        and not _accelerate_wrapped(module)

    def undo() -> None:
        ref = _innermost_ref(module)
        if ref is not None:
            for attr in ("original_forward", "forward"):
                if getattr(ref, attr, None) is new_forward:
                    setattr(ref, attr, original)
        if module.__dict__.get("_old_forward") is new_forward:  # an accelerate hook added on top meanwhile
            module.__dict__["_old_forward"] = original
        if module.__dict__.get("forward") is new_forward:
            if had_instance_attr or ref is not None:
                module.forward = original
            else:
                del module.forward

    _set_inner_forward(module, new_forward)
    return undo


def swap_processor(attn: nn.Module, new_processor) -> Callable[[], None]:
    """Set ``attn.processor = new_processor``; the returned undo puts the original object back, but only while
    ``new_processor`` is still installed (a processor the user set in between is theirs and stays)."""
    original = attn.processor
    attn.processor = new_processor

    def undo() -> None:
        if attn.processor is new_processor:
            attn.processor = original

    return undo


def on_original(name: str) -> property:
    """A class attribute for a processor that stands in for another (``self._original``): ``name`` is read from and
    written to the original, so ``set_attention_backend`` / ``enable_parallelism`` while the stand-in is installed
    outlive its undo."""
    return property(lambda self: getattr(self._original, name, None),
                    lambda self, value: setattr(self._original, name, value))
