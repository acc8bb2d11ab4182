"""The NVFP4 Triton kernels without a GPU: the interpreter runs them on CPU tensors (precise mode, software E2M1)
and must match the torch reference byte for byte; ahead-of-time compilation proves the SM90 and Blackwell variants
(fast-math inline PTX, hardware E2M1 conversion) build."""

import re
import sys
from pathlib import Path

import pytest
import torch
from kernel_subprocess import run_interpreted

triton = pytest.importorskip("triton", reason="Triton is not installed, so the CPU kernel tests (interpreter, AOT compiles) "
                                               "did not run; CI installs it with .[test]")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # sass_count: compile and disassemble


def test_interpreted_kernels_match_reference():
    out = run_interpreted("""
        import torch
        from diffusers_nvfp4_fast import kernels
        from diffusers_nvfp4_fast.format import quantize_nvfp4
        torch.manual_seed(0)
        g = torch.tensor([2688 / 5.0])
        cases = []
        for m, k, dtype in [(1, 64, torch.bfloat16), (17, 48, torch.bfloat16), (130, 160, torch.bfloat16),
                            (33, 96, torch.float16)]:
            x = (torch.randn(m, k) * 3).to(dtype)
            x[0, :16] = 0
            if m > 3:
                x[1, 3] = float("nan"); x[2, 5] = float("inf"); x[2, 6] = -1e-30; x[3, 16:32] = -0.0
            cases.append((x, g))
        # every scale binade, including E4M3 subnormals, saturation and underflow to 0
        x = (torch.rand(64, 512) * 2 ** torch.randint(-40, 12, (64, 512)).float()).bfloat16()
        cases.append((x, torch.tensor([1.0])))
        cases.append((torch.randn(20, 200).bfloat16()[:, 8:168], g))  # row-strided view
        bad = 0
        for x, gs in cases:
            got, ref = kernels.quantize_nvfp4(x, gs, fast_math=False), quantize_nvfp4(x, gs[0], fast_math=False)
            bad += not (torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]))
        a, b = torch.randn(3, 5, 48).bfloat16(), torch.randn(3, 5, 80).bfloat16() * 0.01
        for block_c in (4, 8):
            got = kernels.token_cat_quantize(a, b, g, fast_math=False, block_c=block_c)
            ref = quantize_nvfp4(torch.cat([a, b], -1), g[0], fast_math=False)
            bad += not (torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]))
        # a broken reference must be caught: flip one nibble
        got = kernels.quantize_nvfp4(cases[0][0], g, fast_math=False)
        ref = quantize_nvfp4(cases[0][0], g[0], fast_math=False)
        ref[0][0, 0] ^= 0x10
        print("MISMATCHES", bad, "CANARY", torch.equal(got[0], ref[0]))
    """)
    assert "MISMATCHES 0 CANARY False" in out, out


def test_e2m1_rounding_matches_reference_on_every_boundary():
    """The epilogue's E2M1 encoder (eight values -> one packed word) vs ``format.e2m1_round`` + ``pack_nibbles`` on
    every BF16 bit pattern (as FP32), the 4096 FP32 neighbours on each side of every rounding midpoint and of every code
    value, and NaNs of both signs; each value is encoded at every one of the word's eight nibble positions."""
    out = run_interpreted("""
        import torch, triton, triton.language as tl
        from diffusers_nvfp4_fast.kernels.nvfp4_epilogue import e2m1_words
        from diffusers_nvfp4_fast.format import e2m1_round, pack_nibbles

        @triton.jit
        def probe(x_ptr, out_ptr, n_words, BLOCK: tl.constexpr):
            words = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + words[:, None] * 8 + tl.arange(0, 8)[None, :], mask=words[:, None] < n_words, other=0.0)
            tl.store(out_ptr + words, e2m1_words(x, False), mask=words < n_words)

        points = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0])
        steps = torch.arange(-4096, 4097, dtype=torch.int32)
        near = (points.view(torch.int32)[:, None] + steps[None, :]).flatten()
        near = near[near >= 0].view(torch.float32)
        every_bf16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
        nans = torch.tensor([0x7FC00000, 0x7F800001, -0x00400000, -0x00000001], dtype=torch.int32).view(torch.float32)
        x = torch.cat([near, -near, every_bf16, nans])
        x = torch.cat([x, torch.zeros((-x.numel()) % 8)])
        # eight rotations: every value lands once in each nibble position of its word
        x = torch.cat([torch.roll(x.view(-1, 8), shifts=k, dims=1).flatten() for k in range(8)])
        got = torch.empty(x.numel() // 8, dtype=torch.int32)
        probe[(triton.cdiv(got.numel(), 1024),)](x, got, got.numel(), BLOCK=1024)
        want = pack_nibbles(e2m1_round(x)).view(torch.int32)
        bad = (got != want).nonzero().flatten()
        print("CHECKED", x.numel(), "MISMATCHES", bad.numel(), x.view(-1, 8)[bad[:3]].tolist(), got[bad[:3]].tolist(),
              want[bad[:3]].tolist())
    """)
    assert " MISMATCHES 0 " in out, out


@pytest.mark.parametrize("capability", [90, 100, 120])
@pytest.mark.parametrize("fast_math", [True, False])
@pytest.mark.parametrize("kernel", ["quantize", "token_cat"])
def test_kernels_compile_ahead_of_time(kernel, capability, fast_math):
    from sass_count import compile_kernel

    compiled = compile_kernel(kernel, capability, fast_math)
    ptx = compiled.asm["ptx"]
    assert ("cvt.rn.satfinite.e2m1x2.f32" in ptx) == (capability >= 100)
    assert ("rcp.approx.ftz.f32" in ptx) == fast_math
    assert len(compiled.asm["cubin"]) > 0


@pytest.mark.parametrize("capability", [90, 100, 120])
def test_qwen_resnorm_kernel_compiles_ahead_of_time(capability):
    """The fused Qwen kernel (whole-block and split-block quantize paths) builds for Hopper and both Blackwell targets,
    with the hardware E2M1 conversion exactly on SM100+; it runs only where such a GPU exists."""
    from sass_count import compile_qwen_resnorm

    compiled = compile_qwen_resnorm(3072, capability)
    assert ("cvt.rn.satfinite.e2m1x2.f32" in compiled.asm["ptx"]) == (capability >= 100)
    assert len(compiled.asm["cubin"]) > 0


@pytest.mark.parametrize("even_k", [True, False])
def test_sm90_gemm_overlaps_decode_and_mma(even_k):
    """The Gluon SM90 GEMM compiles with this Triton, and its SASS keeps one wgmma in flight while the next weight
    tile is decoded (wait until <= 1 group is pending, not 0), with the decoded tile as the register A operand."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper",
                        reason="this Triton has no Gluon Hopper API, so the SM90 GEMM compile check did not run; "
                               "it runs with Triton >= 3.6, as CI installs")
    from sass_count import compile_gemm_sm90, disassemble

    sass = disassemble(compile_gemm_sm90(even_k=even_k))
    assert re.search(r"HGMMA\.64x256x16\.F32 R\d+, R\d+, gdesc", sass), "the weight is not the register A operand"
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass, "every wgmma is waited on at once: decode and MMA do not overlap"
    assert "USETMAXREG" in sass, "not warp-specialized: no register hand-over between producer and MMA warps"


@pytest.mark.parametrize("even_k", [True, False])
def test_sm90_gemm_never_overwrites_registers_of_a_running_wgmma(even_k):
    """The decode of K step i must not write the A fragment (or accumulator) of wgmma(i - 1), which is still running:
    the hardware does not check it, and a loop that did it gave wrong, run-dependent bytes on an H200."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper",
                        reason="this Triton has no Gluon Hopper API, so the SM90 GEMM SASS check did not run; "
                               "it runs with Triton >= 3.6, as CI installs")
    from sass_count import compile_gemm_sm90, disassemble, wgmma_register_hazards

    assert wgmma_register_hazards(disassemble(compile_gemm_sm90(even_k=even_k))) == []


def test_wgmma_hazard_check_finds_a_write_to_an_in_flight_fragment():
    """The checker above flags the pattern that broke the GEMM: a loop writing the A registers of the wgmma it left
    in flight (``DEPBAR.LE gsb0, 0x1``), and accepts the same loop once the write targets other registers."""
    from sass_count import wgmma_register_hazards

    def loop(decode_dst: str) -> str:
        return "\n".join([
            ".L_x_1:",
            f"        /*0010*/                   LOP3.LUT {decode_dst}, R9, 0x80008000, R22, 0xf8, !PT ;",
            "        /*0020*/                   WARPGROUP.ARRIVE ;",
            "        /*0030*/                   HGMMA.64x256x16.F32 R24, R152, gdesc[UR4], R24, gsb0 ;",
            "        /*0040*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;",
            "        /*0050*/              @P1 BRA `(.L_x_1) ;",
        ])

    assert len(wgmma_register_hazards(loop("R153"))) == 1
    assert wgmma_register_hazards(loop("R20")) == []
    assert len(wgmma_register_hazards(loop("R100"))) == 1  # the accumulator R24..R151 is in flight too


def test_qwen_resnorm_kernel_prefetches_and_does_not_spill():
    """The fused Qwen kernel, compiled for sm_90 with its register cap, keeps every value in registers (no local
    memory) and issues the x/residual loads of several chunks before its first store (a load placed after a store
    that may alias it cannot be hoisted, which exposed one memory round trip per chunk)."""
    from sass_count import compile_qwen_resnorm, disassemble

    sass = disassemble(compile_qwen_resnorm(3072))
    ops = re.findall(r"\b(LDG|STG|LDL|STL)\.\S+", sass)
    assert "LDL" not in ops and "STL" not in ops, "the register cap made the compiler spill to local memory"
    loads_before_first_store = ops.index("STG")
    assert loads_before_first_store >= 8, f"only {loads_before_first_store} global loads before the first store"


def test_host_cdiv_and_next_power_of_2_match_triton():
    """The plain host helpers that replace triton.cdiv / triton.next_power_of_2 in launch code give the same values."""
    from diffusers_nvfp4_fast.kernels.launch import cdiv, next_power_of_2

    values = [0, 1, 2, 15, 16, 17, 127, 128, 129, 4095, 4096, 4097, 70000, 2**31 - 1]
    for a in values:
        for b in (1, 2, 4, 16, 64, 128, 192, 256, 1000):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
    for n in [*range(1, 5000), 65535, 65536, 65537, 2**31 - 1]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n


def test_sm90_gemm_rejects_a_pipeline_depth_that_does_not_fit():
    """Too many stages for the output dtype is a clear ValueError before anything is launched (not a compiler
    out-of-resources error from deep inside Triton)."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper",
                        reason="this Triton has no Gluon Hopper API, so the SM90 GEMM pipeline-depth check did not "
                                "run; it runs with Triton >= 3.6, as CI installs")
    from diffusers_nvfp4_fast.kernels.nvfp4_gemm_sm90 import nvfp4_gemm_sm90

    x16 = torch.zeros(4, 64, dtype=torch.float16)
    w = torch.zeros(128, 32, dtype=torch.uint8)
    s = torch.zeros(128, 4, dtype=torch.uint8)
    alpha = torch.ones(1)
    with pytest.raises(ValueError, match="stages=5 does not fit; with torch.float32 output it must be in 3..4"):
        nvfp4_gemm_sm90(x16, w, s, alpha, torch.empty(4, 128), stages=5)
    with pytest.raises(ValueError, match="stages=6 does not fit; with torch.bfloat16 output it must be in 3..5"):
        nvfp4_gemm_sm90(x16, w, s, alpha, torch.empty(4, 128, dtype=torch.bfloat16), stages=6)


def test_sm90_weight_descriptors_are_reused_rebuilt_and_freed():
    import gc
    import importlib
    import weakref

    pytest.importorskip("triton.experimental.gluon.nvidia.hopper",
                        reason="this Triton has no Gluon Hopper API, so the SM90 weight-descriptor cache check did not "
                               "run; it runs with Triton >= 3.6, as CI installs")
    sm90 = importlib.import_module("diffusers_nvfp4_fast.kernels.nvfp4_gemm_sm90")
    w = torch.randint(0, 256, (256, 64), dtype=torch.uint8)
    s = torch.randint(0, 256, (256, 8), dtype=torch.uint8)
    first = sm90._weight_descriptors(w, s)
    assert sm90._weight_descriptors(w, s)[0] is first[0], "a second call for the same weight reuses its descriptors"
    assert torch.equal(first[0].base.reshape(-1).view(torch.uint8), w.reshape(-1))
    assert torch.equal(first[1].base.reshape(-1).view(torch.uint8), s.reshape(-1))
    w.set_(torch.randint(0, 256, (256, 64), dtype=torch.uint8).untyped_storage(), 0, (256, 64))  # same object, new storage
    rebuilt = sm90._weight_descriptors(w, s)
    assert rebuilt[0] is not first[0] and rebuilt[0].base.data_ptr() == w.data_ptr()
    weight_ref = weakref.ref(w)
    del w, s, first, rebuilt
    gc.collect()
    assert weight_ref() is None, "the cache must not keep a weight alive"
    assert not sm90._WEIGHT_DESCRIPTORS, "a freed weight's descriptors (and their storage views) are dropped"
