"""FLUX.2 token-cat quantize: ``quantize(cat([attn, mlp], -1))`` without building the concatenation.

Reference: ``token_cat_quantize_reference`` (docs/design.md §6). Kernel: ``kernels.token_cat_quantize_triton``.
"""

from __future__ import annotations

import torch

from .fused import AotKernel, Case, Form, FusedOp, Probe
from .quantize import empty_quantized, quantize


def token_cat_quantize_reference(
    attn: torch.Tensor, mlp: torch.Tensor, global_scale: torch.Tensor, fast_math: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize(cat([attn, mlp], -1))``: attn ``[..., A]``, mlp ``[..., B]`` -> packed ``[R, (A+B)/2]``, 128x4
    scales."""
    x = torch.cat([attn, mlp], dim=-1)
    return quantize(x.reshape(-1, x.shape[-1]), global_scale, fast_math)


# attn [..., A], mlp [..., B] (same leading dims, BF16/FP16, A and B multiples of 16), global_scale, fast_math ->
# packed uint8 [R, (A+B)/2], 128x4 scales uint8 [round_up(R,128), round_up((A+B)/16,4)].
token_cat_quantize = Form(
    "token_cat_quantize", token_cat_quantize_reference,
    lambda k, attn, mlp, g, fast_math: k.token_cat_quantize_triton(attn, mlp, g, fast_math=fast_math),
    lambda attn, mlp, *_: empty_quantized(attn, attn.numel() // attn.shape[-1], attn.shape[-1] + mlp.shape[-1]),
    ("packed", "scales"),
    aot=AotKernel("token_cat", "token_cat_quantize", "_token_cat_quantize_kernel", {
        "a_ptr": "*i64", "b_ptr": "*i64", "g_ptr": "*fp32", "packed_ptr": "*i64", "scales_ptr": "*u8", "M": "i32",
        "A": "i32", "B": "i32", "stride_a": "i32", "stride_b": "i32", "padded_cols": "i32", "col_tiles": "i32"}))


def _probe(p: Probe) -> list[Case]:
    """FLUX.2-dev's single-stream block: the attention output (6144) and the MLP activation (18432) per token."""
    attn, mlp = p.randn(p.rows, p.pick(6144, 64)), p.randn(p.rows, p.pick(18432, 192), scale=0.3)
    shape = f"{p.rows}x({attn.shape[-1]}+{mlp.shape[-1]})"
    return [Case("token-cat quantize", shape, (attn, mlp, p.global_scale(attn, mlp), p.fast_math))]


TOKEN_CAT_QUANTIZE = FusedOp(token_cat_quantize, _probe)
