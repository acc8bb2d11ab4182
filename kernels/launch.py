"""Launch helpers shared by the NVFP4-emitting kernels."""

import functools
import os

import torch

try:
    from triton import knobs
except ImportError:  # Triton < 3.4 keeps its hooks elsewhere: every launch then takes Triton's own path
    knobs = None

# The @triton.jit decorator picks the interpreter when the module is imported with TRITON_INTERPRET set, so reading
# the variable once, at import, agrees with what Triton runs (and saves an environment read per launch).
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host code. ``triton.cdiv`` is a constexpr function whose Python-side call costs a few
    microseconds (argument unwrapping); the launch wrappers call it hundreds of times per transformer block, which
    shows in eager steps that are bound by host time."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (n >= 1), like ``triton.next_power_of_2`` but a plain host function."""
    return 1 << (n - 1).bit_length()


def padded_scale_shape(m: int, k: int) -> tuple[int, int]:
    return (cdiv(m, 128) * 128, cdiv(k // 16, 4) * 4)


def tile_grid(m: int, padded_cols: int, block_r: int, block_c: int) -> tuple[tuple[int], int]:
    """1-D grid over (row tiles x 16-block tiles) covering the padded scale area (no 65,535 grid-dimension limit)."""
    col_tiles = cdiv(padded_cols, block_c)
    row_tiles = cdiv(cdiv(m, 128) * 128, block_r)
    return (row_tiles * col_tiles,), col_tiles


def as_block_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A 2-D bf16/fp16 matrix as int64 words (four values each) and its row stride in words.

    Rows may be strided; the last dimension must be contiguous and every row start 8-byte aligned, otherwise a
    contiguous copy is made.
    """
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"NVFP4 kernels take bfloat16/float16 input, got {x.dtype}")
    if x.shape[0] and (x.stride(-1) != 1 or x.stride(0) % 4 or x.data_ptr() % 8):
        x = x.contiguous()
    words = x.view(torch.int64)
    return words, words.stride(0)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of a CUDA device, cached (the wrappers ask on every call)."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached: GEMM launches ask on every call)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def hardware_e2m1(device: torch.device) -> bool:
    """cvt.rn.satfinite.e2m1x2.f32 exists from SM100 on (ptxas rejects it for SM90)."""
    if device.type != "cuda":
        return False
    return cuda_capability(device)[0] >= 10


# Programmatic dependent launch (docs/performance.md, "Kernel boundaries"): DIFFUSERS_NVFP4_PDL=0 turns it off. Read
# once, at import, like TRITON_INTERPRET: the binaries compiled with it carry the launch attribute.
PDL = os.environ.get("DIFFUSERS_NVFP4_PDL", "1").strip() not in ("0", "")


def pdl_options(device: torch.device) -> dict:
    """The launch keywords of a kernel that starts with ``grid_dependency.wait_for_prior_grids(PDL)``: on SM90 and
    newer it is launched with the programmatic-serialization attribute, so that its CTAs are placed while the kernel
    before it finishes, and waits for that kernel's memory before touching any (the same bytes as a plain launch)."""
    if INTERPRETING:
        return {"PDL": False}
    on = PDL and device.type == "cuda" and cuda_capability(device)[0] >= 9
    return {"PDL": on, "launch_pdl": on}


def launch_options(device: torch.device, fast_math: bool, num_warps: int = 4) -> dict:
    # No FMA contraction: every rounding step must happen exactly where the spec puts it.
    return {"FAST_MATH": bool(fast_math), "HW_E2M1": hardware_e2m1(device), "enable_fp_fusion": False,
            "num_warps": num_warps}


_COMPILED: dict = {}


def hooks_installed() -> bool:
    """Whether a launch hook (a profiler such as proton) is registered: then every launch takes Triton's path."""
    if knobs is None:
        return True
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def launch(kernel, grid: tuple[int, ...], *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)`` for a ``@triton.jit`` kernel, with less host work per call.

    Triton's launch path costs 22 us (9 runtime arguments) to 40 us (24) of host time per call on the H200
    machine's CPU, against 18 and 23 us here (benchmarks/studies/results/launch_overhead-h200.json), and an eager
    Qwen-Image step, which launches a few thousand kernels, is bound by host time. Triton's own binder still
    decides which binary runs (the argument specialization: dtypes, 16-byte alignment, integers equal to 1 or
    divisible by 16); the binary compiled for that specialization is then launched directly, without the per-call
    bookkeeping of ``JITFunction.run`` (launch-metadata objects, hook chains, environment reads, the check that no
    global changed since compilation, which the constants of these kernels never do). Same binary, same
    arguments: same bytes.

    Triton's full path runs for the first call of each specialization (it compiles and returns the binary), under
    the interpreter, while a launch hook is installed, and when the binder rejects the call (a Triton whose
    ``device_caches`` entries are laid out differently). Triton's debug and instrumentation settings (environment
    knobs) are taken when a specialization is first launched, not re-read per call.
    """
    _launch(kernel, grid, args, kwargs)


def _launch(kernel, grid, args, kwargs) -> tuple:
    """``launch``; returns (binary, every parameter's value in signature order) when the binary was launched directly,
    else (None, None)."""
    if INTERPRETING:
        kernel[grid](*args, **kwargs)
        return None, None
    device = torch.cuda.current_device()
    caches = kernel.device_caches.get(device)
    if caches is None or hooks_installed():
        _compile_and_launch(kernel, grid, device, None, args, kwargs)
        return None, None
    try:
        bound, key = binder_key(kernel, device, args, kwargs)
        kernel_of_entry, compiled = _COMPILED.get(key, (None, None))
        if kernel_of_entry is not kernel:  # an entry of a freed kernel whose id was reused
            compiled = None
    except TypeError:  # another binder signature, or an unhashable constexpr: Triton's own path
        key = compiled = None
    if compiled is None:
        _compile_and_launch(kernel, grid, device, key, args, kwargs)
        return None, None
    values = tuple(bound.values())
    _run(compiled, grid, device, values)
    return compiled, values


def binder_key(kernel, device: int, args: tuple, kwargs: dict) -> tuple:
    """(Triton's bound parameters, the key of ``_COMPILED``) for a call: the binder's specialization of the arguments.
    The key holds id(kernel) (hashing the JITFunction itself runs Python); entries keep the kernel, which is checked."""
    bound, specialization, _ = kernel.device_caches[device][-1](*args, **kwargs)
    return bound, (id(kernel), device, tuple(specialization), tuple(kwargs.items()))


def _run(compiled, grid, device: int, values: tuple) -> None:
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                 torch._C._cuda_getCurrentRawStream(device), compiled.function, compiled.packed_metadata, None,
                 None, None, *values)


class DirectLaunch:
    """A compiled binary launched through Triton's C launcher itself, past ``CudaLauncher.__call__`` and its
    tensor-descriptor wrapper (Python that every launch pays: two scratch-allocation closures, a list rebuilt per
    call, a ``cuTensorMapEncodeTiled`` per descriptor argument). ``run`` takes the arguments in the C launcher's
    order: pointers as tensors or plain integers (device addresses), each tensor-descriptor argument expanded as
    ``DescriptorEncoding.arguments`` gives it.

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
_LAUNCHER_HEAD = "iiiKKppOOOOOO"
# What direct_launch and DescriptorEncoding read of Triton 3.6's NVIDIA driver module besides the head: attributes
# CudaLauncher.__init__ sets, the closure of wrap_handle_tensordesc's wrapper, the TMA encoder CudaUtils.__init__ sets.
_LAUNCHER_ATTRIBUTES = frozenset(("launch", "global_scratch_size", "profile_scratch_size", "launch_cooperative_grid",
                                  "launch_pdl"))
_WRAPPER_CLOSURE = frozenset(("launcher", "tensordesc_meta"))


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
    head = getattr(driver, "_BASE_ARGS_FORMAT", None)
    if head is None:  # Triton 3.7 - 3.9: one C launch function for all kernels, arguments passed as one tuple
        return (f"Triton {version}'s C launcher takes the kernel arguments as one tuple with their annotations "
                "(no _BASE_ARGS_FORMAT); only Triton 3.6's per-kernel launcher is launched directly")
    if head != _LAUNCHER_HEAD:
        return f"Triton {version}'s C launcher starts with {head!r}, not Triton 3.6's {_LAUNCHER_HEAD!r}"
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
        missing |= {f"CudaLauncher.{name}" for name in _LAUNCHER_ATTRIBUTES - _names(launcher_cls.__init__)}
    if wrap is not None:
        inner = [c for c in wrap.__code__.co_consts if hasattr(c, "co_freevars")]
        freevars = set().union(*(c.co_freevars for c in inner))
        missing |= {f"wrap_handle_tensordesc's {name}" for name in _WRAPPER_CLOSURE - freevars}
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
                isinstance(m, dict) and _DESCRIPTOR_KEYS <= m.keys() for m in meta):
            return None
    return DirectLaunch(launch, compiled.function, compiled.packed_metadata, bool(run.launch_cooperative_grid),
                        bool(run.launch_pdl), meta)


_DESCRIPTOR_KEYS = frozenset(("swizzle", "elem_size", "elem_type", "block_size", "fp4_padded"))


class DescriptorEncoding:
    """How one tensor-descriptor argument of a ``DirectLaunch`` becomes the C launcher's arguments: a
    ``CUtensorMap`` encoded for the base address, then the shape and strides. Everything but the address is fixed
    by the call site (shape, strides, block, layout), so ``arguments(ptr)`` encodes only the map."""

    __slots__ = ("fill", "swizzle", "elem_size", "elem_type", "block", "shape", "strides", "padding", "_by_address")
    _ADDRESSES = 16  # the caching allocator hands a call class the same few blocks again and again

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
        self._by_address: dict[int, tuple] = {}

    def arguments(self, address: int) -> tuple:
        """The C launcher's arguments for a descriptor with this encoding over ``address``: encoded once per address
        (the map depends on nothing else, and the launcher copies it into the kernel's parameters)."""
        known = self._by_address.get(address)
        if known is None:
            if len(self._by_address) >= self._ADDRESSES:
                self._by_address.clear()
            tensor_map = self.fill(address, self.swizzle, self.elem_size, self.elem_type, self.block, self.shape,
                                   self.strides, self.padding)
            known = self._by_address[address] = (tensor_map, *self.shape, *self.strides)
        return known


_BY_SITE: dict = {}
# False keeps every launch on the path that ran before DirectLaunch and launch plans existed (read per call), so a
# benchmark can time both in one process (benchmarks/studies/20261203_layer_host.py).
DIRECT_LAUNCH = True
_CONSTANT_TYPES = (int, bool, float, str, type(None))


def launch_by_site(kernel, grid: tuple[int, ...], site: tuple, *args, **kwargs) -> None:
    """``launch`` for a call site that can tell, from a few numbers it has at hand, which binary Triton would pick.

    ``site`` (hashable) must determine, together with the kernel and the current device, everything Triton specializes
    this call on: the value of every integer argument (Triton looks at 1, divisibility by 16 and the 32/64-bit range),
    every tensor's dtype and 16-byte alignment, every tensor descriptor's dtype, shape, strides, block shape and layout,
    and every keyword argument. Runtime arguments are passed by position. A site's first direct launch through
    ``launch`` (after Triton's own path has compiled the binary) records the binary Triton's binder picked and the
    values of the keyword and default parameters; later calls with an equal ``site`` launch that binary with these
    values and skip the binder and the hashing of its specialization (the SM90 GEMM wrapper: 55 -> 33 us of host time
    per call on the H200 machine, docs/profile.md). A site whose binder output is not the positional arguments
    themselves followed by plain constants is never recorded. The GPU tests of each site check that the recorded binary
    is the binder's (``tests/support/launch_sites.py``).
    """
    if INTERPRETING:
        kernel[grid](*args, **kwargs)
        return
    device = torch.cuda.current_device()
    key = (id(kernel), site, device)
    entry = _BY_SITE.get(key)
    if entry is not None and entry[0] is kernel and not hooks_installed():
        direct = entry[3]
        if DIRECT_LAUNCH and direct is not None and direct.descriptor_meta is None:
            direct.run(grid, torch._C._cuda_getCurrentRawStream(device), *args, *entry[2])
        else:
            _run(entry[1], grid, device, (*args, *entry[2]))
        return
    compiled, values = _launch(kernel, grid, args, kwargs)
    if compiled is None or len(values) < len(args) or any(v is not a for v, a in zip(values, args)):
        return
    tail = values[len(args):]
    if all(type(v) in _CONSTANT_TYPES for v in tail):
        _BY_SITE[key] = (kernel, compiled, tail, direct_launch(compiled))


def site_binary(kernel, site: tuple) -> tuple[DirectLaunch, tuple] | None:
    """(the ``DirectLaunch`` of the binary ``launch_by_site`` recorded for ``site`` on the current device, the values
    of its keyword and default parameters), or None when none is recorded or it cannot be launched directly."""
    entry = _BY_SITE.get((id(kernel), site, torch.cuda.current_device()))
    if entry is None or entry[0] is not kernel or entry[3] is None:
        return None
    return entry[3], entry[2]


def _compile_and_launch(kernel, grid, device, key, args, kwargs) -> None:
    compiled = kernel[grid](*args, **kwargs)
    if key is None or not hasattr(compiled, "packed_metadata"):  # first call on this device, or an unknown Triton
        return
    compiled.run  # noqa: B018 (loads the binary, so the direct path never does)
    _COMPILED[key] = (kernel, compiled)
