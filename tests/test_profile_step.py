"""``benchmarks/profile_step.py``'s split of NVFP4 GEMM time by layer shape: kernel time inside each layer's GPU-side
range, counted once (the first version added the CPU range's device total to the GPU span's length, and a later one
missed the Triton launches that are not tied to the CPU range)."""

from __future__ import annotations

from types import SimpleNamespace

import profile_step  # benchmarks/ is on the test path (pyproject.toml)
import pytest
import torch

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


def _event(name: str, start: float, end: float, device=CUDA):
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))


def test_kernel_time_is_summed_inside_each_range_once():
    qkv, mod = "gemm M=4096 N=3072 K=3072", "gemm M=1 N=18432 K=3072"
    events = [
        _event(qkv, 100, 200), _event(qkv, 100, 200, CPU),  # a layer call: its GPU span and its CPU range
        _event("other kernel", 90, 95),  # before the range
        _event("_quantize_nvfp4_decoded_kernel", 100, 130), _event("_nvfp4_gemm_sm90_kernel", 140, 190),  # idle between
        _event("elementwise", 205, 215),  # after it
        _event(qkv, 300, 400), _event("_nvfp4_gemm_sm90_kernel", 310, 350),  # the same shape again
        _event(mod, 500, 600), _event("_nvfp4_gemm_kernel", 520, 530),
    ]
    shapes = profile_step.kernel_time_in_ranges(events)
    assert shapes == {qkv: pytest.approx(0.12), mod: pytest.approx(0.01)}  # ms: (30 + 50 + 40) us and 10 us


def test_every_gemm_entry_of_the_layer_opens_a_shape_range(monkeypatch):
    """Fused producers reach the GEMM through ``forward_prequantized`` (packed) or ``forward_decoded`` (FP16 values);
    a range missing on one of them left most of a step's GEMM time out of the per-shape split (2026-12-01)."""
    from diffusers_nvfp4_fast import linear
    from diffusers_nvfp4_fast.linear import NVFP4Linear
    from diffusers_nvfp4_fast.ops.quantize import quantize

    torch.manual_seed(0)
    layer = NVFP4Linear.from_weight(torch.randn(32, 64, dtype=torch.bfloat16), None, 1.0 / 8)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    packed, scales = quantize(x, layer.input_scale_inv.reshape(1), True)
    # the FP16-operand GEMM runs on Hopper-class GPUs only; the range around it is what is tested here
    monkeypatch.setattr(linear, "linear_fp16_x", lambda x16, *args: x16.new_zeros(x16.shape[0], 32))
    with profile_step.gemm_ranges(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        layer(x)
        layer.forward_prequantized(packed, scales)
        layer.forward_decoded(torch.randn(3, 64, dtype=torch.float16))
    names = [e.name for e in prof.events() if e.name.startswith("gemm M=")]
    assert names == ["gemm M=3 N=32 K=64"] * 3, names
    assert NVFP4Linear.forward_decoded.__name__ == "forward_decoded"  # restored


@pytest.mark.parametrize("name,label", [
    ("_nvfp4_gemv_kernel", "NVFP4 GEMM"),  # was counted as a BF16 GEMM
    ("_nvfp4_gemm_sm90_kernel", "NVFP4 GEMM"),
    ("triton_poi_fused_gelu_quantized_linear_view_11", "inductor kernels"),  # was "fused kernels" (gelu_quantize...)
    ("triton_poi_fused__scaled_dot_product_cudnn_attention__to_copy_cat_permute_view_5", "inductor kernels"),
    ("_gelu_quantize_decoded_kernel", "fused kernels"),
    ("_quantize_nvfp4_decoded_kernel", "quantize"),
    ("nvjet_sm90_tst_192x8_64x8_4x1_v_bz_bias_TNT", "BF16 GEMM"),
])
def test_kernel_classes(name, label):
    assert profile_step.kernel_class(name) == label
