"""The adaptive-LayerNorm quantize op (``ops/layer_norm_quantize.py``: ``LayerNorm(x) * (1 + scale) + shift ->
NVFP4``, and Qwen-Image 2.1's form without the shift) and the decoded-output variants of both norm kernels, against
diffusers' eager ops.

CPU: the kernel under the Triton interpreter is compared with an emulation of torch's CUDA LayerNorm in
``test_layer_norm_quantize.py`` (``test_decoded_and_adaln_variants_match``); here the op's torch reference is checked
against diffusers' own block code, and the op falls back to that reference off the GPU.

GPU (``gpu``): the kernel against the eager chain on the GPU (torch's CUDA LayerNorm, BF16 ops, then the standalone
quantize), byte for byte, packed and decoded; outputs are allocated poisoned so that an unwritten byte cannot pass.
"""

from __future__ import annotations

import pytest
import torch

from diffusers_nvfp4_fast.format import decode_nvfp4
from diffusers_nvfp4_fast.ops.layer_norm_quantize import (
    AdaLNInputs,
    adaln_chain,
    adaln_quantize,
    adaln_quantize_decoded,
    adaln_quantize_reference,
)
from diffusers_nvfp4_fast.ops.site import Site
from diffusers_nvfp4_fast.ops.verify import new_stats

EPS = 1e-6


def _case(b: int, rows: int, d: int, per_token: bool = False, device: str = "cpu", seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(b, rows, d, device=device, generator=gen) * 3 + 1).bfloat16()
    shape = (b, rows, 6 * d) if per_token else (b, 6 * d)
    mod = (torch.randn(shape, device=device, generator=gen) * 0.3).bfloat16()
    shift, scale, _gate = mod.chunk(2, dim=-1)[0].chunk(3, dim=-1)  # views with the row stride of mod, as diffusers
    return AdaLNInputs(x, scale, shift)


def _g(m: torch.Tensor) -> torch.Tensor:
    return torch.tensor([448.0 * 6.0 / m.float().abs().max().item()], device=m.device)


def test_reference_chain_is_diffusers_qwen_and_flux2_norm1():
    """The op's reference equals both models' own norm1 sections (Qwen's ``_modulate``, FLUX.2's
    ``(1 + scale) * norm + shift``) byte for byte."""
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock

    inputs = _case(2, 5, 64)
    norm = torch.nn.LayerNorm(64, elementwise_affine=False, eps=EPS)
    flux2 = (1 + inputs.scale.unsqueeze(1)) * norm(inputs.x) + inputs.shift.unsqueeze(1)
    mod = torch.cat([inputs.shift, inputs.scale, inputs.scale], dim=-1)
    qwen, _ = QwenImageTransformerBlock._modulate(None, norm(inputs.x), mod)
    ours = adaln_chain(inputs, EPS)
    assert torch.equal(ours.view(torch.int16), flux2.view(torch.int16))
    assert torch.equal(ours.view(torch.int16), qwen.view(torch.int16))


def test_op_on_cpu_is_the_reference_and_decoded_is_its_decode():
    inputs = _case(1, 7, 32, per_token=True)
    g = _g(adaln_chain(inputs, EPS))
    packed, scales = adaln_quantize(*inputs, g, EPS, False)
    ref = adaln_quantize_reference(*inputs, g, EPS, False)
    assert torch.equal(packed, ref[0]) and torch.equal(scales, ref[1])
    stats_id, stats = new_stats("always")
    x16 = adaln_quantize_decoded.checked(Site(stats_id, "qwen_adaln"), *inputs, g, EPS, False)
    want = decode_nvfp4(packed, scales, dtype=torch.float16)
    assert torch.equal(x16.view(torch.int16), want.view(torch.int16))
    assert stats.verified["qwen_adaln"] == 1 and not stats.verify_failed


# ---------------------------------------------------------------------------------------------------------------
# GPU: the kernel against the eager chain.
# ---------------------------------------------------------------------------------------------------------------


def _gpu_reference(inputs: AdaLNInputs, g: torch.Tensor, fast_math: bool):
    from diffusers_nvfp4_fast.format import quantize_nvfp4
    from diffusers_nvfp4_fast.kernels.quantize_nvfp4 import quantize_nvfp4_triton

    m = adaln_chain(inputs, EPS)
    m2d = m.reshape(-1, m.shape[-1])
    if fast_math:  # rcp.approx.ftz runs the same way only in the standalone kernel
        return quantize_nvfp4_triton(m2d, g, fast_math=True)
    return quantize_nvfp4(m2d, g, scale_layout="128x4", fast_math=False)


def _check_gpu(inputs: AdaLNInputs, fast_math: bool) -> None:
    from test_layer_norm_quantize import poisoned_outputs

    from diffusers_nvfp4_fast.kernels import adaln_quantize_triton

    g = _g(adaln_chain(inputs, EPS))
    with poisoned_outputs():
        packed, scales = adaln_quantize_triton(*inputs, g, eps=EPS, fast_math=fast_math)
        (x16,) = adaln_quantize_triton(*inputs, g, eps=EPS, fast_math=fast_math, decoded=True)
    ref_packed, ref_scales = _gpu_reference(inputs, g, fast_math)
    assert torch.equal(packed, ref_packed), f"{int((packed != ref_packed).sum())} packed bytes differ"
    assert torch.equal(scales, ref_scales), f"{int((scales != ref_scales).sum())} scale bytes differ"
    want = decode_nvfp4(ref_packed, ref_scales, dtype=torch.float16)
    assert torch.equal(x16.view(torch.int16), want.view(torch.int16)), "decoded values differ"


@pytest.mark.gpu
@pytest.mark.parametrize("fast_math", [False, True], ids=["precise", "fast"])
@pytest.mark.parametrize("d", [512, 3072, 6144])
@pytest.mark.parametrize("rows", [1, 17, 512, 4608])
def test_gpu_adaln_matches_eager(rows, d, fast_math):
    """Qwen-Image (3072) and FLUX.2-dev (6144) widths; text-stream, image-stream and single-stream row counts."""
    _check_gpu(_case(1, rows, d, device="cuda", seed=rows + d), fast_math)


@pytest.mark.gpu
@pytest.mark.parametrize("fast_math", [False, True], ids=["precise", "fast"])
def test_gpu_adaln_batch2_per_token_and_strided(fast_math):
    """CFG batch 2 with per-sample and per-token parameters, and x as the image rows of a joint sequence."""
    _check_gpu(_case(2, 1024, 3072, device="cuda", seed=1), fast_math)
    _check_gpu(_case(2, 300, 3072, per_token=True, device="cuda", seed=2), fast_math)
    inputs = _case(1, 4096 + 512, 6144, device="cuda", seed=3)
    _check_gpu(inputs._replace(x=inputs.x[:, 512:]), fast_math)


@pytest.mark.gpu
def test_gpu_adaln_activation_like_rows():
    """Rows that stress the statistics (zero, constant, tiny, huge, one spike) and per-channel outliers."""
    from test_layer_norm_quantize import make_residual

    gen = torch.Generator(device="cuda").manual_seed(4)
    for dist in ("activation-like", "edge-rows", "large-offset"):
        inputs = _case(1, 4608, 3072, device="cuda", seed=5)
        inputs = inputs._replace(x=make_residual(4608, 3072, dist, gen).reshape(1, 4608, 3072))
        for fast_math in (False, True):
            _check_gpu(inputs, fast_math)


@pytest.mark.gpu
@pytest.mark.parametrize("fast_math", [False, True], ids=["precise", "fast"])
@pytest.mark.parametrize("d", [3072, 6144])
def test_gpu_resnorm_decoded_is_the_decode_of_packed(d, fast_math):
    """The residual-norm kernel writing FC1's FP16 operand: residual_out as before, values = decode(packed)."""
    from test_layer_norm_quantize import EPS as QWEN_EPS
    from test_layer_norm_quantize import global_scale, make_case, poisoned_outputs

    from diffusers_nvfp4_fast.kernels import resnorm_quantize_triton
    from diffusers_nvfp4_fast.ops.layer_norm_quantize import ResNormInputs, residual_norm_chain

    case = make_case(2, 2048, d=d, dist="activation-like", seed=d)
    g = global_scale(residual_norm_chain(ResNormInputs(*case), QWEN_EPS)[1])
    with poisoned_outputs():
        r, packed, scales = resnorm_quantize_triton(*case, g, eps=QWEN_EPS, fast_math=fast_math)
        r16, x16 = resnorm_quantize_triton(*case, g, eps=QWEN_EPS, fast_math=fast_math, decoded=True)
    assert torch.equal(r16.view(torch.int16), r.view(torch.int16))
    want = decode_nvfp4(packed, scales, dtype=torch.float16)
    assert torch.equal(x16.view(torch.int16), want.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("fast_math", [False, True], ids=["precise", "fast"])
def test_gpu_no_shift_matches_eager(fast_math):
    """Qwen-Image 2.1's modulation, ``norm(x) * (1 + scale)`` with no shift add, at its width (4096): the adaptive
    LayerNorm with per-token rows and the residual norm without bias, on rows whose modulated values are zeros of
    both signs (a constant row normalizes to +0, ``scale = -2`` gives ``1 + scale = -1``), packed and decoded."""
    from test_layer_norm_quantize import check, make_case

    inputs = _case(1, 4608, 4096, per_token=True, device="cuda", seed=6)._replace(shift=None)
    inputs.x[:, 0] = 1.5
    inputs.scale[..., ::7] = -2.0
    _check_gpu(inputs, fast_math)
    residual, attn, _bias, gate, scale, _shift = make_case(2, 2048, d=4096, per_token=True, bias=False, seed=7)
    residual[:, 0] = 1.5
    attn[:, 0] = 0.0
    scale[..., ::7] = -2.0
    check((residual, attn, None, gate, scale, None), fast_math)
