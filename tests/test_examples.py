"""The README's demo command and the example notebooks run on the embedded tiny models (CPU)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("notebook", ["flux2_nvfp4.ipynb", "qwen_image_nvfp4.ipynb"])
def test_notebook_executes_on_tiny_model(notebook, tmp_path):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(ROOT / "examples" / notebook, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                      for o in cell.get("outputs", []))
    off = next(line for line in outputs.splitlines() if line.startswith("PNG SHA256 fast paths off:")).split()[-1]
    on = next(line for line in outputs.splitlines() if line.startswith("PNG SHA256 fast paths on:")).split()[-1]
    assert len(off) == 64 and off == on


@pytest.mark.parametrize("model", ["flux2", "qwen"])
def test_demo_command(model):
    out = subprocess.run([sys.executable, "-m", "diffusers_nvfp4_fast", "demo", "--model", model],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "identical" in out.stdout and "fused calls: {'" in out.stdout, out.stdout
    assert re.search(r"^done in \d+\.\d s \(imports included\)$", out.stdout, re.M), out.stdout  # no "in seconds"


@pytest.mark.parametrize("script", ["flux2_nvfp4.py", "qwen_image_nvfp4.py"])
def test_example_script_tiny(script, tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "examples" / script), "--tiny"], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    hashes = [line.split()[-1] for line in out.stdout.splitlines() if line.startswith("PNG SHA256")]
    assert len(hashes) == 2 and hashes[0] == hashes[1]
