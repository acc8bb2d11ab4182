"""Launch helpers shared by the NVFP4-emitting kernels."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from typing import TYPE_CHECKING

import torch

from . import triton_compat as compat
from .caches import declare
from .triton_compat import INTERPRETING, DescriptorEncoding, DirectLaunch, direct_launch_unavailable, hooks_installed

if TYPE_CHECKING:  # run as a program by its workers, so not imported with the package
    from .compile_workers import CompileWorkers

__all__ = ["INTERPRETING", "DescriptorEncoding", "DirectLaunch", "PendingCompiles", "compile_only", "compiling_only",
           "direct_launch_unavailable", "hooks_installed", "launch", "launch_by_site", "site_binary"]


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


_COMPILED: dict = declare("kernels.launch.compiled", {}, "one entry per specialization Triton compiled; kept for the "
                          "process (an entry holds its kernel, checked against id reuse)")


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
    binder takes other arguments, ``triton_compat.bind``). Triton's debug and instrumentation settings (environment
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
    if _PENDING:
        _PENDING[0].add(kernel, grid, device, args, kwargs)
        return None, None
    if not compat.has_binder(kernel, device) or hooks_installed():
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
    compat.run_compiled(compiled, grid, compat.current_raw_stream(device), values)
    return compiled, values


def binder_key(kernel, device: int, args: tuple, kwargs: dict) -> tuple:
    """(Triton's bound parameters, the key of ``_COMPILED``) for a call: the binder's specialization of the arguments.
    The key holds id(kernel) (hashing the JITFunction itself runs Python); entries keep the kernel, which is checked."""
    bound, specialization = compat.bind(kernel, device, args, kwargs)
    return bound, (id(kernel), device, tuple(specialization), tuple(kwargs.items()))


_BY_SITE: dict = declare("kernels.launch.by_key", {}, "one entry per specialization key launched; kept for the "
                         "process, like Triton's own kernel cache")
# False keeps every launch on the path that ran before DirectLaunch and launch plans existed (read per call), so a
# benchmark can time both in one process (benchmarks/studies/20261203_layer_host.py).
DIRECT_LAUNCH = True
_CONSTANT_TYPES = (int, bool, float, str, type(None))


def launch_by_site(kernel, grid: tuple[int, ...], *args, **kwargs) -> None:
    """``launch`` keyed by the call's specialization key (``triton_compat.specialization_key``: Triton's own rules,
    applied to the arguments), past Triton's binder.

    Runtime arguments are passed by position, constexprs and launch options by keyword, in one order and with one
    type each per call site. A key's first direct launch through ``launch`` (after Triton's own path has compiled the
    binary) records the binary Triton's binder picked and the values of the keyword and default parameters; later
    calls with an equal key launch that binary with these values and skip the binder and the hashing of its
    specialization (the SM90 GEMM wrapper: 55 -> 33 us of host time per call on the H200 machine, docs/profile.md).
    A call whose binder output is not the positional arguments themselves followed by plain constants is never
    recorded. tests/test_triton_compat.py checks the key against Triton's specialization; the GPU tests of each caller
    check that the recorded binary is the binder's (``tests/support/launch_sites.py``).
    """
    if INTERPRETING:
        kernel[grid](*args, **kwargs)
        return
    device = torch.cuda.current_device()
    if _PENDING:
        _PENDING[0].add(kernel, grid, device, args, kwargs)
        return
    key = (id(kernel), compat.specialization_key(args, kwargs), device)
    entry = _BY_SITE.get(key)
    if entry is not None and entry[0] is kernel and not hooks_installed():
        direct = entry[3]
        if DIRECT_LAUNCH and direct is not None and direct.descriptor_meta is None:
            direct.run(grid, compat.current_raw_stream(device), *args, *entry[2])
        else:
            compat.run_compiled(entry[1], grid, compat.current_raw_stream(device), (*args, *entry[2]))
        return
    compiled, values = _launch(kernel, grid, args, kwargs)
    if compiled is None or len(values) < len(args) or any(v is not a for v, a in zip(values, args)):
        return
    tail = values[len(args):]
    if all(type(v) in _CONSTANT_TYPES for v in tail):
        _BY_SITE[key] = (kernel, compiled, tail, compat.direct_launch(compiled))


def site_binary(kernel, args: tuple, kwargs: dict) -> tuple[DirectLaunch, tuple] | None:
    """(the ``DirectLaunch`` of the binary ``launch_by_site`` recorded for these arguments on the current device, the
    values of its keyword and default parameters), or None when none is recorded or it cannot be launched directly."""
    key = (id(kernel), compat.specialization_key(args, kwargs), torch.cuda.current_device())
    entry = _BY_SITE.get(key)
    if entry is None or entry[0] is not kernel or entry[3] is None:
        return None
    return entry[3], entry[2]


def _compile_and_launch(kernel, grid, device, key, args, kwargs) -> None:
    compiled = kernel[grid](*args, **kwargs)
    if key is not None and compat.load_binary(compiled):  # not on the first call on this device, nor an unknown Triton
        _COMPILED[key] = (kernel, compiled)


def recorded_binary(kernel, args: tuple, kwargs: dict):
    """The binary ``launch_by_site`` recorded for these arguments on the current device, or None (tests)."""
    entry = _BY_SITE.get((id(kernel), compat.specialization_key(args, kwargs), torch.cuda.current_device()))
    return None if entry is None or entry[0] is not kernel else entry[1]


def binders_binary(kernel, args: tuple, kwargs: dict):
    """The binary ``launch`` holds for the specialization Triton's binder gives these arguments, or None (tests)."""
    _, key = binder_key(kernel, torch.cuda.current_device(), args, kwargs)
    entry = _COMPILED.get(key)
    return None if entry is None or entry[0] is not kernel else entry[1]


def recorded_binaries() -> list:
    """Every binary ``launch_by_site`` recorded, in recording order (tests, benchmarks)."""
    return [entry[1] for entry in _BY_SITE.values()]


def compiled_binaries(kernel) -> list:
    """The binaries ``launch`` holds for ``kernel``, one per specialization it launched (tests)."""
    return [compiled for kernel_of_entry, compiled in _COMPILED.values() if kernel_of_entry is kernel]


# Compile-only passes (docs/design.md §8, "Preparation"): a model's first call is run once with every launch replaced
# by its compile, so that the kernels it needs compile side by side instead of one after another.


class PendingCompiles:
    """The compiles a compile-only pass asked for: each specialization once, started at once on a thread pool.

    Specializations compile in parallel, of one kernel too (Triton's MLIR passes, ``ptxas`` and the launcher's C
    compiler run outside the GIL; a ``JITFunction``'s caches are dictionaries keyed by specialization, which Triton's
    own ``AsyncCompileMode`` fills from an executor the same way, once the kernel's binder exists: it is built here,
    on the calling thread). ``JITFunction.warmup`` compiles exactly what a launch with the same arguments would run,
    and leaves the binary in the kernel's own cache, where the next launch finds it; the binary is loaded onto the
    device in the same task.
    """

    def __init__(self, workers: int, processes: CompileWorkers | None = None) -> None:
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="nvfp4-compile")
        self.seen: set = set()
        self.futures: list[Future] = []
        self.processes = processes
        self.in_workers: list[tuple[str, float]] = []  # (kernel, seconds) of each binary a worker process compiled
        self.worker_failures: list[str] = []  # each compiled here instead: the same binary, later

    def add(self, kernel, grid: tuple[int, ...], device: int, args: tuple, kwargs: dict) -> None:
        compat.make_binder(kernel, device)
        try:  # Triton's own specialization: one task per binary
            key = binder_key(kernel, device, args, kwargs)[1]
            hash(key)
        except TypeError:  # another binder signature, or an unhashable constexpr
            key = (id(kernel), device, compat.specialization_key(args, kwargs))
        if key in self.seen:
            return
        self.seen.add(key)
        args = warmup_arguments(args)
        self.futures.append(self.pool.submit(self.compile_one, kernel, grid, device, args, kwargs))

    def compile_one(self, kernel, grid: tuple[int, ...], device: int, args: tuple, kwargs: dict) -> None:
        """One binary: compiled by a worker process where there are any (the warmup then loads it from Triton's
        cache), else or where the worker failed here; then loaded onto the device."""
        def warmup():
            return kernel.warmup(*args, grid=grid, **kwargs)

        with torch.cuda.device(device):
            if self.processes is not None:
                try:
                    spec = compat.capture_specialization(warmup)
                    if spec is not None:
                        self.in_workers.append((spec.kernel, self.processes.compile(spec)))
                except Exception as error:  # noqa: BLE001
                    self.worker_failures.append(f"{type(error).__name__}: {error}"[:300])
            compat.load_binary(warmup())

    def wait(self, on_done: Callable[[], None] | None = None) -> list[BaseException]:
        """Wait for every compile, calling ``on_done`` after each; returns the failures (the launch itself then
        compiles and raises as it would have)."""
        failures = []
        for future in as_completed(self.futures):
            if future.exception() is not None:
                failures.append(future.exception())
            if on_done is not None:
                on_done()
        self.close(wait=True)
        return failures

    def close(self, wait: bool) -> None:
        self.pool.shutdown(wait=wait, cancel_futures=not wait)


def warmup_arguments(args: tuple) -> tuple:
    """``args`` with each 16-byte aligned tensor replaced by its dtype, which ``JITFunction.warmup`` specializes as an
    aligned tensor of that dtype (Triton's ``MockTensor``): a pending compile then holds no activation memory."""
    return tuple(a.dtype if a.__class__ is torch.Tensor and not a.data_ptr() & 15 else a for a in args)


_PENDING: list[PendingCompiles] = []  # the compile-only pass under way (at most one; read by every launch)


def compiling_only() -> bool:
    """Whether a compile-only pass is under way: launches are not run, and their outputs hold no values."""
    return bool(_PENDING)


@contextlib.contextmanager
def compile_only(workers: int | None = None, processes: CompileWorkers | None = None) -> Iterator[PendingCompiles]:
    """Within the block, every ``launch`` / ``launch_by_site`` starts the compile of its binary (if Triton has not
    got it yet) on a thread pool instead of running, each thread handing it to one of ``processes`` where given; the
    caller waits on ``futures`` after the block (leaving the block with an exception cancels what has not started).
    Used from one thread, for one pass at a time."""
    if _PENDING:
        raise RuntimeError("compile_only: a compile-only pass is already under way")
    threads = workers or (processes.count if processes is not None else min(8, os.cpu_count() or 1))
    pending = PendingCompiles(threads, processes)
    _PENDING.append(pending)
    try:
        yield pending
    except BaseException:
        pending.close(wait=False)
        raise
    finally:
        _PENDING.clear()
