"""CPU check of the Triton NVFP4 GEMM (``kernels/nvfp4_gemm.py``) under the Triton interpreter.

The same kernel code that runs on SM80-SM90 (minus a one-instruction PTX register split, replaced by shifts) runs
here on CPU tensors and is compared with ``ops.emulated_nvfp4_gemm``: tiny shapes, odd N and K (K % 16 == 0 but not
% 64), both X variants (decoded in the kernel / pre-decoded), split K, every autotune config, random bytes covering
all codes and scales, garbage in the scale padding, and the standalone decode against ``format.decode_nvfp4``.

Outputs are FP32/FP16 here: the interpreter's FP32 -> BF16 cast truncates instead of rounding (and its BF16 dot is
wrong), which is why the kernel computes in FP16; the BF16 epilogue is checked on the GPU.
The kernel runs in a subprocess because TRITON_INTERPRET must be set before triton is imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="Triton is not installed, so the GEMM interpreter tests did not run; CI installs it with .[test]")

_SCRIPT = r"""
import importlib, json, torch
from diffusers_nvfp4_fast.format import decode_nvfp4, quantize_nvfp4, round_up, swizzle_scales, unswizzle_scales
from diffusers_nvfp4_fast.ops import emulated_nvfp4_gemm
g = importlib.import_module("diffusers_nvfp4_fast.kernels.nvfp4_gemm")
results = []

def operands(m, n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen) * 3).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
    gx, gw = 2688.0 / x.float().abs().amax(), 2688.0 / w.float().abs().amax()
    xp, xs = quantize_nvfp4(x, gx, fast_math=False)
    wp, ws = quantize_nvfp4(w, gw, fast_math=False)
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
    ref = emulated_nvfp4_gemm(xp, xs, wp, ws) * alpha
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
    results.append({"name": f"configs identical (x_packed={packed})", "equal": all(torch.equal(o, outs[0]) for o in outs)})

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
print("RESULTS" + json.dumps(results))
"""


@pytest.fixture(scope="module")
def interpreter_results():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("DIFFUSERS_NVFP4_GEMM_BACKEND", None)
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS"))
    return json.loads(line[len("RESULTS"):])


def test_gemm_matches_emulation_under_interpreter(interpreter_results):
    checks = [r for r in interpreter_results if "rel" in r]
    assert len(checks) == 10
    # The interpreter sums in FP32 in another order than torch: a few ulps, nothing like a wrong term (FP16 output:
    # one FP16 rounding, <= 2^-11 relative).
    bad = [r for r in checks if not r["rel"] <= (1e-3 if r["dtype"] == "torch.float16" else 1e-6)]
    assert not bad, bad


def test_gemm_exact_properties_under_interpreter(interpreter_results):
    flags = [r for r in interpreter_results if "equal" in r]
    assert len(flags) == 8
    assert all(r["equal"] for r in flags), [r for r in flags if not r["equal"]]


def test_gemm_kernel_choice_errors_under_interpreter(interpreter_results):
    errors = {r["name"]: r["error"] for r in interpreter_results if "error" in r}
    assert "needs an SM90 GPU" in errors["sm90 on cpu"] and "K=256 on cpu" in errors["sm90 on cpu"], errors
    assert "pre-decoded X path" in errors["sm90 in kernel"], errors
    assert "'cutlass'" in errors["unknown kernel"], errors
    assert "cannot be combined with kernel='sm90'" in errors["sm90 with config"], errors
