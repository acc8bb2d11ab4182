"""Run a snippet in a fresh interpreter with TRITON_INTERPRET=1 (it must be set before Triton is imported)."""

import os
import subprocess
import sys
import textwrap


def run_interpreted(code: str, timeout: int = 300) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout
