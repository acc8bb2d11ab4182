"""The layering of docs/design.md §2, checked on the source: kernels import nothing from the package, the ground
floor nothing but itself, the graph runner nothing NVFP4-aware, ops import no patches or loaders, loaders no patches,
no module imports one that imports it back (package and kernels), the command line starts without importing torch or
diffusers, and the kernels an install imports are its own."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


# Private Triton and torch names of the launch path: only kernels/triton_compat.py may read them (docs/design.md §2).
PRIVATE_NAMES = re.compile(r"\._[A-Za-z]|device_caches|__closure__|__code__|__dict__|object\.__|fill_tma_descriptor"
                           r"|_BASE_ARGS_FORMAT|torch\._C\.|packed_metadata|cell_contents")
# Each other occurrence in kernels/, allowed by (file, text of the line) and why.
ALLOWED_PRIVATE = {
    # Triton 3.6's Gluon names the shared-memory reinterpret `_reinterpret` (3.9: `reinterpret`); inside a jit
    # function, checked by the SM90 AOT builds of tests/test_gemm.py for both names.
    ("nvfp4_gemm_sm90.py", "s_view = s_smem.index(s)._reinterpret(gl.int32, [BLOCK_N], s_rows_layout)"),
    # Prose: the project's own function format._rcp_approx named in a docstring.
    ("rcp_approx.py", "\"\"\"``rcp.approx.ftz.f32`` elementwise, for references: with it in place of "
                      "``format._rcp_approx``, the pure-torch"),
}


def test_private_triton_and_torch_names_appear_only_in_the_seam():
    found = set()
    for path in sorted(KERNELS.glob("*.py")):
        if path.name == "triton_compat.py":
            continue
        for line in path.read_text().splitlines():
            text = line.strip()
            if PRIVATE_NAMES.search(text) and not text.startswith("#"):
                found.add((path.name, text))
    assert found == ALLOWED_PRIVATE, (f"private names outside kernels/triton_compat.py: "
                                      f"{sorted(found - ALLOWED_PRIVATE)}; allowed but gone: "
                                      f"{sorted(ALLOWED_PRIVATE - found)}")


def test_the_private_name_pattern_finds_what_it_is_for():
    for text in ("torch._C._cuda_getCurrentRawStream(0)", "kernel.device_caches[0]", "f.__closure__",
                 "driver._BASE_ARGS_FORMAT", "utils.fill_tma_descriptor", "object.__new__(T)", "d.__dict__",
                 "c.packed_metadata", "launch._private_table"):
        assert PRIVATE_NAMES.search(text), text
    assert not PRIVATE_NAMES.search("compat.current_raw_stream(device)")


def test_ops_import_no_patches_loaders_or_api():
    graph = _package_graph()
    higher = ("diffusers_nvfp4_fast.patches", "diffusers_nvfp4_fast.loaders", "diffusers_nvfp4_fast.api")
    offenders = {m: sorted(i for i in deps if i.startswith(higher)) for m, deps in graph.items()
                 if m.startswith("diffusers_nvfp4_fast.ops")}
    assert not any(offenders.values()), offenders


# Modules of the ground floor: they import torch or the standard library and, of the package, only each other.
GROUND_FLOOR = ("diffusers_nvfp4_fast.caches", "diffusers_nvfp4_fast.module_hooks", "diffusers_nvfp4_fast.progress",
                "diffusers_nvfp4_fast.state_probes", "diffusers_nvfp4_fast.swaps", "diffusers_nvfp4_fast.switches",
                "diffusers_nvfp4_fast.torch_compat")
# What the graph runner must not reach, directly or through another module: it knows nothing of NVFP4.
NVFP4_AWARE = ("diffusers_nvfp4_fast.ops", "diffusers_nvfp4_fast.patches", "diffusers_nvfp4_fast.linear",
               "diffusers_nvfp4_fast.loaders", "diffusers_nvfp4_fast.api", "diffusers_nvfp4_fast.kernels",
               "diffusers_nvfp4_fast.format", "diffusers_nvfp4_fast.lora")


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Package modules that importing ``start`` imports, by the source's import statements. The package's own
    ``__init__`` is not followed: it imports its public names on first use only."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            while dep and dep not in graph:  # "pkg.mod.name" resolves to the longest known module
                dep = dep.rpartition(".")[0]
            if dep and dep != "diffusers_nvfp4_fast" and dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_ground_floor_imports_nothing_above_it():
    graph = _package_graph()
    assert set(GROUND_FLOOR) <= set(graph)
    offenders = {m: sorted(i for i in graph[m] if i != "diffusers_nvfp4_fast" and not i.startswith(GROUND_FLOOR))
                 for m in GROUND_FLOOR}
    assert not any(offenders.values()), offenders


def test_graphs_import_no_ops_patches_linear_loaders_or_api():
    graph = _package_graph()
    runner = [m for m in graph if m.startswith("diffusers_nvfp4_fast.graphs")]
    assert len(runner) >= 4
    offenders = {m: sorted(i for i in _reachable(graph, m) if i.startswith(NVFP4_AWARE)) for m in runner}
    assert not any(offenders.values()), offenders


def test_reachable_follows_imports_through_other_modules():
    graph = {"p.a": {"p.b.f"}, "p.b": {"p.c"}, "p.c": set(), "p.d": {"p.a"}}
    assert _reachable(graph, "p.d") == {"p.a", "p.b", "p.c"}


def test_importing_the_graph_runner_loads_no_nvfp4_module():
    """What the source says, at run time: a fresh process that imports the runner holds none of the NVFP4 stack
    (nor Triton)."""
    code = ("import sys; import diffusers_nvfp4_fast.graphs\n"
            f"print('LOADED', sorted(m for m in sys.modules if m == 'triton' or m.startswith({NVFP4_AWARE!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "LOADED []" in out.stdout, out.stdout + out.stderr


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
    code = ("import sys; from diffusers_nvfp4_fast.commands.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('HEAVY', sorted(m for m in ('torch', 'diffusers', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "inspect" in out.stdout and "HEAVY []" in out.stdout, out.stdout + out.stderr


def test_loaders_and_quantize_import_no_patches_graphs_or_api():
    graph = _package_graph()
    higher = ("diffusers_nvfp4_fast.patches", "diffusers_nvfp4_fast.graphs", "diffusers_nvfp4_fast.api")
    wing = ("diffusers_nvfp4_fast.loaders", "diffusers_nvfp4_fast.quantize")
    assert any(m.startswith(wing[1]) for m in graph)
    offenders = {m: sorted(i for i in deps if i.startswith(higher)) for m, deps in graph.items() if m.startswith(wing)}
    assert not any(offenders.values()), offenders


def test_no_import_cycles_between_kernel_modules():
    names = {p.stem for p in KERNELS.glob("*.py")}
    edges = {p.stem: {m.rpartition(".")[2] for m in _imports(p, "diffusers_nvfp4_fast.kernels")
                      if m.startswith("diffusers_nvfp4_fast.kernels.")} & names - {p.stem}
             for p in KERNELS.glob("*.py") if p.stem != "__init__"}
    assert edges["nvfp4_gemm_sm90"] >= {"launch", "tiling"}  # the walk sees the kernels' own imports
    assert not find_cycles(edges)


def test_a_kernel_import_failure_is_warned_with_its_error():
    pytest.importorskip("triton", reason="without Triton the kernels are not imported at all (the silent case)")
    code = (
        "import sys, warnings\n"
        "class Broken:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'diffusers_nvfp4_fast.kernels':\n"
        "            raise ImportError('a broken kernel module')\n"
        "sys.meta_path.insert(0, Broken())\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    from diffusers_nvfp4_fast.ops import dispatch\n"
        "print('KERNELS', dispatch.kernels)\n"
        "print('WHY', dispatch.KERNELS_UNAVAILABLE)\n"
        "print('WARNED', [str(w.message) for w in caught if 'a broken kernel module' in str(w.message)] != [])\n"
        "print('OWN_CAPABILITY', dispatch.cuda_capability is dispatch._cuda_capability)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "KERNELS None" in out.stdout and "WARNED True" in out.stdout, out.stdout + out.stderr
    assert "WHY diffusers_nvfp4_fast.kernels failed to import (ImportError: a broken kernel module)" in out.stdout
    assert "OWN_CAPABILITY True" in out.stdout  # the dispatch's fallback where the kernels' one is missing


def test_dispatch_and_kernels_share_one_cuda_capability():
    pytest.importorskip("triton", reason="without Triton the kernels are not imported, so the shared function was "
                                         "not checked; this runs wherever Triton is installed, as in CI")
    from diffusers_nvfp4_fast.kernels import launch
    from diffusers_nvfp4_fast.ops import dispatch

    assert dispatch.cuda_capability is launch.cuda_capability


def test_an_installed_package_uses_its_own_kernels(tmp_path):
    """``pip install`` puts ``kernels/`` inside the package; imported from there (not from this checkout), the
    package's kernels are its own files."""
    pytest.importorskip("triton", reason="the kernels import Triton, so they were not checked; "
                                         "this runs wherever Triton is installed, as in CI")
    source, target = tmp_path / "source", tmp_path / "site"  # a copy, so the build leaves this checkout untouched
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "tests", "benchmarks",
                                                                "examples", ".venv", "__pycache__"))
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                          str(source)], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    code = ("import diffusers_nvfp4_fast, diffusers_nvfp4_fast.kernels as k\n"
            "from diffusers_nvfp4_fast.ops import dispatch\n"
            "print(diffusers_nvfp4_fast.__file__); print(k.__file__); print(dispatch.kernels is k)")
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env=env)
    package, kernels, same = out.stdout.split()
    assert Path(package).parent == target / "diffusers_nvfp4_fast", out.stdout + out.stderr
    assert Path(kernels) == target / "diffusers_nvfp4_fast" / "kernels" / "__init__.py" and same == "True"
    for name in ("tiling.py", "gemm_configs.json"):  # the shipped GEMM configs are package data
        installed = target / "diffusers_nvfp4_fast" / "kernels" / name
        assert installed.read_bytes() == (KERNELS / name).read_bytes(), name


def test_a_checkout_root_on_sys_path_leaves_the_name_kernels_to_the_installed_package(tmp_path):
    """transformers (5.2x requires the hub package ``kernels``) imports ``kernels``; run from this checkout's root
    (``python -m pytest``, ``python -c``) the root comes first on sys.path and ``kernels/`` would answer instead."""
    pytest.importorskip("triton", reason="the kernels import Triton, so they were not checked; "
                                         "this runs wherever Triton is installed, as in CI")
    hub = tmp_path / "kernels"
    hub.mkdir()
    (hub / "__init__.py").write_text("WHICH = 'hub'\n")
    (hub / "layer.py").write_text("NAME = 'hub layer'\n")
    code = ("import kernels, kernels.layer, diffusers_nvfp4_fast.kernels as k\n"
            "print(kernels.WHICH, kernels.layer.NAME == 'hub layer', callable(k.nvfp4_gemm), k.__file__)")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    which, layer, gemm, path = out.stdout.split()
    assert (which, layer, gemm) == ("hub", "True", "True") and Path(path) == KERNELS / "__init__.py"
