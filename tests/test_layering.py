"""The layering of docs/design.md §2, checked on the source: kernels import nothing from the package, ops import
no patches or loaders, no package module imports one that imports it back, and the command line starts without
importing torch or diffusers."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "diffusers_nvfp4_fast"
KERNELS = ROOT / "kernels"


def _imports(path: Path, package: str) -> set[str]:
    """Modules ``path`` imports, relative imports resolved against ``package`` (its dotted module name)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
                found.update(f"{base}.{alias.name}" for alias in node.names)
            found.add(base)
    return found


def _module_name(path: Path, root: Path, top: str) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = [top, *rel.parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_graph() -> dict[str, set[str]]:
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path, PACKAGE, "diffusers_nvfp4_fast")
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        graph[name] = {m for m in _imports(path, package) if m.startswith("diffusers_nvfp4_fast")}
    return graph


def test_kernels_import_nothing_from_the_package():
    offenders = {}
    for path in KERNELS.glob("*.py"):
        package = "diffusers_nvfp4_fast.kernels"
        bad = {m for m in _imports(path, package) if m.startswith("diffusers_nvfp4_fast") and not m.startswith(package)}
        if bad:
            offenders[path.name] = sorted(bad)
    assert not offenders, offenders


def test_ops_import_no_patches_loaders_or_api():
    graph = _package_graph()
    higher = ("diffusers_nvfp4_fast.patches", "diffusers_nvfp4_fast.loaders", "diffusers_nvfp4_fast.api")
    offenders = {m: sorted(i for i in deps if i.startswith(higher)) for m, deps in graph.items()
                 if m.startswith("diffusers_nvfp4_fast.ops")}
    assert not any(offenders.values()), offenders


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first walk of ``edges`` meets, as the list of modules around it."""
    cycles: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    return cycles


def test_cycle_finder_finds_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_no_import_cycles_between_package_modules():
    graph = _package_graph()
    modules = set(graph)

    def targets(deps: set[str]) -> set[str]:  # "pkg.mod.name" imports resolve to the longest known module
        out = set()
        for dep in deps:
            while dep and dep not in modules:
                dep = dep.rpartition(".")[0]
            if dep:
                out.add(dep)
        return out

    edges = {m: targets(deps) - {m} for m, deps in graph.items()}
    # Importing a module imports its parent packages first anyway, so edges to an ancestor are left out.
    edges = {m: {d for d in ds if not m.startswith(d + ".")} for m, ds in edges.items()}
    assert not find_cycles(edges)


def test_cli_help_imports_neither_torch_nor_diffusers():
    code = ("import sys; from diffusers_nvfp4_fast.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('HEAVY', sorted(m for m in ('torch', 'diffusers', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "inspect" in out.stdout and "HEAVY []" in out.stdout, out.stdout + out.stderr
