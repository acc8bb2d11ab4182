"""Row counts that the kernels are not specialized on: Triton compiles one binary per divisibility-by-16 of each
integer argument, so Qwen-Image's image stream (4096 rows) and its text stream (a prompt's length) asked for two
binaries of each kernel below, and a negative prompt of another length for more. Where the hint changes no code,
the kernel declares the argument in ``do_not_specialize_on_alignment`` (docs/performance.md, "First image")."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton", reason="Triton is not installed, so no kernel was compiled; CI installs it")
GLUON_HOPPER = "triton.experimental.gluon.language.nvidia.hopper"


def _ptx_code(compiled) -> list[str]:
    """The PTX's instructions: no comments, file table or DWARF sections, which name the directory a cached binary was
    first compiled in (a fresh clone elsewhere shares Triton's cache, keyed by source)."""
    code = compiled.asm["ptx"].split("\t.section\t.debug", 1)[0]
    return [line for line in code.splitlines() if not line.startswith("//") and ".file" not in line]


def _resnorm(divisible):
    from support.sass_count import compile_qwen_resnorm

    return compile_qwen_resnorm(3072, decoded=True, divisible=divisible)


# As Qwen-Image launches them (the specializations its H100 run recorded): aligned pointers, K and the row stride
# divisible by 16, as NVFP4's 16-element blocks make them.
ALIGNED = ("x_ptr", "h_ptr", "g_ptr", "out_ptr", "K", "row_stride")


def _quantize_decoded(divisible):
    from support.sass_count import SIGNATURES, compile_kernel

    names = SIGNATURES["decoded"][0].arg_names
    return compile_kernel("decoded", 90, fast_math=True, block_r=4, block_c=32,
                          divisible=tuple(n for n in ALIGNED if n in names) + divisible)


def _gelu_decoded(divisible):
    from support.sass_count import SIGNATURES, compile_kernel

    names = SIGNATURES["gelu_decoded"][0].arg_names
    return compile_kernel("gelu_decoded", 90, fast_math=True, block_r=8, block_c=16,
                          divisible=tuple(n for n in (*ALIGNED, "col_tiles") if n in names) + divisible)


def _qk_norm_rotary(divisible):
    from support.sass_count import compile_qk_norm_rotary

    return compile_qk_norm_rotary(90, divisible=divisible)


def _gemm_sm90(divisible):
    from support.sass_count import compile_gemm_sm90

    return compile_gemm_sm90(block_m=256, has_bias=True, divisible=divisible)


# (module, kernel, the arguments not specialized on alignment, a sm_90 build given the arguments told divisible)
CASES = {
    "resnorm": ("layer_norm_quantize", "_resnorm_quantize_kernel", ("M", "L"), _resnorm),
    "quantize_decoded": ("quantize_nvfp4", "_quantize_nvfp4_decoded_kernel", ("M",), _quantize_decoded),
    "gelu_decoded": ("gelu_quantize", "_gelu_quantize_decoded_kernel", ("M",), _gelu_decoded),
    "qk_norm_rotary": ("qk_norm_rotary", "_qk_norm_rotary_kernel", ("S",), _qk_norm_rotary),
    "gemm_sm90": ("nvfp4_gemm_sm90", "_nvfp4_gemm_sm90_kernel", ("M",), _gemm_sm90),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_row_count_hint_that_changes_no_code_is_not_specialized(case):
    """The kernel is declared so, and compiled for sm_90 its PTX is the same whether or not the row counts are known
    divisible by 16: dropping the specialization halves the binaries to compile and loses no instruction."""
    import importlib

    module, name, rows, build = CASES[case]
    if case == "gemm_sm90":
        pytest.importorskip(GLUON_HOPPER, reason="this Triton has no Gluon Hopper API, so the SM90 GEMM was not "
                                                 "compiled; it is with Triton >= 3.6, as CI installs")
    kernel = getattr(importlib.import_module(f"diffusers_nvfp4_fast.kernels.{module}"), name)
    declared = {p.name for p in kernel.params if p.do_not_specialize_on_alignment}
    assert declared == set(rows), f"{name}: not specialized on alignment: {sorted(declared)}, expected {rows}"
    assert _ptx_code(build(())) == _ptx_code(build(rows)), (
        f"{name}: the divisibility of {rows} changes its code, so one binary for both costs speed")
