"""Fused SwiGLU quantize: ``quantize(cat([attn, silu(h[:, :H]) * h[:, H:]], -1))`` without writing the activation.

FLUX.2's feed-forwards compute ``silu(gate) * up`` in the model dtype only to quantize it inside the next NVFP4
projection (``ff.linear_out`` in double-stream blocks; ``to_out`` after the token concatenation in single-stream
blocks, where ``attn`` is the attention output; ``A = 0`` for the plain feed-forward). Qwen-Image 2.1's
``QwenImage21SwiGLUFeedForward`` computes the same ``silu(gate) * up`` from two projections' outputs, two tensors
(``swiglu_gate_up_quantize_triton``): the kernel reads the up values through a pointer of their own, which for
FLUX.2 is the hidden tensor again, ``H`` columns on. Each output value is computed
exactly as torch's eager CUDA kernels do: ``s = round(x / (1 + exp(-x)))`` in FP32 (``expf``, a correctly rounded
add and division), rounded to the model dtype; ``y = round(s * up)`` (an exact FP32 product, rounded once). 16-blocks
never straddle ``attn`` and the SwiGLU part (A, H multiples of 16), so each block is quantized from its own source.

Triton links libdevice with flush-to-zero on, nvcc (torch) without; ``expf`` then differs only where its argument or
result is subnormal, and there ``1 + exp(-x)`` rounds to the same value (1, or ``exp(-x)`` itself when that is huge).
The division stays IEEE (``div.rn.f32``, subnormal results kept, as in torch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import INTERPRETING, as_block_rows, launch, launch_options, padded_scale_shape, tile_grid
from .nvfp4_epilogue import cat_tile, load_blocks, quantize_blocks, store_blocks, unpack4
from .rounding import half_value, round_to_half

__all__ = ["swiglu_gate_up_quantize_triton", "swiglu_quantize_triton"]

try:
    from triton.language.extra import libdevice
except ImportError:  # older Triton keeps it under the CUDA namespace
    from triton.language.extra.cuda import libdevice

# libdevice's expf is what torch's CUDA kernels call (tl.exp would be ex2.approx); the interpreter has only NumPy's.
LIBDEVICE_EXP = tl.constexpr(not INTERPRETING)


@triton.jit
def swiglu_value(gate, up, IS_BF16: tl.constexpr):
    """One SwiGLU output (FP32 inputs holding model-dtype values) as 16 bits: torch's ``silu`` then ``mul``."""
    if LIBDEVICE_EXP:
        e = libdevice.exp(-gate)
    else:
        e = tl.exp(-gate)
    silu = half_value(round_to_half(tl.math.div_rn(gate, 1.0 + e), IS_BF16), IS_BF16)
    return round_to_half(silu * up, IS_BF16)


@triton.jit
def swiglu_word(g, u, IS_BF16: tl.constexpr):
    """Gate and up int64 words (four values each) -> the word of their four SwiGLU outputs."""
    g0, g1, g2, g3 = unpack4(g, IS_BF16)
    u0, u1, u2, u3 = unpack4(u, IS_BF16)
    return (swiglu_value(g0, u0, IS_BF16) | (swiglu_value(g1, u1, IS_BF16) << 16)
            | (swiglu_value(g2, u2, IS_BF16) << 32) | (swiglu_value(g3, u3, IS_BF16) << 48))


@triton.jit
def _swiglu_quantize_kernel(
    a_ptr, h_ptr, u_ptr, g_ptr, packed_ptr, scales_ptr, M, A, H, stride_a, stride_h, stride_u, up_block, padded_cols,
    col_tiles,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, IS_BF16: tl.constexpr, FAST_MATH: tl.constexpr,
    HW_E2M1: tl.constexpr,
):
    # h_ptr: the gate values (columns [0, H) of each row); u_ptr: the up values, from column up_block * 16 of each row
    # (FLUX.2: the hidden tensor again, up_block = H / 16; Qwen-Image 2.1: a tensor of its own, up_block = 0).
    rows, kbs, in_a, in_h = cat_tile(tl.program_id(0), col_tiles, M, A, H, BLOCK_R, BLOCK_C)
    a0, a1, a2, a3 = load_blocks(a_ptr, rows, kbs, stride_a, in_a)
    g0, g1, g2, g3 = load_blocks(h_ptr, rows, kbs - A // 16, stride_h, in_h)
    u0, u1, u2, u3 = load_blocks(u_ptr, rows, kbs - A // 16 + up_block, stride_u, in_h)
    # Masked lanes loaded 0 and silu(0) * 0 is +0 (bits 0), so OR-ing picks the block's own source.
    packed, sf_byte = quantize_blocks(
        a0 | swiglu_word(g0, u0, IS_BF16), a1 | swiglu_word(g1, u1, IS_BF16),
        a2 | swiglu_word(g2, u2, IS_BF16), a3 | swiglu_word(g3, u3, IS_BF16),
        tl.load(g_ptr), IS_BF16, FAST_MATH, HW_E2M1,
    )
    store_blocks(packed, sf_byte, rows, kbs, packed_ptr, scales_ptr, M, A + H, padded_cols)


def swiglu_quantize_triton(
    hidden: torch.Tensor, global_scale: torch.Tensor, attn: torch.Tensor | None = None, *, fast_math: bool = True,
    block_r: int = 8, block_c: int = 16, num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden ``[..., 2H]`` (gate then up), optional attn ``[..., A]`` (same leading dims and dtype, bf16/fp16; rows
    may be strided) -> packed uint8 ``[R, (A+H)/2]`` and 128x4 scales uint8 ``[round_up(R,128),
    round_up((A+H)/16,4)]`` of ``cat([attn, silu(gate) * up], -1)``."""
    h = hidden.reshape(-1, hidden.shape[-1])
    m, width_h = h.shape
    if width_h % 32:
        raise ValueError(f"swiglu_quantize_triton: hidden width {width_h} must be a multiple of 32 (2 x 16)")
    a = h[:, :0] if attn is None else attn.reshape(-1, attn.shape[-1])
    if a.dtype != h.dtype or a.shape[0] != m or a.shape[1] % 16:
        raise ValueError(f"swiglu_quantize_triton: attn {tuple(a.shape)} {a.dtype} and hidden {tuple(h.shape)} "
                         f"{h.dtype} need equal rows, one dtype and an attn width % 16 == 0")
    (h_blocks, stride_h) = as_block_rows(h)
    (a_blocks, stride_a) = as_block_rows(a) if a.shape[1] else (h_blocks, stride_h)
    half = width_h // 2
    return _launch((a_blocks, stride_a, a.shape[1]), (h_blocks, stride_h), (h_blocks, stride_h, half // 16), half,
                   h.dtype, global_scale, fast_math, block_r, block_c, num_warps)


def swiglu_gate_up_quantize_triton(
    gate: torch.Tensor, up: torch.Tensor, global_scale: torch.Tensor, *, fast_math: bool = True, block_r: int = 8,
    block_c: int = 16, num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """gate and up ``[..., H]`` (same shape and dtype, bf16/fp16, H a multiple of 16; rows may be strided) -> packed
    uint8 ``[R, H/2]`` and 128x4 scales uint8 ``[round_up(R,128), round_up(H/16,4)]`` of ``silu(gate) * up``: the
    kernel of ``swiglu_quantize_triton`` with the two halves in two tensors (Qwen-Image 2.1's ``gate_layer`` and
    ``proj`` outputs)."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.shape[-1] % 16:
        raise ValueError(f"swiglu_gate_up_quantize_triton: gate {tuple(gate.shape)} {gate.dtype} and up "
                         f"{tuple(up.shape)} {up.dtype} need one shape and dtype, a width % 16 == 0")
    (g_blocks, stride_g) = as_block_rows(gate.reshape(-1, gate.shape[-1]))
    (u_blocks, stride_u) = as_block_rows(up.reshape(-1, up.shape[-1]))
    return _launch((g_blocks, stride_g, 0), (g_blocks, stride_g), (u_blocks, stride_u, 0), gate.shape[-1],
                   gate.dtype, global_scale, fast_math, block_r, block_c, num_warps)


def _launch(attn, gate, up, h: int, dtype: torch.dtype, global_scale, fast_math, block_r, block_c, num_warps):
    """Allocate the outputs and launch the kernel. ``attn``: (words, row stride, width A); ``gate``: (words, row
    stride); ``up``: (words, row stride, first 16-block of the up values in each row); ``h``: the SwiGLU width;
    ``dtype``: the values' (the words are int64 views)."""
    a_blocks, stride_a, a_width = attn
    g_blocks, stride_g = gate
    u_blocks, stride_u, up_block = up
    m, device = g_blocks.shape[0], g_blocks.device
    k = a_width + h
    packed = torch.empty((m, k // 2), dtype=torch.uint8, device=device)
    scales = torch.empty(padded_scale_shape(m, k), dtype=torch.uint8, device=device)
    grid, col_tiles = tile_grid(m, scales.shape[1], block_r, block_c)
    launch(
        _swiglu_quantize_kernel, grid,
        a_blocks, g_blocks, u_blocks, global_scale, packed.view(torch.int64), scales, m, a_width, h, stride_a,
        stride_g, stride_u, up_block, scales.shape[1], col_tiles,
        BLOCK_R=block_r, BLOCK_C=block_c, IS_BF16=dtype == torch.bfloat16,
        **launch_options(device, fast_math, num_warps),
    )
    return packed, scales
