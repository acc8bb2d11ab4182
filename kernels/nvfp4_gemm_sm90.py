"""NVFP4 weight x exact-FP16 activation GEMM for Hopper (SM90), in Gluon, with the weight decode overlapping the MMA.

``out[M, N] = out_dtype((x16 @ decode(w).T) * alpha)`` where ``x16`` is the activation decoded once per call into
exact FP16 (``nvfp4_gemm.decode_nvfp4_rows``) and the weight stays packed in memory: each K step of 64 decodes a
``[128, 64]`` weight tile in registers and feeds it to the MMA.

Why a second kernel: Triton's compiler (3.6, inspected in SM90 SASS) routes the decoded tile through one
shared-memory buffer and waits for every wgmma at once (``WARPGROUP.DEPBAR.LE gsb0, 0x0`` after each group), so a
CTA's decode and MMA never overlap; that kernel reaches 0.5-0.7x cuBLAS BF16. Gluon states the layouts and the
schedule explicitly:

* The decoded tile is the wgmma's register A operand (``W @ X^T``; 128 weight rows x 256 tokens per CTA, two
  warpgroups of 64 rows). The packed words are read from shared memory in ``pair_layout``, chosen so that the FP16
  pairs the decode produces already sit in the thread and register of the A fragment: no shuffle, no shared-memory
  round trip.
* Warp specialization: one producer warp issues the TMA loads of X, the packed weight (as int32 words) and the
  weight's scale words into a STAGES-deep ring; the two MMA warpgroups only wait on "ready" mbarriers, decode, issue
  the wgmma and hand a stage back on its "empty" mbarrier. (With every warp issuing the loads, Triton put four CTA
  barriers and a memory fence into each K step.)
* One wgmma stays in flight while the next tile is decoded (``warpgroup_mma_wait(1)``). A wgmma reads its register
  A operand until a later wait retires it, and nothing in the PTX Triton emits says so: a loop whose body decodes
  into the registers of the previous step let ptxas overwrite the fragment of the wgmma still running (wrong,
  run-dependent bytes on the H200). So the loop body is two steps, two inlined calls whose fragments are distinct
  values; ``tests/test_gemm.py`` checks the SASS for any write to the registers of an in-flight wgmma.

    producer warp:   for i: wait empty[i % S]; TMA x/w/scales of step i -> stage i % S, signalling ready[i % S]
    MMA warpgroups:  for i: wait ready[i % S]; decode W[i] (overlaps wgmma(i - 1)); wgmma(W[i], X[i]^T) async;
                            wait until only wgmma(i) is in flight; arrive empty[(i - 1) % S]

Decoding, per weight row and K step: the row's scale word (4 E4M3 bytes, one per 16 values) becomes FP16 values
``scale * 2^7``, two at a time, by the hardware conversion ``cvt.rn.f16x2.e4m3x2`` and one FP16 multiply (both exact:
every E4M3 value is an FP16 value, NaN stays NaN), and a PRMT copies each into both halves of its pair. A lane's byte
of a weight word is picked by one PRMT; its two E2M1 nibbles become FP16 bits ``value * 2^-14`` with the integer
placement of ``nvfp4_gemm``, and one FP16 multiply per pair gives ``value * scale * 2^-7``: the very operand values
of the Triton kernel. (A variant without the 2^7, whose operands are ``value * scale * 2^-14`` and far more often
FP16 subnormals, gave other bytes than the Triton kernel on random codes and scales on the H200, so the operands stay
identical.) The epilogue multiplies the FP32 accumulator by 2^7 (exact) and then by alpha.

Same summation as ``nvfp4_gemm``: 16-wide K steps in order with FP32 accumulation in the same HGMMA instruction
family on the same operand values, so the output bytes equal those of every ``nvfp4_gemm`` config (checked on the
GPU) and do not depend on STAGES. Out-of-range rows read as zeros (TMA) and are masked at the store; K past the data
reads as zero words and its scale pairs are forced to 0. Needs ``K % 32 == 0`` (16-byte TMA row strides) and
16-byte aligned operands.
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from typing import cast

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .caches import declare
from .grid_dependency import RELEASE_ASM, WAIT_ASM
from .launch import (
    cdiv,
    cuda_capability,
    launch_by_site,
    pdl_options,
    site_binary,
    sm_count,
)
from .tiling import grouped_tile
from .triton_compat import DescriptorEncoding, DirectLaunch, descriptor_fields, descriptor_over, layout_with_fixed_repr

__all__ = ["nvfp4_gemm_sm90", "sm90_supported", "sm90_block_m", "sm90_launch", "Sm90Launch", "SM90_STAGES",
           "SM90_GROUP_N", "SM90_TILE_COST", "sm90_max_stages"]

BLOCK_N, BLOCK_K, NUM_WARPS = 128, 64, 8
# Per-thread register cap of the launch: 8 MMA warps + the producer warp (a warpgroup of 4 as allocated) = 384
# threads x 168 <= 64K registers. setmaxnreg then moves registers to the MMA warpgroups: 240 each (accumulator 128,
# two A fragments 32, decode), 24 for the producer.
MAX_REGISTERS = 168
# Pipeline depth, tile order and tile costs: the H200 measurements behind each are in docs/history.md ("Kernel tuning
# constants"). None of them changes a byte: every choice runs the same K walk on the same operand values.
SM90_STAGES = 4  # the fastest depth at every tile height (deeper ones fit at 64 and 128 tokens and do not help)
SMEM_BYTES = 232448  # shared memory a CTA may use on SM90 (227 KB)
SM90_GROUP_N = 64  # weight tiles per group of grouped_tile's order
SM90_TILE_COST = {256: 1.0, 128: 0.72, 64: 0.55}  # relative time of one tile per height; sm90_block_m weighs waves

# Triton 3.9 renamed the TMA load and the shared-memory reinterpret; 3.6 (torch 2.11) has only the old names.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_NEW_REINTERPRET = hasattr(gl.shared_memory_descriptor, "reinterpret")


@gluon.jit
def _load_partition(x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, empty, off_m, off_n, s_row0, k_steps,
                    STAGES: gl.constexpr, BLOCK_K: gl.constexpr, WORDS: gl.constexpr, STEP_BYTES: gl.constexpr):
    """Producer warp: step i's X tile, packed weight words and scale words into stage i % STAGES."""
    for i in range(k_steps):
        s = i % STAGES
        # A fresh mbarrier counts as having completed phase 1, so the first STAGES waits pass at once.
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        # The consumers read this stage's weight words with ordinary loads; order them before the TMA overwrite.
        fence_async_shared()
        mbarrier.expect(ready.index(s), STEP_BYTES)
        _tma_load(x_desc, [off_m, i * BLOCK_K], ready.index(s), x_smem.index(s))
        _tma_load(w_desc, [off_n, i * WORDS], ready.index(s), w_smem.index(s))
        _tma_load(s_desc, [s_row0 + i, 0], ready.index(s), s_smem.index(s))


@gluon.jit
def _mma_step(i, acc, x_smem, w_smem, s_smem, ready, empty, K, cols, byte_select3,
              BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, EVEN_K: gl.constexpr,
              NEW_REINTERPRET: gl.constexpr, a_layout: gl.constexpr, word_layout: gl.constexpr,
              s_rows_layout: gl.constexpr):
    """K step i of both MMA warpgroups: decode W[i] into a fresh A fragment, start its wgmma, retire wgmma(i - 1)
    and release that step's stage. Returns the accumulator with wgmma(i) still in flight."""
    WORDS: gl.constexpr = BLOCK_K // 8
    s = i % STAGES
    mbarrier.wait(ready.index(s), (i // STAGES) & 1)
    words = w_smem.index(s).load(word_layout)
    if NEW_REINTERPRET:
        s_view = s_smem.index(s).reinterpret(gl.int32, [BLOCK_N], s_rows_layout)
    else:
        s_view = s_smem.index(s)._reinterpret(gl.int32, [BLOCK_N], s_rows_layout)
    sword = s_view.load(gl.SliceLayout(1, word_layout))
    kb = (i * WORDS + cols) // 2
    # The row's four scale bytes, converted two at a time by the hardware to exact FP16 pairs and times 2^7
    # (0x5800 = 128.0), the scale operand of the Triton kernel's decode; then each scale duplicated into a pair.
    s0, s1, s2, s3 = gl.inline_asm_elementwise(
        "{ .reg .b16 l, h; .reg .b32 a, c, m; mov.b32 {l, h}, $4; cvt.rn.f16x2.e4m3x2 a, l; "
        "cvt.rn.f16x2.e4m3x2 c, h; mov.b32 m, 0x58005800; mul.rn.f16x2 a, a, m; mul.rn.f16x2 c, c, m; "
        "prmt.b32 $0, a, 0, 0x1010; prmt.b32 $1, a, 0, 0x3232; prmt.b32 $2, c, 0, 0x1010; prmt.b32 $3, c, 0, 0x3232; }",
        "=r,=r,=r,=r,r", [sword], dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
    q = ((cols // 2) % 4)[None, :]  # = kb % 4 (a step is 8 words), known per register at compile time
    s_pair = gl.where(q == 0, s0[:, None], gl.where(q == 1, s1[:, None], gl.where(q == 2, s2[:, None], s3[:, None])))
    if not EVEN_K:
        s_pair = gl.where((kb < K // 16)[None, :], s_pair, 0)
    s_pair = gl.expand_dims(s_pair, 2)
    # The lane's byte of each word, by one PRMT (selector 0x4440 + byte: that byte, then zero bytes).
    w3, sel3 = gl.broadcast(gl.expand_dims(words, 2), byte_select3)
    b = gl.inline_asm_elementwise("prmt.b32 $0, $1, 0, $2;", "=r,r,r", [w3, sel3], dtype=gl.int32, is_pure=True,
                                  pack=1)
    r = ((b * 0x00200200) & 0x0E000E00) | ((b * 0x01001000) & -0x7FFF8000)
    lo, hi = gl.inline_asm_elementwise("{ .reg .b32 t; mul.rn.f16x2 t, $2, $3; mov.b32 {$0, $1}, t; }",
                                       "=h,=h,r,r", [r, s_pair], dtype=(gl.float16, gl.float16),
                                       is_pure=True, pack=1)
    a = gl.reshape(gl.join(lo, hi), [BLOCK_N, BLOCK_K])
    a = gl.convert_layout(a, a_layout)

    acc = warpgroup_mma(a, x_smem.index(s).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
    # wgmma(i - 1) is done in both warpgroups (arrive synchronizes the partition): hand its stage back.
    mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i >= 1)
    return acc


@gluon.jit
def _mma_partition(x_smem, w_smem, s_smem, ready, empty, alpha_ptr, bias_ptr, out_ptr, M, N, K, stride_om, off_m,
                   off_n, k_steps, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                   STAGES: gl.constexpr, EVEN_K: gl.constexpr, NEW_REINTERPRET: gl.constexpr, HAS_BIAS: gl.constexpr):
    """The two MMA warpgroups (the default partition): the K loop, then alpha, the bias and the masked store."""
    WORDS: gl.constexpr = BLOCK_K // 8
    # acc [weight rows, tokens]; the decoded weight is the wgmma's register A operand.
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                          instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    # [row, word, byte] such that byte b of word w of row r lands in the thread and register that hold the FP16
    # pair k = 8w + 2b of the A fragment: lanes pick the byte (k bits 1-2), registers the word (k bits 3-5).
    pair_layout: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[8, 0, 0], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        lane_bases=[[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0], [64, 0, 0]], block_bases=[], shape=[BLOCK_N, WORDS, 4])
    word_layout: gl.constexpr = gl.SliceLayout(2, pair_layout)
    # One step's 128 scale words are stored in 128x4 order; this view reads them back indexed by weight row.
    s_rows_layout: gl.constexpr = gl.SharedLinearLayout(offset_bases=[[32], [64], [1], [2], [4], [8], [16]])

    cols = gl.arange(0, WORDS, layout=gl.SliceLayout(0, word_layout))
    byte = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, pair_layout)))
    byte_select3 = gl.expand_dims(gl.expand_dims(byte + 0x4440, 0), 0)

    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, acc_layout)
    # Two steps per iteration, each a separate inlined call: the wgmma of one step reads its A fragment from registers
    # until the next step's wait retires it, so consecutive steps must decode into different registers.
    for j in range(k_steps // 2):
        acc = _mma_step(2 * j, acc, x_smem, w_smem, s_smem, ready, empty, K, cols, byte_select3, BLOCK_N, BLOCK_K,
                        STAGES, EVEN_K, NEW_REINTERPRET, a_layout, word_layout, s_rows_layout)
        acc = _mma_step(2 * j + 1, acc, x_smem, w_smem, s_smem, ready, empty, K, cols, byte_select3, BLOCK_N, BLOCK_K,
                        STAGES, EVEN_K, NEW_REINTERPRET, a_layout, word_layout, s_rows_layout)
    if k_steps % 2 == 1:
        acc = _mma_step(k_steps - 1, acc, x_smem, w_smem, s_smem, ready, empty, K, cols, byte_select3, BLOCK_N, BLOCK_K,
                        STAGES, EVEN_K, NEW_REINTERPRET, a_layout, word_layout, s_rows_layout)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])

    # The decoded weight carries a factor 2^-7 (module docstring); undo it exactly, then apply alpha.
    out = gl.permute(acc * 128.0 * gl.load(alpha_ptr), (1, 0)).to(out_ptr.dtype.element_ty)  # [tokens, rows]
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    out = gl.convert_layout(out, store_layout)
    offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, store_layout))
    offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, store_layout))
    if HAS_BIAS:
        # torch's eager ``out + bias`` on the rounded output: one FP32 add, one more rounding (nvfp4_gemm's epilogue).
        b = gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
        out = (out.to(gl.float32) + gl.expand_dims(b.to(gl.float32), 0)).to(out_ptr.dtype.element_ty)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    gl.store(out_ptr + offs_m.to(gl.int64)[:, None] * stride_om + offs_n[None, :], out, mask=mask)


@gluon.jit
def _wait_for_prior_grids(PDL: gl.constexpr):
    """``grid_dependency.wait_for_prior_grids`` in Gluon: before the first global memory access of every warp."""
    if PDL:
        gl.inline_asm_elementwise(WAIT_ASM, "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise(RELEASE_ASM, "=r", [], dtype=gl.int32, is_pure=False, pack=1)


# One binary for M divisible by 16 and not: the hint changes no code (tests/test_specialization.py).
@gluon.jit(do_not_specialize_on_alignment=["M"])
def _nvfp4_gemm_sm90_kernel(
    x_desc, w_desc, s_desc, alpha_ptr, bias_ptr, out_ptr, M, N, K, stride_om, scale_rows_per_tile,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
    GROUP_N: gl.constexpr, EVEN_K: gl.constexpr, NEW_REINTERPRET: gl.constexpr, HAS_BIAS: gl.constexpr,
    PDL: gl.constexpr,
):
    gl.static_assert(BLOCK_K == 64, "one scale word (4 blocks of 16) per row and k-step")
    gl.static_assert(BLOCK_N == 128, "one 128-row block of the 128x4 scale layout per tile")
    gl.static_assert(gl.num_warps() == 8, "two warpgroups of 64 weight rows")
    gl.static_assert(BLOCK_M == 64 or BLOCK_M == 128 or BLOCK_M == 256, "one wgmma covers the tile's tokens")
    WORDS: gl.constexpr = BLOCK_K // 8

    pid_m, pid_n = grouped_tile(gl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_N)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N

    x_smem = gl.allocate_shared_memory(gl.float16, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, WORDS], w_desc.layout)
    s_smem = gl.allocate_shared_memory(gl.int32, [STAGES, 1, BLOCK_N], s_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(ready.index(st), count=1)
        mbarrier.init(empty.index(st), count=1)
    _wait_for_prior_grids(PDL)  # the prologue above touches shared memory only

    k_steps = gl.cdiv(K, BLOCK_K)
    STEP_BYTES: gl.constexpr = BLOCK_M * BLOCK_K * 2 + BLOCK_N * WORDS * 4 + BLOCK_N * 4
    gl.warp_specialize([
        (_mma_partition, (x_smem, w_smem, s_smem, ready, empty, alpha_ptr, bias_ptr, out_ptr, M, N, K, stride_om,
                          off_m, off_n, k_steps, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, EVEN_K, NEW_REINTERPRET,
                          HAS_BIAS)),
        (_load_partition, (x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, empty, off_m, off_n,
                           pid_n * scale_rows_per_tile, k_steps, STAGES, BLOCK_K, WORDS, STEP_BYTES)),
    ], [1], [24])  # the producer: one warp, 24 registers


@functools.cache
def _x_layout(block_m: int):
    """The X tile's shared-memory layout: built once per tile height, the host cost of a launch matters (eager)."""
    return layout_with_fixed_repr(gl.NVMMASharedLayout.get_default_for([block_m, BLOCK_K], gl.float16))


@functools.cache
def _flat_layout():
    return layout_with_fixed_repr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))


@functools.cache
def sm90_block_m(m: int, n: int, sm_count: int) -> int:
    """Tokens per tile for an ``[m, n]`` output on ``sm_count`` SMs: the height in ``SM90_TILE_COST`` with the least
    waves x tile cost (ties go to the taller tile, which reads the weight fewer times)."""
    def cost(bm: int) -> float:
        tiles = cdiv(m, bm) * cdiv(n, BLOCK_N)
        return cdiv(tiles, sm_count) * SM90_TILE_COST[bm]
    return min(sorted(SM90_TILE_COST, reverse=True), key=cost)


def sm90_max_stages(block_m: int, out_element_size: int) -> int:
    """The deepest pipeline whose shared memory fits a CTA: per stage the X tile (``block_m`` x 64 FP16), the weight's
    words (128 rows x 32 bytes) and scale words (512 bytes); besides them the epilogue's layout conversion, taken as
    ``block_m`` x 64 output elements (which matches the depths measured to fit at 256 tokens: 5 for BF16, 4 for FP32
    output); at most 12, the deepest the H200 sweep tried."""
    stage = block_m * BLOCK_K * 2 + BLOCK_N * BLOCK_K // 2 + BLOCK_N * 4
    return min(12, (SMEM_BYTES - block_m * 64 * out_element_size - 1024) // stage)


# (id(weight), id(scales)) -> ((data pointers and shapes), weight descriptor, scale descriptor)
_WEIGHT_DESCRIPTORS: dict[tuple[int, int], tuple] = declare(
    "kernels.nvfp4_gemm_sm90.weight_descriptors", {}, "an entry is dropped when its weight or scale tensor is freed")


class _CudaWords:
    """``count`` int32 words at a CUDA address, through the CUDA array interface: a tensor made from it owns nothing."""

    def __init__(self, address: int, count: int) -> None:
        self.__cuda_array_interface__ = {"shape": (count,), "typestr": "<i4", "data": (address, False), "version": 3}


def _words(t: torch.Tensor) -> torch.Tensor:
    """A contiguous byte tensor's memory as a flat int32 tensor that does not own it. The descriptor cache must not
    keep a weight's memory alive: offloading hooks move a weight off the GPU between calls by swapping its ``.data``,
    and an owning alias kept every offloaded layer's GPU copy (docs/budget.md). Each use checks the address first."""
    count = t.numel() * t.element_size() // 4
    if t.is_cuda:
        return torch.as_tensor(_CudaWords(t.data_ptr(), count), device=t.device)
    return torch.frombuffer((ctypes.c_int32 * count).from_address(t.data_ptr()), dtype=torch.int32)


def _weight_descriptors(w_packed: torch.Tensor, w_scales: torch.Tensor) -> tuple[TensorDescriptor, TensorDescriptor]:
    """TMA descriptors of a weight and its scales, built on the first call for that weight and then reused.

    Building them (four tensor views, two descriptor objects) costs about 20 us of host time per GEMM on the H200
    machine, and an eager step is bound by host time. An entry is keyed by the two tensors' identities, checked
    against their current data pointers and shapes (a weight moved or replaced in place gets new descriptors), and
    dropped when either tensor is freed. The descriptors' bases own no memory (``_words``), so an entry never keeps a
    weight on the GPU after an offloading hook moved it.
    """
    key = (id(w_packed), id(w_scales))
    where = (w_packed.data_ptr(), w_scales.data_ptr(), w_packed.shape, w_scales.shape)
    entry = _WEIGHT_DESCRIPTORS.get(key)
    if entry is not None and entry[0] == where:
        return entry[1], entry[2]
    flat = _flat_layout()
    w_desc = TensorDescriptor.from_tensor(_words(w_packed).reshape(w_packed.shape[0], -1), [BLOCK_N, BLOCK_K // 8],
                                          flat)
    # 128 consecutive scale words = one 128-row block x 4 scale columns = one k-step of 64 for one weight tile.
    s_desc = TensorDescriptor.from_tensor(_words(w_scales).reshape(-1, 128), [1, 128], flat)
    if entry is None:
        weakref.finalize(w_packed, _WEIGHT_DESCRIPTORS.pop, key, None)
        weakref.finalize(w_scales, _WEIGHT_DESCRIPTORS.pop, key, None)
    _WEIGHT_DESCRIPTORS[key] = (where, w_desc, s_desc)
    return w_desc, s_desc


def sm90_supported(k: int, w_packed: torch.Tensor, w_scales: torch.Tensor) -> bool:
    """Whether ``nvfp4_gemm_sm90`` takes a GEMM with this K and weight: an SM90 GPU, K % 32 == 0, contiguous
    16-byte aligned weight and scales. (Its X is the fresh FP16 decode, always contiguous and aligned.)"""
    if not (w_packed.is_cuda and cuda_capability(w_packed.device)[0] == 9):
        return False
    return (k % 32 == 0 and w_packed.is_contiguous() and w_scales.is_contiguous()
            and w_packed.data_ptr() % 16 == 0 and w_scales.data_ptr() % 16 == 0)


def nvfp4_gemm_sm90(x16: torch.Tensor, w_packed: torch.Tensor, w_scales: torch.Tensor, alpha: torch.Tensor,
                    out: torch.Tensor, stages: int | None = None, group_n: int = SM90_GROUP_N,
                    bias: torch.Tensor | None = None, block_m: int | None = None) -> torch.Tensor:
    """``out = out.dtype((x16 @ decode(w).T) * alpha)`` (+ bias) on an SM90 GPU (operands as ``sm90_supported``
    requires).

    Args:
        x16: FP16 ``[M, K]``, contiguous: the exact decoded activation (``decode_nvfp4_rows``).
        w_packed: uint8 ``[N, K/2]`` packed E2M1, contiguous.
        w_scales: uint8 (or E4M3) 128x4-swizzled scales ``[round_up(N, 128), round_up(K/16, 4)]``, contiguous.
        alpha: FP32 with one element (0-d or ``[1]``) on the same device, read in the kernel.
        out: ``[M, N]`` BF16/FP16/FP32 with unit column stride; written and returned.
        stages: TMA pipeline depth (default ``SM90_STAGES``; 3 to ``sm90_max_stages``);
            group_n: tile order (see ``SM90_GROUP_N``).
        bias: ``[N]`` in out's dtype, contiguous, or None: added as torch's ``out + bias`` would.
        block_m: tokens per tile (64, 128 or 256); default ``sm90_block_m``. The bytes depend on none of these three.
    """
    m, k = x16.shape
    n = w_packed.shape[0]
    if block_m is None:
        block_m = sm90_block_m(m, n, sm_count(x16.device))
    if block_m not in SM90_TILE_COST:
        raise ValueError(f"nvfp4_gemm_sm90: block_m={block_m}; it must be one of {sorted(SM90_TILE_COST)}")
    stages = SM90_STAGES if stages is None else stages
    max_stages = sm90_max_stages(block_m, out.element_size())
    if not 3 <= stages <= max_stages:
        raise ValueError(f"nvfp4_gemm_sm90: stages={stages} does not fit; with {block_m}-token tiles and {out.dtype} "
                         f"output it must be in 3..{max_stages}")
    grid, args, options = _arguments(x16, w_packed, w_scales, alpha, out, bias, block_m, stages, group_n)
    launch_by_site(_nvfp4_gemm_sm90_kernel, grid, *args, **options)
    return out


def _arguments(x16: torch.Tensor, w_packed: torch.Tensor, w_scales: torch.Tensor, alpha: torch.Tensor,
               out: torch.Tensor, bias: torch.Tensor | None, block_m: int, stages: int, group_n: int) -> tuple:
    """(grid, positional arguments, keyword arguments) of one ``_nvfp4_gemm_sm90_kernel`` launch."""
    m, k = x16.shape
    n = w_packed.shape[0]
    w_desc, s_desc = _weight_descriptors(w_packed, w_scales)
    args = (_x_descriptor(x16, block_m), w_desc, s_desc, alpha, alpha if bias is None else bias, out, m, n, k,
            out.stride(0), w_scales.shape[1] // 4)
    options = dict(BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, STAGES=stages, GROUP_N=group_n,
                   EVEN_K=k % BLOCK_K == 0, NEW_REINTERPRET=_NEW_REINTERPRET, HAS_BIAS=bias is not None,
                   num_warps=NUM_WARPS, maxnreg=MAX_REGISTERS, **pdl_options(x16.device))
    return (cdiv(m, block_m) * cdiv(n, BLOCK_N),), args, options


class Sm90Launch:
    """The SM90 GEMM of one weight for one class of calls (M, dtypes, bias), launched without its wrapper: the
    binary ``nvfp4_gemm_sm90`` recorded for the call's arguments, the weight's tensor maps encoded once, the
    activation's encoded per call (``launch.DirectLaunch``). ``run`` gives the bytes ``nvfp4_gemm_sm90`` gives for an
    FP16 activation of ``m`` contiguous, 16-byte aligned rows and a fresh ``[m, n]`` output (docs/performance.md)."""

    __slots__ = ("direct", "grid", "x_encoding", "after_x", "after_out", "m", "n", "out_dtype")

    def __init__(self, direct: DirectLaunch, tail: tuple, grid: tuple[int], args: tuple) -> None:
        x_desc, w_desc, s_desc, alpha, bias_arg, out = args[:6]
        meta = cast(list, direct.descriptor_meta)
        self.direct, self.grid, self.m, self.n, self.out_dtype = direct, grid, args[6], args[7], out.dtype
        self.x_encoding = DescriptorEncoding(x_desc, meta[0])
        weight_args = (*DescriptorEncoding(w_desc, meta[1]).arguments(w_desc.base.data_ptr()),
                       *DescriptorEncoding(s_desc, meta[2]).arguments(s_desc.base.data_ptr()))
        self.after_x = (*weight_args, alpha.data_ptr(), bias_arg.data_ptr())
        self.after_out = (*args[6:], *tail)

    def run(self, x16_address: int, out: torch.Tensor, stream: int) -> torch.Tensor:
        """``out`` (``[m, n]``, fresh) = the GEMM of the FP16 activation at ``x16_address``, launched on ``stream``."""
        self.direct.run(self.grid, stream, *self.x_encoding.arguments(x16_address), *self.after_x, out.data_ptr(),
                        *self.after_out)
        return out


def sm90_launch(x16: torch.Tensor, w_packed: torch.Tensor, w_scales: torch.Tensor, alpha: torch.Tensor,
                out: torch.Tensor, bias: torch.Tensor | None = None) -> Sm90Launch | None:
    """The ``Sm90Launch`` of a call that ``nvfp4_gemm_sm90`` (default stages, order and tile height) has run once
    with these arguments, or None where it cannot be launched directly (no recorded binary, another Triton)."""
    m, k = x16.shape
    n = w_packed.shape[0]
    block_m = sm90_block_m(m, n, sm_count(x16.device))
    grid, args, options = _arguments(x16, w_packed, w_scales, alpha, out, bias, block_m, SM90_STAGES, SM90_GROUP_N)
    recorded = site_binary(_nvfp4_gemm_sm90_kernel, args, options)
    if recorded is None or recorded[0].descriptor_meta is None or len(recorded[0].descriptor_meta) != 3:
        return None
    return Sm90Launch(recorded[0], recorded[1], grid, args)


_X_DESCRIPTOR_FIELDS: dict[tuple, dict] = declare(
    "kernels.nvfp4_gemm_sm90.x_descriptor_fields", {},
    "one entry per activation shape, stride and tile height; kept for the process")


def _x_descriptor(x16: torch.Tensor, block_m: int) -> TensorDescriptor:
    """The TMA descriptor of X. The first one for a shape, row stride and tile height is built and validated by
    ``from_tensor``; later ones copy its fields and take the new tensor as base, which saves the dataclass's checks
    (about 5 us of host time per GEMM)."""
    shape = (x16.dtype, *x16.shape, *x16.stride(), block_m)
    fields = _X_DESCRIPTOR_FIELDS.get(shape)
    if fields is None:
        desc = TensorDescriptor.from_tensor(x16, [block_m, BLOCK_K], _x_layout(block_m))
        fields = descriptor_fields(desc)
        if fields is not None:
            _X_DESCRIPTOR_FIELDS[shape] = fields
        return desc
    return descriptor_over(TensorDescriptor, fields, x16)
