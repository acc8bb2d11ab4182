"""Input generators shared by the kernel tests."""

import torch


def make_input(kind: str, rows: int, cols: int, device="cuda", seed: int = 0) -> torch.Tensor:
    """bf16 [rows, cols]: randn, large/small magnitudes, exact E2M1 ties, zeros, NaN (both signs)/Inf rows."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, cols, device=device, generator=gen)
    if kind == "large":
        x = x * 3e4
    elif kind == "small":
        x = x * 1e-6
    elif kind == "mixed_scale":
        exps = torch.randint(-30, 20, (rows, cols // 16, 1), device=device, generator=gen).float()
        x = (x.reshape(rows, cols // 16, 16) * torch.exp2(exps)).reshape(rows, cols)
    elif kind == "ties":
        # Block max 6 * 2^e makes the scale a power of two, so these values land exactly on E2M1 midpoints.
        ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0,
                             0.0, 6.0], device=device)
        x = ties.repeat(rows, cols // 16)
    elif kind == "zeros":
        x = torch.zeros(rows, cols, device=device)
        if rows > 1:
            x[1::3, :16] = -0.0
    elif kind == "nan_inf":
        x[:: max(rows // 7, 1), 3] = float("nan")
        x[1 :: max(rows // 5, 1), 17 % cols] = float("inf")
        x[2 :: max(rows // 5, 1), 5] = float("-inf")
        if rows > 3:
            x[3, :16] = float("nan")
    x = x.to(torch.bfloat16)
    if kind == "nan_inf":
        # NaNs with the sign bit set (0xFFC0; assigning -nan to a bf16 tensor would store the positive 0x7FC0): the
        # kernels take the E2M1 sign from the scaled product, which a GPU multiply returns as the positive NaN.
        x.view(torch.int16)[max(rows // 3, 1) - 1 :: max(rows // 4, 1), 9 % cols] = -64
    return x


INPUT_KINDS = ("randn", "large", "small", "mixed_scale", "ties", "zeros", "nan_inf")


def global_scale_for(x: torch.Tensor) -> torch.Tensor:
    """The activation global scale ``448 * 6 / amax`` of ``x`` (NaN/Inf ignored), FP32 one-element on x's device."""
    amax = x.float().abs().nan_to_num(0.0, 0.0, 0.0).max().clamp(min=1e-12)
    return (448.0 * 6.0 / amax).reshape(1).to(torch.float32)


def adversarial(rows: int, cols: int, device="cuda", seed: int = 0) -> torch.Tensor:
    """bf16 ``[rows, cols]`` whose 16-blocks each take one of the patterns that stress NVFP4 rounding: E2M1 ties at
    every grid point (block max 6 * 2^e makes the scale a power of two), block maxima on E4M3 rounding boundaries,
    saturation (values far above the global scale's range), subnormal and underflowing block scales, all-zero blocks,
    -0, NaN with either sign bit, +-Inf, and plain random blocks. ``cols`` must be a multiple of 16."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks = rows * (cols // 16)
    pattern = torch.randint(0, 9, (blocks,), device=device, generator=gen)
    x = torch.randn(blocks, 16, device=device, generator=gen)
    exps = torch.randint(-12, 12, (blocks, 1), device=device, generator=gen).float()
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0,
                         -6.0], device=device)
    out = torch.where(pattern[:, None] == 0, ties[torch.randperm(16, device=device, generator=gen)] * exps.exp2(), x)
    # E4M3 boundaries: block max = 6 * (an E4M3 midpoint) * 2^e, so the block scale rounds exactly halfway.
    mid = 6.0 * (1.0 + (2 * torch.randint(0, 8, (blocks, 1), device=device, generator=gen) + 1) / 16.0) * exps.exp2()
    out = torch.where(pattern[:, None] == 1, x / x.abs().amax(1, keepdim=True) * mid, out)
    out = torch.where(pattern[:, None] == 2, x * 1e6, out)  # saturation
    out = torch.where(pattern[:, None] == 3, x * 1e-7, out)  # E4M3 subnormal block scales
    out = torch.where(pattern[:, None] == 4, x * 1e-30, out)  # block scale underflows to 0
    out = torch.where(pattern[:, None] == 5, torch.zeros_like(x), out)
    out = torch.where(pattern[:, None] == 6, torch.full_like(x, -0.0), out)
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0], device=device)
    pick = torch.randint(0, 8, x.shape, device=device, generator=gen)
    out = torch.where((pattern[:, None] == 7) & (pick < 4), special[pick.clamp(max=3)], out)
    out = out.reshape(rows, cols).to(torch.bfloat16)
    # NaNs with the sign bit set (0xFFC0) in pattern 8: assigning -nan to a bf16 tensor would store 0x7FC0.
    bits = out.view(torch.int16).reshape(blocks, 16)
    bits[(pattern == 8).nonzero().flatten(), :3] = -64
    return out


def swiglu_adversarial(rows: int, hidden: int, device="cuda", seed: int = 0) -> torch.Tensor:
    """bf16 ``[rows, 2 * hidden]`` feed-forward projections whose gate half stresses SiLU: values where ``exp(-x)``
    overflows or underflows (|x| near 87-89 and beyond), subnormal and zero gates (both signs), +-Inf, NaN, huge and
    tiny magnitudes, alongside random ones; the up half is random with the same specials sprinkled in."""
    gen = torch.Generator(device=device).manual_seed(seed)
    edges = torch.tensor([87.0, 87.5, 88.0, 88.5, 88.72, 89.0, 100.0, 1e30, 3e38, 1e-38, 1e-40, 0.0, float("inf"),
                          float("nan"), 1e-3, 15.0], device=device)
    signs = torch.where(torch.rand(rows, hidden, device=device, generator=gen) < 0.5, -1.0, 1.0)
    gate = torch.randn(rows, hidden, device=device, generator=gen) * 4
    pick = torch.randint(0, 2 * len(edges), (rows, hidden), device=device, generator=gen)
    gate = torch.where(pick < len(edges), edges[pick.clamp(max=len(edges) - 1)] * signs, gate)
    up = torch.randn(rows, hidden, device=device, generator=gen)
    pick_up = torch.randint(0, 8 * len(edges), (rows, hidden), device=device, generator=gen)
    up = torch.where(pick_up < len(edges), edges[pick_up.clamp(max=len(edges) - 1)], up)
    return torch.cat([gate, up], dim=-1).to(torch.bfloat16)


def gelu_adversarial(rows: int, cols: int, device="cuda", seed: int = 0) -> torch.Tensor:
    """bf16 ``[rows, cols]`` FC1 outputs that stress GELU (tanh): ``x**3`` overflowing (|x| from 1e13 up, Inf, where
    ``0.5 * x * (1 + tanh)`` becomes -0 or NaN), tanh saturating, tanh arguments around its algorithm's switch
    (|inner| near 0.55-0.6), subnormal and zero inputs (both signs), NaN, alongside random values."""
    gen = torch.Generator(device=device).manual_seed(seed)
    edges = torch.tensor([1e13, 1e20, 3e38, float("inf"), float("nan"), 0.0, 1e-39, 1e-3, 0.6, 0.66, 0.7, 0.75, 4.0,
                          5.5, 9.0, 10.0], device=device)
    signs = torch.where(torch.rand(rows, cols, device=device, generator=gen) < 0.5, -1.0, 1.0)
    x = torch.randn(rows, cols, device=device, generator=gen) * 3
    pick = torch.randint(0, 4 * len(edges), (rows, cols), device=device, generator=gen)
    x = torch.where(pick < len(edges), edges[pick.clamp(max=len(edges) - 1)] * signs, x)
    return x.to(torch.bfloat16)
