"""Every private Triton and torch internal the kernel launch path reads, behind named functions (docs/design.md §2).

The rest of ``kernels/`` calls these and touches no private name (tests/test_layering.py greps for them); what each
function reads of the installed Triton is checked against that Triton's real objects, on the CPU, by
tests/test_triton_compat.py. Read against Triton 3.6 (torch 2.11's) and 3.8; pyproject admits Triton < 3.10.

What is read, and where Triton keeps it:

* the binder: ``JITFunction.device_caches[device][-1]``, returning (bound arguments, specialization, options);
* ``CompiledKernel.run`` / ``.function`` / ``.packed_metadata`` and the argument order ``JITFunction.run`` gives
  ``CompiledKernel.run`` (``run_compiled``);
* Triton 3.6's per-kernel C launcher (``driver._BASE_ARGS_FORMAT``, ``CudaLauncher``'s attributes, the closure cells
  of ``wrap_handle_tensordesc``'s wrapper, ``CudaUtils.fill_tma_descriptor``, ``TMA_DTYPE_DEVICE_TO_HOST``):
  ``direct_launch``, ``DirectLaunch``, ``DescriptorEncoding``;
* a Gluon ``TensorDescriptor``'s instance dictionary (``descriptor_fields``, ``descriptor_over``) and an
  ``NVMMASharedLayout`` whose repr is computed once (``layout_with_fixed_repr``);
* ``torch._C._cuda_getCurrentRawStream`` (``raw_stream_getter``, bound by ``current_raw_stream``);
* Triton's specialization rules (``specialization_key``, checked against ``native_specialize_impl``);
* the compilation listener ``knobs.compilation.listener`` and the cache directory ``knobs.cache.dir``
  (``add_compile_listener``, ``triton_cache_dir``);
* ``JITCallable.cache_key`` and the functions a kernel calls (``settle_cache_keys``);
* the JIT cache hook ``knobs.runtime.jit_cache_hook``, Triton's serialized specialization (``preload``'s format) and
  ``ASTSource`` / ``GluonASTSource`` (``capture_specialization``, ``compile_specialization``);
* ``runtime.cache.triton_key`` and the backend's ``hash`` (``compute_cache_key_parts``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import CodeType, ModuleType
from typing import Any

import torch

try:
    from triton import knobs
except ImportError:  # Triton < 3.4 keeps its hooks elsewhere: every launch then takes Triton's own path
    knobs = None

# The @triton.jit decorator picks the interpreter when the module is imported with TRITON_INTERPRET set, so reading
# the variable once, at import, agrees with what Triton runs (and saves an environment read per launch).
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def raw_stream_getter() -> Callable[[int], int]:
    """torch's getter of the CUDA stream handle launches go to (torch.cuda.current_stream() builds an object per
    call)."""
    return torch._C._cuda_getCurrentRawStream


def _bind_raw_stream(device: int) -> int:
    """``current_raw_stream``'s first call binds it to torch's getter: nothing in ``kernels/`` touches torch at
    import, so a compile worker (``compile_workers.py``) never loads it."""
    global current_raw_stream
    current_raw_stream = raw_stream_getter()
    return current_raw_stream(device)


current_raw_stream: Callable[[int], int] = _bind_raw_stream


def settle_cache_keys(module_prefix: str) -> None:
    """Compute the ``cache_key`` of every JIT function in the loaded modules under ``module_prefix``, each after those
    of the JIT functions it calls.

    Triton 3.6 folds a callee's global constants into its caller's key before it computes the callee's own key, so a
    caller hashed before its callee gets another key than one hashed after: a process that hashes in another order
    (a compile-only pass against a first call) misses every binary in Triton's cache (docs/design.md, "One cache
    key per kernel")."""
    from triton.runtime import jit

    callable_type = getattr(jit, "JITCallable", jit.JITFunction)
    done: set[int] = set()

    def settle(fn: Any) -> None:
        if id(fn) in done:
            return
        done.add(id(fn))
        for callee in _callees(fn, callable_type):
            settle(callee)
        try:
            fn.cache_key  # noqa: B018  (computed once, then kept by Triton)
        except Exception:  # noqa: BLE001  (the kernel then fails in its own compile, where it is used)
            pass

    for name, module in sorted(sys.modules.items()):
        if module is not None and (name == module_prefix or name.startswith(module_prefix + ".")):
            for value in list(vars(module).values()):
                if isinstance(value, callable_type) and getattr(value, "__module__", None) == name:
                    settle(value)


def _callees(fn: Any, callable_type: type) -> list:
    """The JIT functions ``fn``'s source names: globals, and attributes of global modules."""
    code = getattr(getattr(fn, "fn", None), "__code__", None)
    names, found = _code_names(code) if code is not None else [], []
    scope = getattr(fn, "__globals__", {})
    for name in names:
        value = scope.get(name)
        if isinstance(value, ModuleType):
            found += [getattr(value, other, None) for other in names]
        else:
            found.append(value)
    return [value for value in found if isinstance(value, callable_type) and value is not fn]


def _code_names(code: CodeType) -> list[str]:
    """The global and attribute names a code object and the code objects nested in it read."""
    return [*code.co_names, *(name for const in code.co_consts if isinstance(const, CodeType)
                              for name in _code_names(const))]


def hooks_installed() -> bool:
    """Whether a launch hook (a profiler such as proton) is registered: then every launch takes Triton's path."""
    if knobs is None:
        return True
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


# The binder and the compiled kernel, as JITFunction.run uses them.


def has_binder(kernel, device: int) -> bool:
    """Whether Triton has built ``kernel``'s binder for ``device`` (it does at the kernel's first launch there)."""
    return kernel.device_caches.get(device) is not None


def make_binder(kernel, device: int) -> None:
    """Have Triton build ``kernel``'s binder for ``device`` now (its first launch would), on the calling thread: the
    kernel's caches then exist before compiles of its specializations run on other threads."""
    kernel.device_caches[device]  # noqa: B018 (a defaultdict: reading the entry builds it)


def bind(kernel, device: int, args: tuple, kwargs: dict) -> tuple[dict, list]:
    """(every parameter's value by name in signature order, Triton's specialization of the call) from ``kernel``'s
    binder on ``device``. TypeError where the binder rejects the call (another binder signature)."""
    bound, specialization, _ = kernel.device_caches[device][-1](*args, **kwargs)
    return bound, specialization


def run_compiled(compiled, grid: tuple[int, ...], stream: int, values: tuple) -> None:
    """``compiled`` launched as ``JITFunction.run`` launches it, without launch metadata or hooks."""
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream, compiled.function,
                 compiled.packed_metadata, None, None, None, *values)


def load_binary(compiled) -> bool:
    """Load ``compiled``'s binary onto the device now (``CompiledKernel.run`` loads it on first access), so that a
    direct launch never does; False for an object that is not a CompiledKernel this module knows."""
    if not hasattr(compiled, "packed_metadata"):
        return False
    compiled.run  # noqa: B018 (the property loads the binary)
    return True


# Triton's specialization rules (Triton 3.6 - 3.8, runtime/jit.py create_function_from_signature and the native
# specialize_impl): a tensor by its dtype and 16-byte alignment, an integer by == 1, divisibility by 16 and its
# 32/64-bit range, a tensor descriptor by its dtype, block shape and layout, a constexpr by its value.

def specialization_key(args: tuple, kwargs: dict) -> tuple:
    """A hashable key of a launch that determines everything Triton specializes it on, built by Triton's rules from
    the arguments themselves (finer where that is cheaper: an integer by its value, a descriptor with its shape and
    strides). Positional arguments are the runtime ones; ``kwargs`` (constexprs and launch options) enter by value,
    in the caller's order, so a call site passes them in one order with one type each."""
    tensor = torch.Tensor  # read per call, not at import (a compile worker loads no torch)
    return (*[(a.dtype, not a.data_ptr() & 15) if a.__class__ is tensor else a if a.__class__ is int
              else _other_key(a) for a in args], *kwargs.values())


def _other_key(arg) -> object:
    if isinstance(arg, torch.Tensor):  # a subclass (nn.Parameter)
        return arg.dtype, not arg.data_ptr() & 15
    base = getattr(arg, "base", None)
    if isinstance(base, torch.Tensor) and hasattr(arg, "block_shape"):  # a tensor descriptor
        return (base.dtype, not base.data_ptr() & 15, tuple(arg.shape), tuple(arg.strides), tuple(arg.block_shape),
                repr(arg.layout), arg.padding)
    return arg.__class__, arg  # a bool, float or None: its type too (True == 1 == 1.0 in a tuple)


# Triton 3.6's per-kernel C launcher.


class DirectLaunch:
    """A compiled binary launched through Triton's C launcher itself, past ``CudaLauncher.__call__`` and its
    tensor-descriptor wrapper (Python that every launch pays: two scratch-allocation closures, a list rebuilt per
    call, a ``cuTensorMapEncodeTiled`` per descriptor argument). ``run`` takes the arguments in the C launcher's
    order, which is the kernel's parameter order (constexprs included): pointers as tensors or plain integers (device
    addresses), each tensor-descriptor argument expanded as ``DescriptorEncoding.arguments`` gives it.

    ``descriptor_meta`` holds, per tensor-descriptor parameter, the metadata Triton compiled it with (None for a
    kernel without any). docs/performance.md ("Host time per call") says what it saves and how it is checked.
    """

    __slots__ = ("launch", "function", "metadata", "cooperative", "pdl", "descriptor_meta")

    def __init__(self, launch, function: int, metadata: tuple, cooperative: bool, pdl: bool,
                 descriptor_meta: list | None) -> None:
        self.launch, self.function, self.metadata = launch, function, metadata
        self.cooperative, self.pdl, self.descriptor_meta = cooperative, pdl, descriptor_meta

    def run(self, grid: tuple[int, ...], stream: int, *arguments) -> None:
        """One launch on ``stream`` (a raw CUDA stream handle) with a 1-, 2- or 3-D ``grid``."""
        self.launch(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream, self.function,
                    self.cooperative, self.pdl, None, None, self.metadata, None, None, None, *arguments)


def _driver_module():
    try:
        from triton.backends.nvidia import driver
    except ImportError:
        return None
    return driver


# The C launcher's leading arguments in the Triton releases this reads (3.6: grid x/y/z, stream, function,
# cooperative, pdl, two scratch buffers, kernel metadata, launch metadata, two hooks); another layout keeps
# Triton's own launch path.
LAUNCHER_HEAD = "iiiKKppOOOOOO"
# What direct_launch and DescriptorEncoding read of Triton 3.6's NVIDIA driver module besides the head: attributes
# CudaLauncher.__init__ sets, the closure of wrap_handle_tensordesc's wrapper, the TMA encoder CudaUtils.__init__ sets.
LAUNCHER_ATTRIBUTES = frozenset(("launch", "global_scratch_size", "profile_scratch_size", "launch_cooperative_grid",
                                 "launch_pdl"))
WRAPPER_CLOSURE = frozenset(("launcher", "tensordesc_meta"))
DESCRIPTOR_KEYS = frozenset(("swizzle", "elem_size", "elem_type", "block_size", "fp4_padded"))


def launcher_head() -> str | None:
    """The installed NVIDIA driver's C-launcher argument head (``_BASE_ARGS_FORMAT``), None where it has none."""
    driver = _driver_module()
    return None if driver is None else getattr(driver, "_BASE_ARGS_FORMAT", None)


def direct_launch_unavailable() -> str | None:
    """Why the installed Triton's binaries cannot be launched through its C launcher directly (None: they can).
    Then every launch goes through ``CompiledKernel.run`` (same binaries, same bytes, more host time per call)."""
    if INTERPRETING:
        return "the Triton interpreter runs the kernels (TRITON_INTERPRET)"
    driver = _driver_module()
    if driver is None:
        return "this Triton has no NVIDIA driver module (triton.backends.nvidia.driver)"
    import triton

    version = getattr(triton, "__version__", "?")
    head = launcher_head()
    if head is None:  # Triton 3.7 - 3.9: one C launch function for all kernels, arguments passed as one tuple
        return (f"Triton {version}'s C launcher takes the kernel arguments as one tuple with their annotations "
                "(no _BASE_ARGS_FORMAT); only Triton 3.6's per-kernel launcher is launched directly")
    if head != LAUNCHER_HEAD:
        return f"Triton {version}'s C launcher starts with {head!r}, not Triton 3.6's {LAUNCHER_HEAD!r}"
    missing = sorted(_missing_launcher_parts(driver))
    return f"Triton {version}'s NVIDIA driver module lacks {', '.join(missing)}" if missing else None


def _missing_launcher_parts(driver) -> set[str]:
    launcher_cls, wrap = getattr(driver, "CudaLauncher", None), getattr(driver, "wrap_handle_tensordesc", None)
    utils = getattr(driver, "CudaUtils", None)
    missing = {name for name, found in (("CudaLauncher", launcher_cls), ("wrap_handle_tensordesc", wrap),
                                        ("CudaUtils", utils)) if found is None}
    if not isinstance(getattr(driver, "TMA_DTYPE_DEVICE_TO_HOST", None), dict):
        missing.add("TMA_DTYPE_DEVICE_TO_HOST")
    if launcher_cls is not None:
        missing |= {f"CudaLauncher.{name}" for name in LAUNCHER_ATTRIBUTES - _names(launcher_cls.__init__)}
    if wrap is not None:
        inner = [c for c in wrap.__code__.co_consts if hasattr(c, "co_freevars")]
        freevars = set().union(*(c.co_freevars for c in inner))
        missing |= {f"wrap_handle_tensordesc's {name}" for name in WRAPPER_CLOSURE - freevars}
    if utils is not None and "fill_tma_descriptor" not in _names(utils.__init__):
        missing.add("CudaUtils.fill_tma_descriptor")
    return missing


def _names(function) -> set[str]:
    code = getattr(function, "__code__", None)
    return set(code.co_names) if code is not None else set()


def direct_launch(compiled) -> DirectLaunch | None:
    """``compiled``'s ``DirectLaunch``, or None where its launcher is not the one this module knows (another Triton
    layout, ``direct_launch_unavailable`` says why; scratch memory; the interpreter): then Triton's own path launches
    it. Callers check for launch hooks at every call."""
    if direct_launch_unavailable() is not None:
        return None
    driver = _driver_module()
    run = getattr(compiled, "run", None)
    if not isinstance(run, getattr(driver, "CudaLauncher", ())) or run.global_scratch_size or run.profile_scratch_size:
        return None
    launch, meta = run.launch, None
    if type(launch).__name__ != "builtin_function_or_method":  # the tensor-descriptor wrapper around the C function
        cells = dict(zip(launch.__code__.co_freevars, (c.cell_contents for c in launch.__closure__ or ())))
        launch, meta = cells.get("launcher"), cells.get("tensordesc_meta")
        if type(launch).__name__ != "builtin_function_or_method" or not meta or not all(
                isinstance(m, dict) and DESCRIPTOR_KEYS <= m.keys() for m in meta):
            return None
    return DirectLaunch(launch, compiled.function, compiled.packed_metadata, bool(run.launch_cooperative_grid),
                        bool(run.launch_pdl), meta)


class DescriptorEncoding:
    """How one tensor-descriptor argument of a ``DirectLaunch`` becomes the C launcher's arguments: a
    ``CUtensorMap`` encoded for the base address, then the shape and strides (Triton 3.6's ``make_tensordesc_arg``).
    Everything but the address is fixed by the call site (shape, strides, block, layout), so ``arguments(ptr)``
    encodes only the map."""

    __slots__ = ("fill", "swizzle", "elem_size", "elem_type", "block", "shape", "strides", "padding", "by_address")
    ADDRESSES = 16  # the caching allocator hands a call class the same few blocks again and again

    def __init__(self, descriptor, meta: dict) -> None:
        from triton.runtime import driver as runtime_driver

        nvidia = _driver_module()
        assert nvidia is not None  # direct_launch returned a launch, so Triton's NVIDIA driver module exists
        self.fill = runtime_driver.active.utils.fill_tma_descriptor
        shape = list(descriptor.shape)
        if meta["fp4_padded"]:
            shape[-1] *= 2
        self.swizzle, self.elem_size, self.block = meta["swizzle"], meta["elem_size"], meta["block_size"]
        self.elem_type = nvidia.TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]]
        self.shape, self.strides = shape, list(descriptor.strides)
        self.padding = 1 if descriptor.padding == "nan" else 0
        self.by_address: dict[int, tuple] = {}

    def arguments(self, address: int) -> tuple:
        """The C launcher's arguments for a descriptor with this encoding over ``address``: encoded once per address
        (the map depends on nothing else, and the launcher copies it into the kernel's parameters)."""
        known = self.by_address.get(address)
        if known is None:
            if len(self.by_address) >= self.ADDRESSES:
                self.by_address.clear()
            tensor_map = self.fill(address, self.swizzle, self.elem_size, self.elem_type, self.block, self.shape,
                                   self.strides, self.padding)
            known = self.by_address[address] = (tensor_map, *self.shape, *self.strides)
        return known


# Gluon descriptors and layouts built with less host work.


def descriptor_fields(descriptor) -> dict | None:
    """A Gluon ``TensorDescriptor``'s fields without its base tensor, for ``descriptor_over`` (None for a Triton whose
    descriptor has no instance dictionary: then every descriptor is built by ``from_tensor``)."""
    fields = getattr(descriptor, "__dict__", None)
    return None if fields is None else {**fields, "base": None}


def descriptor_over(descriptor_cls, fields: dict, base: torch.Tensor):
    """A ``descriptor_cls`` with ``fields`` (from ``descriptor_fields`` of one built and validated over a tensor of
    the same shape, strides and dtype) over ``base``, without the dataclass's checks (about 5 us per descriptor)."""
    descriptor = object.__new__(descriptor_cls)
    descriptor.__dict__.update(fields)
    descriptor.base = base
    return descriptor


@functools.cache
def _fixed_repr_class(layout_cls: type) -> type:
    class _ReprOnceLayout(layout_cls):  # type: ignore[misc, valid-type]
        def __repr__(self) -> str:
            return self.__dict__["repr_once"]

    return _ReprOnceLayout


def layout_with_fixed_repr(layout):
    """``layout`` (a frozen Gluon layout dataclass) with its repr computed now and kept: equal fields, equal text, an
    instance of its class. Triton's launcher takes the repr of each descriptor argument's layout on every launch (its
    specialization key): three dataclass reprs per SM90 GEMM, a few milliseconds of an eager Qwen-Image step."""
    fixed = copy.copy(layout)
    object.__setattr__(fixed, "__class__", _fixed_repr_class(type(layout)))
    fixed.__dict__["repr_once"] = repr(layout)
    return fixed


# Triton's compilation listener. triton.compile calls ``knobs.compilation.listener`` (when set) after every compile and
# every load from Triton's on-disk cache, with keyword arguments src, metadata, metadata_group, times (CompileTimes,
# microseconds) and cache_hit: read in Triton 3.6, 3.8 and 3.9 (knobs.py, compiler/compiler.py); Triton < 3.4 has no
# knobs. A kernel already loaded in this process launches without calling triton.compile, so without an event.


@dataclass(frozen=True)
class CompileEvent:
    """One ``triton.compile`` call: the kernel's name, the module of its Python function (None for IR sources),
    whether it was loaded from Triton's cache, the seconds ``triton.compile`` measured for it, and what Triton's cache
    key is made of (``specialization``: the function's ``cache_key``, argument types, constants and attributes by
    argument name; empty where the source does not say), which tells two processes' binaries of one kernel apart."""

    name: str
    module: str | None
    cache_hit: bool
    seconds: float
    specialization: dict = field(default_factory=dict)


def compile_listener_unavailable() -> str | None:
    """Why this Triton cannot report its compiles (None: it can)."""
    compilation = getattr(knobs, "compilation", None) if knobs is not None else None
    if compilation is None or not hasattr(compilation, "listener"):
        import triton

        return (f"Triton {getattr(triton, '__version__', '?')} has no compilation listener "
                "(triton.knobs.compilation.listener, Triton 3.4 and later)")
    return None


def _specialization(src) -> dict:
    """What ``ASTSource.hash`` (Triton 3.6-3.9) keys a binary by, with argument names for indices."""
    fn, names = getattr(src, "fn", None), getattr(getattr(src, "fn", None), "arg_names", None)
    if fn is None or not isinstance(names, list) or not isinstance(getattr(src, "constants", None), dict):
        return {}

    def named(index: Any) -> str:
        path = index if isinstance(index, tuple) else (index,)
        first = path[0] if path and isinstance(path[0], int) and path[0] < len(names) else None
        return ".".join([names[first] if first is not None else str(path[0]), *map(str, path[1:])]) if path else "?"

    return {"fn": str(getattr(fn, "cache_key", ""))[:16],
            "signature": {str(k): str(v) for k, v in dict(getattr(src, "signature", {}) or {}).items()},
            "constants": {named(k): repr(v) for k, v in src.constants.items()},
            "attrs": {named(k): repr(v) for k, v in dict(getattr(src, "attrs", {}) or {}).items()}}


def _event(src, metadata: dict, times, cache_hit: bool) -> CompileEvent:
    fn = getattr(src, "fn", None)
    name = getattr(src, "name", None) or metadata.get("name") or "?"
    total = getattr(times, "total", None)
    try:
        specialization = _specialization(src)
    except Exception:  # noqa: BLE001  (a report detail: never fails the compile it describes)
        specialization = {}
    return CompileEvent(str(name), getattr(fn, "__module__", None), bool(cache_hit),
                        total / 1e6 if isinstance(total, (int, float)) else 0.0, specialization)


def add_compile_listener(callback: Callable[[CompileEvent], None]) -> Callable[[], None]:
    """Call ``callback`` with a ``CompileEvent`` after each ``triton.compile`` in this process, after the listener
    that was installed before (the user's, which keeps working). Returns the function that takes ``callback`` out:
    the previous listener is put back where this one is still the installed one; where another listener was
    installed on top since, this one only stops calling ``callback``. RuntimeError where
    ``compile_listener_unavailable`` gives a reason."""
    why = compile_listener_unavailable()
    if why is not None:
        raise RuntimeError(why)
    previous = knobs.compilation.listener
    active = [True]

    def listener(*, src, metadata, metadata_group, times, cache_hit, **more) -> None:
        if previous is not None:
            previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit,
                     **more)
        if active[0]:
            callback(_event(src, metadata, times, cache_hit))

    knobs.compilation.listener = listener

    def remove() -> None:
        active[0] = False
        if knobs.compilation.listener is listener:
            knobs.compilation.listener = previous

    return remove


def triton_cache_dir() -> str:
    """The directory Triton keeps compiled kernels in (``TRITON_CACHE_DIR``, by default ~/.triton/cache)."""
    cache = getattr(knobs, "cache", None) if knobs is not None else None
    found = getattr(cache, "dir", None)
    if found:
        return str(found)
    return os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")


def compute_cache_key_parts(arch: int) -> None:
    """Compute what Triton computes once per process for every cache key, before the first compile or cache load can
    use it: Triton's own key (``runtime.cache.triton_key``: hashes of its compiler's sources and of its ~400 MB
    library, 0.3 s on one core) and the CUDA backend's for ``arch`` (``ptxas --version``). Both are cached pure
    functions, so a compile racing this one computes the same values (docs/design.md §8, "Triton's key ahead")."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.cache import triton_key

    triton_key()
    make_backend(GPUTarget("cuda", arch, 32)).hash()


# Triton's JIT cache hook (``knobs.runtime.jit_cache_hook``, Triton 3.6 - 3.9): ``JITFunction._do_compile`` calls it
# before it compiles a specialization, with the specialization in Triton's own JSON (``compile["specialization_data"]``,
# what ``JITFunction.preload`` reads) and the function as ``fn`` (a ``JitFunctionInfo``); a true return skips the
# compile. ``device_caches[device][2]`` is the target the binder was built for.

_CAPTURING = threading.local()
_HOOK_LOCK = threading.Lock()
_HOOK_STATE: dict[str, Any] = {"users": 0, "previous": None}


@dataclass(frozen=True)
class Specialization:
    """What a worker process needs to compile one binary of a kernel exactly as this process's JIT would: the
    kernel's module and name, Triton's serialized specialization, and the target (backend, arch, warp size)."""

    module: str
    kernel: str
    data: str
    target: dict


def capture_unavailable() -> str | None:
    """Why this Triton cannot hand a specialization to another process (None: it can)."""
    runtime = getattr(knobs, "runtime", None) if knobs is not None else None
    if runtime is None or not hasattr(runtime, "jit_cache_hook"):
        import triton

        return f"Triton {getattr(triton, '__version__', '?')} has no knobs.runtime.jit_cache_hook"
    return None


def _capturing_hook(**kwargs: Any) -> Any:
    if not getattr(_CAPTURING, "on", False):  # another thread's compile: the hook that was there before decides
        previous = _HOOK_STATE["previous"]
        return previous(**kwargs) if previous is not None else None
    info, compile_args = kwargs["fn"], kwargs["compile"]
    target = info.jit_function.device_caches[compile_args["device"]][2]
    _CAPTURING.found = Specialization(str(info.module), str(info.name), compile_args["specialization_data"],
                                      dict(vars(target)))
    return True


@contextlib.contextmanager
def _capturing_hook_installed() -> Iterator[None]:
    with _HOOK_LOCK:
        if _HOOK_STATE["users"] == 0:
            _HOOK_STATE["previous"] = knobs.runtime.jit_cache_hook
            knobs.runtime.jit_cache_hook = _capturing_hook
        _HOOK_STATE["users"] += 1
    try:
        yield
    finally:
        with _HOOK_LOCK:
            _HOOK_STATE["users"] -= 1
            if _HOOK_STATE["users"] == 0 and knobs.runtime.jit_cache_hook is _capturing_hook:
                knobs.runtime.jit_cache_hook = _HOOK_STATE["previous"]


def capture_specialization(run: Callable[[], Any]) -> Specialization | None:
    """Call ``run`` (a kernel's ``warmup``) with this thread's compiles skipped, and return the specialization of the
    binary it would have compiled; None where it compiled nothing (the binary was loaded in this process already).
    Other threads' compiles go on as before. RuntimeError where ``capture_unavailable`` gives a reason."""
    why = capture_unavailable()
    if why is not None:
        raise RuntimeError(why)
    with _capturing_hook_installed():
        _CAPTURING.on, _CAPTURING.found = True, None
        try:
            run()
        finally:
            _CAPTURING.on = False
        return _CAPTURING.found


def _decoded_constant(value: Any) -> Any:
    """One constant of Triton's serialized specialization, decoded as ``JITFunction.preload`` decodes it."""
    import triton.language as tl
    from triton.runtime import jit

    if tl.dtype.is_dtype(value):
        return tl.dtype(value)
    if isinstance(value, dict) and "constexpr" in value:
        return tl.constexpr(jit.convert_to_tuple_if_list(value["constexpr"]))
    if isinstance(value, dict) and "jit_function" in value:  # Triton 3.8: a JIT function passed as a constexpr
        registry = getattr(jit, "_triton_jit_function_registry", {})
        if value["jit_function"] not in registry:
            raise RuntimeError(f"cannot resolve the JIT function {value['jit_function']} of a specialization")
        return registry[value["jit_function"]]
    return jit.convert_to_tuple_if_list(value)


def compile_specialization(kernel: Any, spec: Specialization) -> Any:
    """Compile ``spec`` of ``kernel`` into Triton's cache without a GPU: the source, constants, attributes and options
    the capturing process's JIT would have compiled (decoded as ``JITFunction.preload`` decodes them), for its
    target, so under the same cache key. Returns the CompiledKernel."""
    import json

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime import jit

    data = json.loads(spec.data)
    constants = {tuple(k): _decoded_constant(v) for k, v in zip(data["constant_keys"], data["constant_vals"])}
    attrs = {tuple(k): v for k, v in zip(data["attrs_keys"], data["attrs_vals"])}
    signature = {k: jit.convert_to_tuple_if_list(v) for k, v in data["signature"].items()}
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in data["options"].items()}
    source_class = triton.compiler.ASTSource
    if getattr(kernel, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as source_class
    return triton.compile(source_class(kernel, signature, constants, attrs), target=GPUTarget(**spec.target),
                          options=options)
