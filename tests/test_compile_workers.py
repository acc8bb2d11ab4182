"""Compiles in worker processes (``kernels/compile_workers.py``): a worker compiles the specialization this process's
JIT captured, into the shared Triton cache under the key this process then looks up, so its next warmup loads the
binary instead of compiling it. Run on the CPU against the installed Triton, whose JIT builds its binder for an SM90
target given by a stand-in driver (no GPU); the compile-only pass with workers on a GPU is in tests/test_preparation.py.
"""

import importlib
import types

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed, so the worker-process compile tests did not "
                                               "run; they run wherever Triton is installed, as in CI")

compat = importlib.import_module("diffusers_nvfp4_fast.kernels.triton_compat")
launch = importlib.import_module("diffusers_nvfp4_fast.kernels.launch")
workers_mod = importlib.import_module("diffusers_nvfp4_fast.kernels.compile_workers")
quantize_mod = importlib.import_module("diffusers_nvfp4_fast.kernels.quantize_nvfp4")


@pytest.fixture
def sm90_jit(monkeypatch, tmp_path):
    """The quantize kernel's JIT with a binder for an SM90 device 0, an empty Triton cache, and the compiles this
    process runs or loads (kernel name, cache hit)."""
    from triton.backends.compiler import GPUTarget

    jit = importlib.import_module("triton.runtime.jit")
    active = types.SimpleNamespace(get_current_target=lambda: GPUTarget("cuda", 90, 32),
                                   get_current_device=lambda: 0, get_current_stream=lambda device: 0)
    monkeypatch.setattr(jit, "driver", types.SimpleNamespace(active=active))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    kernel = quantize_mod._quantize_nvfp4_kernel
    monkeypatch.setattr(kernel, "device_caches", type(kernel.device_caches)(kernel.create_binder))
    monkeypatch.setattr(compat, "load_binary", lambda compiled: compiled is not None)  # no device to load onto
    heard: list[tuple[str, bool]] = []
    remove = compat.add_compile_listener(lambda event: heard.append((event.name, event.cache_hit)))
    yield kernel, heard
    remove()


def _call(rows: int) -> tuple[tuple, dict]:
    """One quantize launch's arguments (x as int64 words)."""
    x, g = torch.zeros(64, 256, dtype=torch.int64), torch.ones(1)
    packed, scales = torch.zeros(64, 64, dtype=torch.int64), torch.zeros(128, 64, dtype=torch.uint8)
    options = {"BLOCK_R": 8, "BLOCK_C": 32, "IS_BF16": True, **launch.launch_options(torch.device("cpu"), True)}
    return (x, g, packed, scales, rows, 1024, 256, 64, 2), options


def _warmup(kernel, rows: int = 16):
    """The warmup the compile-only pass runs for one launch (tensors as their dtypes)."""
    args, options = _call(rows)
    return lambda: kernel.warmup(*launch.warmup_arguments(args), grid=(1,), **options)


def test_a_worker_compiles_the_captured_binary_under_this_processs_key(sm90_jit):
    """Captured, nothing compiles here; a worker compiles it; this process's warmup then loads it from the cache. A
    second capture of a binary this process holds finds nothing to compile."""
    kernel, heard = sm90_jit
    spec = compat.capture_specialization(_warmup(kernel))
    assert spec is not None and heard == []
    assert (spec.module, spec.kernel) == (kernel.fn.__module__, "_quantize_nvfp4_kernel")
    assert spec.target == {"backend": "cuda", "arch": 90, "warp_size": 32}
    assert triton.knobs.runtime.jit_cache_hook is None  # put back after the capture
    with workers_mod.CompileWorkers(1) as workers:
        assert workers.compile(spec) > 0
    assert heard == []  # the worker's compile is not this process's
    assert _warmup(kernel)() is not None
    assert heard == [("_quantize_nvfp4_kernel", True)]
    assert compat.capture_specialization(_warmup(kernel)) is None


def test_capture_leaves_other_threads_compiles_to_the_hook_before_it(sm90_jit, monkeypatch):
    """A hook the user installed keeps deciding for compiles outside a capture, and is back after it."""
    kernel, _ = sm90_jit
    calls = []
    user_hook = lambda **kw: calls.append(kw["fn"].name)  # noqa: E731
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", user_hook)
    assert compat.capture_specialization(_warmup(kernel, rows=17)) is not None
    assert calls == [] and triton.knobs.runtime.jit_cache_hook is user_hook
    with compat._capturing_hook_installed():
        _warmup(kernel, rows=18)()  # not capturing on this thread: compiled here, the user's hook called
    assert calls == ["_quantize_nvfp4_kernel"]


def test_a_worker_compiles_the_gluon_gemm_under_this_processs_key(monkeypatch, tmp_path):
    """The SM90 GEMM (a Gluon kernel) from a specialization in Triton's format, keyed as the JIT keys constants (by
    argument index) with the options the JIT parses: compiled by a worker, then loaded from the cache here."""
    import json

    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    from support.sass_count import compile_gemm_sm90, gemm_sm90_parts

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    kernel, signature, constants, attrs, options = gemm_sm90_parts(block_m=128, has_bias=True)
    target = GPUTarget("cuda", 90, 32)
    indexed = {(kernel.arg_names.index(name),): value for name, value in constants.items()}
    data = json.dumps({"name": kernel.fn.__qualname__, "signature": signature,
                       "constant_keys": [list(k) for k in indexed], "constant_vals": list(indexed.values()),
                       "attrs_keys": [list(k) for k in attrs], "attrs_vals": list(attrs.values()),
                       "options": make_backend(target).parse_options(options).__dict__})
    spec = compat.Specialization(kernel.fn.__module__, kernel.fn.__qualname__, data, dict(vars(target)))
    with workers_mod.CompileWorkers(1) as workers:
        workers.compile(spec)
    heard: list[bool] = []
    remove = compat.add_compile_listener(lambda event: heard.append(event.cache_hit))
    try:
        compile_gemm_sm90(block_m=128, has_bias=True)
    finally:
        remove()
    assert heard == [True]


def test_the_compile_only_pass_hands_each_binary_to_a_worker_and_loads_it(sm90_jit):
    """The pass with worker processes: each specialization compiled once, by a worker; this process only loads."""
    kernel, heard = sm90_jit
    with workers_mod.CompileWorkers(2) as workers:
        with launch.compile_only(processes=workers) as pending:
            for rows in (16, 17, 32):  # 16 and 32: one specialization
                pending.add(kernel, (1,), -1, *_call(rows))
        assert pending.wait() == [] and pending.worker_failures == []
    assert [name for name, _ in pending.in_workers] == ["_quantize_nvfp4_kernel"] * 2
    assert heard == [("_quantize_nvfp4_kernel", True)] * 2


def test_a_binary_a_worker_could_not_compile_is_compiled_here(sm90_jit):
    """A worker's failure is recorded, and the binary compiled in this process instead (the same binary)."""
    kernel, heard = sm90_jit

    class Failing:
        count = 1

        def compile(self, spec):
            raise RuntimeError(f"compile worker 1, {spec.kernel}: exited")

    with launch.compile_only(processes=Failing()) as pending:
        pending.add(kernel, (1,), -1, *_call(16))
    assert pending.wait() == [] and pending.in_workers == []
    assert pending.worker_failures == ["RuntimeError: compile worker 1, _quantize_nvfp4_kernel: exited"]
    assert heard == [("_quantize_nvfp4_kernel", False)]


def test_a_failing_worker_names_the_kernel_and_the_error():
    """A specialization the worker cannot compile comes back as a RuntimeError with the kernel and the reason (the
    pass then compiles that binary in its own process)."""
    spec = compat.Specialization(quantize_mod.__name__, "_quantize_nvfp4_kernel", "{not json", {"backend": "cuda"})
    with workers_mod.CompileWorkers(1) as workers, pytest.raises(RuntimeError) as error:
        workers.compile(spec)
    assert "_quantize_nvfp4_kernel" in str(error.value) and "JSONDecodeError" in str(error.value)


def test_closed_workers_have_exited():
    workers = workers_mod.CompileWorkers(2)
    processes = list(workers.processes)
    workers.close(wait=True)
    assert all(p.returncode is not None for p in processes)


def test_closing_does_not_wait_for_a_worker_still_starting(monkeypatch):
    """A model whose pass needs no compiles closes the workers while they may still import: ``close`` returns at once
    (it once waited for them, up to 5 s, inside the first image), and a worker that does not end is killed later."""
    import sys
    import time

    monkeypatch.setattr(workers_mod, "worker_command", lambda: [sys.executable, "-c", "import time; time.sleep(60)"])
    monkeypatch.setattr(workers_mod, "EXIT_GRACE_S", 0.5)
    workers = workers_mod.CompileWorkers(1)
    worker = workers.processes[0]
    workers.close()
    assert worker.poll() is None  # still running: close did not wait
    deadline = time.monotonic() + 30
    while worker.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker.returncode is not None and worker.returncode < 0  # killed after the grace


def test_no_kernel_module_uses_torch_at_import():
    """Every module of kernels/ imports with torch's stand-in in place and leaves it unloaded (an annotation, a default
    argument or a module constant that reads a torch attribute would load torch in every worker)."""
    import pkgutil

    package = importlib.import_module("diffusers_nvfp4_fast.kernels")
    names = [f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)]
    printed = _with_the_stand_in(f"for name in {names!r}: importlib.import_module(name)\n"
                                 "print(type(sys.modules['torch']).__name__, 'torch._C' in sys.modules)")
    assert len(names) > 15 and printed == ["TorchOnFirstUse", "False"]


def test_the_stand_in_is_torch_from_its_first_use():
    """Where a worker's compile did use torch, the module bound at import works as torch from then on."""
    printed = _with_the_stand_in("import torch\nbefore = 'torch._C' in sys.modules\n"
                                 "print(before, torch.ones(3).sum().item(), torch.Tensor is "
                                 "importlib.import_module('torch').Tensor)")
    assert printed == ["False", "3.0", "True"]


def _with_the_stand_in(code: str) -> list[str]:
    """What ``code`` prints, run in a new process after the workers' torch stand-in is bound."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", workers_mod.TORCH_ON_FIRST_USE + code], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def test_a_worker_compiles_without_importing_torch(sm90_jit):
    """A worker's start is Triton's import and the kernels' (no torch: seconds less before it can compile); nothing
    it runs for a compile imports torch. The import log of a worker that compiled a binary lists no torch module."""
    import json
    import os
    import subprocess
    from dataclasses import asdict

    kernel, heard = sm90_jit
    spec = compat.capture_specialization(_warmup(kernel))
    assert spec is not None
    worker = subprocess.run(workers_mod.worker_command(), input=json.dumps(asdict(spec)) + "\n",
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert worker.returncode == 0, worker.stderr[-2000:]
    assert json.loads(worker.stdout)["ok"], worker.stdout
    log = worker.stderr.splitlines()
    imported = [line.rsplit("|", 1)[-1].strip() for line in log if line.startswith("import time")]
    assert "diffusers_nvfp4_fast.kernels.quantize_nvfp4" in imported
    assert [m for m in imported if m == "torch" or m.startswith("torch.")] == []
    assert _warmup(kernel)() is not None and heard == [("_quantize_nvfp4_kernel", True)]  # this process's key


def test_a_worker_ends_at_the_end_of_its_input_or_when_idle():
    """The worker's loop answers each task line, and returns at end of input, or when no task came for a while (a
    model enabled but never called leaves no processes behind)."""
    import io
    import os

    read, write = os.pipe()
    with os.fdopen(read) as tasks, os.fdopen(write, "w") as feed:
        replies = io.StringIO()
        workers_mod._serve(tasks, replies, idle_s=0.2)  # nothing comes: idle
        assert replies.getvalue() == ""
        feed.write("{not json\n")
        feed.close()
        workers_mod._serve(tasks, replies, idle_s=5)  # one task, then the end of the input
    assert replies.getvalue().count("\n") == 1 and '"ok": false' in replies.getvalue()


def test_models_awaiting_a_pass_share_one_set_of_workers_until_the_last_is_done(monkeypatch):
    """With ``DIFFUSERS_NVFP4_COMPILE_WORKERS`` set, the first model awaiting its pass starts the workers, the next
    one shares them, and they end when neither awaits one any more; unset, none start."""
    from diffusers_nvfp4_fast import preparation

    started = []

    class Fake:
        def __init__(self, count):
            self.count, self.closed = count, False
            started.append(self)

        def close(self):
            self.closed = True

    monkeypatch.setattr(workers_mod, "CompileWorkers", Fake)
    assert preparation._await_workers() is False and started == []
    monkeypatch.setenv("DIFFUSERS_NVFP4_COMPILE_WORKERS", "3")
    assert preparation._await_workers() and preparation._await_workers()
    assert [w.count for w in started] == [3]
    preparation._stop_awaiting_workers()
    assert not started[0].closed
    preparation._stop_awaiting_workers()
    assert started[0].closed and preparation._WORKERS == {"pool": None, "awaiting": 0}
