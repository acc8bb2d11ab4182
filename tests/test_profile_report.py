"""``benchmarks/profile_report.py``: docs/profile.md's generated part is what the committed results give, and it
follows a changed result (issue 35, point 5)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import profile_report  # benchmarks/ is on the test path (pyproject.toml)
import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "profile.md"
EDITED = 123.45  # a step time no run has recorded


@pytest.fixture
def copies(tmp_path: Path) -> tuple[Path, Path]:
    """The committed results folder and docs/profile.md, copied to ``tmp_path``."""
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    doc = tmp_path / "profile.md"
    shutil.copy(DOC, doc)
    return results, doc


def _args(results: Path, doc: Path, *flags: str) -> list[str]:
    return ["--results", str(results), "--doc", str(doc), *flags]


def test_check_passes_on_the_committed_files():
    assert profile_report.main(["--check"]) == 0


def test_a_changed_figure_fails_check_and_write_puts_it_in_the_document(copies, capsys):
    results, doc = copies
    path = results / "transformer_step-qwen-image-graph-h200.json"
    data = json.loads(path.read_text())
    on = next(c for c in data["cases"] if c["variant"] == "nvfp4_fast_on")
    assert str(EDITED) not in doc.read_text()
    on["ms_per_step"] = EDITED
    path.write_text(json.dumps(data))

    assert profile_report.main(_args(results, doc, "--check")) == 1
    assert str(EDITED) in capsys.readouterr().err  # the diff shows the new figure
    assert profile_report.main(_args(results, doc, "--write")) == 0
    text = doc.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| Qwen-Image | CUDA-graph runner | NVFP4 on"))
    assert str(EDITED) in row
    assert profile_report.main(_args(results, doc, "--check")) == 0
    # Only the generated part changed: the hand-written text around the markers is kept.
    before, after = (DOC.read_text().split(m)[i] for m, i in ((profile_report.BEGIN, 0), (profile_report.END, 1)))
    assert text.startswith(before) and text.endswith(after)


def test_every_table_has_a_source_line_naming_a_results_file():
    generated = profile_report.render(profile_report.Results(RESULTS, "h200"))
    blocks = re.split(r"\n\n", generated)
    tables = [i for i, b in enumerate(blocks) if b.startswith("| ")]
    assert tables
    for i in tables:
        source = blocks[i + 1]
        assert source.startswith("Source: ") and ("-h200.json`" in source or "each file's" in source), blocks[i][:80]


def test_every_results_file_names_a_writer_script():
    results = profile_report.Results(RESULTS, "h200")
    missing = [n for n in results.names() if profile_report.writer(results.load(n).get("benchmark", "")) is None]
    assert not missing


def test_bad_input_is_named(copies, capsys):
    results, doc = copies
    doc.write_text("# no markers\n")
    assert profile_report.main(_args(results, doc, "--check")) == 2
    assert str(doc) in capsys.readouterr().err
    (results / "pipeline-h200.json").write_text("{")
    assert profile_report.main(_args(results, doc)) == 2
    assert "pipeline-h200.json is not valid JSON" in capsys.readouterr().err
    (results / "pipeline-h200.json").write_text(json.dumps({"benchmark": "pipeline", "cases": [{"model": "x"}]}))
    assert profile_report.main(_args(results, doc)) == 2
    assert "pipeline-h200.json cases[0] has no field ['dtype']" in capsys.readouterr().err


def test_a_bf16_profile_gets_its_own_column(copies):
    """``profile_step.py --compile blocks --bf16`` writes ``profile_step_compiled-<model>-bf16``: the class table
    shows it beside the NVFP4 compiled profile."""
    results, doc = copies
    nvfp4 = json.loads((results / "profile_step_compiled-qwen-image-h200.json").read_text())
    bf16 = dict(nvfp4, classes={"BF16 GEMM": EDITED, "attention": 27.0}, kernel_ms=EDITED + 27.0)
    (results / "profile_step_compiled-qwen-image-bf16-h200.json").write_text(json.dumps(bf16))
    assert profile_report.main(_args(results, doc, "--write")) == 0
    header = next(line for line in doc.read_text().splitlines() if line.startswith("| class |"))
    assert "Qwen-Image compiled, BF16 model ms" in header
    assert any(line.startswith("| BF16 GEMM |") and str(EDITED) in line for line in doc.read_text().splitlines())
