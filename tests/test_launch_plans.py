"""``NVFP4Linear``'s eager launch plans (docs/design.md §8): prepared once per row count after an ordinary call,
then the same binaries with the same arguments, so the same bytes; inputs a plan does not take go the ordinary
way. CPU: no plan is ever made (the torch emulation runs). GPU: plan bytes == ordinary bytes, plans used, fallbacks."""

from __future__ import annotations

import pytest
import torch

from diffusers_nvfp4_fast import NVFP4Linear
from diffusers_nvfp4_fast.ops.linear import linear_fp16_x, quantized_linear


def _layer(device: str, bias: bool = True, n: int = 3072, k: int = 3072) -> NVFP4Linear:
    torch.manual_seed(0)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
    b = torch.randn(n, device=device, dtype=torch.bfloat16) * 0.02 if bias else None
    return NVFP4Linear.from_weight(w, b, 8.0 / 2688)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_cpu_calls_make_no_plan():
    layer = _layer("cpu", n=64, k=128)
    x = torch.randn(200, 128, dtype=torch.bfloat16)
    assert _same(layer(x), layer(x))
    assert "_plans" not in layer.__dict__


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [True, False])
def test_gpu_plans_give_the_ordinary_bytes(bias):
    layer = _layer("cuda", bias)
    g = layer.input_scale_inv
    for rows in (65, 512, 4096):
        x = torch.randn(rows, 3072, device="cuda", dtype=torch.bfloat16)
        ordinary = quantized_linear(x, g, True, layer.weight, layer.weight_scale, layer.alpha, layer.bias, x.dtype)
        first, planned = layer(x), layer(x)  # the first call records the binaries and prepares the plan
        assert _same(first, ordinary) and _same(planned, ordinary)
        x16 = torch.randn(rows, 3072, device="cuda").clamp(-6, 6).round().half()
        ref16 = linear_fp16_x(x16, layer.weight, layer.weight_scale, layer.alpha, layer.bias, torch.bfloat16)
        assert _same(layer.forward_decoded(x16), ref16) and _same(layer.forward_decoded(x16), ref16)
    plans = [p for p in layer.__dict__["_plans"].values()]
    assert sum(callable(p) for p in plans) == 6, plans  # 3 row counts x (quantize + GEMM, GEMM alone)


@pytest.mark.gpu
def test_gpu_inputs_a_plan_does_not_take_go_the_ordinary_way():
    layer = _layer("cuda")
    x = torch.randn(4096, 3072, device="cuda", dtype=torch.bfloat16)
    layer(x)
    buffer = torch.randn(4096 * 3072 + 8, device="cuda", dtype=torch.bfloat16)
    misaligned = buffer[1:1 + 4096 * 3072].view(4096, 3072)  # 2-byte offset: the kernels specialise on alignment
    ordinary = quantized_linear(misaligned, layer.input_scale_inv, True, layer.weight, layer.weight_scale,
                                layer.alpha, layer.bias, misaligned.dtype)
    assert _same(layer(misaligned), ordinary)
    strided = torch.randn(4096, 6144, device="cuda", dtype=torch.bfloat16)[:, :3072]
    assert _same(layer(strided), quantized_linear(strided, layer.input_scale_inv, True, layer.weight,
                                                  layer.weight_scale, layer.alpha, layer.bias, strided.dtype))
    moved = layer.weight.data.clone()
    layer.weight.data = moved  # a new address: the old plan (its descriptors) must not be used
    assert _same(layer(x), quantized_linear(x, layer.input_scale_inv, True, layer.weight, layer.weight_scale,
                                            layer.alpha, layer.bias, x.dtype))
