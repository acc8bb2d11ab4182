"""Stand-ins for the Blackwell GEMMs, for CPU contract tests (tests/test_blackwell_contract.py).

``FakeScaledMM`` is torch's ``torch.nn.functional.scaled_mm`` (the automatic backend, cuBLASLt) with torch 2.14.1's
exact signature (``SCALED_MM_SOURCE``; compared with the installed torch's by the contract test);
``CompilingFlashInfer`` is a FlashInfer whose GEMM entry raises, standing for the nvcc compile that the real one
starts at its first call.

``FakeFlashInfer`` is a ``flashinfer`` module with ``mm_fp4`` of FlashInfer 0.7.2.post1's exact signature
(flashinfer/gemm/gemm_base.py of the ``flashinfer-python==0.7.2.post1`` wheel, line 9538; the ``skip_check`` keyword
that its ``@backend_requirement`` wrapper pops is not part of ``inspect.signature``). Each call is checked against
what that release documents and what its code checks or silently assumes:
- ``_check_mm_fp4_problem_size``: 2-D operands, ``a.shape[1] == b.shape[0]``, uint8 (or FP4) operands, E4M3/uint8
  scales, FP32 ``alpha`` with one element (the per-token form is CuTe-DSL only), BF16/FP16 output, block size 16;
- ``_cutlass_gemm_fp4_requirement``: no 8x4 scale layout, NVFP4 (not MXFP4), SM100/103/107/110/120/121;
- the CUTLASS runner calls ``fp4_gemm(a, b.T, a_descale, b_descale.T, alpha, out, ...)``; the SM100 binding
  (csrc/fp4_gemm_cutlass.cu) checks that each of those is contiguous and that K and N are multiples of 32. The SM120
  binding (csrc/fp4_gemm_cutlass_sm120.cu) checks neither contiguity nor scale sizes, and its CUTLASS kernel needs
  K % 32 and N % 8: a wrong view or size would be read silently, so the stand-in checks them on every GPU;
- both bindings read ``round_up(M,128) * round_up(K/16,4)`` scale bytes for A and ``round_up(N,128) * ...`` for B
  (the 128x4 layout, "mat1Scale"/"mat2Scale" in the binding's comment) and ``alpha`` through a device pointer.
On top, the layer-side contract: ``b`` is the transposed view of a registered layer's packed weight (no copy) unless
that layer's shape needs padding, ``b_descale`` the transposed view of its once-swizzled scales, ``alpha`` bitwise its
``input_scale * weight_scale_2``, all scale padding zero and no E4M3 NaN byte.

The result is computed with this module's own decoder, written from docs/design.md §3 (E2M1 and E4M3 bit fields, low
nibble first, the 128x4 offset formula), not from ``diffusers_nvfp4_fast.format``: ``out_dtype(fp32(A @ B) * alpha)``
with the FP32 product taken exactly as ``ops.linear.emulated_gemm`` takes it, so the bytes equal the emulated backend's.
No code of FlashInfer is copied here; only its signature and the facts above.
"""

from __future__ import annotations

import dataclasses
import inspect
from types import ModuleType
from typing import Any, Literal

import torch

MM_FP4_SOURCE = "flashinfer-python 0.7.2.post1, flashinfer/gemm/gemm_base.py:9538"
SCALED_MM_SOURCE = "torch 2.14.1, torch/nn/functional.py:7195"
# FlashInfer 0.7.2.post1: mm_fp4(backend="cutlass") -> get_cutlass_fp4_gemm_module (gemm_base.py:2895) ->
# gen_gemm_sm100_module_cutlass_fp4().build_and_load() (gemm_base.py:2871), which compiles with nvcc unless a
# flashinfer-jit-cache or ~/.cache/flashinfer holds the module (jit/core.py:337, build_and_load).
MM_FP4_JIT_ENTRY = "flashinfer-python 0.7.2.post1, flashinfer/gemm/gemm_base.py:2871 (build_and_load)"
E4M3_NAN_BYTES = (0x7F, 0xFF)
SUPPORTED_CAPABILITIES = (100, 103, 107, 110, 120, 121)  # _cutlass_gemm_fp4_requirement


class ContractError(AssertionError):
    """A call broke FlashInfer's (or the layer's) contract; the message names the argument and what was wrong."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ContractError(message)


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


# ----------------------------------------------------------------------------------------------------------------
# The decoder, from docs/design.md §3.
# ----------------------------------------------------------------------------------------------------------------


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes -> FP32: bit 3 sign, bits 2..1 exponent (bias 1), bit 0 mantissa; exponent 0 is subnormal (m/2)."""
    codes = codes.to(torch.int32)
    exponent, mantissa = (codes >> 1) & 3, (codes & 1).to(torch.float32)
    magnitude = torch.where(exponent == 0, mantissa * 0.5,
                            torch.exp2((exponent - 1).to(torch.float32)) * (1.0 + mantissa * 0.5))
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def e4m3_values(raw: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes -> FP32: bit 7 sign, bits 6..3 exponent (bias 7), bits 2..0 mantissa; exponent 0 is subnormal."""
    raw = raw.to(torch.int32)
    exponent, mantissa = (raw >> 3) & 15, (raw & 7).to(torch.float32)
    magnitude = torch.where(exponent == 0, mantissa / 8 * 2.0 ** -6,
                            torch.exp2((exponent - 7).to(torch.float32)) * (1.0 + mantissa / 8))
    return torch.where((raw & 0x80) != 0, -magnitude, magnitude)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[R, K/2]`` -> codes ``[R, K]``: byte j holds element 2j in its low nibble, 2j+1 in its high nibble."""
    p = packed.to(torch.int32)
    return torch.stack([p & 15, p >> 4], dim=-1).reshape(p.shape[0], -1)


def scale_offsets(rows: int, cols: int, padded_cols: int) -> torch.Tensor:
    """Flat 128x4 offsets of elements ``(m, k)``, ``m < rows``, ``k < cols``, in a matrix of ``padded_cols``."""
    m = torch.arange(rows).reshape(-1, 1)
    k = torch.arange(cols).reshape(1, -1)
    return ((m // 128) * (padded_cols * 128) + (k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4)


def read_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The linear ``[rows, cols]`` scale bytes of a 128x4 tensor of ``round_up(rows,128) * round_up(cols,4)`` bytes."""
    flat = swizzled.reshape(-1).view(torch.uint8) if swizzled.is_contiguous() else swizzled.contiguous().view(-1)
    return flat.view(torch.uint8)[scale_offsets(rows, cols, round_up(cols, 4))]


def padding_bytes(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The bytes of a 128x4 scale tensor that hold no element of the ``[rows, cols]`` matrix."""
    flat = swizzled.contiguous().reshape(-1).view(torch.uint8)
    used = torch.zeros(flat.numel(), dtype=torch.bool)
    used[scale_offsets(rows, cols, round_up(cols, 4)).reshape(-1)] = True
    return flat[~used]


def check_scale_bytes(name: str, raw: torch.Tensor, rows: int, k: int) -> None:
    """No E4M3 NaN byte anywhere, and zero padding: the kernel reads the padding (times zero codes)."""
    require(not bool(torch.isin(raw, torch.tensor(E4M3_NAN_BYTES, dtype=torch.uint8)).any()),
            f"{name} holds an E4M3 NaN byte")
    require(not bool(padding_bytes(raw, rows, k // 16).any()), f"{name} padding is not zero")


def decode(packed: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """Codes ``[R, K/2]`` and linear scale bytes ``[R, K/16]`` -> FP32 ``[R, K]`` (each value exact)."""
    values = e2m1_values(unpack_codes(packed))
    return values * e4m3_values(scale_bytes).repeat_interleave(16, dim=1)


def decode_swizzled(packed: torch.Tensor, swizzled: torch.Tensor) -> torch.Tensor:
    rows, k = packed.shape[0], packed.shape[1] * 2
    return decode(packed, read_scales(swizzled, rows, k // 16))


def emulated_result(a_values: torch.Tensor, b_values: torch.Tensor, alpha: torch.Tensor, out_dtype: torch.dtype
                    ) -> torch.Tensor:
    """``out_dtype(fp32(A @ B^T) * alpha)`` with A ``[M, K]`` and B ``[N, K]`` contiguous FP32."""
    return ((a_values @ b_values.t()) * alpha.reshape(())).to(out_dtype)


def integer_values(values: torch.Tensor) -> torch.Tensor:
    """Decoded values times 2^10, as int64: exact (E2M1 steps of 1/2 times E4M3 steps of 2^-9)."""
    scaled = values.to(torch.float64) * 1024.0
    assert torch.equal(scaled, scaled.round()), "decoded values are multiples of 2^-10"
    return scaled.to(torch.int64)


def exact_gemm(a_values: torch.Tensor, b_values: torch.Tensor) -> torch.Tensor:
    """The exact sums of products of ``[M, K]`` and ``[N, K]`` decoded operands, in units of 2^-20 (int64; no
    rounding at all, so no order of summation)."""
    return integer_values(a_values) @ integer_values(b_values).t()


def ordered_fp32_gemm(a_values: torch.Tensor, b_values: torch.Tensor) -> torch.Tensor:
    """FP32 sums accumulated over K in order from +0: a model of every GEMM whose order over the real terms does
    not depend on zero padding."""
    acc = torch.zeros(a_values.shape[0], b_values.shape[0], dtype=torch.float32)
    for k in range(a_values.shape[1]):
        acc = acc + a_values[:, k:k + 1] * b_values[:, k].reshape(1, -1)
    return acc


# ----------------------------------------------------------------------------------------------------------------
# The stand-in module.
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Call:
    """One ``mm_fp4`` call: the layer it served (None for a warm-up call on zero operands), the shapes it saw, the
    operands decoded by this module, and whether ``b`` was a padded copy of the layer's weight."""

    layer: object | None
    m: int
    n: int
    k: int
    out_dtype: torch.dtype
    alpha: torch.Tensor
    a_values: torch.Tensor
    b_values: torch.Tensor
    padded_b: bool
    copied_b: bool = False


class _LayerContract:
    """The layer side of the contract, shared by both stand-ins: calls are matched to ``register``-ed layers by the
    storage of their weight scales."""

    capability: tuple[int, int]

    def __init__(self, capability: tuple[int, int]) -> None:
        self.capability = capability
        self.layers: dict[int, object] = {}
        self.calls: list[Call] = []
        self.copied = False
        self.any_weight = False  # True: weights of no registered layer are allowed (FlashInfer's own contract only)

    def register(self, model: torch.nn.Module):
        from diffusers_nvfp4_fast.linear import NVFP4Linear

        for module in model.modules():
            if isinstance(module, NVFP4Linear):
                self.layers[module.weight_scale.data_ptr()] = module
        return self

    def layer_calls(self) -> list[Call]:
        return [c for c in self.calls if c.layer is not None]

    def n_multiple(self) -> int:
        """The CUTLASS FP4 kernels: N % 32 on SM100-SM110 (the binding's check), N % 8 on SM120/121."""
        return 8 if self.capability[0] == 12 else 32

    def misaligned(self, n: int, k: int) -> bool:
        """Whether the kernel cannot take an ``[N, K]`` weight as it is (K % 32 everywhere)."""
        return k % 32 != 0 or n % self.n_multiple() != 0

    def _check_weight(self, rows, scales, n, k, alpha) -> tuple[object | None, bool]:
        """``rows``: the uint8 ``[N, K/2]`` weight the kernel reads, ``scales`` its 128x4 scale matrix. Sets
        ``self.copied`` where ``rows`` is an aligned copy of a misaligned weight."""
        self.copied = False
        layer = self.layers.get(scales.data_ptr())
        if layer is None and self.any_weight:
            require(not bool(torch.isin(scales.view(torch.uint8), torch.tensor(E4M3_NAN_BYTES, dtype=torch.uint8))
                             .any()), "b_descale holds an E4M3 NaN byte")
            return None, False
        if layer is None:  # a warm-up call: zero operands of a layer's shape
            require(not bool(rows.view(torch.uint8).any()) and not bool(scales.view(torch.uint8).any()),
                    "a GEMM call with a weight no registered layer holds, and not a zero warm-up operand")
            return None, False
        lay: Any = layer
        weight, weight_scale = lay.weight, lay.weight_scale
        require(lay.scale_layout == "128x4", "the layer's weight scales are not in the 128x4 layout")
        require(scales.is_contiguous() and tuple(scales.shape) == tuple(weight_scale.shape),
                f"the weight scales must be (a transposed view of) the layer's [round_up(N,128), round_up(K/16,4)] "
                f"scales, got {tuple(scales.shape)} strides {scales.stride()}")
        real_n, real_k = weight.shape[0], weight.shape[1] * 2
        check_scale_bytes("b_descale", weight_scale.view(torch.uint8), real_n, real_k)
        rows = rows.view(torch.uint8)
        padded = (n, k) != (real_n, real_k)
        require(padded == self.misaligned(real_n, real_k),
                f"a [{real_n}, {real_k}] layer called as [{n}, {k}]: padded only where the kernel needs it")
        if padded:
            require(bool(torch.equal(rows[:real_n, :real_k // 2], weight)) and not bool(rows[real_n:].any())
                    and not bool(rows[:, real_k // 2:].any()), "a padded b is not the weight plus zeros")
        elif rows.data_ptr() != weight.data_ptr() or rows.untyped_storage().data_ptr() != \
                weight.untyped_storage().data_ptr():
            require(weight.data_ptr() % 16 != 0 and bool(torch.equal(rows, weight)),
                    "b is not a view of the layer's weight: a per-call copy of an aligned weight")
            self.copied = True  # allowed only for a weight whose own storage is not 16-byte aligned
        if not getattr(lay, "dynamic_input_scale", False):
            want = lay.input_scale * lay.weight_scale_2
            require(torch.equal(alpha.reshape(()).view(torch.int32), want.reshape(()).view(torch.int32)),
                    f"alpha {alpha.item()!r} is not input_scale * weight_scale_2 = {want.item()!r} bit for bit")
        return layer, padded


class FakeFlashInfer(ModuleType, _LayerContract):
    """``flashinfer`` for ``sys.modules``: ``__version__`` and a contract-checking ``mm_fp4``; ``register`` the
    model's NVFP4 layers first so that calls can be matched to them."""

    def __init__(self, capability: tuple[int, int], version: str = "0.7.2.post1") -> None:
        ModuleType.__init__(self, "flashinfer")
        _LayerContract.__init__(self, capability)
        self.__version__ = version
        self.mm_fp4 = self._make_mm_fp4()

    def _make_mm_fp4(self):
        fake = self

        def mm_fp4(
            a: torch.Tensor,
            b: torch.Tensor,
            a_descale: torch.Tensor,
            b_descale: torch.Tensor,
            alpha: torch.Tensor | None = None,
            out_dtype: torch.dtype = torch.bfloat16,
            out: torch.Tensor | None = None,
            block_size: int = 16,
            use_8x4_sf_layout: bool = False,
            backend: Literal["cudnn", "trtllm", "cutlass", "cute-dsl", "cutedsl_low_latency", "b12x", "cake",
                             "auto"] = "auto",
            use_nvfp4: bool = True,
            enable_pdl: bool = True,
        ) -> torch.Tensor:
            return fake._call(a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_8x4_sf_layout,
                              backend, use_nvfp4)

        return mm_fp4

    # -- the checks --------------------------------------------------------------------------------------------

    def _call(self, a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_8x4_sf_layout, backend,
              use_nvfp4) -> torch.Tensor:
        major, minor = self.capability
        require(backend == "cutlass", f"backend={backend!r}: the project asks for 'cutlass' (trtllm needs shuffled "
                                      "weights, auto may pick cuDNN or b12x)")
        require(block_size == 16 and use_nvfp4 and not use_8x4_sf_layout,
                f"block_size={block_size}, use_nvfp4={use_nvfp4}, use_8x4_sf_layout={use_8x4_sf_layout}: NVFP4 with "
                "128x4 scales needs 16, True, False")
        require(out is None, "out: the project lets mm_fp4 allocate its output")
        require(major * 10 + minor in SUPPORTED_CAPABILITIES, f"SM{major}{minor} has no CUTLASS FP4 GEMM")
        m, n, k = self._check_operands(a, b)
        self._check_a_descale(a_descale, m, k)
        require(alpha is not None and alpha.dtype == torch.float32 and alpha.numel() == 1,
                f"alpha: a one-element FP32 tensor, got {None if alpha is None else (alpha.dtype, alpha.shape)}")
        require(alpha.device == a.device, f"alpha on {alpha.device}: read through a device pointer on {a.device}")
        require(out_dtype in (torch.bfloat16, torch.float16), f"out_dtype={out_dtype}: BF16 or FP16 only")
        layer, padded_b = self._check_weight(b.t(), b_descale.t(), n, k, alpha)
        a_values = decode_swizzled(a, a_descale.view(torch.uint8))
        b_values = decode_swizzled(b.t().contiguous(), b_descale.t().view(torch.uint8))
        self.calls.append(Call(layer, m, n, k, out_dtype, alpha.detach().clone(), a_values, b_values, padded_b,
                               self.copied))
        return emulated_result(a_values, b_values, alpha, out_dtype)

    def _check_operands(self, a: torch.Tensor, b: torch.Tensor) -> tuple[int, int, int]:
        require(a.dim() == 2 and b.dim() == 2, f"mm_fp4 takes 2-D operands, got {tuple(a.shape)}, {tuple(b.shape)}")
        require(a.dtype == torch.uint8 and b.dtype == torch.uint8, f"packed operands are uint8: {a.dtype}, {b.dtype}")
        require(a.shape[1] == b.shape[0], f"K mismatch: a {tuple(a.shape)}, b {tuple(b.shape)}")
        require(a.is_contiguous(), f"a (mat1) must be contiguous, strides {a.stride()}")
        require(b.t().is_contiguous(), f"b must be the transposed view of a row-major [N, K/2] matrix, strides "
                                       f"{b.stride()}")
        for name, t in (("a", a), ("b", b)):
            require(t.data_ptr() % 16 == 0, f"{name} is not 16-byte aligned (address % 16 = {t.data_ptr() % 16})")
        m, k, n = a.shape[0], a.shape[1] * 2, b.shape[1]
        require(k % 32 == 0, f"K={k} is not a multiple of 32 (the CUTLASS FP4 kernel's alignment)")
        require(n % self.n_multiple() == 0, f"N={n} is not a multiple of {self.n_multiple()} on "
                                            f"SM{self.capability[0]}x")
        return m, n, k

    def _check_a_descale(self, a_descale: torch.Tensor, m: int, k: int) -> None:
        shape = (round_up(m, 128), round_up(k // 16, 4))
        require(a_descale.dtype in (torch.float8_e4m3fn, torch.uint8), f"a_descale dtype {a_descale.dtype}")
        require(tuple(a_descale.shape) == shape and a_descale.is_contiguous(),
                f"a_descale must be a contiguous {shape} 128x4 tensor, got {tuple(a_descale.shape)} strides "
                f"{a_descale.stride()}")
        check_scale_bytes("a_descale", a_descale.view(torch.uint8), m, k)

class CompilingFlashInfer(FakeFlashInfer):
    """A ``flashinfer`` whose ``mm_fp4`` (the call that JIT-compiles the CUTLASS GEMM, ``MM_FP4_JIT_ENTRY``) raises and
    counts: a machine without a CUDA toolkit. The default backend must never get there."""

    def __init__(self, capability: tuple[int, int]) -> None:
        super().__init__(capability)
        self.compile_attempts = 0

        def mm_fp4(*args, **kwargs):
            self.compile_attempts += 1
            raise RuntimeError("Could not find nvcc and default cuda_home='/usr/local/cuda' doesn't exist "
                               f"(stand-in for {MM_FP4_JIT_ENTRY})")

        self.mm_fp4 = mm_fp4


class FakeScaledMM(_LayerContract):
    """``torch.nn.functional.scaled_mm`` for the ``cublaslt`` backend (monkeypatched in; ``ScalingType`` and
    ``SwizzleType`` stay torch's), with the signature of ``SCALED_MM_SOURCE``. Checks the two-level NVFP4 recipe as
    torch's ``_scaled_mm_v2`` accepts it (aten/src/ATen/native/ScaledBlasUtils.cpp ``check_nvfp4_recipe``;
    cuda/ScaledBlas.cpp ``_scaled_nvfp4_nvfp4``, pytorch main, 2026) and as torch 2.14.1's
    ``_check_scaled_mm_sizes`` (torch/_meta_registrations.py:7158-7175, 7223-7248) states it: FP4 operands, A
    row-major and B column-major, packed K (``mat_a.size(1)``) and both dimensions of B divisible by 16 (so K % 32,
    N % 16), per operand ``[E4M3 block scales of round_up(rows,128) * round_up(K/16,4) elements, contiguous,
    SWIZZLE_32_4_4; one FP32 global scale, NO_SWIZZLE]``, no bias (cuBLASLt would add it before the output rounding),
    no fast accumulation. torch multiplies the two global scales into cuBLASLt's alpha; the stand-in computes
    ``out_dtype(fp32(A @ B) * (g_a * g_b))``."""

    def n_multiple(self) -> int:
        return 16

    def __call__(self, mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, swizzle_a=None, swizzle_b=None,
                 bias=None, output_dtype=torch.bfloat16, contraction_dim=(), use_fast_accum=False) -> torch.Tensor:
        functional: Any = torch.nn.functional
        recipe = [functional.ScalingType.BlockWise1x16, functional.ScalingType.TensorWise]
        swizzles = [functional.SwizzleType.SWIZZLE_32_4_4, functional.SwizzleType.NO_SWIZZLE]
        require(list(scale_recipe_a) == recipe and list(scale_recipe_b) == recipe, "not the two-level NVFP4 recipe")
        require(list(swizzle_a or []) == swizzles and list(swizzle_b or []) == swizzles, "swizzles")
        require(bias is None and not use_fast_accum and tuple(contraction_dim) == (), "bias / fast accum / dims")
        require(output_dtype in (torch.bfloat16, torch.float16), f"output_dtype {output_dtype}")
        fp4 = torch.float4_e2m1fn_x2
        require(mat_a.dtype == fp4 and mat_b.dtype == fp4, f"operands {mat_a.dtype}, {mat_b.dtype}")
        require(mat_a.dim() == 2 and mat_b.dim() == 2, f"2-D operands, got {tuple(mat_a.shape)}, {tuple(mat_b.shape)}")
        require(mat_a.is_contiguous() and mat_a.stride(0) > mat_a.stride(1) == 1 and mat_b.t().is_contiguous()
                and mat_b.stride(1) > mat_b.stride(0) == 1,
                f"A row-major, B column-major ('TN'): strides {mat_a.stride()}, {mat_b.stride()}")
        for name, t in (("mat_a", mat_a), ("mat_b", mat_b)):
            require(t.data_ptr() % 16 == 0, f"{name} is not 16-byte aligned (address % 16 = {t.data_ptr() % 16})")
        m, k, n = mat_a.shape[0], mat_a.shape[1] * 2, mat_b.shape[1]
        require(mat_b.shape[0] * 2 == k and mat_a.shape[1] % 16 == 0 and mat_b.shape[0] % 16 == 0 and n % 16 == 0,
                f"shapes M={m} K={k} N={n}: packed K and N must be multiples of 16")
        (sa, ga), (sb, gb) = scale_a, scale_b
        for name, s, rows in (("scale_a", sa, m), ("scale_b", sb, n)):
            require(s.dtype == torch.float8_e4m3fn and s.is_contiguous()
                    and s.numel() == round_up(rows, 128) * round_up(k // 16, 4), f"{name}: {s.dtype} {tuple(s.shape)}")
        for name, g in (("global_scale_a", ga), ("global_scale_b", gb)):
            require(g.dtype == torch.float32 and g.numel() == 1 and g.device == mat_a.device, f"{name}: {g}")
        check_scale_bytes("scale_a", sa.view(torch.uint8), m, k)
        alpha = ga.reshape(()) * gb.reshape(())
        layer, padded = self._check_weight(mat_b.t(), sb, n, k, alpha)
        a_values = decode_swizzled(mat_a.view(torch.uint8), sa.view(torch.uint8))
        b_values = decode_swizzled(mat_b.t().contiguous().view(torch.uint8), sb.view(torch.uint8))
        self.calls.append(Call(layer, m, n, k, output_dtype, alpha.clone(), a_values, b_values, padded, self.copied))
        return emulated_result(a_values, b_values, alpha, output_dtype)


def signature_problems(fake_fn, real_fn) -> list[str]:
    """Differences in parameter names, kinds and defaults between the stand-in's ``mm_fp4`` and the real one."""
    fake, real = inspect.signature(fake_fn).parameters, inspect.signature(real_fn).parameters
    problems = [] if list(fake) == list(real) else [f"parameters {list(fake)} != {list(real)}"]
    for name in set(fake) & set(real):
        f, r = fake[name], real[name]
        if (f.kind, f.default) != (r.kind, r.default):
            problems.append(f"{name}: {f.kind.name}={f.default!r} here, {r.kind.name}={r.default!r} in FlashInfer")
    return problems
