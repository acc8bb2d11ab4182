"""Checkpoints that would load into garbage or NaN are refused with one ``NVFP4CheckpointError`` naming file, key and
value (all problems together), for ModelOpt exports, BFL files and in-memory conversions; truncated files are named
as truncated; a forced GEMM backend that cannot run says why.

Decisions (docs/checkpoints.md): a NaN, +-Inf or negative ``weight_scale_2`` is refused; a zero one is legal only when
every block scale is zero too (an all-zero weight); a NaN, +-Inf, zero or negative ``input_scale`` is refused; E4M3 NaN
bytes (0x7F, 0xFF) and negative block scales in ``weight_scale`` are refused."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffusers_nvfp4_fast import NVFP4CheckpointError, load_nvfp4_transformer
from diffusers_nvfp4_fast.loaders.inspect import inspect_checkpoint
from diffusers_nvfp4_fast.ops.dispatch import BackendUnavailableError, gemm_backend
from support.bfl_files import export_modelopt, quantize_tiny_flux2, write_bfl_file

LAYER = "transformer_blocks.0.attn.to_out.0"
WEIGHTS = "diffusion_pytorch_model.safetensors"


def _edited_export(src, dst, edit):
    shutil.copytree(src, dst)
    sd = load_file(str(dst / WEIGHTS))
    edit(sd)
    save_file(sd, str(dst / WEIGHTS))
    return dst


def _scalar(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


def test_bad_scales_in_a_modelopt_export_are_listed_together(modelopt_exports, tmp_path):
    def edit(sd):
        sd[f"{LAYER}.weight_scale_2"] = _scalar(float("nan"))
        sd["transformer_blocks.0.ff.linear_in.input_scale"] = _scalar(0.0)
        sd["transformer_blocks.0.ff.linear_out.input_scale"] = _scalar(-1.0)
        sd["single_transformer_blocks.0.attn.to_out.input_scale"] = _scalar(float("inf"))
        sd["single_transformer_blocks.1.attn.to_out.weight_scale_2"] = _scalar(float("-inf"))
        scales = sd["transformer_blocks.0.ff_context.linear_in.weight_scale"].view(torch.uint8).clone()
        scales[0, 0], scales[1, 1] = 0x7F, 0xFF
        sd["transformer_blocks.0.ff_context.linear_in.weight_scale"] = scales.view(torch.float8_e4m3fn)

    path = _edited_export(modelopt_exports("flux2"), tmp_path / "bad", edit)
    with pytest.raises(NVFP4CheckpointError) as info:
        load_nvfp4_transformer(path)
    msg = str(info.value)
    assert str(path) in msg and "6 problem(s) in NVFP4 scales" in msg, msg
    for needle in (f"{LAYER}.weight_scale_2 is nan", "ff.linear_in.input_scale is 0.0",
                   "ff.linear_out.input_scale is -1.0", "single_transformer_blocks.0.attn.to_out.input_scale is inf",
                   "single_transformer_blocks.1.attn.to_out.weight_scale_2 is -inf",
                   "ff_context.linear_in.weight_scale holds 2 E4M3 NaN byte(s)"):
        assert needle in msg, (needle, msg)


def test_zero_weight_scale_2_is_legal_only_with_all_zero_blocks(modelopt_exports, tmp_path):
    def zero_weight(sd):
        sd[f"{LAYER}.weight_scale_2"] = _scalar(0.0)
        sd[f"{LAYER}.weight_scale"] = torch.zeros_like(sd[f"{LAYER}.weight_scale"].view(torch.uint8)).view(
            torch.float8_e4m3fn)

    model = load_nvfp4_transformer(_edited_export(modelopt_exports("flux2"), tmp_path / "zero", zero_weight))
    assert float(model.get_submodule(LAYER).weight_scale_2) == 0.0

    def zero_global_only(sd):
        sd[f"{LAYER}.weight_scale_2"] = _scalar(0.0)

    with pytest.raises(NVFP4CheckpointError, match=f"{LAYER}.weight_scale_2 is 0 but some block scales are not"):
        load_nvfp4_transformer(_edited_export(modelopt_exports("flux2"), tmp_path / "zero2", zero_global_only))


def test_negative_block_scales_are_refused(modelopt_exports, tmp_path):
    def edit(sd):
        scales = sd[f"{LAYER}.weight_scale"].view(torch.uint8).clone()
        scales[0, 0] = 0x80 | 0x30  # -1.0 in E4M3
        sd[f"{LAYER}.weight_scale"] = scales.view(torch.float8_e4m3fn)

    with pytest.raises(NVFP4CheckpointError, match=f"{LAYER}.weight_scale holds 1 negative block scale"):
        load_nvfp4_transformer(_edited_export(modelopt_exports("flux2"), tmp_path / "neg", edit))


@pytest.fixture(scope="module")
def bfl_export(tmp_path_factory):
    return export_modelopt(quantize_tiny_flux2(True), tmp_path_factory.mktemp("errors") / "export")


def test_bad_scales_in_a_bfl_file(bfl_export, tmp_path):
    def edit(tensors, metadata):
        tensors["single_blocks.0.linear2.input_scale"] = _scalar(float("nan"))

    path = tmp_path / "bad.safetensors"
    write_bfl_file(bfl_export, path, edit=edit)
    with pytest.raises(NVFP4CheckpointError, match=r"single_blocks\.0\.linear2\.input_scale is nan") as info:
        load_nvfp4_transformer(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("cut", ["data", "header"])
def test_truncated_files_are_named(bfl_export, modelopt_exports, tmp_path, cut):
    bfl = tmp_path / "cut.safetensors"
    write_bfl_file(bfl_export, bfl)
    export = shutil.copytree(modelopt_exports("flux2"), tmp_path / "cut_export")
    for f in (bfl, export / WEIGHTS):
        data = f.read_bytes()
        header_len = int.from_bytes(data[:8], "little")
        f.write_bytes(data[: 8 + header_len // 2] if cut == "header" else data[:-100])
    for path, f in ((bfl, bfl), (export, export / WEIGHTS)):
        with pytest.raises(NVFP4CheckpointError, match="truncated or corrupt safetensors file") as info:
            load_nvfp4_transformer(path)
        assert str(f) in str(info.value)
    with pytest.raises(NVFP4CheckpointError, match="truncated or corrupt"):
        inspect_checkpoint(bfl)


@pytest.mark.parametrize("backend,needle", [
    ("triton", "DIFFUSERS_NVFP4_GEMM_BACKEND=triton cannot run here: the tensors are on cpu"),
    ("flashinfer", "DIFFUSERS_NVFP4_GEMM_BACKEND=flashinfer cannot run here: the tensors are on cpu"),
])
def test_forced_backend_that_cannot_run_says_why(monkeypatch, backend, needle):
    from diffusers_nvfp4_fast.linear import NVFP4Linear

    monkeypatch.setenv("DIFFUSERS_NVFP4_GEMM_BACKEND", backend)
    with pytest.raises(BackendUnavailableError, match=needle):
        gemm_backend(torch.device("cpu"))
    layer = NVFP4Linear.from_weight(torch.randn(32, 64), None, 0.01)
    with pytest.raises(BackendUnavailableError, match=needle):
        layer(torch.randn(2, 64, dtype=torch.bfloat16))
    monkeypatch.setenv("DIFFUSERS_NVFP4_GEMM_BACKEND", "cutlass")
    with pytest.raises(ValueError, match="DIFFUSERS_NVFP4_GEMM_BACKEND='cutlass': expected one of flashinfer, triton"):
        gemm_backend(torch.device("cpu"))
