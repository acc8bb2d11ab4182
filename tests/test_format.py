"""The pure-torch NVFP4 format (docs/design.md §3): the reference every kernel is tested against."""

import pytest
import torch

from diffusers_nvfp4_fast import format as nvfp4
from diffusers_nvfp4_fast.format import (
    dequantize_nvfp4,
    e2m1_round,
    quantize_nvfp4,
    quantize_nvfp4_weight,
    round_up,
    swap_nibbles,
    swizzle_scales,
    unswizzle_scales,
)


def _codes(packed: torch.Tensor) -> torch.Tensor:
    return nvfp4.unpack_nibbles(packed)


def test_e2m1_ties_boundaries_sign_saturation_and_nan():
    values = torch.tensor([0.0, 0.24, 0.25, 0.26, 0.74, 0.75, 1.25, 1.26, 1.74, 1.75, 2.5, 2.51, 3.49, 3.5, 5.0, 5.01,
                           6.0, 7.0, 1e30, float("inf"), -0.0, -0.1, -0.75, -5.0, -1e30, float("-inf"), float("nan")])
    expected = [0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 7, 7, 7, 8, 8, 10, 14, 15, 15, 7]
    assert e2m1_round(values).tolist() == expected


def test_quantize_with_exact_unit_factor():
    # g = 1 and a block maximum of 6 give the E4M3 scale 1.0 exactly, so each value is rounded as it stands.
    row = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.0, 6.0])
    packed, scales = quantize_nvfp4(row.reshape(1, 16).bfloat16(), 1.0, scale_layout="linear", fast_math=False)
    assert scales.tolist() == [[0x38]]
    assert _codes(packed).tolist() == [[0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 8, 7]]
    # element 2j in the low nibble
    assert packed[0, 0].item() == (2 << 4) | 0


def test_saturation_zero_blocks_underflow_nan_inf():
    x = torch.zeros(5, 16)
    x[0, 0] = 6.2           # scale rounds down to 1.0 -> 6.2 saturates to 6
    x[1] = 0.0              # all-zero block: scale 0
    x[2, :] = 1e-6          # scale underflows to 0 in E4M3
    x[3, 0], x[3, 1], x[3, 2] = float("nan"), 3.0, -6.0
    x[4, 0], x[4, 1] = float("inf"), 1.0
    packed, scales = quantize_nvfp4(x.bfloat16(), 1.0, scale_layout="linear", fast_math=False)
    codes = _codes(packed)
    assert scales[0, 0].item() == 0x38 and codes[0, 0].item() == 7
    assert scales[1, 0].item() == 0 and codes[1].tolist() == [0] * 16
    assert scales[2, 0].item() == 0
    assert dequantize_nvfp4(packed[2:3], scales[2:3], global_scale=1.0, scale_layout="linear").abs().max().item() == 0.0
    assert scales[3, 0].item() == 0x38 and codes[3, :3].tolist() == [7, 5, 15]  # NaN skipped by the max, -> 0x7
    assert scales[4, 0].item() == 0x7E and codes[4, 0].item() == 7                # Inf saturates the scale at 448


def test_e4m3_scale_rounding_matches_torch_cast_over_all_binades():
    x = (torch.rand(64, 256) * 2.0 ** torch.randint(-30, 12, (64, 256)).float()).bfloat16()
    _, scales = quantize_nvfp4(x, 1.0, scale_layout="linear", fast_math=False)
    vmax = x.float().abs().reshape(64, 16, 16).amax(-1)
    sf = vmax * (torch.tensor(1.0) * torch.tensor(1 / 6, dtype=torch.float32))
    assert torch.equal(scales, sf.clamp(max=448).to(torch.float8_e4m3fn).view(torch.uint8))


def test_fast_math_env(monkeypatch):
    for var in ("FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH", "TRTLLM_DISABLE_FP4_QUANT_FAST_MATH"):
        monkeypatch.delenv(var, raising=False)
    assert nvfp4.fast_math_from_env() is True
    for value, fast in (("1", False), ("true", False), ("ON", False), ("0", True), ("off", True), ("", True),
                        ("no", True)):
        monkeypatch.setenv("TRTLLM_DISABLE_FP4_QUANT_FAST_MATH", value)
        assert nvfp4.fast_math_from_env() is fast, value


def test_fast_math_differs_from_precise_only_by_rounding():
    torch.manual_seed(0)
    x = torch.randn(256, 512).bfloat16()
    fast = dequantize_nvfp4(*quantize_nvfp4(x, 2688 / 4.0, fast_math=True), global_scale=2688 / 4.0)
    precise = dequantize_nvfp4(*quantize_nvfp4(x, 2688 / 4.0, fast_math=False), global_scale=2688 / 4.0)
    assert (fast - precise).abs().max() < 0.05 * x.float().abs().max()


@pytest.mark.parametrize("rows,cols", [(1, 1), (17, 3), (128, 4), (130, 9), (300, 384), (257, 1536)])
def test_swizzle_matches_closed_form_offsets_and_round_trips(rows, cols):
    s = torch.randint(1, 255, (rows, cols), dtype=torch.uint8)
    sw = swizzle_scales(s)
    pr, pc = round_up(rows, 128), round_up(cols, 4)
    assert sw.shape == (pr, pc)
    m = torch.arange(rows).unsqueeze(1).expand(rows, cols)
    k = torch.arange(cols).unsqueeze(0).expand(rows, cols)
    offset = (m // 128) * (pc * 128) + (k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4
    flat = sw.reshape(-1)
    assert torch.equal(flat[offset.reshape(-1)], s.reshape(-1))
    mask = torch.ones(flat.numel(), dtype=torch.bool)
    mask[offset.reshape(-1)] = False
    assert flat[mask].eq(0).all()  # padding is zero
    assert torch.equal(unswizzle_scales(sw, rows, cols), s)


def test_swizzled_and_linear_quantize_agree():
    x = torch.randn(200, 96).bfloat16()
    p1, s1 = quantize_nvfp4(x, 100.0, fast_math=False)
    p2, s2 = quantize_nvfp4(x, 100.0, scale_layout="linear", fast_math=False)
    assert torch.equal(p1, p2) and torch.equal(unswizzle_scales(s1, 200, 6), s2)
    assert torch.equal(swap_nibbles(swap_nibbles(p1)), p1) and not torch.equal(swap_nibbles(p1), p1)


def test_round_trip_error_and_leading_dims():
    torch.manual_seed(1)
    x = torch.randn(2, 50, 64).bfloat16()
    g = 2688 / x.float().abs().max()
    packed, scales = quantize_nvfp4(x, g, fast_math=False)
    assert packed.shape == (100, 32) and scales.shape == (128, 4)
    err = (dequantize_nvfp4(packed, scales, global_scale=g) - x.float().reshape(100, 64)).norm() / x.float().norm()
    assert err < 0.12


def test_bad_input_errors_name_the_problem():
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_nvfp4(torch.zeros(2, 24), 1.0)
    with pytest.raises(TypeError, match="int32"):
        quantize_nvfp4(torch.zeros(2, 16, dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="scale_layout"):
        quantize_nvfp4(torch.zeros(2, 16), 1.0, scale_layout="32x4")
    with pytest.raises(ValueError, match="2-D"):
        quantize_nvfp4(torch.zeros(16), 1.0)


def test_modelopt_weight_quantizer_agrees_except_documented_differences(tmp_path):
    """ModelOpt's exported weight bytes equal ``quantize_nvfp4_weight``'s on every layer of a tiny FLUX.2, including
    two planted blocks where the activation recipe differs: an all-zero block (scale 1.0 there, 0 in the activation
    recipe) and a block whose scale is below 2^-9 (clamped to 2^-9 there, flushed to 0 in the activation recipe)."""
    import warnings

    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from modelopt.torch.quantization.config import _load_quantize_config_dict
    from safetensors.torch import load_file

    from diffusers_nvfp4_fast.testing import tiny
    from support.bfl_files import flux2_batch
    from support.modelopt_exports import FLUX2_EXCLUDE_RE

    model = tiny.tiny_flux2_transformer(True)
    name = "single_transformer_blocks.0.attn.to_out"
    with torch.no_grad():
        w = model.get_submodule(name).weight
        w[0, :16] = 0.0                      # all-zero block
        w[1, :16] = w.abs().max() * 1e-6     # block scale far below 2^-9
    base = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    batches = [flux2_batch(model, gen) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(model, _load_quantize_config_dict("configs/ptq/presets/diffusers/nvfp4"),
                     lambda m: [m(**b) for b in batches])
        mtq.disable_quantizer(model, lambda n: FLUX2_EXCLUDE_RE.match(n) is not None)
        export_hf_checkpoint(model, export_dir=tmp_path)
    sd = load_file(str(tmp_path / "diffusion_pytorch_model.safetensors"))
    layers = sorted(k[: -len(".weight_scale_2")] for k in sd if k.endswith(".weight_scale_2"))
    assert len(layers) == 16
    for layer in layers:
        ws2 = sd[f"{layer}.weight_scale_2"]
        packed, scales = quantize_nvfp4_weight(base[f"{layer}.weight"], ws2)
        assert torch.equal(packed, sd[f"{layer}.weight"]), layer
        assert torch.equal(scales, sd[f"{layer}.weight_scale"].view(torch.uint8)), layer
    scales = sd[f"{name}.weight_scale"].view(torch.uint8)
    assert scales[0, 0].item() == 0x38 and scales[1, 0].item() == 0x01  # the planted blocks: 1.0 and 2^-9, as here
    # the activation recipe gives those blocks scale 0 (both dequantize the zero block to 0; it flushes the other)
    _, act_scales = quantize_nvfp4(base[f"{name}.weight"], 1.0 / sd[f"{name}.weight_scale_2"].float(),
                                   scale_layout="linear", fast_math=False)
    assert act_scales[0, 0].item() == 0 and act_scales[1, 0].item() == 0


def test_the_package_weight_quantizer_writes_modelopt_bytes_on_a_real_sized_layer():
    """ModelOpt 0.47 divides each weight value by ``block_scale * weight_scale_2`` (``NVFP4QTensor.quantize``); the
    activation recipe multiplies by a reciprocal, which lands on the other side of an E2M1 rounding tie for about one
    value in 750 of a BF16 layer. The package's checkpoints (``quantize/layers.nvfp4_layer_tensors``, used by the
    quantize commands and the load-time quantizer) must carry ModelOpt's bytes."""
    from modelopt.torch.export.model_config import QUANTIZATION_NVFP4
    from modelopt.torch.export.quant_utils import to_quantized_weight
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    from diffusers_nvfp4_fast.quantize.layers import nvfp4_layer_tensors

    torch.manual_seed(0)
    w = (torch.randn(1024, 1024) * 0.02).to(torch.bfloat16)
    ws2 = NVFP4QTensor.get_weights_scaling_factor_2(w)
    scale = NVFP4QTensor.get_weights_scaling_factor(w, 16, ws2)[0]
    theirs = to_quantized_weight(w, scale, QUANTIZATION_NVFP4, ws2, 16).view(torch.uint8)
    ours = nvfp4_layer_tensors(w, w.float().abs().max().item(), None)
    assert torch.equal(ours["weight_scale_2"], ws2.reshape(()))
    assert torch.equal(ours["weight_scale"].view(torch.uint8), scale.view(torch.uint8))
    assert torch.equal(ours["weight"], theirs)
    packed, scales = quantize_nvfp4_weight(w, ws2)
    assert torch.equal(packed, theirs) and torch.equal(scales, scale.view(torch.uint8))
    # the activation recipe on the same values: the ties it rounds the other way are why weights have their own verb
    act, _ = quantize_nvfp4(w, 1.0 / ws2, scale_layout="linear", fast_math=False)
    assert 0 < int((act != theirs).sum()) < theirs.numel() // 200
