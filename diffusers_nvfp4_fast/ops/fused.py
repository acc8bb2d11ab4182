"""One skeleton for every fused op: declared once, it gets its custom ops, its checked variant and its key.

A fused op file writes its torch reference, an implementation that calls the kernel where it runs (else the
reference), a fake (the output shapes) and one ``FusedOp(...)`` declaration. The declaration registers
``nvfp4_fast::<name>`` (the plain op) and ``nvfp4_fast::<name>_checked`` (the same op with first-use byte
verification against the reference, ``verify.run_checked``), both with the fake, so ``torch.compile(fullgraph=True)``
traces either as one node (docs/design.md §1, §8). The verification key of a call is derived from its own arguments
(``verification_key``), never built by the caller.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import caches
from .dispatch import call_op, define_op
from .site import Site
from .verify import run_checked

_CHECKED_PARAMETERS = (
    inspect.Parameter("stats_id", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=int),
    inspect.Parameter("kind", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str),
)


def _describe(arg: Any) -> str:
    """One argument's part of a verification key: a tensor's dtype, trailing width and strided-ness (the leading
    dimensions are rows, which a kernel treats alike), or a plain value as written."""
    if isinstance(arg, torch.Tensor):
        strided = "" if arg.is_contiguous() else ",strided"
        width = arg.shape[-1] if arg.dim() else "scalar"
        return f"{str(arg.dtype).removeprefix('torch.')}[{arg.dim()}d,{width}{strided}]"
    return repr(arg)


def verification_key(name: str, args: Sequence[Any]) -> str:
    """The class of calls one verification of op ``name`` stands for: the op, its arguments' dtypes, ranks, trailing
    widths and layouts, its plain arguments, and the device (e.g. ``swiglu_quantize(bfloat16[3d,128],None,...)``)."""
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    return f"{name}({','.join(_describe(a) for a in args)})@{device}"


# verification_key by the facts it is made of, as a tuple (every checked call asks; the string costs 1.7x the host
# time). A float is keyed by its bits (0.0 and -0.0 print differently), a plain value by its type too.
_KEYS: dict[tuple, str] = caches.register("ops.fused.verification_keys", {}, "emptied past _KEYS_LIMIT entries")
_KEYS_LIMIT = 4096


def call_class(name: str, args: Sequence[Any]) -> str:
    """``verification_key(name, args)``, remembered by a tuple of the facts it depends on."""
    facts = (name, next((a.device for a in args if isinstance(a, torch.Tensor)), None),
             *[(a.dtype, a.dim(), a.shape[-1] if a.dim() else None, a.is_contiguous()) if isinstance(a, torch.Tensor)
               else (type(a), a.hex() if type(a) is float else a) for a in args])
    try:
        key = _KEYS.get(facts)
    except TypeError:  # an unhashable plain argument
        return verification_key(name, args)
    if key is None:
        if len(_KEYS) >= _KEYS_LIMIT:
            _KEYS.clear()
        key = _KEYS[facts] = verification_key(name, args)
    return key


def _as_tuple(out: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


class FusedOp:
    """A fused op: ``op(*args)`` runs ``impl``, ``op.checked(site, *args)`` verifies it against ``reference``.

    name: the custom op's name (``nvfp4_fast::<name>``); impl: the typed implementation (kernel where it runs, else
    the reference); reference: the unfused torch computation, same arguments and outputs; fake: the outputs' shapes
    (uninitialised tensors); outputs: the output names a mismatch warning shows. ``impl``'s annotations define the
    schema; ``reference``, ``fake`` and ``impl`` return the same structure (one tensor or a tuple). Both custom ops
    call ``self.impl`` at run time, so a test may replace it on the instance.
    """

    def __init__(self, name: str, impl: Callable[..., Any], reference: Callable[..., Any], fake: Callable[..., Any],
                 outputs: tuple[str, ...]) -> None:
        self.name, self.impl, self.reference, self.fake, self.outputs = name, impl, reference, fake, outputs
        signature = inspect.signature(impl, eval_str=True)

        def plain_impl(*args):
            return self.impl(*args)

        def checked_impl(*args):
            return self._run_checked(Site(args[-2], args[-1]), args[:-2])

        plain_impl.__signature__ = signature  # type: ignore[attr-defined]  # read by infer_schema
        checked_impl.__signature__ = signature.replace(  # type: ignore[attr-defined]  # (as above)
            parameters=[*signature.parameters.values(), *_CHECKED_PARAMETERS])
        self._op = define_op(name, plain_impl, lambda *args: self.fake(*args))
        self._checked_op = define_op(f"{name}_checked", checked_impl, lambda *args: self.fake(*args[:-2]))
        self._checked_impl = checked_impl

    def _run_checked(self, site: Site, args: tuple) -> Any:
        out = run_checked(
            site, call_class(self.name, args), self.outputs,
            lambda: _as_tuple(self.impl(*args)), lambda: _as_tuple(self.reference(*args)),
        )
        return out[0] if len(self.outputs) == 1 else out

    def __call__(self, *args: Any) -> Any:
        """The op without verification (the custom op under compilation, ``impl`` directly in eager mode)."""
        return call_op(self._op, self.impl, *args)

    def checked(self, site: Site, *args: Any) -> Any:
        """The op with first-use byte verification, counted under ``site`` (``verify.run_checked``)."""
        return call_op(self._checked_op, self._checked_impl, *args, site.stats_id, site.kind)
