"""The public API as the README states it: every name of its API table imports from the package, and the reports
and errors of ``enable_fast_paths`` say what is true for models without fused paths and for uncalibrated layers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import diffusers_nvfp4_fast
from diffusers_nvfp4_fast import NVFP4CheckpointError, disable_fast_paths, enable_fast_paths, fast_path_report
from diffusers_nvfp4_fast.linear import NVFP4Linear

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_api_names() -> list[str]:
    """The Python names the README's API table documents: each identifier called or named in its first column."""
    text = README.read_text()
    table = text[text.index("## API"):]
    table = table[:table.index("\n\n", table.index("| call |"))]
    names = []
    for row in table.splitlines()[2:]:
        first = row.split(" | ")[0]
        for code in re.findall(r"`([^`]+)`", first):
            if code.startswith("diffusers-nvfp4-fast"):
                continue  # a command, not a Python name
            while "(" in code:  # drop argument lists, innermost first
                code = re.sub(r"\([^()]*\)", "", code)
            names += [n for n in re.findall(r"[A-Za-z_]\w*", code) if n != "with"]
    return sorted(set(names))


def test_the_readme_api_table_lists_what_it_should():
    names = readme_api_names()
    for name in ("enable_fast_paths", "capture_cuda_graphs", "release_cuda_graphs", "fit_to_budget",
                 "load_nvfp4_transformer", "NVFP4Linear", "dequantize_nvfp4", "exact_inductor"):
        assert name in names, (name, names)


@pytest.mark.parametrize("name", readme_api_names())
def test_every_name_of_the_readme_api_table_imports_from_the_package(name):
    exec(f"from diffusers_nvfp4_fast import {name}", {})  # noqa: S102 - the import a README reader types
    assert name in diffusers_nvfp4_fast.__all__


def readme_api_signatures() -> list[tuple[str, list[str]]]:
    """(name, the parameter names the README's API table writes in its call) for every call written with arguments."""
    text = README.read_text()
    table = text[text.index("## API"):]
    table = table[:table.index("\n\n", table.index("| call |"))]
    calls = []
    for row in table.splitlines()[2:]:
        for code in re.findall(r"`([^`]+)`", row.split(" | ")[0]):
            match = re.fullmatch(r"(?:with )?([A-Za-z_]\w*)\((.*)\)(?::.*)?", code)
            if match and not code.startswith("diffusers-nvfp4-fast"):
                params = [p.strip().split("=")[0] for p in match.group(2).split(",")]
                calls.append((match.group(1), [p for p in params if p and p not in ("*", "...")]))
    return calls


@pytest.mark.parametrize("name, params", readme_api_signatures())
def test_the_readme_api_table_names_each_parameter_as_the_code_does(name, params):
    import inspect

    signature = inspect.signature(getattr(diffusers_nvfp4_fast, name))
    accepted = set(signature.parameters)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    # The first argument may be written as what the user passes (pipe, model) rather than by its name.
    unknown = [p for p in params[1:] if p not in accepted and not takes_any]
    if params and params[0] not in accepted and params[0] not in ("pipe", "model"):
        unknown.insert(0, params[0])
    assert not unknown, f"README writes {name}({', '.join(params)}); {name} has no parameter {unknown}"


class _Encoder(nn.Module):
    """A module of a class this package has no patches for, with one NVFP4 layer (say, a text encoder)."""

    def __init__(self) -> None:
        super().__init__()
        weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        self.proj = NVFP4Linear.from_weight(weight, None, 0.01)

    def forward(self, x):
        return self.proj(x)


def test_a_class_without_fused_paths_is_reported_as_gemms_only():
    model = _Encoder()
    entry = enable_fast_paths(model)["_Encoder"]
    assert entry["fused"] is True and entry["fused_paths"] is False and entry["sites"] == {}
    text = str(fast_path_report(model))
    assert "no fused paths for _Encoder: NVFP4 GEMMs only" in text and "fused paths on" not in text
    disable_fast_paths(model)


def test_the_advice_for_uncalibrated_modelopt_layers_is_a_call_that_exists():
    import modelopt.torch.quantization as mtq

    from support.bfl_files import quantize_tiny_flux2

    model = quantize_tiny_flux2(True, bf16_txt_qkv=False)
    mtq.disable_quantizer(model, lambda n: n == "single_transformer_blocks.0.attn.to_out.input_quantizer")
    with pytest.raises(NVFP4CheckpointError, match=r"pass dynamic_input_scale=True to enable_fast_paths\(\.\.\.\)"):
        enable_fast_paths(model)
    entry = enable_fast_paths(model, dynamic_input_scale=True)["Flux2Transformer2DModel"]
    layer = model.single_transformer_blocks[0].attn.to_out
    assert isinstance(layer, NVFP4Linear) and layer.dynamic_input_scale and entry["converted"]
    disable_fast_paths(model)
    assert not isinstance(model.single_transformer_blocks[0].attn.to_out, NVFP4Linear)
