"""Static instruction counts of the NVFP4 quantize kernels for a GPU that need not be present (CPU is enough).

Compiles a kernel ahead of time for ``--arch`` (default sm_90) with Triton, disassembles the cubin with the
``nvdisasm`` that ships with Triton, and prints SASS instructions per element with an opcode histogram. The
quantize kernels are straight-line code (one tile per program), so instructions / (elements per thread) is the
per-element cost that bounds them when they are instruction-bound, as on Hopper.

    python tests/support/sass_count.py                      # standalone quantize, fast-math, sm_90
    python tests/support/sass_count.py --kernel token_cat --precise --block-r 16
"""

from __future__ import annotations

import argparse
import collections
import importlib
import inspect
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from diffusers_nvfp4_fast.kernels.qk_norm_rotary import NORM_BLOCK_R, NORM_WARPS
from diffusers_nvfp4_fast.ops.registry import aot_kernels

# build name -> (the @triton.jit kernel, the types of its arguments that are not constexprs), from each op's declaration
SIGNATURES = {k.name: (getattr(importlib.import_module(f"diffusers_nvfp4_fast.kernels.{k.module}"), k.kernel),
                       dict(k.signature)) for k in aot_kernels().values()}
# The quantize-style kernels (tiles of BLOCK_R rows x BLOCK_C blocks): the ones compile_kernel builds.
QUANTIZE_KERNELS = [name for name, (fn, _) in SIGNATURES.items() if "BLOCK_C" in inspect.signature(fn.fn).parameters]


def compile_kernel(kernel: str, arch: int, fast_math: bool, block_r: int = 8, block_c: int = 32, num_warps: int = 4,
                   divisible: tuple[str, ...] = ()):
    """Compile ``kernel`` (one of ``QUANTIZE_KERNELS``) for compute capability ``arch`` (x10) without a GPU; the
    hardware E2M1 conversion is selected from SM100 on, and the grid dependency wait (kernels that take ``PDL``) from
    SM90 on, as at run time. ``divisible``: arguments told divisible by 16."""
    fn, sig = SIGNATURES[kernel]
    consts = {"BLOCK_R": block_r, "BLOCK_C": block_c, "IS_BF16": True, "FAST_MATH": fast_math, "HW_E2M1": arch >= 100}
    options = {"enable_fp_fusion": False, "num_warps": num_warps}
    if "PDL" in inspect.signature(fn.fn).parameters:
        consts["PDL"] = options["launch_pdl"] = arch >= 90
    return triton.compile(ASTSource(fn, {**sig, **dict.fromkeys(consts, "constexpr")}, constexprs=consts,
                                    attrs=divisible_by_16(fn, divisible)),
                          target=GPUTarget("cuda", arch, 32), options=options)


def divisible_by_16(fn, names: tuple[str, ...]) -> dict:
    """Triton's attributes saying that the arguments ``names`` of ``fn`` are divisible by 16."""
    return {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in names}


def compile_rotary(arch: int, head_dim: int = 128, block_r: int = 16, num_warps: int = 4):
    """Compile the rotary kernel for compute capability ``arch`` (x10) without a GPU, as ``rotary_triton`` launches
    it (FMA contraction off)."""
    kernel, sig = SIGNATURES["rotary"]
    consts = {"D": head_dim, "BLOCK_R": block_r, "IS_BF16": True}
    return triton.compile(ASTSource(kernel, {**sig, **dict.fromkeys(consts, "constexpr")}, constexprs=consts),
                          target=GPUTarget("cuda", arch, 32),
                          options={"enable_fp_fusion": False, "num_warps": num_warps})


def compile_qk_norm_rotary(arch: int, real_fma: int = 1, imag_fma: int = 1, tree: int = 1, block_r: int | None = None,
                           num_warps: int | None = None, norm: bool = True, divisible: tuple[str, ...] = ()):
    """Compile the Qwen-Image QK-norm + rotary kernel for ``arch`` (x10) without a GPU, as ``qk_norm_rotary_triton``
    launches it there (``rsqrt.approx.f32``, hardware BF16 conversions, FMA contraction off); ``norm=False``: the
    rotary embedding alone, as ``qwen_rotary_triton`` launches it."""
    kernel, sig = SIGNATURES["qk_norm_rotary"]
    tile = (NORM_BLOCK_R, NORM_WARPS) if norm else (16, 4)  # as the norm and the rotary-only wrappers launch it
    block_r, num_warps = block_r or tile[0], num_warps or tile[1]
    consts = {"BLOCK_R": block_r, "APPROX_RSQRT": norm, "REAL_FMA": real_fma, "IMAG_FMA": imag_fma,
              "SOFT_BF16": False, "WRITE_MEAN": False, "TREE": tree, "NORM": norm}
    return triton.compile(ASTSource(kernel, {**sig, **dict.fromkeys(consts, "constexpr")},
                                    constexprs=consts, attrs=divisible_by_16(kernel, divisible)),
                          target=GPUTarget("cuda", arch, 32),
                          options={"enable_fp_fusion": False, "num_warps": num_warps})


def compile_flux2_qk_norm_rotary(arch: int, tree: int = 1, block_r: int = NORM_BLOCK_R, num_warps: int = NORM_WARPS):
    """Compile the FLUX.2 QK-norm + rotary kernel for ``arch`` (x10) without a GPU, as its wrapper launches it."""
    kernel, sig = SIGNATURES["flux2_qk_norm_rotary"]
    consts = {"BLOCK_R": block_r, "APPROX_RSQRT": True, "SOFT_BF16": False, "TREE": tree}
    return triton.compile(ASTSource(kernel, {**sig, **dict.fromkeys(consts, "constexpr")},
                                    constexprs=consts),
                          target=GPUTarget("cuda", arch, 32),
                          options={"enable_fp_fusion": False, "num_warps": num_warps})


def compile_gemm_sm90(stages: int = 4, even_k: bool = True, block_m: int = 256, has_bias: bool = False,
                      pdl: bool = True, divisible: tuple[str, ...] = ()):
    """Compile the Gluon SM90 GEMM (``kernels/nvfp4_gemm_sm90.py``) for sm_90a without a GPU (``pdl``: with its grid
    dependency wait, as it launches on SM90 unless DIFFUSERS_NVFP4_PDL=0); ``divisible``: ``("M",)`` tells M
    divisible by 16, which the launch does not (the kernel is not specialized on it)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel, signature, consts, attrs, options = gemm_sm90_parts(stages, even_k, block_m, has_bias, pdl, divisible)
    return triton.compile(GluonASTSource(kernel, signature, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)


def gemm_sm90_parts(stages: int = 4, even_k: bool = True, block_m: int = 256, has_bias: bool = False,
                    pdl: bool = True, divisible: tuple[str, ...] = ()) -> tuple:
    """(kernel, signature, constants, attributes, options) of the Gluon SM90 GEMM as ``compile_gemm_sm90`` builds it."""
    from triton.experimental.gluon import language as gl

    from diffusers_nvfp4_fast.kernels import nvfp4_gemm_sm90 as mod

    x_layout = gl.NVMMASharedLayout.get_default_for([block_m, mod.BLOCK_K], gl.float16)
    flat = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    sig = {"x_desc": f"tensordesc<fp16[{block_m}, {mod.BLOCK_K}],{x_layout!r}>",
           "w_desc": f"tensordesc<i32[{mod.BLOCK_N}, {mod.BLOCK_K // 8}],{flat!r}>",
           "s_desc": f"tensordesc<i32[1, 128],{flat!r}>", "alpha_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16",
           "M": "i32", "N": "i32", "K": "i32", "stride_om": "i32", "scale_rows_per_tile": "i32"}
    consts = {"BLOCK_M": block_m, "BLOCK_N": mod.BLOCK_N, "BLOCK_K": mod.BLOCK_K, "STAGES": stages, "GROUP_N": 8,
              "EVEN_K": even_k, "NEW_REINTERPRET": mod._NEW_REINTERPRET, "HAS_BIAS": has_bias, "PDL": pdl}
    kernel = mod._nvfp4_gemm_sm90_kernel  # alpha_ptr .. scale_rows_per_tile but M, as Triton specializes them
    attrs = divisible_by_16(kernel, tuple(n for n in kernel.arg_names[3:11] if n != "M") + divisible)
    return (kernel, {**sig, **dict.fromkeys(consts, "constexpr")}, consts, attrs,
            {"num_warps": mod.NUM_WARPS, "maxnreg": mod.MAX_REGISTERS, "launch_pdl": pdl})


def compile_gemv(x_packed: bool, arch: int = 90, has_bias: bool = True):
    """Compile the one-row product (``nvfp4_gemv``) for a packed or an FP16 row as it launches (its tile, no FMA
    contraction), without a GPU."""
    mod = importlib.import_module("diffusers_nvfp4_fast.kernels.nvfp4_gemv")
    consts = {"X_PACKED": x_packed, "SPLIT": False, "HAS_BIAS": has_bias, "EVEN_K": True, "USE_ASM": True,
              "BLOCK_N": mod.GEMV_BLOCK_N, "BLOCK_K": mod.GEMV_BLOCK_K, "HALVINGS": mod.GEMV_BLOCK_K.bit_length() - 1,
              "PDL": arch >= 90}
    names = list(inspect.signature(mod._nvfp4_gemv_kernel.fn).parameters)
    pointers = {"x_ptr": "*u8" if x_packed else "*fp16", "xs_ptr": "*i32", "w_ptr": "*u8",
                "ws_ptr": "*i32", "alpha_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16"}
    sig = {n: pointers.get(n, "i32") for n in names if n not in consts}
    aligned = (*pointers, "N", "K", "stride_wn")
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in aligned}
    src = ASTSource(mod._nvfp4_gemv_kernel, {**sig, **dict.fromkeys(consts, "constexpr")}, constexprs=consts,
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"enable_fp_fusion": False, "num_warps": mod.GEMV_WARPS,
                                   "num_stages": mod.GEMV_STAGES, "launch_pdl": arch >= 90})


def compile_qwen_resnorm(d: int = 3072, arch: int = 90, has_residual: bool = True, decoded: bool = False,
                         has_shift: bool = True, divisible: tuple[str, ...] = ()):
    """Compile the fused residual-norm quantize kernel for hidden size ``d`` as ``resnorm_quantize_triton`` launches
    it (register cap, no FMA contraction, 4 warps), without a GPU; row strides divisible by 16 as at run time.
    ``has_residual=False``: the adaptive-LayerNorm variant; ``decoded``: FP16 output instead of packed bytes;
    ``has_shift=False``: no shift (Qwen-Image 2.1's modulation); ``divisible``: more arguments told divisible by 16."""
    mod = importlib.import_module("diffusers_nvfp4_fast.kernels.layer_norm_quantize")
    consts = {"D": d, "HAS_BIAS": has_residual, "APPROX_RSQRT": True, "SOFT_BF16": False,
              "MEAN_FMA": mod.TORCH_MEAN_FMA, "FAST_MATH": True, "HW_E2M1": arch >= 100, "ONE_SAMPLE": True,
              "HAS_RESIDUAL": has_residual, "DECODED": decoded, "HAS_SHIFT": has_shift}
    names = list(inspect.signature(mod._resnorm_quantize_kernel.fn).parameters)
    pointer_types = {"g_ptr": "*fp32", "packed_ptr": "*i64" if decoded else "*i32", "scales_ptr": "*u8"}
    sig = {n: pointer_types.get(n, "*bf16") if n.endswith("_ptr") else "fp32" if n == "eps" else "i32"
           for n in names if n not in consts}
    aligned = tuple(n for n in names if n.endswith("_ptr") or n.startswith("s_") or n == "padded_cols")
    src = ASTSource(mod._resnorm_quantize_kernel, {**sig, **dict.fromkeys(consts, "constexpr")}, constexprs=consts,
                    attrs=divisible_by_16(mod._resnorm_quantize_kernel, aligned + divisible))
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"enable_fp_fusion": False, "num_warps": 4, "maxnreg": mod.MAX_REGISTERS})


def disassemble(compiled) -> str:
    """SASS of a compiled kernel (the nvdisasm that ships with Triton)."""
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout


_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?(\S+)\s*(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH = re.compile(r"BRA `\((\.L_x_\d+)\)")
_NO_REGISTER_RESULT = ("HGMMA", "ST", "RED", "ATOM", "BAR", "SYNCS", "BRA", "WARPGROUP")


def _written_registers(opcode: str, operands: str) -> set[int]:
    m = re.match(r"R(\d+)\b", operands)
    if not m or opcode.startswith(_NO_REGISTER_RESULT):
        return set()
    parts = opcode.split(".")
    width = 4 if "128" in parts else 2 if ("64" in parts or "WIDE" in parts) else 1
    return set(range(int(m.group(1)), int(m.group(1)) + width))


def wgmma_register_hazards(sass: str) -> list[str]:
    """Instructions that write a register an in-flight wgmma still uses (its accumulator or register A fragment).

    An asynchronous wgmma reads its register operands and writes its accumulator until a ``WARPGROUP.DEPBAR.LE gsb0,
    N`` retires its group, and the hardware does not check those registers. The SASS is walked in program order
    (each loop body also twice in a row, for hazards across iterations); the destination register of every other
    instruction is compared with the registers of the wgmma groups not yet retired.
    """
    seq, labels, loops = [], {}, []
    for line in sass.splitlines():
        label = _LABEL.match(line)
        if label:
            labels[label.group(1)] = len(seq)
            continue
        m = _INSTRUCTION.match(line)
        if m:
            seq.append((m.group(1), m.group(2), line.strip()))
            branch = _BRANCH.search(line)
            if branch and branch.group(1) in labels:
                loops.append((labels[branch.group(1)], len(seq)))
    found = []

    def walk(instructions):
        groups, pending = [], set()
        for opcode, operands, text in instructions:
            if opcode.startswith("HGMMA"):
                ops = [o.strip() for o in operands.split(",")]
                shape = re.match(r"HGMMA\.(\d+)x(\d+)x", opcode)
                d0 = int(ops[0][1:])
                pending |= set(range(d0, d0 + int(shape.group(1)) * int(shape.group(2)) // 128))
                if ops[1].startswith("R"):
                    pending |= set(range(int(ops[1][1:]), int(ops[1][1:]) + 4))
                if "gsb0" in operands:
                    groups.append(pending)
                    pending = set()
            elif opcode.startswith("WARPGROUP.DEPBAR"):
                keep = int(operands.split(",")[-1], 0)
                groups = groups[len(groups) - keep:] if keep else []
            elif _written_registers(opcode, operands) & set().union(pending, *groups):
                found.append(text)

    walk(seq)
    for start, end in loops:
        walk(seq[start:end] * 2)
    return found


def first_k_step(sass: str) -> list[str]:
    """The instructions of the SM90 GEMM's first K step: from the last mbarrier wait before the first
    ``WARPGROUP.ARRIVE`` (the stage's "ready") to that fence, i.e. the loads and the weight decode of one step."""
    lines = [line for line in sass.splitlines() if _INSTRUCTION.match(line)]
    fence = next(i for i, line in enumerate(lines) if "WARPGROUP.ARRIVE" in line)
    start = max(i for i, line in enumerate(lines[:fence]) if "TRYWAIT" in line)
    return lines[start:fence]


def sass_histogram(compiled) -> collections.Counter:
    """Opcode counts of a compiled kernel's SASS."""
    ops = collections.Counter()
    for line in disassemble(compiled).splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if m:
            ops[m.group(1)] += 1
    return ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernel", choices=QUANTIZE_KERNELS, default="quantize")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90, 100, 120)")
    ap.add_argument("--precise", action="store_true", help="precise recipe instead of fast-math")
    ap.add_argument("--block-r", type=int, default=8)
    ap.add_argument("--block-c", type=int, default=32, help="16-element blocks per tile row")
    ap.add_argument("--num-warps", type=int, default=4)
    args = ap.parse_args()
    ops = sass_histogram(compile_kernel(args.kernel, args.arch, not args.precise, args.block_r, args.block_c,
                                        args.num_warps))
    elements = args.block_r * args.block_c * 16 / (32 * args.num_warps)
    total = sum(ops.values())
    print(f"{args.kernel} sm_{args.arch} {'precise' if args.precise else 'fast-math'} "
          f"tile {args.block_r}x{args.block_c * 16}: {total} SASS instructions, {elements:g} elements per thread, "
          f"{total / elements:.1f} per element")
    print(", ".join(f"{op} {n}" for op, n in ops.most_common(20)))


if __name__ == "__main__":
    main()
