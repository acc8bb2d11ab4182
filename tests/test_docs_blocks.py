"""Every Python block of ``docs/`` is tested the way the README's are (issue 33, point 10).

A block runs as written on the tiny models, in file order, with only paths, repo ids, the device and the image size
substituted. A block that cannot run here says why in the HTML comment just above it:
``<!-- docs-test: compile (why) -->`` (parsed, and its calls checked against the functions they name) or
``<!-- docs-test: modelopt (why) -->`` (runs with ``pipe`` a tiny FLUX.2 pipeline whose transformer ModelOpt
quantized in memory). Every block, README's included, must pass
the prompt to a pipeline by name: ``Flux2Pipeline``'s first parameter is ``image``."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch

from diffusers_nvfp4_fast import load_nvfp4_transformer
from diffusers_nvfp4_fast.linear import NVFP4Linear
from diffusers_nvfp4_fast.testing import tiny
from support.bfl_files import write_bfl_file
from support.comfy_files import FAMILIES, FileCase, make_source, write_case
from support.comfy_writer import COMFY_PREFIX

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(?:<!-- docs-test: (?P<mode>compile|modelopt) \((?P<why>[^)]+)\) -->\n)?"
                   r"```python\n(?P<code>.*?)```", re.S)


def blocks(path: Path) -> list[tuple[str, str]]:
    """``(mode, code)`` of each Python block in ``path``: mode "run", "compile" or "modelopt"."""
    return [(m["mode"] or "run", m["code"]) for m in BLOCK.finditer(path.read_text())]


def all_blocks() -> list[tuple[str, int, str, str]]:
    files = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    return [(f.relative_to(ROOT).as_posix(), i, mode, code) for f in files for i, (mode, code) in enumerate(blocks(f))]


def positional_pipeline_calls(code: str) -> list[str]:
    """Calls ``pipe(...)`` / ``pipeline(...)`` that pass anything by position."""
    return [ast.unparse(node) for node in ast.walk(ast.parse(code))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in ("pipe", "pipeline") and node.args]


def unbound_package_calls(code: str) -> list[str]:
    """Calls of names imported from this package (``from diffusers_nvfp4_fast... import f``) whose arguments do not
    bind to ``f``'s signature, with the error."""
    tree = ast.parse(code)
    imported = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("diffusers_nvfp4_fast"):
            module = importlib.import_module(node.module or "")
            imported.update({a.asname or a.name: getattr(module, a.name) for a in node.names})
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in imported:
            try:
                inspect.signature(imported[node.func.id]).bind(*node.args, **{k.arg: k.value for k in node.keywords
                                                                               if k.arg is not None})
            except TypeError as e:
                bad.append(f"{ast.unparse(node)}: {e}")
    return bad


def test_docs_have_blocks_and_every_skipped_one_says_why():
    found = all_blocks()
    assert {f for f, *_ in found} >= {"docs/checkpoints.md", "docs/design.md", "docs/format.md", "README.md"}
    assert not [(f, i) for f, i, mode, code in found if f == "README.md" and mode != "run"]  # test_readme runs them
    assert sum(mode == "run" for f, _, mode, _ in found if f.startswith("docs/")) >= 5


@pytest.mark.parametrize("where, index, mode, code", all_blocks(), ids=lambda v: v if isinstance(v, str) and
                         v.endswith(".md") else None)
def test_block_parses_passes_prompts_by_name_and_binds_package_calls(where, index, mode, code):
    assert not positional_pipeline_calls(code), f"{where} block {index}"
    assert not unbound_package_calls(code), f"{where} block {index}"


def test_positional_prompt_is_caught():
    assert positional_pipeline_calls('image = pipe("a fox", num_inference_steps=4)') == \
        ["pipe('a fox', num_inference_steps=4)"]
    assert unbound_package_calls("from diffusers_nvfp4_fast import quantize_nvfp4\n"
                                 "quantize_nvfp4(x, 1.0, scale_layot='linear')")


@pytest.fixture(scope="module")
def paths(modelopt_exports, tmp_path_factory) -> list[tuple[str, str]]:
    """What ``docs/checkpoints.md`` names, in the order it is substituted, and the tiny stand-in."""
    tmp = tmp_path_factory.mktemp("docs")
    export = modelopt_exports("flux2")
    pipe, _ = tiny.tiny_flux2_pipeline()
    pipe.save_pretrained(tmp / "flux2-pipeline")
    pipe.transformer = load_nvfp4_transformer(export)
    pipe.save_pretrained(tmp / "nvfp4-repo")
    comfy = {}  # written by comfy-kitchen's own quantizer in ComfyUI's layout (support.comfy_files)
    for name, case in (("bfl-repo/flux2-dev-nvfp4.safetensors", FileCase("flux2", "flux2", prefix=COMFY_PREFIX)),
                       ("qwen_image_nvfp4.safetensors", FileCase("qwen", "qwen", prefix=COMFY_PREFIX)),
                       ("qwen_image_edit_2511_nvfp4.safetensors", FileCase("edit", "qwen_edit_2511")),
                       ("qwen_image_2.1_nvfp4.safetensors", FileCase("qwen21", "qwen21", prefix=COMFY_PREFIX)),
                       ("flux2-dev-nvfp4-mixed.safetensors", FileCase("mixed", "flux2", input_scales="some"))):
        comfy[name] = tmp / name
        write_case(make_source(FAMILIES[case.family]), case, comfy[name])
    write_bfl_file(export, tmp / "native.safetensors", nibble_order="lo_first", swizzle=False, markers=False,
                   header=False)
    return [
        ('"path/to/export"', repr(str(export))),
        ('"org/repo"', repr(str(tmp / "nvfp4-repo"))),
        ('"black-forest-labs/FLUX.2-dev-NVFP4"', repr(str(tmp / "bfl-repo"))),
        ('("flux2-dev-nvfp4.safetensors")', f"({str(tmp / 'bfl-repo' / 'flux2-dev-nvfp4.safetensors')!r})"),
        ('("flux2-dev-nvfp4.safetensors",', f"({str(tmp / 'bfl-repo' / 'flux2-dev-nvfp4.safetensors')!r},"),
        *[(f'"{name}"', repr(str(path))) for name, path in comfy.items() if "/" not in name],
        ('"flux2-nvfp4-diffusers-layout.safetensors"', repr(str(tmp / "native.safetensors"))),
        ('"black-forest-labs/FLUX.2-dev"', repr(str(tmp / "flux2-pipeline"))),
        ('"flux2-nvfp4-pipeline"', repr(str(tmp / "saved-pipeline"))),
        ('export_dir="flux2-dev-nvfp4"', f"export_dir={str(tmp / 'recipe-export')!r}"),
        ('.to("cuda")', ""),  # ModelOpt's fake quantization of the tiny model runs on the CPU
        ("num_inference_steps=4,", "num_inference_steps=1, height=64, width=64, text_encoder_out_layers=(1, 2, 3),"),
    ]


def substitute(code: str, paths: list[tuple[str, str]]) -> str:
    for old, new in paths:
        code = code.replace(old, new)
    assert "black-forest-labs" not in code and "org/repo" not in code, f"a name was kept:\n{code}"
    return code


def test_checkpoints_md_blocks_run_in_order(paths):
    pytest.importorskip("modelopt", reason="the ModelOpt recipe needs nvidia-modelopt (pip install -e '.[test]')")
    from support.modelopt_exports import quantize_with_modelopt

    namespace: dict = {}
    for i, (mode, block) in enumerate(blocks(ROOT / "docs" / "checkpoints.md")):
        if mode == "modelopt":
            scope = {"pipe": quantize_with_modelopt("flux2")}
            exec(compile(block, f"docs/checkpoints.md python block {i}", "exec"), scope)  # noqa: S102 - the docs' code
            assert any(isinstance(m, NVFP4Linear) for m in scope["pipe"].transformer.modules())
        elif mode == "run":
            code = substitute(block, paths)
            exec(compile(code, f"docs/checkpoints.md python block {i}", "exec"), namespace)  # noqa: S102 - the docs' code
    recipe = dict(paths)['export_dir="flux2-dev-nvfp4"'].split("=", 1)[1].strip("'")
    assert any(isinstance(m, NVFP4Linear) for m in load_nvfp4_transformer(recipe).modules())
    assert namespace["transformer"].dtype == torch.bfloat16
    assert namespace["edit_2511"].config["zero_cond_t"]  # "Where to get checkpoints": each kind loaded
    assert any(getattr(m, "dynamic_input_scale", False) for m in namespace["mixed"].modules())
