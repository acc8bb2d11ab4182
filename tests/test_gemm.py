"""The NVFP4 GEMM kernels (``kernels/nvfp4_gemm.py``: Triton, SM80-SM90; ``kernels/nvfp4_gemm_sm90.py``: Gluon, Hopper).

CPU, under the Triton interpreter: the same Triton kernel code (minus a one-instruction PTX register split, replaced
by shifts) on CPU tensors against ``ops.linear.emulated_gemm``: tiny shapes, odd N and K, both X variants, split K,
every candidate config, random bytes covering all codes and scales, garbage in the scale padding, and the standalone
decode against ``format.decode_nvfp4``. Outputs are FP32/FP16 there (the interpreter's FP32 -> BF16 cast truncates).

CPU, ahead of time: the Gluon SM90 kernel compiles, keeps one wgmma in flight while decoding the next tile, never
writes registers of a running wgmma, refuses pipelines that do not fit, and caches weight descriptors correctly.

GPU (``gpu``):
The GEMM adds exactly the same FP32 terms as ``ops.emulated_nvfp4_gemm`` (decoded values are exact in FP16 and
their products exact in FP32); only the summation order differs. So the comparison with the emulation has a
bound, stated and measured here: ``||out - ref|| / ||ref|| <= REL_BOUND`` on FP32 outputs. Everything else is
exact: repeat runs, every candidate config (shipped or autotuned), asm vs. pure decode, scale padding garbage, the
BF16 epilogue, the standalone decode.
"""

from __future__ import annotations

import importlib
import re

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed, so the GEMM tests did not run; they "
                                               "run wherever Triton is installed, as in CI (pip install -e '.[test]')")
from diffusers_nvfp4_fast import caches  # noqa: E402
from diffusers_nvfp4_fast.format import (  # noqa: E402
    decode_nvfp4,
    round_up,
    swizzle_scales,
    unswizzle_scales,
)
from diffusers_nvfp4_fast.format import quantize_nvfp4 as reference_quantize  # noqa: E402
from diffusers_nvfp4_fast.linear import NVFP4Linear  # noqa: E402
from diffusers_nvfp4_fast.ops.linear import emulated_gemm  # noqa: E402
from support.gpus import skip_unless_sm80_to_sm90  # noqa: E402
from support.interpreter import run_interpreted  # noqa: E402
from support.launch_sites import check_sites_against_binder  # noqa: E402

DEV = "cuda"
gemm_mod = importlib.import_module("diffusers_nvfp4_fast.kernels.nvfp4_gemm")
nvfp4_gemm = gemm_mod.nvfp4_gemm


# ---------------------------------------------------------------------------------------------------------------
# CPU: the interpreter.
# ---------------------------------------------------------------------------------------------------------------


def interpreted_gemm() -> list[dict]:
    """The GEMM checks under the interpreter; each entry is a relative error, an equality flag or an error message."""
    g = importlib.import_module("diffusers_nvfp4_fast.kernels.nvfp4_gemm")
    results = []

    def operands(m, n, k, seed):
        gen = torch.Generator().manual_seed(seed)
        x = (torch.randn(m, k, generator=gen) * 3).to(torch.bfloat16)
        w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
        gx, gw = 2688.0 / x.float().abs().amax(), 2688.0 / w.float().abs().amax()
        xp, xs = reference_quantize(x, gx, fast_math=False)
        wp, ws = reference_quantize(w, gw, fast_math=False)
        return xp, xs, wp, ws, ((1 / gx) * (1 / gw)).reshape(()).float()

    def random_bytes(m, n, k, seed):
        gen = torch.Generator().manual_seed(seed)
        def one(rows):
            p = torch.randint(0, 256, (rows, k // 2), generator=gen, dtype=torch.uint8)
            s = swizzle_scales(torch.randint(0, 0x7F, (rows, k // 16), generator=gen, dtype=torch.uint8))
            return p, s
        return (*one(m), *one(n), torch.tensor(0.37))

    def check(name, ops, out_dtype=torch.float32, **kw):
        xp, xs, wp, ws, alpha = ops
        ref = emulated_gemm(xp, xs, wp, ws) * alpha
        out = g.nvfp4_gemm(xp, xs, wp, ws, alpha, out_dtype, **kw)
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        results.append({"name": name, "rel": rel, "shape": list(out.shape), "dtype": str(out.dtype)})
        return out

    check("in_kernel 5x70x48", operands(5, 70, 48, 0), x_decode="in_kernel")
    check("in_kernel 17x200x176", operands(17, 200, 176, 1), x_decode="in_kernel")
    check("in_kernel 17x200x176 fp16 out", operands(17, 200, 176, 1), torch.float16, x_decode="in_kernel")
    check("split_k=2 17x200x176", operands(17, 200, 176, 1), x_decode="in_kernel", split_k=2)
    check("split_k=3 3x64x1024", operands(3, 64, 1024, 2), x_decode="in_kernel", split_k=3)
    check("predecode 130x130x256", operands(130, 130, 256, 3), x_decode="predecode")
    check("predecode 17x200x176", operands(17, 200, 176, 1), x_decode="predecode")
    check("auto 65x40x80", operands(65, 40, 80, 4))
    check("random bytes in_kernel", random_bytes(17, 72, 256, 5), x_decode="in_kernel")
    check("random bytes predecode", random_bytes(70, 72, 256, 6), x_decode="predecode")

    # Every autotune config of both variants gives the same bytes.
    for packed, m in ((True, 17), (False, 70)):
        ops = operands(m, 136, 176, 7)
        outs = [g.nvfp4_gemm(*ops, torch.float32, x_decode="in_kernel" if packed else "predecode", config=c)
                for c in g.gemm_configs(packed)]
        results.append({"name": f"configs identical (x_packed={packed})",
                        "equal": all(torch.equal(o, outs[0]) for o in outs)})

    # Garbage (including NaN bytes) in the padding of the 128x4 scale matrices does not change a byte.
    xp, xs, wp, ws, alpha = operands(17, 200, 176, 8)
    gen = torch.Generator().manual_seed(9)
    def dirty(s, rows):
        garbage = torch.randint(0, 256, s.shape, generator=gen, dtype=torch.uint8)
        garbage[-1, -1] = 0x7F
        garbage[:rows, :11] = unswizzle_scales(s, rows, 11)
        return swizzle_scales(garbage)
    for mode in ("in_kernel", "predecode"):
        clean = g.nvfp4_gemm(xp, xs, wp, ws, alpha, torch.float32, x_decode=mode)
        got = g.nvfp4_gemm(xp, dirty(xs, 17), wp, dirty(ws, 200), alpha, torch.float32, x_decode=mode)
        results.append({"name": f"scale padding garbage ({mode})", "equal": torch.equal(clean, got)})

    # The standalone decode equals format.decode_nvfp4 byte for byte.
    p, s, *_ = random_bytes(70, 8, 176, 10)
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        same = torch.equal(g.decode_nvfp4_rows(p, s, dt), decode_nvfp4(p, s, dtype=dt))
        results.append({"name": f"decode_nvfp4_rows {dt}", "equal": same})

    # The bias epilogue gives the bytes of torch's ``out + bias`` (every output dtype, split K, both X variants), and
    # the pre-decoded entry point those of the packed one.
    for name, (m, mode, split) in {"in_kernel": (17, "in_kernel", None), "split_k=2": (17, "in_kernel", 2),
                                   "predecode": (70, "predecode", None)}.items():
        ops = operands(m, 200, 176, 12)
        for dt in (torch.float32, torch.float16, torch.bfloat16):
            b = (torch.randn(200, generator=torch.Generator().manual_seed(13)) * 0.3).to(dt)
            plain = g.nvfp4_gemm(*ops, dt, x_decode=mode, split_k=split)
            fused = g.nvfp4_gemm(*ops, dt, x_decode=mode, split_k=split, bias=b)
            results.append({"name": f"bias {name} {dt}", "equal": torch.equal(fused, plain + b)})
            if mode == "predecode":
                x16 = g.decode_nvfp4_rows(ops[0], ops[1])
                same = torch.equal(g.nvfp4_gemm_fp16_x(x16, *ops[2:], dt, b), fused)
                results.append({"name": f"fp16_x {dt}", "equal": same})
    ops = operands(70, 72, 256, 14)
    for case, bias in {"bias dtype": torch.zeros(72, dtype=torch.float16), "bias shape": torch.zeros(71)}.items():
        try:
            g.nvfp4_gemm(*ops, torch.float32, bias=bias)
            results.append({"name": case, "error": None})
        except ValueError as exc:
            results.append({"name": case, "error": str(exc)})

    # kernel="triton" is what "auto" runs here; kernel="sm90" names why it cannot run; a bad choice is refused.
    ops = operands(70, 72, 256, 11)
    results.append({"name": "kernel=triton equals auto", "equal": torch.equal(
        g.nvfp4_gemm(*ops, torch.float32, kernel="triton"), g.nvfp4_gemm(*ops, torch.float32))})
    bad_choices = {
        "sm90 on cpu": {"kernel": "sm90"},
        "sm90 in kernel": {"kernel": "sm90", "x_decode": "in_kernel"},
        "unknown kernel": {"kernel": "cutlass"},
        "sm90 with config": {"kernel": "sm90", "config": g.gemm_configs(False)[0]},
    }
    for case, kw in bad_choices.items():
        try:
            g.nvfp4_gemm(*ops, torch.float32, **kw)
            results.append({"name": case, "error": None})
        except ValueError as exc:
            results.append({"name": case, "error": str(exc)})
    return results

@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreted(__name__, "interpreted_gemm")


def test_interpreted_matches_emulation(interpreter_results):
    checks = [r for r in interpreter_results if "rel" in r]
    assert len(checks) == 10
    # The interpreter sums in FP32 in another order than torch: a few ulps, nothing like a wrong term (FP16 output:
    # one FP16 rounding, <= 2^-11 relative).
    bad = [r for r in checks if not r["rel"] <= (1e-3 if r["dtype"] == "torch.float16" else 1e-6)]
    assert not bad, bad


def test_interpreted_exact_properties(interpreter_results):
    flags = [r for r in interpreter_results if "equal" in r]
    assert len(flags) == 20
    assert all(r["equal"] for r in flags), [r for r in flags if not r["equal"]]


def test_interpreted_bias_errors_name_the_bias(interpreter_results):
    errors = {r["name"]: r.get("error") for r in interpreter_results if "error" in r}
    assert "bias must be [72] torch.float32" in errors["bias dtype"] and "torch.float16" in errors["bias dtype"], errors
    assert "got (71,)" in errors["bias shape"], errors


def test_interpreted_kernel_choice_errors(interpreter_results):
    errors = {r["name"]: r["error"] for r in interpreter_results if "error" in r}
    assert "needs an SM90 GPU" in errors["sm90 on cpu"] and "K=256 on cpu" in errors["sm90 on cpu"], errors
    assert "pre-decoded X path" in errors["sm90 in kernel"], errors
    assert "'cutlass'" in errors["unknown kernel"], errors
    assert "cannot be combined with kernel='sm90'" in errors["sm90 with config"], errors


# ---------------------------------------------------------------------------------------------------------------
# CPU: the SM90 kernel's SASS and host code.
# ---------------------------------------------------------------------------------------------------------------


def _need_gluon_hopper(what: str, module: str = "triton.experimental.gluon.language.nvidia.hopper") -> None:
    """Skip ``what`` (a CPU check of the SM90 kernel) where this Triton has no Gluon Hopper API."""
    pytest.importorskip(module, reason=f"this Triton has no Gluon Hopper API, so the {what} did not run; it runs "
                                       "with Triton >= 3.6, as CI installs")


_OPCODE = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")  # a SASS line's opcode, past its predicate
SM90_VARIANTS = [(True, 256, False), (False, 256, False), (True, 128, True), (False, 64, True)]  # even_k, tokens, bias


@pytest.mark.parametrize("even_k,block_m,has_bias", SM90_VARIANTS)
def test_sm90_gemm_overlaps_decode_and_mma(even_k, block_m, has_bias):
    """The Gluon SM90 GEMM compiles with this Triton for every tile height, with and without the bias epilogue, and
    its SASS keeps one wgmma in flight while the next weight tile is decoded (wait until <= 1 group is pending, not
    0), with the decoded tile as the register A operand."""
    _need_gluon_hopper("SM90 GEMM compile check")
    from support.sass_count import compile_gemm_sm90, disassemble

    sass = disassemble(compile_gemm_sm90(even_k=even_k, block_m=block_m, has_bias=has_bias))
    assert re.search(rf"HGMMA\.64x{block_m}x16\.F32 R\d+, R\d+, gdesc", sass), "the weight is not the A operand"
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass, "every wgmma is waited on at once: decode and MMA do not overlap"
    assert "USETMAXREG" in sass, "not warp-specialized: no register hand-over between producer and MMA warps"


@pytest.mark.parametrize("even_k,block_m,has_bias", SM90_VARIANTS)
def test_sm90_gemm_never_overwrites_registers_of_a_running_wgmma(even_k, block_m, has_bias):
    """The decode of K step i must not write the A fragment (or accumulator) of wgmma(i - 1), which is still running:
    the hardware does not check it, and a loop that did it gave wrong, run-dependent bytes on an H200."""
    _need_gluon_hopper("SM90 GEMM SASS check")
    from support.sass_count import compile_gemm_sm90, disassemble, wgmma_register_hazards

    sass = disassemble(compile_gemm_sm90(even_k=even_k, block_m=block_m, has_bias=has_bias))
    assert wgmma_register_hazards(sass) == []


def test_sm90_gemm_decodes_a_k_step_in_few_instructions():
    """The weight decode is the SM90 GEMM's critical path at 64-128 tokens per tile (docs/history.md, "the K step
    probes"): one PRMT per lane byte and the scales converted two at a time keep a K step at 127 instructions with
    Triton 3.8 (151 with shift-and-mask byte picks and one conversion per scale pair, 1.4-6.7 % slower on the H200).
    Counted per thread: the uniform-datapath instructions (U*: the wgmma descriptors' shared-memory addresses) are
    Triton's choice, 7 / 6 / 13 of the 128 / 127 / 134 with Triton 3.6 / 3.8 / 3.9, and 121 per-thread ones in each."""
    _need_gluon_hopper("SM90 GEMM SASS check")
    from support.sass_count import compile_gemm_sm90, disassemble, first_k_step

    step = first_k_step(disassemble(compile_gemm_sm90(block_m=128)))
    per_thread = [line for line in step if not _OPCODE.match(line).group(1).startswith("U")]
    assert len(per_thread) <= 126, f"{len(per_thread)} per-thread instructions per K step ({len(step)} in all)"
    assert not [line for line in step if "SHF.R.S32.HI" in line], "bytes picked by shift and mask again"


def test_wgmma_hazard_check_finds_a_write_to_an_in_flight_fragment():
    """The checker above flags the pattern that broke the GEMM: a loop writing the A registers of the wgmma it left
    in flight (``DEPBAR.LE gsb0, 0x1``), and accepts the same loop once the write targets other registers."""
    from support.sass_count import wgmma_register_hazards

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


def test_sm90_gemm_rejects_a_pipeline_depth_that_does_not_fit():
    """Too many stages for the output dtype is a clear ValueError before anything is launched (not a compiler
    out-of-resources error from deep inside Triton)."""
    _need_gluon_hopper("SM90 GEMM pipeline-depth check")
    from diffusers_nvfp4_fast.kernels.nvfp4_gemm_sm90 import nvfp4_gemm_sm90

    x16 = torch.zeros(4, 64, dtype=torch.float16)
    w = torch.zeros(128, 32, dtype=torch.uint8)
    s = torch.zeros(128, 4, dtype=torch.uint8)
    alpha = torch.ones(1)
    with pytest.raises(ValueError, match="stages=5 does not fit; with 256-token tiles and torch.float32 output it must "
                                         "be in 3..4"):
        nvfp4_gemm_sm90(x16, w, s, alpha, torch.empty(4, 128), stages=5, block_m=256)
    with pytest.raises(ValueError, match="stages=6 does not fit; with 256-token tiles and torch.bfloat16 output it "
                                         "must be in 3..5"):
        nvfp4_gemm_sm90(x16, w, s, alpha, torch.empty(4, 128, dtype=torch.bfloat16), stages=6, block_m=256)
    # smaller tiles leave room for deeper pipelines
    with pytest.raises(ValueError, match="it must be in 3..10"):
        nvfp4_gemm_sm90(x16, w, s, alpha, torch.empty(4, 128, dtype=torch.bfloat16), stages=11, block_m=128)


def test_sm90_weight_descriptors_are_reused_rebuilt_and_freed():
    import gc
    import importlib
    import weakref

    _need_gluon_hopper("SM90 weight-descriptor cache check", module="triton.experimental.gluon.nvidia.hopper")
    sm90 = importlib.import_module("diffusers_nvfp4_fast.kernels.nvfp4_gemm_sm90")
    w = torch.randint(0, 256, (256, 64), dtype=torch.uint8)
    s = torch.randint(0, 256, (256, 8), dtype=torch.uint8)
    first = sm90._weight_descriptors(w, s)
    assert sm90._weight_descriptors(w, s)[0] is first[0], "a second call for the same weight reuses its descriptors"
    assert torch.equal(first[0].base.reshape(-1).view(torch.uint8), w.reshape(-1))
    assert torch.equal(first[1].base.reshape(-1).view(torch.uint8), s.reshape(-1))
    # same object, new storage
    w.set_(torch.randint(0, 256, (256, 64), dtype=torch.uint8).untyped_storage(), 0, (256, 64))
    rebuilt = sm90._weight_descriptors(w, s)
    assert rebuilt[0] is not first[0] and rebuilt[0].base.data_ptr() == w.data_ptr()
    weight_ref = weakref.ref(w)
    del w, s, first, rebuilt
    gc.collect()
    assert weight_ref() is None, "the cache must not keep a weight alive"
    descriptors = caches.registered()["kernels.nvfp4_gemm_sm90.weight_descriptors"].table
    assert not len(descriptors), "a freed weight's descriptors (and their storage views) are dropped"


def test_sm90_weight_descriptors_do_not_keep_a_moved_weight_in_memory():
    """Offloading hooks move a weight away between calls by swapping its ``.data``; the descriptor cache, keyed by the
    weight object, must not keep the old memory alive until that weight's next call (with an owning alias it kept a
    whole group-offloaded text encoder on the GPU: FLUX.2-dev's ``text_encoder_offload`` ran out of memory)."""
    import gc
    import importlib

    from torch.multiprocessing.reductions import StorageWeakRef

    _need_gluon_hopper("SM90 weight-descriptor ownership check", module="triton.experimental.gluon.nvidia.hopper")
    sm90 = importlib.import_module("diffusers_nvfp4_fast.kernels.nvfp4_gemm_sm90")
    w = torch.nn.Parameter(torch.randint(0, 256, (256, 64), dtype=torch.uint8), requires_grad=False)
    s = torch.nn.Parameter(torch.randint(0, 256, (256, 8), dtype=torch.uint8), requires_grad=False)
    w_desc, s_desc = sm90._weight_descriptors(w, s)
    assert torch.equal(w_desc.base.reshape(-1).view(torch.uint8), w.reshape(-1))
    assert torch.equal(s_desc.base.reshape(-1).view(torch.uint8), s.reshape(-1))
    moved = [StorageWeakRef(w.untyped_storage()), StorageWeakRef(s.untyped_storage())]
    del w_desc, s_desc
    w.data, s.data = w.data.clone(), s.data.clone()  # what an offloading hook does
    gc.collect()
    assert all(ref.expired() for ref in moved), "the cached descriptors kept a moved weight's memory alive"
    rebuilt = sm90._weight_descriptors(w, s)
    assert rebuilt[0].base.data_ptr() == w.data_ptr() and rebuilt[1].base.data_ptr() == s.data_ptr()


def test_sm90_layouts_keep_the_text_triton_specializes_on():
    """The descriptors' layouts repr once; Triton's launch key (and the kernel signature parsed from it) must see the
    same text and the same layout type as a plain ``NVMMASharedLayout``."""
    import importlib

    _need_gluon_hopper("SM90 layout-repr check", module="triton.experimental.gluon.nvidia.hopper")
    from triton.experimental.gluon import language as gl

    sm90 = importlib.import_module("diffusers_nvfp4_fast.kernels.nvfp4_gemm_sm90")
    plain = {64: gl.NVMMASharedLayout.get_default_for([64, sm90.BLOCK_K], gl.float16),
             128: gl.NVMMASharedLayout.get_default_for([128, sm90.BLOCK_K], gl.float16),
             "flat": gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)}
    for key, want in plain.items():
        got = sm90._flat_layout() if key == "flat" else sm90._x_layout(key)
        assert isinstance(got, gl.NVMMASharedLayout) and repr(got) == repr(want), (key, repr(got), repr(want))
        assert got.swizzle_byte_width == want.swizzle_byte_width and hash(got) == hash(want)


# ---------------------------------------------------------------------------------------------------------------
# GPU.
# ---------------------------------------------------------------------------------------------------------------


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
    skip_unless_sm80_to_sm90("Triton GEMM test")


def _operands(m: int, n: int, k: int, seed: int = 0):
    """Quantized X [m, k] and W [n, k] (precise mode) + alpha, all on the GPU."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, device=DEV, generator=gen).to(torch.bfloat16) * 3
    w = (torch.randn(n, k, device=DEV, generator=gen) * 0.02).to(torch.bfloat16)
    gx = (2688.0 / x.float().abs().amax()).reshape(())
    gw = (2688.0 / w.float().abs().amax()).reshape(())
    xp, xs = reference_quantize(x, gx, fast_math=False)
    wp, ws = reference_quantize(w, gw, fast_math=False)
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
    return emulated_gemm(xp, xs, wp, ws) * alpha


def _rel(out, ref) -> float:
    return ((out.float() - ref).norm() / ref.norm().clamp(min=1e-30)).item()


@pytest.mark.gpu
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_gpu_matches_emulation(m, n, k):
    _skip_unless_sm80_to_sm90()
    xp, xs, wp, ws, alpha = _operands(m, n, k)
    ref = _reference(xp, xs, wp, ws, alpha)
    out = nvfp4_gemm(xp, xs, wp, ws, alpha, torch.float32)
    rel = _rel(out, ref)
    print(f"M={m} N={n} K={k}: ||out-ref||/||ref|| = {rel:.3e}")
    assert rel <= REL_BOUND
    # The BF16/FP16 epilogue is one rounding of the same FP32 value (configs never change bytes, §7).
    assert torch.equal(nvfp4_gemm(xp, xs, wp, ws, alpha, torch.bfloat16), out.to(torch.bfloat16))
    assert torch.equal(nvfp4_gemm(xp, xs, wp, ws, alpha, torch.float16), out.to(torch.float16))


@pytest.mark.gpu
@pytest.mark.parametrize("m", (1, 17, 4608))
def test_gpu_all_codes_and_scales(m):
    """Random bytes: all 16 codes, scales from 2^-9 to 448 (FP16-subnormal MMA inputs included)."""
    _skip_unless_sm80_to_sm90()
    xp, xs, wp, ws, alpha = _random_bytes(m, 384, 2048, seed=m)
    ref = _reference(xp, xs, wp, ws, alpha)
    out = nvfp4_gemm(xp, xs, wp, ws, alpha, torch.float32)
    rel = _rel(out, ref)
    print(f"random bytes M={m}: rel {rel:.3e}")
    assert rel <= REL_BOUND


@pytest.mark.gpu
def test_gpu_tiny_scales_exact():
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


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 3072, 12288), (17, 6144, 6144), (4608, 512, 3072), (200, 200, 176)])
def test_gpu_bitwise_repeatable(m, n, k):
    _skip_unless_sm80_to_sm90()
    xp, xs, wp, ws, alpha = _operands(m, n, k, seed=1)
    first = nvfp4_gemm(xp, xs, wp, ws, alpha)
    for _ in range(3):
        assert torch.equal(nvfp4_gemm(xp, xs, wp, ws, alpha), first)


@pytest.mark.gpu
@pytest.mark.parametrize("x_packed,m", [(True, 1), (True, 17), (True, 64), (False, 65), (False, 1000), (False, 4608)])
@pytest.mark.parametrize("n,k", [(384, 3072), (200, 176)])
def test_gpu_every_config_gives_the_same_bytes(x_packed, m, n, k, monkeypatch):
    """Any candidate may be the shipped or autotuned config of a shape class: the output must not depend on it (nor
    on the asm)."""
    _skip_unless_sm80_to_sm90()
    xp, xs, wp, ws, alpha = _operands(m, n, k, seed=2)
    mode = "in_kernel" if x_packed else "predecode"
    outs = {}
    for cfg in gemm_mod.gemm_configs(x_packed):
        outs[str(cfg.kwargs) + f" w{cfg.num_warps}s{cfg.num_stages}"] = nvfp4_gemm(
            xp, xs, wp, ws, alpha, torch.float32, x_decode=mode, config=cfg)
    monkeypatch.setenv("DIFFUSERS_NVFP4_TRITON_NO_ASM", "1")
    outs["no-asm shipped"] = nvfp4_gemm(xp, xs, wp, ws, alpha, torch.float32, x_decode=mode, kernel="triton")
    monkeypatch.delenv("DIFFUSERS_NVFP4_TRITON_NO_ASM")
    outs["triton shipped"] = nvfp4_gemm(xp, xs, wp, ws, alpha, torch.float32, x_decode=mode, kernel="triton")
    caches.reset("kernels.nvfp4_gemm.chosen_configs")  # a fresh first call of the key, timed by the opt-in autotuner
    monkeypatch.setenv(gemm_mod.AUTOTUNE_VAR, "1")
    outs["triton autotuned"] = nvfp4_gemm(xp, xs, wp, ws, alpha, torch.float32, x_decode=mode, kernel="triton")
    monkeypatch.delenv(gemm_mod.AUTOTUNE_VAR)
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


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(65, 128, 64), (300, 256, 1024), (1000, 200, 96), (257, 129, 32),
                                   (4609, 3000, 3104), (4608, 3072, 3072)])
@pytest.mark.parametrize("random_bytes", [False, True])
def test_gpu_sm90_kernel_equals_triton_kernel(m, n, k, random_bytes):
    """The Gluon kernel gives the Triton kernel's bytes: odd M/N, K % 64 == 32 (partial last step), one K step,
    every code and scale byte (random bytes); and it is what ``kernel="auto"`` runs on SM90."""
    _skip_unless_sm90()
    xp, xs, wp, ws, alpha = (_random_bytes if random_bytes else _operands)(m, n, k, seed=7)
    triton_out = nvfp4_gemm(xp, xs, wp, ws, alpha, torch.float32, x_decode="predecode", kernel="triton")
    sm90_out = nvfp4_gemm(xp, xs, wp, ws, alpha, torch.float32, x_decode="predecode", kernel="sm90")
    assert torch.equal(sm90_out, triton_out)
    assert torch.equal(nvfp4_gemm(xp, xs, wp, ws, alpha, torch.bfloat16, kernel="sm90"), sm90_out.to(torch.bfloat16))
    assert _rel(sm90_out, _reference(xp, xs, wp, ws, alpha)) <= REL_BOUND


@pytest.mark.gpu
def test_gpu_sm90_site_launches_run_the_binders_binary(monkeypatch):
    """``launch_by_site``: for every property Triton specializes the GEMM on (M equal to 1, output dtype, output
    alignment, bias, tile height; M divisible by 16 or not, which it no longer tells apart, checked too), the binary
    recorded for the GEMM's site key is the one Triton's binder picks for the same call, and the keyed launches give
    the bytes of the binder's launch and of the Triton kernel."""
    _skip_unless_sm90()
    sm90 = _sm90()
    checked = check_sites_against_binder(sm90, monkeypatch)
    n, k = 256, 1024
    # (M, output dtype, output offset in elements, bias, tile height): M divisible by 16, not, and 1; output
    # 16-byte aligned or not; with and without bias; two tile heights. Few cases: each new one compiles a binary.
    cases = [(16, torch.float32, 0, False, None), (17, torch.bfloat16, 0, True, None),
             (1, torch.bfloat16, 1, False, 64), (16, torch.bfloat16, 1, True, None)]
    for m, dtype, offset, with_bias, block_m in cases:
        xp, xs, wp, ws, alpha = _operands(m, n, k, seed=m)
        x16 = gemm_mod.decode_nvfp4_rows(xp, xs)
        fp32 = nvfp4_gemm(xp, xs, wp, ws, alpha, torch.float32, x_decode="predecode", kernel="triton")
        bias = (torch.randn(n, device=DEV) * 0.5).to(dtype) if with_bias else None
        want = fp32.to(dtype) + (bias if with_bias else 0)
        for call in range(4):  # Triton's path (twice at a kernel's first launch), recording, keyed
            buf = torch.empty(m * n + 8, device=DEV, dtype=dtype)
            out = buf[offset:offset + m * n].view(m, n)  # offset 1: not 16-byte aligned
            got = sm90.nvfp4_gemm_sm90(x16, wp, ws, alpha.reshape(1), out, bias=bias, block_m=block_m)
            assert torch.equal(got, want), (m, dtype, offset, with_bias, block_m, call)
    assert len(set(checked)) == len(cases), f"sites checked: {len(set(checked))} of {len(cases)}"


@pytest.mark.gpu
def test_gpu_sm90_weight_moved_off_the_gpu_frees_its_memory():
    """A weight an offloading hook moves to the CPU (``.data`` swapped) gives its GPU memory back at once, though the
    GEMM cached its descriptors; moved back, the GEMM gives the same bytes."""
    _skip_unless_sm90()
    sm90 = _sm90()
    xp, xs, wp, ws, alpha = _operands(300, 256, 1024, seed=9)
    x16 = gemm_mod.decode_nvfp4_rows(xp, xs)
    w, s = torch.nn.Parameter(wp, requires_grad=False), torch.nn.Parameter(ws, requires_grad=False)
    del wp, ws

    def gemm() -> torch.Tensor:
        return sm90.nvfp4_gemm_sm90(x16, w, s, alpha.reshape(1), torch.empty(300, 256, device=DEV,
                                                                            dtype=torch.bfloat16))

    want = gemm()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    w.data, s.data = w.data.cpu(), s.data.cpu()
    freed = before - torch.cuda.memory_allocated()
    assert freed >= w.numel() + s.numel(), f"{freed} bytes freed of {w.numel() + s.numel()}"
    w.data, s.data = w.data.to(DEV), s.data.to(DEV)
    assert torch.equal(gemm(), want)


@pytest.mark.gpu
def test_gpu_auto_uses_the_sm90_kernel_where_it_applies(monkeypatch):
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


@pytest.mark.gpu
def test_gpu_in_kernel_and_predecode_agree_with_emulation():
    _skip_unless_sm80_to_sm90()
    xp, xs, wp, ws, alpha = _operands(48, 640, 2064, seed=3)
    ref = _reference(xp, xs, wp, ws, alpha)
    a = nvfp4_gemm(xp, xs, wp, ws, alpha, torch.float32, x_decode="in_kernel")
    b = nvfp4_gemm(xp, xs, wp, ws, alpha, torch.float32, x_decode="predecode")
    print(f"in_kernel rel {_rel(a, ref):.3e}, predecode rel {_rel(b, ref):.3e}, equal: {torch.equal(a, b)}")
    assert _rel(a, ref) <= REL_BOUND and _rel(b, ref) <= REL_BOUND


@pytest.mark.gpu
@pytest.mark.parametrize("splits", (1, 2, 5))
def test_gpu_split_k(splits):
    _skip_unless_sm80_to_sm90()
    xp, xs, wp, ws, alpha = _operands(3, 256, 6144, seed=4)
    ref = _reference(xp, xs, wp, ws, alpha)
    out = nvfp4_gemm(xp, xs, wp, ws, alpha, torch.float32, split_k=splits)
    assert _rel(out, ref) <= REL_BOUND
    assert torch.equal(nvfp4_gemm(xp, xs, wp, ws, alpha, torch.float32, split_k=splits), out)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(17, 200, 176), (1000, 300, 48), (130, 130, 2064), (1000, 300, 3104)])
def test_gpu_scale_padding_bytes_do_not_matter(m, n, k):
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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16, torch.float32))
@pytest.mark.parametrize("rows,k", [(1, 16), (130, 176), (4608, 6144)])
def test_gpu_decode_rows_equals_format_decode(dtype, rows, k):
    xp, xs, _, _, _ = _random_bytes(rows, 8, k, seed=rows)
    assert torch.equal(gemm_mod.decode_nvfp4_rows(xp, xs, dtype), decode_nvfp4(xp, xs, dtype=dtype))


@pytest.mark.gpu
def test_gpu_large_m_int64_offsets():
    """M * N > 2^31 output elements: only the last rows are checked against the emulation."""
    _skip_unless_sm80_to_sm90()
    m, n, k = 70_000, 36_864, 64
    if torch.cuda.get_device_properties(0).total_memory < 24 << 30:
        pytest.skip("large-M GEMM test not run: needs ~6 GB of free GPU memory for the output; "
                    "runs on an H200-class GPU")
    gen = torch.Generator(device=DEV).manual_seed(6)
    x = torch.randn(m, k, device=DEV, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, device=DEV, generator=gen).to(torch.bfloat16)
    g = torch.tensor(100.0, device=DEV)
    xp, xs = reference_quantize(x, g, fast_math=False)
    wp, ws = reference_quantize(w, g, fast_math=False)
    alpha = torch.tensor(1e-4, device=DEV)
    out = nvfp4_gemm(xp, xs, wp, ws, alpha, torch.bfloat16)
    tail_p, tail_s = reference_quantize(x[-64:], g, fast_math=False)  # per-row quantization: same bytes as in xp
    assert torch.equal(tail_p, xp[-64:])
    ref = (emulated_gemm(tail_p, tail_s, wp, ws) * alpha)
    assert _rel(out[-64:], ref) <= 1e-2  # BF16 output: one rounding of a value within REL_BOUND
    del out


@pytest.mark.gpu
def test_gpu_nvfp4linear_triton_backend_vs_emulated(monkeypatch):
    """NVFP4Linear with bias: the Triton backend equals the emulated backend up to BF16 rounding of nearly equal
    FP32 values (the bias is added after the GEMM in both)."""
    _skip_unless_sm80_to_sm90()
    torch.manual_seed(0)
    in_f, out_f = 3072, 1000
    w = (torch.randn(out_f, in_f, device=DEV) * 0.02).to(torch.bfloat16)
    ws2 = (w.float().abs().amax() / 2688.0).reshape(())
    packed, scales = reference_quantize(w, 1.0 / ws2, scale_layout="128x4", fast_math=False)
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


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 3072, 12288), (17, 200, 176), (3, 256, 6144), (300, 256, 1024),
                                   (4096, 3072, 3072), (512, 3072, 12288)])
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
def test_gpu_bias_epilogue_equals_torch_add(m, n, k, dtype):
    """The bias added in the epilogue (small-M kernel, split K, Triton and SM90 large-M kernels) gives the bytes of
    torch's eager ``out + bias`` on the GEMM's rounded output."""
    _skip_unless_sm80_to_sm90()
    xp, xs, wp, ws, alpha = _operands(m, n, k, seed=21)
    bias = (torch.randn(n, device=DEV, generator=torch.Generator(device=DEV).manual_seed(22)) * 0.5).to(dtype)
    kernels = ("auto", "triton") if m > gemm_mod.PREDECODE_MAX_M else ("auto",)
    for kernel in kernels:
        plain = nvfp4_gemm(xp, xs, wp, ws, alpha, dtype, kernel=kernel)
        assert torch.equal(nvfp4_gemm(xp, xs, wp, ws, alpha, dtype, kernel=kernel, bias=bias), plain + bias), kernel
    if m > gemm_mod.PREDECODE_MAX_M:
        x16 = gemm_mod.decode_nvfp4_rows(xp, xs)
        assert torch.equal(gemm_mod.nvfp4_gemm_fp16_x(x16, wp, ws, alpha, dtype, bias),
                           nvfp4_gemm(xp, xs, wp, ws, alpha, dtype, bias=bias))


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(65, 128, 64), (257, 129, 32), (512, 3072, 3072), (1000, 200, 96),
                                   (4609, 3000, 3104)])
@pytest.mark.parametrize("random_bytes", [False, True])
def test_gpu_sm90_tile_heights_give_the_same_bytes(m, n, k, random_bytes):
    """64-, 128- and 256-token tiles walk K in the same order on the same operand values: the same bytes, so the
    height can follow the shape (``sm90_block_m``)."""
    _skip_unless_sm90()
    xp, xs, wp, ws, alpha = (_random_bytes if random_bytes else _operands)(m, n, k, seed=23)
    x16 = gemm_mod.decode_nvfp4_rows(xp, xs)
    outs = {}
    for block_m in _sm90().SM90_TILE_COST:
        out = torch.empty(m, n, device=DEV, dtype=torch.float32)
        outs[block_m] = _sm90().nvfp4_gemm_sm90(x16, wp, ws, alpha.reshape(1), out, block_m=block_m)
    first = outs[256]
    assert all(torch.equal(o, first) for o in outs.values()), [b for b, o in outs.items() if not torch.equal(o, first)]
    assert torch.equal(first, nvfp4_gemm(xp, xs, wp, ws, alpha, torch.float32, x_decode="predecode", kernel="triton"))


def test_sm90_block_m_picks_the_fastest_measured_height():
    """``sm90_block_m`` picks the fastest tile height of every (M, N, K) in the committed H200 measurement (the cost
    table was fit to it; a change to the table must keep it right or come with a new measurement)."""
    _need_gluon_hopper("SM90 tile-choice check")
    import json
    from pathlib import Path

    result = json.loads((Path(__file__).parents[1] / "benchmarks/results/gemm_tiles-h200.json").read_text())
    times: dict = {}
    for case in result["cases"]:
        if case["variant"].startswith("sm90_bm"):
            shape = case["shape"]
            times.setdefault((shape["M"], shape["N"], shape["K"]), {})[int(case["variant"][7:])] = case["us"]
    assert len(times) >= 40
    picks = {(m, n, k): _sm90().sm90_block_m(m, n, 132) for m, n, k in times}
    wrong = {shape: (picks[shape], us) for shape, us in times.items() if picks[shape] != min(us, key=us.get)}
    assert not wrong, wrong
    assert _sm90().sm90_block_m(512, 3072, 132) == 128 and _sm90().sm90_block_m(4096, 3072, 132) == 256


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 65, 4096])
@pytest.mark.parametrize("fast_math", [False, True], ids=["precise", "fast"])
def test_gpu_quantized_linear_equals_quantize_then_linear(m, fast_math):
    """``quantized_linear`` (straight to FP16 for M > 64) gives the bytes of quantize then ``nvfp4_linear``."""
    _skip_unless_sm80_to_sm90()
    from diffusers_nvfp4_fast.ops.linear import nvfp4_linear, quantized_linear
    from diffusers_nvfp4_fast.ops.quantize import quantize
    from support.inputs import adversarial

    _, _, wp, ws, alpha = _operands(8, 3072, 3072, seed=24)
    x = adversarial(m, 3072, seed=m) if m > 1 else torch.randn(1, 3072, device=DEV).bfloat16()
    g = torch.tensor([2688 / 5.0], device=DEV)
    bias = torch.randn(3072, device=DEV).bfloat16()
    for b in (None, bias):
        want = nvfp4_linear(*quantize(x, g, fast_math), wp, ws, alpha, b, torch.bfloat16)
        assert torch.equal(quantized_linear(x, g, fast_math, wp, ws, alpha, b, torch.bfloat16), want)
