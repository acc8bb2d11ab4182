"""One declaration per fused op feeds every registry: its forms, its custom op, its selftest probe, its kernel builds.

A fused op file writes, per form (the packed result, and where the SM80-SM90 GEMM multiplies decoded FP16 values, the
decoded form), its torch reference (typed: the one place its signature is written, read for the custom op's schema),
its kernel call and its fake (the output shapes) as one ``Form(...)``; then one ``FusedOp(...)`` groups the forms with
a probe-input builder (real FLUX.2-dev / Qwen-Image widths, small ones for CPU tests) and what keeps the op off a GPU.
``ops/registry.py`` lists the op files; the selftest, the ahead-of-time kernel builds
(``tests/support/sass_count.py``) and ``tests/test_fused_registry.py`` iterate that list (docs/design.md §2).

Only ``nvfp4_fast::<form>_checked`` is registered with torch: production calls ``form.checked(site, *args)`` (first-use
byte verification against the reference, ``verify.run_checked``), traced by ``torch.compile(fullgraph=True)`` as one
node (docs/design.md §1, §8). ``form(*args)`` is a plain function (tests, benchmarks, the selftest). The verification
key of a call is derived from its own arguments (``verification_key``), never built by the caller.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, NamedTuple, cast

import torch

from .. import caches
from . import dispatch
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


@dataclass(frozen=True)
class AotKernel:
    """A Triton kernel as the ahead-of-time builds compile it without a GPU (``tests/support/sass_count.py``): the
    build's name, the kernel's module in ``kernels/`` and its name there, and the types Triton specializes its
    arguments that are not constexprs to at run time."""

    name: str
    module: str
    kernel: str
    signature: Mapping[str, str] = field(hash=False)


class Form:
    """One form of a fused op: ``form(*args)`` runs the kernel where ``runs(args[0])`` holds, else the reference;
    ``form.checked(site, *args)`` verifies that against the reference at first use, counted under ``site``.

    name: the custom op is ``nvfp4_fast::<name>_checked``; reference: the unfused torch computation, typed (its
    signature is the op's schema); kernel: ``kernel(kernels, *args)`` calls the kernel with the reference's arguments;
    fake: the outputs' shapes (uninitialised tensors) for the same arguments; outputs: the output names a mismatch
    warning shows; runs: whether the kernel runs for the first argument (default: where Triton runs for it); aot: the
    kernel's ahead-of-time build. ``reference``, ``kernel`` and ``fake`` return the same structure (one tensor or a
    tuple). The custom op calls ``self.impl`` at run time, so a test may replace it on the instance.
    """

    def __init__(self, name: str, reference: Callable[..., Any], kernel: Callable[..., Any], fake: Callable[..., Any],
                 outputs: tuple[str, ...], *, runs: Callable[[torch.Tensor], bool] = dispatch.triton_runs_on,
                 aot: AotKernel | None = None) -> None:
        self.name, self.reference, self.kernel, self.fake, self.outputs = name, reference, kernel, fake, outputs
        self.runs, self.aot = runs, aot
        self.impl: Callable[..., Any] = self.kernel_or_reference
        signature = inspect.signature(reference, eval_str=True)

        def checked_impl(*args):
            return self._run_checked(Site(args[-2], args[-1]), args[:-2])

        checked_impl.__signature__ = signature.replace(  # type: ignore[attr-defined]  # read by infer_schema
            parameters=[*signature.parameters.values(), *_CHECKED_PARAMETERS])
        self._checked_op = define_op(f"{name}_checked", checked_impl, lambda *args: self.fake(*args[:-2]))
        self._checked_impl = checked_impl

    def kernel_or_reference(self, *args: Any) -> Any:
        """The kernel where it runs for these arguments, else the reference (the same bytes, GPU-tested)."""
        if self.runs(args[0]):
            return self.kernel(cast(ModuleType, dispatch.kernels), *args)
        return self.reference(*args)

    def _run_checked(self, site: Site, args: tuple) -> Any:
        out = run_checked(
            site, call_class(self.name, args), self.outputs,
            lambda: _as_tuple(self.impl(*args)), lambda: _as_tuple(self.reference(*args)),
        )
        return out[0] if len(self.outputs) == 1 else out

    def __call__(self, *args: Any) -> Any:
        """The form without verification: a plain function (not a custom op; production calls ``checked``)."""
        return self.impl(*args)

    def checked(self, site: Site, *args: Any) -> Any:
        """The form with first-use byte verification, counted under ``site`` (``verify.run_checked``)."""
        return call_op(self._checked_op, self._checked_impl, *args, site.stats_id, site.kind)


@dataclass
class Probe:
    """What a probe-input builder draws from: random BF16 tensors on ``device`` from ``gen``, the recipe, and the
    sizes (``pick(full, small)``: the real FLUX.2-dev / Qwen-Image width for the selftest and GPU tests, a small one
    for CPU tests under the Triton interpreter)."""

    device: torch.device
    gen: torch.Generator
    fast_math: bool
    small: bool = False

    def pick(self, full: int, small: int) -> int:
        return small if self.small else full

    @property
    def rows(self) -> int:
        return self.pick(512, 16)

    def randn(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.gen, device=self.device) * scale).to(torch.bfloat16)

    def global_scale(self, *xs: torch.Tensor) -> torch.Tensor:
        """The FP32 one-element global scale ModelOpt would calibrate for these tensors (amax -> 448 * 6)."""
        amax = torch.stack([x.float().abs().amax() for x in xs]).amax()
        return (448.0 * 6.0 / amax).reshape(1)


class Case(NamedTuple):
    """One probe call: the check's title (e.g. "GELU quantize"), its shape label (e.g. "512x12288"), the arguments."""

    title: str
    shape: str
    args: tuple


@dataclass
class FusedOp:
    """A fused op declared once: its forms (``packed``; ``decoded``, the FP16 values of the packed result, where the
    SM80-SM90 GEMM multiplies those), ``probe`` (the selftest's calls, built from a ``Probe``) and ``unused_here``
    (why this GPU keeps the op's sites on diffusers' ops, e.g. a property checked before first use; None where it
    runs). Declaring one adds it to ``DECLARED``, which ``ops/registry.py`` gathers."""

    packed: Form
    probe: Callable[[Probe], list[Case]]
    decoded: Form | None = None
    unused_here: Callable[[torch.device], str | None] = lambda device: None

    def __post_init__(self) -> None:
        DECLARED.append(self)

    @property
    def forms(self) -> tuple[Form, ...]:
        return (self.packed,) if self.decoded is None else (self.packed, self.decoded)


DECLARED: list[FusedOp] = []
