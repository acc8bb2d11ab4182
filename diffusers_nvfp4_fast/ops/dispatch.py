"""The one place that decides which implementation of an op runs: Triton kernel, cuBLASLt / FlashInfer or torch
reference.

Every op in this package is a ``torch.library`` op with a fake implementation (``define_op``), so
``torch.compile(fullgraph=True)`` traces it as one opaque node and CUDA graphs capture it. ``call_op`` runs the
implementation directly in eager mode (docs/design.md §8: the eager step is bound by host time) and the op under
compilation.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import logging
import re
import warnings
from collections.abc import Callable
from types import ModuleType

import torch
import torch.utils._pytree as pytree

from ..switches import CHECK_OPS, env_value
from ..switches import GEMM_BACKEND as GEMM_BACKEND_VAR

logger = logging.getLogger("diffusers_nvfp4_fast")


def _import_kernels() -> tuple[ModuleType | None, str]:
    """This package's kernels, or None and why not. Only a missing Triton is expected and silent: any other import
    failure (a checkout used without ``pip install -e .``, a Triton too old for a kernel) is warned with its error."""
    if importlib.util.find_spec("triton") is None:
        return None, "Triton is not installed (pip install triton)"
    try:
        from .. import kernels as module
    except Exception as e:  # noqa: BLE001 - any failure: the ops run their torch references, and the user is told why
        why = (f"diffusers_nvfp4_fast.kernels failed to import ({type(e).__name__}: {e}); is the package installed "
               "(pip install -e .)?")
        warnings.warn(f"diffusers-nvfp4-fast: {why} Every op runs its torch reference (same bytes, slower).",
                      stacklevel=2)
        return None, why
    return module, ""


kernels, KERNELS_UNAVAILABLE = _import_kernels()
GEMM_BACKENDS = ("flashinfer", "triton", "emulated", "cublaslt")
# The first FlashInfer release whose CUTLASS mm_fp4 serves each Blackwell family (docs/blackwell.md, "Versions").
FLASHINFER_MINIMUM = {10: "0.2.9", 11: "0.5.3", 12: "0.3.1"}
# The first CUDA whose cuBLASLt multiplies NVFP4 (block-scaled E2M1) operands; torch.version.cuda of the build.
CUBLASLT_CUDA_MINIMUM = (12, 8)
# The automatic order: cuBLASLt ships compiled inside torch, FlashInfer's CUTLASS GEMM needs nvcc (or its prebuilt
# cache) at the first call, so FlashInfer runs only when forced (docs/design.md §7, "Selection").
AUTOMATIC_BACKENDS = ("cublaslt", "triton")


class BackendUnavailableError(RuntimeError):
    """``DIFFUSERS_NVFP4_GEMM_BACKEND`` names a backend that cannot run here; the message says why."""


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _cuda_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of a CUDA device, cached; for a process whose kernels did not import (no Triton)."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


# (major, minor) of a CUDA device, cached because every NVFP4 call asks (docs/performance.md, host cost): one function
# for the kernels and the dispatch, the kernels' own where they imported (kernels/ cannot import the package).
cuda_capability: Callable[[torch.device], tuple[int, int]] = (
    kernels.launch.cuda_capability if kernels is not None else _cuda_capability)


def compiling_only() -> bool:
    """Whether a compile-only pass runs (``kernels/launch.compile_only``, preparation.py): kernel outputs then hold no
    values, so nothing may be learned from them (verdicts, launch plans, kernel-vs-torch checks)."""
    return kernels is not None and kernels.launch.compiling_only()


# Every op of this package lives in this library fragment. ``torch.library.custom_op`` would wrap each call of a
# compiled graph in a Python autograd layer and an aliasing check: 18 us of host time per call on an H200 host,
# against 6 for this registration (docs/performance.md, "Host time in compiled graphs").
_LIBRARY = torch.library.Library("nvfp4_fast", "FRAGMENT")
# switches.CHECK_OPS set (to 1) when the package is imported makes every op call through the dispatcher check that no
# output shares storage with an input, the one promise a plain registration does not check; the test suite sets it.


def define_op(name: str, impl: Callable, fake: Callable) -> torch._ops.OpOverload:
    """Register ``nvfp4_fast::<name>``: schema from ``impl``'s annotations (no argument mutated), ``impl`` for every
    device, ``fake`` (output shapes) for tracing. Returns the op. ``impl`` must return fresh tensors, never an input or
    a view of one: the graph treats the op as functional (``switches.CHECK_OPS`` checks it)."""
    _LIBRARY.define(name + torch.library.infer_schema(impl, mutates_args=()))
    kernel = _checking_outputs(name, impl) if env_value(CHECK_OPS) == "1" else impl
    _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"nvfp4_fast::{name}", fake, lib=_LIBRARY)
    return getattr(torch.ops.nvfp4_fast, name).default


def _tensors(values) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(values) if isinstance(t, torch.Tensor)]


def _checking_outputs(name: str, impl: Callable) -> Callable:
    def checked(*args):
        out = impl(*args)
        inputs = {t.untyped_storage().data_ptr() for t in _tensors(args) if t.numel()}
        shared = [i for i, t in enumerate(_tensors(out)) if t.numel() and t.untyped_storage().data_ptr() in inputs]
        if shared:
            raise RuntimeError(f"nvfp4_fast::{name}: output(s) {shared} share storage with an input; an op of this "
                               "package must return fresh tensors")
        return out

    return checked


def call_op(op: Callable, impl: Callable, *args):
    """Run custom op ``op`` whose eager implementation is ``impl``: the op while compiling, ``impl`` otherwise.

    Both run the same code, so the bytes are the same; the eager shortcut saves the dispatcher's microseconds.
    """
    if torch.compiler.is_compiling():
        return op(*args)
    return impl(*args)


def gemm_device_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of the CUDA device a GEMM on ``device`` runs on; None for any other device.

    The one place the GEMM dispatch asks which GPU it is on. The Blackwell contract test replaces it to run the
    FlashInfer / cuBLASLt call path on CPU tensors (tests/test_blackwell_contract.py); nothing else does.
    """
    return cuda_capability(device) if device.type == "cuda" else None


def triton_runs_on(x: torch.Tensor) -> bool:
    """True where the Triton kernels run for ``x``: a CUDA tensor on SM80 or newer, with Triton installed."""
    return x.is_cuda and kernels is not None and cuda_capability(x.device) >= (8, 0)


@functools.cache
def flashinfer() -> ModuleType | None:
    """The ``flashinfer`` module, or None where it is not installed."""
    try:
        import flashinfer as module
    except ImportError:
        return None
    return module


def _release(version: str) -> tuple[int, ...]:
    """'0.7.2.post1' -> (0, 7, 2): the numeric release part, enough to compare with ``FLASHINFER_MINIMUM``."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in match.group().split(".")) if match else ()


def flashinfer_problem(major: int, minor: int) -> str | None:
    """Why FlashInfer's CUTLASS FP4 GEMM cannot serve an SM{major}{minor} GPU here, or None where it can."""
    module = flashinfer()
    if module is None:
        return "FlashInfer is not installed (pip install 'diffusers-nvfp4-fast[blackwell]')"
    needed = FLASHINFER_MINIMUM.get(major)
    if needed is None:
        return f"FlashInfer's CUTLASS FP4 GEMM serves SM100-SM121, this GPU is SM{major}{minor}"
    version = str(getattr(module, "__version__", "0"))
    if _release(version) < _release(needed):
        return (f"FlashInfer {version} predates {needed}, the first release whose CUTLASS FP4 GEMM runs on "
                f"SM{major}x (pip install -U 'flashinfer-python>={needed}')")
    return None


def _cuda_release(version: str | None) -> tuple[int, ...]:
    """torch.version.cuda '12.8' -> (12, 8); () for a build without CUDA (None)."""
    return _release(version) if version else ()


def cublaslt_problem() -> str | None:
    """Why torch's cuBLASLt NVFP4 GEMM (two-level scaled ``scaled_mm``) cannot run in this torch, or None where it can.

    It needs the two-level recipe in torch (``torch.nn.functional.scaled_mm`` with ``ScalingType`` and the FP4 dtype:
    every torch this project supports) and a torch built against CUDA 12.8 or newer, whose cuBLASLt first has block-
    scaled FP4 GEMMs (docs/blackwell.md, "Installing")."""
    functional = torch.nn.functional
    if not (hasattr(functional, "scaled_mm") and hasattr(functional, "ScalingType")
            and hasattr(torch, "float4_e2m1fn_x2")):
        return f"torch {torch.__version__} has no two-level NVFP4 torch.nn.functional.scaled_mm"
    cuda = torch.version.cuda
    if _cuda_release(cuda) < CUBLASLT_CUDA_MINIMUM:
        built = f"built with CUDA {cuda}" if cuda else "not built with CUDA"
        return (f"torch {torch.__version__} is {built}; cuBLASLt's FP4 GEMM needs a torch built with CUDA "
                f">= {'.'.join(map(str, CUBLASLT_CUDA_MINIMUM))}")
    return None


def flashinfer_prebuilt() -> str | None:
    """The installed ``flashinfer-jit-cache`` version (FlashInfer's prebuilt kernels, its CUTLASS FP4 GEMM among
    them), or None: then FlashInfer compiles that GEMM with nvcc at its first call."""
    try:
        return importlib.metadata.version("flashinfer-jit-cache")
    except importlib.metadata.PackageNotFoundError:
        return None


def forced_gemm_backend() -> str | None:
    """The backend ``DIFFUSERS_NVFP4_GEMM_BACKEND`` names, or None when it is unset."""
    forced = env_value(GEMM_BACKEND_VAR)  # every NVFP4 layer call asks: os.environ.get costs more when unset
    if not forced:
        return None
    forced = forced.strip().lower()
    if forced not in GEMM_BACKENDS:
        raise ValueError(f"{GEMM_BACKEND_VAR}={forced!r}: expected one of {', '.join(GEMM_BACKENDS)}")
    return forced


def _why_not(backend: str, device: torch.device) -> str | None:
    """Why ``backend`` cannot run on ``device``, or None where it can."""
    if backend == "emulated":
        return None
    capability = gemm_device_capability(device)
    if capability is None or (backend == "triton" and device.type != "cuda"):
        return f"the tensors are on {device.type}, and {backend} runs on CUDA GPUs only"
    major, minor = capability
    if backend in ("flashinfer", "cublaslt"):
        if major < 10:
            return f"the FP4 tensor-core GEMM ({backend}) needs SM100 or newer, this GPU is SM{major}{minor}"
        return flashinfer_problem(major, minor) if backend == "flashinfer" else cublaslt_problem()
    if kernels is None:
        return KERNELS_UNAVAILABLE
    if not 8 <= major < 10:
        return f"the Triton GEMM runs on SM80-SM90, this GPU is SM{major}{minor}"
    return None


@functools.cache
def _automatic_backend(device_type: str, index: int | None) -> str:
    device = torch.device(device_type, index) if index is not None else torch.device(device_type)
    for backend in AUTOMATIC_BACKENDS:
        if _why_not(backend, device) is None:
            return backend
    capability = gemm_device_capability(device)
    if capability is not None and capability[0] >= 10:  # cached: said once per device
        logger.warning(
            "NVFP4 GEMMs on this SM%d%d GPU run in the exact but slow torch emulation: %s. Install a torch built with "
            "CUDA >= 12.8, or set %s=flashinfer (docs/blackwell.md).", *capability, _why_not("cublaslt", device),
            GEMM_BACKEND_VAR)
    return "emulated"


def _chosen_because(backend: str) -> str:
    """Why the automatic choice is ``backend``, in the words ``selftest`` prints."""
    if backend == "cublaslt":
        return (f"cuBLASLt's NVFP4 GEMM through torch {torch.__version__} (CUDA {torch.version.cuda}): ships "
                f"compiled, no nvcc needed; the automatic choice on SM100+ whatever else is installed (FlashInfer "
                f"only with {GEMM_BACKEND_VAR}=flashinfer)")
    return "the exact W4A4 Triton / Gluon kernels of SM80-SM90 (compiled by Triton at first use, no nvcc needed)"


def _forced_because(backend: str) -> str:
    if backend != "flashinfer":
        return f"forced by {GEMM_BACKEND_VAR}"
    prebuilt = flashinfer_prebuilt()
    how = (f"its prebuilt kernels are installed (flashinfer-jit-cache {prebuilt}), no nvcc needed" if prebuilt
           else "no flashinfer-jit-cache installed: its CUTLASS FP4 GEMM compiles with nvcc at the first call")
    return f"forced by {GEMM_BACKEND_VAR}; {how}"


def backend_choice(device: torch.device) -> tuple[str, str]:
    """(the GEMM backend for ``device``, why it was chosen): what ``diffusers-nvfp4-fast selftest`` reports."""
    backend = gemm_backend(device)
    if forced_gemm_backend() is not None:
        return backend, _forced_because(backend)
    if backend != "emulated":
        return backend, _chosen_because(backend)
    reasons = {b: _why_not(b, device) for b in AUTOMATIC_BACKENDS}
    return backend, "; ".join(f"not {b}: {why}" for b, why in reasons.items())


def reset_backend_choice() -> None:
    """Forget the cached automatic choice and the cached ``flashinfer`` import (tests that install a stand-in)."""
    _automatic_backend.cache_clear()
    flashinfer.cache_clear()


def gemm_backend(device: torch.device) -> str:
    """The GEMM backend for tensors on ``device``: 'cublaslt' (SM100+, torch's cuBLASLt NVFP4 GEMM), 'triton'
    (SM80-SM90) or 'emulated' (torch); 'flashinfer' (SM100+, FlashInfer's CUTLASS ``mm_fp4``) only when forced.

    ``DIFFUSERS_NVFP4_GEMM_BACKEND`` forces one; a forced backend that cannot run here raises
    ``BackendUnavailableError`` naming the variable, the backend and the reason. The automatic choice is cached per
    device: every NVFP4 layer call asks.
    """
    forced = forced_gemm_backend()
    if forced is None:
        return _automatic_backend(device.type, device.index)
    reason = _why_not(forced, device)
    if reason is not None:
        raise BackendUnavailableError(f"{GEMM_BACKEND_VAR}={forced} cannot run here: {reason}")
    return forced
