"""``rcp.approx.ftz.f32`` elementwise, for references: with it in place of ``format._rcp_approx``, the pure-torch
quantizer computes the fast-math recipe exactly as the kernels do (docs/design.md §3), so fast-math kernel outputs
can be compared byte for byte (the tests and ``diffusers-nvfp4-fast selftest``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rcp_approx_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=1.0)
    y = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    tl.store(y_ptr + offs, y, mask=offs < n)


def rcp_approx_cuda(x: torch.Tensor) -> torch.Tensor:
    """Elementwise ``rcp.approx.ftz.f32`` of an FP32 CUDA tensor (any shape)."""
    flat = x.to(torch.float32).contiguous().reshape(-1)
    out = torch.empty_like(flat)
    _rcp_approx_kernel[(triton.cdiv(flat.numel(), 1024),)](flat, out, flat.numel(), BLOCK=1024)
    return out.reshape(x.shape)
