"""The one way tests run Triton kernels on the CPU: a test module's function, in a fresh interpreter with
``TRITON_INTERPRET=1`` (Triton reads it when a kernel module is imported, so it cannot be switched on in-process).

A test file defines ``def interpreted_<name>() -> dict`` (plain code, linted like the rest) and calls
``run_interpreted(__name__, "interpreted_<name>")``; the function's JSON-able result comes back. Results are cached
per (module, function) for the session, so several tests can assert on one run.

Run directly (``python tests/support/interpreter.py MODULE FUNCTION``) it is the worker side.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
_MARK = "INTERPRETER-RESULT:"


@functools.cache
def run_interpreted(module: str, function: str, timeout: int = 900):
    """``module.function()`` under the Triton interpreter; returns its result (decoded JSON)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, __file__, module, function], env=env, capture_output=True, text=True,
                          timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_MARK)]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"{module}.{function} failed under the interpreter:\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len(_MARK):])


def _main(module: str, function: str) -> None:
    sys.path[:0] = [str(TESTS), str(TESTS.parent)]
    result = getattr(importlib.import_module(module), function)()
    print(_MARK + json.dumps(result))


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
