"""The torch and Triton ranges in ``pyproject.toml`` are the versions README's "Install" says were tested: from the
oldest tested release to the newest, so that ``pip install -e ".[test]"`` keeps an installed torch that was tested
(and replaces none of them with an older one) and brings none that was not."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib", reason="Python < 3.11 has no tomllib, so the install pins were not checked; "
                                                 "they are checked on Python 3.11+, as in CI")

ROOT = Path(__file__).resolve().parents[1]


def _install_section() -> str:
    text = (ROOT / "README.md").read_text()
    return text.split("## Install\n", 1)[1].split("\n## ", 1)[0]


def _requirement(group: list[str], name: str) -> Requirement:
    found = [Requirement(r) for r in group if Requirement(r).name == name]
    assert len(found) == 1, f"pyproject.toml: {len(found)} requirements on {name}"
    return found[0]


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def _tested(name: str, section: str) -> set[tuple[int, int]]:
    """Every version README's "Install" names after ``name``: 'torch 2.13 / 2.14' names 2.13 and 2.14."""
    lists = re.findall(rf"\b{name} (\d+\.\d+(?: / \d+\.\d+)*)", section)
    return {_minor(v) for found in lists for v in found.split(" / ")}


def _bounds(requirement: Requirement) -> tuple[tuple[int, int], tuple[int, int]]:
    """(lowest admitted minor, first excluded minor) of a ``>=a.b,<c.d`` requirement."""
    ops = {spec.operator: _minor(spec.version) for spec in requirement.specifier}
    assert set(ops) == {">=", "<"}, f"pyproject.toml: {requirement} is not a '>=a.b,<c.d' range"
    return ops[">="], ops["<"]


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_pins_span_exactly_the_tested_versions(name):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    group = project["dependencies"] if name == "torch" else project["optional-dependencies"]["test"]
    low, past = _bounds(_requirement(group, name))
    tested = _tested(name.capitalize() if name == "triton" else name, _install_section())
    assert tested, f"README's Install names no tested {name} version"
    (oldest, newest), dotted = (min(tested), max(tested)), "{0[0]}.{0[1]}".format
    assert low == oldest, f"pyproject.toml admits {name} from {dotted(low)}, README's oldest tested is {dotted(oldest)}"
    assert past == (newest[0], newest[1] + 1), (f"pyproject.toml admits {name} below {dotted(past)}, README's newest "
                                                f"tested is {dotted(newest)}")


def test_readme_says_which_installed_torch_pip_keeps():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    low, past = _bounds(_requirement(project["dependencies"], "torch"))
    kept = f"keeps an installed torch {low[0]}.{low[1]}-{past[0]}.{past[1] - 1} and replaces one outside that range"
    assert kept in " ".join(_install_section().split())
