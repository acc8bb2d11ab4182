"""One activation quantized once for several NVFP4 layers (``ops/shared_quantize.py``) and the inductor pass that
uses it in compiled graphs (``inductor.ShareActivationQuantize``): the bytes of one ``quantized_linear`` per layer.
CPU here (the reference GEMM); tests/test_compile.py runs whole compiled models on the GPU."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch._inductor.utils import run_and_get_code

from diffusers_nvfp4_fast import NVFP4Linear, exact_inductor
from diffusers_nvfp4_fast.ops.linear import quantized_linear
from diffusers_nvfp4_fast.ops.shared_quantize import quantized_linears


def _layers(scales: list[float], k: int = 64, bias: bool = True) -> list[NVFP4Linear]:
    torch.manual_seed(0)
    layers = []
    for i, scale in enumerate(scales):
        layer = NVFP4Linear.from_weight(torch.randn(32 + 16 * i, k), torch.randn(32 + 16 * i) if bias else None, 0.01)
        layer.input_scale_inv.fill_(scale)
        layers.append(layer.to(torch.bfloat16))
    return layers


def _each(x: torch.Tensor, layers: list[NVFP4Linear]) -> list[torch.Tensor]:
    return [quantized_linear(x, m.input_scale_inv, False, m.weight, m.weight_scale, m.alpha, m.bias, x.dtype,
                             m.scale_layout == "128x4") for m in layers]


def _shared(x: torch.Tensor, layers: list[NVFP4Linear]) -> list[torch.Tensor]:
    return quantized_linears(x, [m.input_scale_inv for m in layers], False, [m.weight for m in layers],
                             [m.weight_scale for m in layers], [m.alpha for m in layers], [m.bias for m in layers],
                             x.dtype, [m.scale_layout == "128x4" for m in layers])


@pytest.mark.parametrize("scales", [[0.75, 0.75, 0.75], [0.75, 1.5, 0.75]], ids=["equal", "differing"])
def test_shared_quantize_gives_each_layers_bytes(scales):
    layers = _layers(scales)
    x = torch.randn(40, 64, dtype=torch.bfloat16) * 4
    shared, each = _shared(x, layers), _each(x, layers)
    assert all(torch.equal(a, b) for a, b in zip(shared, each))
    if scales[0] != scales[1]:
        # the scale check matters: layer 1 fed layer 0's quantized activation gives other bytes
        wrong = quantized_linear(x, layers[0].input_scale_inv, False, layers[1].weight, layers[1].weight_scale,
                                 layers[1].alpha, layers[1].bias, x.dtype, True)
        assert not torch.equal(wrong, each[1])


def test_scale_changed_in_place_is_checked_again():
    layers = _layers([0.75, 0.75])
    x = torch.randn(40, 64, dtype=torch.bfloat16) * 4
    _shared(x, layers)
    layers[1].input_scale_inv.fill_(1.5)  # bumps its version: the cached answer no longer applies
    assert all(torch.equal(a, b) for a, b in zip(_shared(x, layers), _each(x, layers)))


class _ThreeProjections(nn.Module):
    def __init__(self, layers: list[NVFP4Linear]):
        super().__init__()
        self.q, self.k, self.v = layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2  # a producer inductor generates, as a norm would be
        return torch.cat([self.q(h), self.k(h), self.v(h)], dim=-1)


@pytest.mark.slow
def test_compiled_projections_share_one_quantize_and_keep_bytes():
    model = _ThreeProjections(_layers([0.75, 0.75, 0.75]))
    x = torch.randn(2, 40, 64, dtype=torch.bfloat16) * 2
    with torch.inference_mode():
        eager = model(x)
        torch._dynamo.reset()
        with exact_inductor():
            compiled, code = run_and_get_code(torch.compile(model, backend="inductor", fullgraph=True), x)
    calls = re.findall(r"nvfp4_fast\.(quantized_linears?)\.default\(", "\n".join(code))
    assert calls == ["quantized_linears"], calls  # one call for the three layers (the code may come from a cache)
    assert torch.equal(compiled, eager)
