"""The activation quantize spelled in torch ops (``ops/quantize_values.py``) and the pass that puts it into compiled
graphs (``inductor.ActivationQuantizePass``, decompose step): the bytes of ``decode_nvfp4(quantize_nvfp4(x))``, of
the quantize kernel, and of the graph with the opaque quantize. CPU: eager and inductor's C++ code; GPU: inductor's
Triton code with the reciprocals lowered to PTX, against the kernels."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch._inductor.utils import run_and_get_code

from diffusers_nvfp4_fast import NVFP4Linear, exact_inductor, inductor
from diffusers_nvfp4_fast.format import decode_nvfp4, e2m1_round, quantize_nvfp4
from diffusers_nvfp4_fast.ops.quantize_values import e2m1_values, quantize_values, register_reciprocal_lowering
from support.inputs import adversarial, e2m1_boundary_values, global_scale_for

RECIPES = pytest.mark.parametrize("fast_math", [True, False], ids=["fast-math", "precise"])
E2M1_TABLE = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _reference_values(x: torch.Tensor, g: torch.Tensor, fast_math: bool) -> torch.Tensor:
    return decode_nvfp4(*quantize_nvfp4(x, g, fast_math=fast_math), dtype=torch.float16)


def _code_values(v: torch.Tensor) -> torch.Tensor:
    codes = e2m1_round(v).long()
    table = E2M1_TABLE.to(v.device)
    return torch.where(codes >= 8, -table[codes & 7], table[codes & 7])  # code 8 is -0.0


def test_e2m1_values_are_the_reference_codes_values_on_every_boundary():
    x = e2m1_boundary_values()
    x = x[: x.numel() // 8]  # each value once
    assert torch.equal(_bits(e2m1_values(x)), _bits(_code_values(x)))
    # the rounding constants matter: without the range's offset a tie goes to the odd code
    assert not torch.equal(_bits(torch.round(x.clamp(-6, 6) * 2) / 2), _bits(_code_values(x)))


@RECIPES
def test_values_match_the_reference_on_adversarial_blocks(fast_math):
    x = adversarial(96, 512, device="cpu", seed=3)
    for g in (global_scale_for(x), torch.tensor([0.37]), torch.tensor(2688.0 / 5.0)):
        assert torch.equal(_bits(quantize_values(x, g, fast_math)), _bits(_reference_values(x, g, fast_math)))


@pytest.mark.slow
@RECIPES
def test_compiled_values_match_the_reference(fast_math):
    x = adversarial(64, 256, device="cpu", seed=4)
    g = global_scale_for(x)
    register_reciprocal_lowering()
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, s: quantize_values(a * 2, s, fast_math), fullgraph=True)
    assert torch.equal(_bits(compiled(x, g)), _bits(_reference_values(x * 2, g, fast_math)))


class _GeluThenNVFP4(nn.Module):
    """A producer inductor generates (as a block's GELU or modulation) feeding an NVFP4 layer, and one NVFP4 layer fed
    straight from the graph's input (which the pass leaves opaque)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = NVFP4Linear.from_weight(torch.randn(48, 64), torch.randn(48), 0.01).to(torch.bfloat16)
        self.first = NVFP4Linear.from_weight(torch.randn(64, 64), None, 0.01).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(nn.functional.gelu(self.first(x), approximate="tanh"))


def _compiled(model: nn.Module, x: torch.Tensor, decompose: bool) -> tuple[torch.Tensor, str, int]:
    pass_ = inductor.ACTIVATION_QUANTIZE_PASS
    before, decomposed = pass_.decompose, pass_.decomposed
    pass_.decompose = decompose
    try:
        torch._dynamo.reset()
        with exact_inductor(), torch._inductor.config.patch(fx_graph_cache=False):
            out, code = run_and_get_code(torch.compile(model, backend="inductor", fullgraph=True), x)
    finally:
        pass_.decompose = before
    return out, "\n".join(code), pass_.decomposed - decomposed


@pytest.mark.slow
def test_pass_fuses_the_quantize_into_the_producer_and_keeps_bytes(monkeypatch):
    # On CPU no layer takes FP16 values (that is SM80-SM90): let the pass treat every call as one that does.
    monkeypatch.setattr(inductor, "takes_decoded_activation", lambda *args: True)
    model, x = _GeluThenNVFP4(), torch.randn(2, 40, 64, dtype=torch.bfloat16) * 3
    with torch.inference_mode():
        opaque, opaque_code, none = _compiled(model, x, decompose=False)
        fused, code, decomposed = _compiled(model, x, decompose=True)
    assert none == 0 and decomposed == 1  # self.fc; self.first reads the graph input and stays opaque
    assert torch.equal(fused, opaque)
    assert len(re.findall(r"nvfp4_fast\.quantized_linear\.default\(", code)) == 1
    assert len(re.findall(r"nvfp4_fast\.linear_fp16_x\.default\(", code)) == 1
    assert len(re.findall(r"nvfp4_fast\.quantized_linear\.default\(", opaque_code)) == 2


def test_pass_leaves_calls_that_do_not_take_fp16_values():
    # On CPU the GEMM takes packed bytes: nothing is decomposed, whatever the producer.
    model, x = _GeluThenNVFP4(), torch.randn(2, 40, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        _, code, decomposed = _compiled(model, x, decompose=True)
    assert decomposed == 0 and "linear_fp16_x" not in code


# --- GPU: inductor's Triton code, reciprocals as PTX, against the quantize kernel -------------------------------

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@gpu
@needs_cuda
@RECIPES
def test_gpu_compiled_values_match_the_kernel(fast_math):
    from diffusers_nvfp4_fast.kernels import quantize_nvfp4_decoded

    assert register_reciprocal_lowering()
    x = adversarial(256, 1024, device="cuda", seed=5)
    g = global_scale_for(x)
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        got, code = run_and_get_code(torch.compile(lambda a, s: quantize_values(a, s, fast_math), fullgraph=True),
                                     x, g)
    want = quantize_nvfp4_decoded(x, g, fast_math=fast_math)
    assert torch.equal(_bits(got), _bits(want))
    source = "\n".join(code)
    assert ("rcp.approx.ftz.f32" if fast_math else "rcp.rn.f32") in source  # lowered, not a call of the op
    assert "torch.ops.nvfp4_fast.reciprocal.default(" not in source


@gpu
@needs_cuda
def test_gpu_compiled_e2m1_values_on_every_boundary():
    x = e2m1_boundary_values()
    x = x[: x.numel() // 8].cuda()
    torch._dynamo.reset()
    got = torch.compile(e2m1_values, fullgraph=True)(x)
    assert torch.equal(_bits(got.cpu()), _bits(_code_values(x.cpu())))


@gpu
@needs_cuda
def test_gpu_pass_keeps_the_bytes_of_the_opaque_quantize():
    model = _GeluThenNVFP4().cuda()
    x = torch.randn(2, 200, 64, dtype=torch.bfloat16, device="cuda") * 3  # 400 rows: the GEMM takes FP16 values
    with torch.inference_mode():
        opaque, _, _ = _compiled(model, x, decompose=False)
        fused, code, decomposed = _compiled(model, x, decompose=True)
    assert decomposed == 1 and "linear_fp16_x" in code
    assert torch.equal(fused, opaque)
