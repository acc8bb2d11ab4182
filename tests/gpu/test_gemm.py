"""GPU: the Triton NVFP4 GEMM (SM80-SM90) against the exact torch emulation.

The GEMM adds exactly the same FP32 terms as ``ops.emulated_nvfp4_gemm`` (decoded values are exact in FP16 and
their products exact in FP32); only the summation order differs. So the comparison with the emulation has a
bound, stated and measured here: ``||out - ref|| / ||ref|| <= REL_BOUND`` on FP32 outputs. Everything else is
exact: repeat runs, every autotune config, asm vs. pure decode, scale padding garbage, the BF16 epilogue, the
standalone decode.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="GEMM GPU tests not run: no CUDA GPU here; they run on an SM80-SM90 GPU "
                                                         "with pytest -m gpu tests/gpu/test_gemm.py"),
]

pytest.importorskip("triton", reason="Triton is not installed, so the GEMM GPU tests did not run; CI installs it with .[test]")

import importlib  # noqa: E402

from diffusers_nvfp4_fast import NVFP4Linear  # noqa: E402
from diffusers_nvfp4_fast.format import (  # noqa: E402
    decode_nvfp4,
    quantize_nvfp4,
    round_up,
    swizzle_scales,
    unswizzle_scales,
)
from diffusers_nvfp4_fast.ops import emulated_nvfp4_gemm  # noqa: E402

DEV = "cuda"  # a module constant so that the test logic can be dry-run on CPU under the Triton interpreter

# The package re-exports the function under the module's name, so fetch the module itself from sys.modules.
gemm_mod = importlib.import_module("diffusers_nvfp4_fast.kernels.nvfp4_gemm")
nvfp4_gemm = gemm_mod.nvfp4_gemm

# Observed on an H200 (triton 3.x): see the printed values with `pytest -s`. FP32 reassociation alone gives
# ~1e-7; the bound leaves room without letting a wrong term (>= 2^-10 relative per term) through.
REL_BOUND = 1e-5

SHAPES = [  # (N, K): FLUX.2/Qwen-like, odd N and K (K % 16 == 0 but not % 64/128), tiny
    (3072, 3072),
    (256, 6144),
    (200, 48),
    (200, 176),
    (136, 1040),
    (8, 16),
]
ROWS = (1, 17, 64, 65, 128, 1000, 4608)


@pytest.fixture(autouse=True)
def _exact_fp32_reference():
    """The emulation's FP32 matmul must not run in TF32."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _skip_unless_sm80_to_sm90():
    major = torch.cuda.get_device_capability()[0]
    if not 8 <= major <= 9:
        pytest.skip("Triton GEMM test not run: it targets SM80-SM90 (Ampere to Hopper); on Blackwell NVFP4Linear "
                    "uses FlashInfer mm_fp4 instead")


def _operands(m: int, n: int, k: int, seed: int = 0):
    """Quantized X [m, k] and W [n, k] (precise mode) + alpha, all on the GPU."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, device=DEV, generator=gen).to(torch.bfloat16) * 3
    w = (torch.randn(n, k, device=DEV, generator=gen) * 0.02).to(torch.bfloat16)
    gx = (2688.0 / x.float().abs().amax()).reshape(())
    gw = (2688.0 / w.float().abs().amax()).reshape(())
    xp, xs = quantize_nvfp4(x, gx, fast_math=False)
    wp, ws = quantize_nvfp4(w, gw, fast_math=False)
    alpha = (1.0 / gx) * (1.0 / gw)
    return xp, xs, wp, ws, alpha.to(torch.float32)


def _random_bytes(m: int, n: int, k: int, seed: int = 0):
    """Uniformly random codes and scale bytes (every E2M1 code, every finite E4M3 scale incl. subnormals)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)

    def operand(rows):
        packed = torch.randint(0, 256, (rows, k // 2), device=DEV, generator=gen, dtype=torch.uint8)
        scales = torch.zeros(round_up(rows, 128), round_up(k // 16, 4), device=DEV, dtype=torch.uint8)
        lin = torch.randint(0, 0x7F, (rows, k // 16), device=DEV, generator=gen, dtype=torch.uint8)  # no NaN
        scales.copy_(swizzle_scales(lin))
        return packed, scales

    xp, xs = operand(m)
    wp, ws = operand(n)
    return xp, xs, wp, ws, torch.tensor(0.37, device=DEV)


def _reference(xp, xs, wp, ws, alpha):
    return emulated_nvfp4_gemm(xp, xs, wp, ws) * alpha


def _rel(out, ref) -> float:
    return ((out.float() - ref).norm() / ref.norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_emulation(m, n, k):
    _skip_unless_sm80_to_sm90()
    xp, xs, wp, ws, alpha = _operands(m, n, k)
    ref = _reference(xp, xs, wp, ws, alpha)
    out = nvfp4_gemm(xp, xs, wp, ws, alpha, torch.float32)
    rel = _rel(out, ref)
    print(f"M={m} N={n} K={k}: ||out-ref||/||ref|| = {rel:.3e}")
    assert rel <= REL_BOUND
    # The BF16/FP16 epilogue is one rounding of the same FP32 value (same config: no second autotuning run).
    tuned = gemm_mod._tuned_fp16_x if m > gemm_mod.PREDECODE_MAX_M else gemm_mod._tuned_packed
    cfg = getattr(tuned, "best_config", None)
    assert torch.equal(nvfp4_gemm(xp, xs, wp, ws, alpha, torch.bfloat16, config=cfg), out.to(torch.bfloat16))
    assert torch.equal(nvfp4_gemm(xp, xs, wp, ws, alpha, torch.float16, config=cfg), out.to(torch.float16))


@pytest.mark.parametrize("m", (1, 17, 4608))
def test_all_codes_and_scales(m):
    """Random bytes: all 16 codes, scales from 2^-9 to 448 (FP16-subnormal MMA inputs included)."""
    _skip_unless_sm80_to_sm90()
    xp, xs, wp, ws, alpha = _random_bytes(m, 384, 2048, seed=m)
    ref = _reference(xp, xs, wp, ws, alpha)
    out = nvfp4_gemm(xp, xs, wp, ws, alpha, torch.float32)
    rel = _rel(out, ref)
    print(f"random bytes M={m}: rel {rel:.3e}")
    assert rel <= REL_BOUND


def test_tiny_scales_exact():
    """Every product lands on FP16 subnormals inside the MMA (scale 2^-9, value 0.5): the sums are exact."""
    _skip_unless_sm80_to_sm90()
    m, n, k = 32, 128, 256
    xp = torch.full((m, k // 2), 0x11, device=DEV, dtype=torch.uint8)  # codes 1, 1: +0.5, +0.5
    wp = torch.full((n, k // 2), 0x19, device=DEV, dtype=torch.uint8)  # codes 9, 1: -0.5, +0.5
    wp[: n // 2, ::3] = 0x11
    xs = torch.ones(round_up(m, 128), round_up(k // 16, 4), device=DEV, dtype=torch.uint8)  # E4M3 0x01 = 2^-9
    ws = torch.ones(round_up(n, 128), round_up(k // 16, 4), device=DEV, dtype=torch.uint8)
    alpha = torch.tensor(1.0, device=DEV)
    ref = _reference(xp, xs, wp, ws, alpha)
    for mode in ("in_kernel", "predecode"):
        out = nvfp4_gemm(xp, xs, wp, ws, alpha, torch.float32, x_decode=mode)
        assert torch.equal(out, ref), mode


@pytest.mark.parametrize("m,n,k", [(1, 3072, 12288), (17, 6144, 6144), (4608, 512, 3072), (200, 200, 176)])
def test_bitwise_repeatable(m, n, k):
    _skip_unless_sm80_to_sm90()
    xp, xs, wp, ws, alpha = _operands(m, n, k, seed=1)
    first = nvfp4_gemm(xp, xs, wp, ws, alpha)
    for _ in range(3):
        assert torch.equal(nvfp4_gemm(xp, xs, wp, ws, alpha), first)


@pytest.mark.parametrize("x_packed,m", [(True, 1), (True, 17), (True, 64), (False, 65), (False, 1000), (False, 4608)])
@pytest.mark.parametrize("n,k", [(384, 3072), (200, 176)])
def test_every_config_gives_the_same_bytes(x_packed, m, n, k, monkeypatch):
    """The autotuner may pick any config in any process: the output must not depend on it (nor on the asm)."""
    _skip_unless_sm80_to_sm90()
    xp, xs, wp, ws, alpha = _operands(m, n, k, seed=2)
    mode = "in_kernel" if x_packed else "predecode"
    outs = {}
    for cfg in gemm_mod.gemm_configs(x_packed):
        outs[str(cfg.kwargs) + f" w{cfg.num_warps}s{cfg.num_stages}"] = nvfp4_gemm(
            xp, xs, wp, ws, alpha, torch.float32, x_decode=mode, config=cfg)
    monkeypatch.setenv("DIFFUSERS_NVFP4_TRITON_NO_ASM", "1")
    outs["no-asm autotuned"] = nvfp4_gemm(xp, xs, wp, ws, alpha, torch.float32, x_decode=mode, kernel="triton")
    monkeypatch.delenv("DIFFUSERS_NVFP4_TRITON_NO_ASM")
    outs["triton autotuned"] = nvfp4_gemm(xp, xs, wp, ws, alpha, torch.float32, x_decode=mode, kernel="triton")
    outs["auto"] = nvfp4_gemm(xp, xs, wp, ws, alpha, torch.float32, x_decode=mode)
    if gemm_mod.sm90_kernel_for(m, k, wp, ws, x_decode=mode) is not None:
        x16 = gemm_mod.decode_nvfp4_rows(xp, xs)
        for stages, group_n in ((4, 8), (4, 64), (3, 1), (3, 64)):
            out = torch.empty(m, n, device=DEV, dtype=torch.float32)
            outs[f"sm90 stages {stages} group {group_n}"] = _sm90().nvfp4_gemm_sm90(x16, wp, ws, alpha.reshape(1), out,
                                                                                    stages, group_n)
    names = list(outs)
    differing = [name for name in names[1:] if not torch.equal(outs[name], outs[names[0]])]
    assert not differing, f"configs differing from {names[0]}: {differing}"
    assert _rel(outs[names[0]], _reference(xp, xs, wp, ws, alpha)) <= REL_BOUND


def _sm90():
    return importlib.import_module("diffusers_nvfp4_fast.kernels.nvfp4_gemm_sm90")


def _skip_unless_sm90():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("SM90 Gluon GEMM test not run: this GPU is not SM90; it runs on a Hopper GPU (H100/H200)")


@pytest.mark.parametrize("m,n,k", [(65, 128, 64), (300, 256, 1024), (1000, 200, 96), (257, 129, 32),
                                   (4609, 3000, 3104), (4608, 3072, 3072)])
@pytest.mark.parametrize("random_bytes", [False, True])
def test_sm90_kernel_equals_triton_kernel(m, n, k, random_bytes):
    """The Gluon kernel gives the Triton kernel's bytes: odd M/N, K % 64 == 32 (partial last step), one K step,
    every code and scale byte (random bytes); and it is what ``kernel="auto"`` runs on SM90."""
    _skip_unless_sm90()
    xp, xs, wp, ws, alpha = (_random_bytes if random_bytes else _operands)(m, n, k, seed=7)
    triton_out = nvfp4_gemm(xp, xs, wp, ws, alpha, torch.float32, x_decode="predecode", kernel="triton")
    sm90_out = nvfp4_gemm(xp, xs, wp, ws, alpha, torch.float32, x_decode="predecode", kernel="sm90")
    assert torch.equal(sm90_out, triton_out)
    assert torch.equal(nvfp4_gemm(xp, xs, wp, ws, alpha, torch.bfloat16, kernel="sm90"), sm90_out.to(torch.bfloat16))
    assert _rel(sm90_out, _reference(xp, xs, wp, ws, alpha)) <= REL_BOUND


def test_auto_uses_the_sm90_kernel_where_it_applies(monkeypatch):
    _skip_unless_sm90()
    calls = []
    real = _sm90().nvfp4_gemm_sm90
    monkeypatch.setattr(_sm90(), "nvfp4_gemm_sm90", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    xp, xs, wp, ws, alpha = _operands(300, 256, 1024, seed=8)
    nvfp4_gemm(xp, xs, wp, ws, alpha)
    assert calls == [(300, 1024)]
    xp, xs, wp, ws, alpha = _operands(300, 256, 176, seed=8)  # K % 32 != 0: the Triton kernel
    nvfp4_gemm(xp, xs, wp, ws, alpha)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="K=176"):
        nvfp4_gemm(xp, xs, wp, ws, alpha, kernel="sm90")


def test_in_kernel_and_predecode_agree_with_emulation():
    _skip_unless_sm80_to_sm90()
    xp, xs, wp, ws, alpha = _operands(48, 640, 2064, seed=3)
    ref = _reference(xp, xs, wp, ws, alpha)
    a = nvfp4_gemm(xp, xs, wp, ws, alpha, torch.float32, x_decode="in_kernel")
    b = nvfp4_gemm(xp, xs, wp, ws, alpha, torch.float32, x_decode="predecode")
    print(f"in_kernel rel {_rel(a, ref):.3e}, predecode rel {_rel(b, ref):.3e}, equal: {torch.equal(a, b)}")
    assert _rel(a, ref) <= REL_BOUND and _rel(b, ref) <= REL_BOUND


@pytest.mark.parametrize("splits", (1, 2, 5))
def test_split_k(splits):
    _skip_unless_sm80_to_sm90()
    xp, xs, wp, ws, alpha = _operands(3, 256, 6144, seed=4)
    ref = _reference(xp, xs, wp, ws, alpha)
    out = nvfp4_gemm(xp, xs, wp, ws, alpha, torch.float32, split_k=splits)
    assert _rel(out, ref) <= REL_BOUND
    assert torch.equal(nvfp4_gemm(xp, xs, wp, ws, alpha, torch.float32, split_k=splits), out)


@pytest.mark.parametrize("m,n,k", [(17, 200, 176), (1000, 300, 48), (130, 130, 2064), (1000, 300, 3104)])
def test_scale_padding_bytes_do_not_matter(m, n, k):
    """Rows past M/N and columns past K/16 of the 128x4 scale matrices hold garbage (NaN bytes included)."""
    _skip_unless_sm80_to_sm90()
    xp, xs, wp, ws, alpha = _operands(m, n, k, seed=5)
    clean = [nvfp4_gemm(xp, xs, wp, ws, alpha, torch.float32, x_decode=mode) for mode in ("in_kernel", "predecode")]
    gen = torch.Generator(device=DEV).manual_seed(9)

    def dirty(scales, rows):
        c = k // 16
        garbage = torch.randint(0, 256, scales.shape, device=DEV, generator=gen, dtype=torch.uint8)
        garbage[-1, -1] = 0x7F  # a NaN byte in the padding (the last row block always has padding here)
        garbage[:rows, :c] = unswizzle_scales(scales, rows, c)
        return swizzle_scales(garbage)  # the shape is already padded, so nothing is zeroed

    xs_d, ws_d = dirty(xs, m), dirty(ws, n)
    assert not torch.equal(xs_d, xs) and not torch.equal(ws_d, ws)
    for mode, ref in zip(("in_kernel", "predecode"), clean, strict=True):
        assert torch.equal(nvfp4_gemm(xp, xs_d, wp, ws_d, alpha, torch.float32, x_decode=mode), ref), mode


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16, torch.float32))
@pytest.mark.parametrize("rows,k", [(1, 16), (130, 176), (4608, 6144)])
def test_decode_rows_equals_format_decode(dtype, rows, k):
    xp, xs, _, _, _ = _random_bytes(rows, 8, k, seed=rows)
    assert torch.equal(gemm_mod.decode_nvfp4_rows(xp, xs, dtype), decode_nvfp4(xp, xs, dtype=dtype))


def test_large_m_int64_offsets():
    """M * N > 2^31 output elements: only the last rows are checked against the emulation."""
    _skip_unless_sm80_to_sm90()
    m, n, k = 70_000, 36_864, 64
    if torch.cuda.get_device_properties(0).total_memory < 24 << 30:
        pytest.skip("large-M GEMM test not run: needs ~6 GB of free GPU memory for the output; runs on an H200-class GPU")
    gen = torch.Generator(device=DEV).manual_seed(6)
    x = torch.randn(m, k, device=DEV, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, device=DEV, generator=gen).to(torch.bfloat16)
    g = torch.tensor(100.0, device=DEV)
    xp, xs = quantize_nvfp4(x, g, fast_math=False)
    wp, ws = quantize_nvfp4(w, g, fast_math=False)
    alpha = torch.tensor(1e-4, device=DEV)
    out = nvfp4_gemm(xp, xs, wp, ws, alpha, torch.bfloat16)
    tail_p, tail_s = quantize_nvfp4(x[-64:], g, fast_math=False)  # per-row quantization: same bytes as in xp
    assert torch.equal(tail_p, xp[-64:])
    ref = (emulated_nvfp4_gemm(tail_p, tail_s, wp, ws) * alpha)
    assert _rel(out[-64:], ref) <= 1e-2  # BF16 output: one rounding of a value within REL_BOUND
    del out


def test_nvfp4linear_triton_backend_vs_emulated(monkeypatch):
    """NVFP4Linear with bias: the Triton backend equals the emulated backend up to BF16 rounding of nearly equal
    FP32 values (the bias is added after the GEMM in both)."""
    _skip_unless_sm80_to_sm90()
    torch.manual_seed(0)
    in_f, out_f = 3072, 1000
    w = (torch.randn(out_f, in_f, device=DEV) * 0.02).to(torch.bfloat16)
    ws2 = (w.float().abs().amax() / 2688.0).reshape(())
    packed, scales = quantize_nvfp4(w, 1.0 / ws2, scale_layout="128x4", fast_math=False)
    lin = NVFP4Linear(in_f, out_f, bias=True, device=DEV)
    lin.load_nvfp4(packed, scales, ws2, torch.tensor(8.0 / 2688.0), torch.randn(out_f, device=DEV).to(torch.bfloat16),
                   scale_layout="128x4")
    x = torch.randn(2, 777, in_f, device=DEV).to(torch.bfloat16)
    monkeypatch.setenv("DIFFUSERS_NVFP4_GEMM_BACKEND", "triton")
    y_tri = lin(x)
    y_tri2 = lin(x)
    monkeypatch.setenv("DIFFUSERS_NVFP4_GEMM_BACKEND", "emulated")
    y_emu = lin(x)
    assert torch.equal(y_tri, y_tri2)
    assert y_tri.shape == y_emu.shape == (2, 777, out_f) and y_tri.dtype == torch.bfloat16
    rel = _rel(y_tri, y_emu.float())
    frac = (y_tri != y_emu).float().mean().item()
    print(f"NVFP4Linear triton vs emulated: rel {rel:.3e}, {frac:.2e} of outputs differ (BF16 rounding)")
    assert rel <= 1e-3 and frac <= 0.05
