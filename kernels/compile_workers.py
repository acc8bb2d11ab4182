"""Worker processes that compile this package's Triton kernels into the shared Triton cache, outside the GIL of the
process that asked (docs/design.md §8, "Preparation").

Triton builds a kernel's first IR from its Python source in Python, so compiles on threads of one process wait on
each other; a worker process compiles a captured specialization (``triton_compat.capture_specialization``) for the
asking process's target under the same cache key, and that process then loads the binary from the cache. A worker
is this module run as a program: it reads one JSON task per line on stdin and answers one JSON line on stdout. It
sees no GPU. Workers are started with the environment of the asking process and its Triton cache directory.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict

from . import triton_compat as compat

WORKER_MODULE = __name__
# A worker runs this module as a program after binding ``torch`` to a stand-in that imports torch at its first
# attribute use (then shares its attributes): nothing in kernels/ uses a torch attribute at import
# (tests/test_compile_workers.py), so a worker starts without torch's import, seconds on a busy host
# (docs/performance.md, "First image"), and a compile that did use torch would still find it. (Python's own
# LazyLoader does not do: an ``import torch`` statement reads the module's ``__spec__``, which loads it.)
TORCH_ON_FIRST_USE = """
import importlib, sys, types
class TorchOnFirstUse(types.ModuleType):
    def __getattr__(self, name):
        del sys.modules["torch"]
        torch = importlib.import_module("torch")
        vars(self).update(vars(torch))
        return getattr(torch, name)
sys.modules["torch"] = TorchOnFirstUse("torch")
"""
WORKER_PROGRAM = TORCH_ON_FIRST_USE + """
import runpy
runpy.run_module(sys.argv[1], run_name="__main__", alter_sys=True)
"""
# Workers are started when a model awaiting its first call is enabled; one that gets no task this long ends itself,
# so a model never called does not keep them (a later pass then compiles on its threads).
IDLE_EXIT_S = 600.0
# A closed worker still importing or compiling gets this long to end before it is killed (by a thread: the process
# that closes the workers does not wait for them).
EXIT_GRACE_S = 5.0


class CompileWorkers:
    """``count`` worker processes, started at once; ``compile`` blocks the calling thread (not the GIL) until a free
    worker has compiled the specialization. Used as a context manager, or ``close``d."""

    def __init__(self, count: int) -> None:
        # no GPU visible: a worker only compiles (CUDA_VISIBLE_DEVICES is not part of Triton's cache key)
        env = dict(os.environ, TRITON_CACHE_DIR=compat.triton_cache_dir(), CUDA_VISIBLE_DEVICES="")
        self.stderr_log = tempfile.TemporaryFile()
        self.idle: queue.Queue[subprocess.Popen] = queue.Queue()
        self.processes = []
        for _ in range(count):
            worker = subprocess.Popen(worker_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self.stderr_log, env=env, text=True)
            self.processes.append(worker)
            self.idle.put(worker)
        self.closed = threading.Event()

    @property
    def count(self) -> int:
        return len(self.processes)

    def compile(self, spec: compat.Specialization) -> float:
        """Have a worker compile ``spec`` into the cache; returns the seconds the worker spent. RuntimeError with the
        worker's reason where it failed (the caller then compiles in its own process)."""
        worker = self.idle.get()
        try:
            if self.closed.is_set() or worker.poll() is not None:
                raise RuntimeError(f"compile worker {worker.pid} is not running ({self.stderr_tail()})")
            assert worker.stdin is not None and worker.stdout is not None
            worker.stdin.write(json.dumps(asdict(spec)) + "\n")
            worker.stdin.flush()
            line = worker.stdout.readline()
        finally:
            self.idle.put(worker)
        if not line:
            raise RuntimeError(f"compile worker {worker.pid} exited ({self.stderr_tail()})")
        reply = json.loads(line)
        if not reply["ok"]:
            raise RuntimeError(f"compile worker {worker.pid}, {spec.module}.{spec.kernel}: {reply['error']}")
        return float(reply["seconds"])

    def stderr_tail(self) -> str:
        self.stderr_log.seek(0)
        return self.stderr_log.read().decode(errors="replace").strip()[-500:] or "no output"

    def close(self, wait: bool = False) -> None:
        """End every worker: closing its stdin ends its loop; one that has not ended ``EXIT_GRACE_S`` later is killed.
        Without ``wait`` a thread waits for that, not the caller (a worker may still be importing)."""
        self.closed.set()
        for worker in self.processes:
            if worker.stdin is not None:
                worker.stdin.close()
        if wait:
            self.reap()
        else:
            threading.Thread(target=self.reap, name="nvfp4-compile-workers-exit", daemon=True).start()

    def reap(self) -> None:
        """Wait for the closed workers to end, killing any still running ``EXIT_GRACE_S`` after ``close``."""
        deadline = time.monotonic() + EXIT_GRACE_S
        for worker in self.processes:
            try:
                worker.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
            if worker.stdout is not None:
                worker.stdout.close()
        self.stderr_log.close()

    def __enter__(self) -> CompileWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(wait=True)


def worker_command() -> list[str]:
    """The command line of one worker process."""
    return [sys.executable, "-c", WORKER_PROGRAM, WORKER_MODULE]


def _serve(tasks, replies, idle_s: float = IDLE_EXIT_S) -> None:
    """The worker's loop: each task line is a ``Specialization``; each reply says ok and seconds, or the error. Ends
    at the end of its input, or after ``idle_s`` without a task (its parent asks for a task only after the reply to
    the previous one, so no second line waits in the input's buffer)."""
    import importlib
    import select

    while select.select([tasks], [], [], idle_s)[0]:
        line = tasks.readline()
        if not line:
            return
        start = time.perf_counter()
        try:
            spec = compat.Specialization(**json.loads(line))
            kernel = getattr(importlib.import_module(spec.module), spec.kernel)
            compat.compile_specialization(kernel, spec)
            reply = {"ok": True, "seconds": round(time.perf_counter() - start, 3)}
        except Exception as error:  # noqa: BLE001  (reported to the asking process, which compiles it itself)
            reply = {"ok": False, "error": f"{type(error).__name__}: {error}"[:2000]}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    replies = sys.stdout  # the package's kernels/ (every kernel module, each cache key settled) is imported by now
    sys.stdout = sys.stderr  # anything a compile prints goes to stderr, never into the replies
    _serve(sys.stdin, replies)
