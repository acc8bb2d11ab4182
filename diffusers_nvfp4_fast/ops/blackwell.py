"""The FP4 tensor-core GEMM of Blackwell GPUs (SM100+): cuBLASLt through torch's two-level scaled
``torch.nn.functional.scaled_mm`` (the automatic choice: it ships compiled with torch), or FlashInfer's CUTLASS
``mm_fp4`` when forced (docs/blackwell.md).

Both compute ``out_dtype(fp32_sum * alpha)`` from the packed operands and their 128x4 scales; ``ops/linear.py`` adds
the bias afterwards. A shape a kernel cannot take (cuBLASLt: K % 32, N % 16; FlashInfer SM100: K and N multiples of
32) is padded with zero codes whose block scales are the zero padding the 128x4 layout already has, so every added
product is an exact +0 and the padded columns are cut off again (proof: tests/test_blackwell_contract.py).
``warm_up`` runs one call per layer shape when the fast paths are enabled: a first call that fails (or, for
FlashInfer without its prebuilt kernels, compiles with nvcc) does so there, with one error that says what to install,
not inside the first denoising step."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import Any, Protocol, cast

import torch

from .. import caches
from ..format import ScaleLayout, padded_scale_shape, round_up, swizzle_scales
from . import dispatch
from .dispatch import GEMM_BACKEND_VAR, BackendUnavailableError, flashinfer, gemm_backend

logger = logging.getLogger("diffusers_nvfp4_fast")
TENSOR_CORE_BACKENDS = ("flashinfer", "cublaslt")
SLOW_WARM_UP_S = 5.0
# The kernels load operands by TMA, whose global addresses must be 16-byte aligned (CUDA driver API,
# cuTensorMapEncodeTiled). Fresh CUDA allocations are; a view into a larger buffer (safetensors packs tensors 8-byte
# aligned) may not be.
ALIGNMENT = 16


class NVFP4LayerShape(Protocol):
    """What the GEMM set-up reads of an ``NVFP4Linear`` (ops/ cannot import the layer, which imports ops/)."""

    @property
    def in_features(self) -> int: ...
    @property
    def out_features(self) -> int: ...
    @property
    def compute_dtype(self) -> torch.dtype: ...
    @property
    def scale_layout(self) -> ScaleLayout: ...
    @property
    def weight(self) -> torch.Tensor: ...
    @property
    def weight_scale(self) -> torch.Tensor: ...


class GemmSetupError(BackendUnavailableError):
    """The Blackwell GEMM failed its warm-up call; the message says what to install or set instead."""


def gemm_alignment(backend: str, capability: tuple[int, int]) -> tuple[int, int]:
    """(multiple of K, multiple of N) that ``backend``'s kernel takes on a GPU of ``capability``.

    FlashInfer 0.7.2.post1: the SM100 binding checks ``k % 32`` and ``n % 32`` (csrc/fp4_gemm_cutlass.cu); the SM120
    kernel needs 32 FP4 values per A/B access and 8 16-bit outputs per C access (fp4_gemm_template_sm120.h).
    torch's ``scaled_mm`` checks K and N % 16; K % 32 keeps cuBLASLt's packed rows 16-byte aligned.
    """
    if backend == "cublaslt":
        return 32, 16
    return (32, 8) if capability[0] == 12 else (32, 32)


def padding_reason(backend: str, capability: tuple[int, int], n: int, k: int) -> str | None:
    """Why a ``[N, K]`` layer's GEMM is padded with zeros on ``backend`` (a report key), or None where it is not."""
    k_multiple, n_multiple = gemm_alignment(backend, capability)
    parts = [f"{name} % {multiple} != 0" for name, size, multiple in (("K", k, k_multiple), ("N", n, n_multiple))
             if size % multiple]
    if not parts:
        return None
    return f"{backend} SM{capability[0]}{capability[1]}: {' and '.join(parts)}, padded with exact zeros"


def _pad_last(packed: torch.Tensor, cols: int) -> torch.Tensor:
    padded = packed.new_zeros((packed.shape[0], cols))
    padded[:, :packed.shape[1]] = packed
    return padded


def _pad_rows(packed: torch.Tensor, rows: int) -> torch.Tensor:
    padded = packed.new_zeros((rows, packed.shape[1]))
    padded[:packed.shape[0]] = packed
    return padded


def padded_operands(
    backend: str, capability: tuple[int, int], x_packed: torch.Tensor, w_packed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed operands zero-padded to the kernel's alignment (the same tensors where none is needed).

    The scale tensors keep their shapes: ``round_up(K/16, 4)`` columns already cover ``round_up(K, 32) / 16`` blocks
    and ``round_up(N, 128)`` rows cover ``round_up(N, 32)``; their padding is zero (docs/design.md §3).
    """
    n, k = w_packed.shape[0], w_packed.shape[1] * 2
    k_multiple, n_multiple = gemm_alignment(backend, capability)
    k_padded, n_padded = round_up(k, k_multiple), round_up(n, n_multiple)
    assert padded_scale_shape(n_padded, k_padded) == padded_scale_shape(n, k)
    if k_padded != k:
        x_packed, w_packed = _pad_last(x_packed, k_padded // 2), _pad_last(w_packed, k_padded // 2)
    if n_padded != n:
        w_packed = _pad_rows(w_packed, n_padded)
    return x_packed, w_packed


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself where its data is 16-byte aligned, else an aligned copy."""
    return t if t.data_ptr() % ALIGNMENT == 0 else t.clone()


def _mm_fp4(x_packed, x_scales, w_packed, w_scales, alpha, out_dtype) -> torch.Tensor:
    # FlashInfer's contract (docs/blackwell.md): b is the transposed view of the row-major [N, K/2] weight, the
    # scales are E4M3 views, alpha a one-element FP32 device tensor (no host sync), the CUTLASS backend.
    return cast(ModuleType, flashinfer()).mm_fp4(
        x_packed, w_packed.t(), x_scales.view(torch.float8_e4m3fn), w_scales.view(torch.float8_e4m3fn).t(),
        alpha, out_dtype, backend="cutlass",
    )


_ONES: dict[torch.device, torch.Tensor] = caches.register("ops.blackwell.ones", {},
                                                           "kept for the process (one tensor per device)")


def _one(device: torch.device) -> torch.Tensor:
    one = _ONES.get(device)
    if one is None:
        one = _ONES[device] = torch.ones(1, dtype=torch.float32, device=device)
    return one


def _scaled_mm(x_packed, x_scales, w_packed, w_scales, alpha, out_dtype) -> torch.Tensor:
    # torch's two-level NVFP4 recipe multiplies the two global scales (alpha * 1.0: exact) and hands the product to
    # cuBLASLt as its alpha, which scales the FP32 accumulator before the conversion to out_dtype. No bias here:
    # cuBLASLt would add it before that rounding.
    functional: Any = torch.nn.functional
    scaling, swizzle = functional.ScalingType, functional.SwizzleType
    recipe = [scaling.BlockWise1x16, scaling.TensorWise]
    swizzles = [swizzle.SWIZZLE_32_4_4, swizzle.NO_SWIZZLE]
    return functional.scaled_mm(
        x_packed.view(torch.float4_e2m1fn_x2), w_packed.view(torch.float4_e2m1fn_x2).t(),
        [x_scales.view(torch.float8_e4m3fn), alpha.reshape(1)], recipe,
        [w_scales.view(torch.float8_e4m3fn), _one(alpha.device)], recipe,
        swizzle_a=swizzles, swizzle_b=swizzles, output_dtype=out_dtype,
    )


def tensor_core_gemm(
    backend: str, x_packed: torch.Tensor, x_scales: torch.Tensor, w_packed: torch.Tensor, w_scales: torch.Tensor,
    alpha: torch.Tensor, out_dtype: torch.dtype,
) -> torch.Tensor:
    """``backend`` ('flashinfer' or 'cublaslt') on x uint8 ``[M, K/2]``, w uint8 ``[N, K/2]`` with their 128x4
    scales, alpha FP32 one-element -> ``[M, N]`` in ``out_dtype`` (BF16 or FP16), without the bias."""
    capability = cast(tuple[int, int], dispatch.gemm_device_capability(x_packed.device))  # checked: not None
    n = w_packed.shape[0]
    x_in, w_in = padded_operands(backend, capability, x_packed, w_packed)
    gemm = _mm_fp4 if backend == "flashinfer" else _scaled_mm
    out = gemm(aligned(x_in), aligned(x_scales), aligned(w_in), aligned(w_scales), alpha, out_dtype)
    return out if w_in.shape[0] == n else out[:, :n].contiguous()


def _install_hint(backend: str) -> str:
    if backend == "cublaslt":
        return ("cuBLASLt's NVFP4 GEMM ships with torch and needs no CUDA toolkit, but a torch built with CUDA >= 12.8 "
                "(torch.version.cuda) on an SM100+ GPU; or set "
                f"{GEMM_BACKEND_VAR}=flashinfer (FlashInfer's CUTLASS GEMM) or =emulated (slow, exact); "
                "docs/blackwell.md")
    return ("FlashInfer compiles its CUTLASS FP4 GEMM with nvcc at its first call: install a CUDA toolkit whose "
            "nvcc lists this GPU's target (`nvcc --list-gpu-arch`; CUDA 12.8+ for SM100/SM120, 12.9+ for SM121) and a "
            "host C++ compiler, put it on PATH or in CUDA_HOME, and keep ~/.cache/flashinfer writable; or install the "
            "prebuilt kernels with `flashinfer install-jit-cache-wheel`; or unset "
            f"{GEMM_BACKEND_VAR} (cuBLASLt through torch, no toolkit) or set it to emulated (slow, exact); "
            "docs/blackwell.md")


_FIRST_CALL = {
    "cublaslt": "cuBLASLt ships compiled with torch (no nvcc); the first call per shape picks its algorithm",
    "flashinfer": ("FlashInfer's first call builds or loads its kernel (without flashinfer-jit-cache: an nvcc "
                   "compile of a few minutes, cached in ~/.cache/flashinfer)"),
}


def zero_scale_padding_(layer: NVFP4LayerShape) -> int:
    """Zero the 128x4 padding of ``layer``'s weight scales (the tensor-core GEMM multiplies it by the zero codes
    beyond K, and ``0 * NaN`` is NaN); returns how many bytes were nonzero. No other backend reads the padding."""
    scales = layer.weight_scale
    if scales.device.type == "meta" or layer.scale_layout != "128x4":
        return 0
    data = swizzle_scales(torch.ones(layer.out_features, layer.in_features // 16, dtype=torch.uint8,
                                     device=scales.device)).bool()
    dirty = int(((scales != 0) & ~data).sum())
    if dirty:
        with torch.no_grad():
            scales.masked_fill_(~data, 0)
    return dirty


def realign_(layer: NVFP4LayerShape) -> int:
    """Give ``layer``'s packed weight and scales 16-byte aligned storage where they lack it (in place: the parameter
    objects stay, for offloading hooks), so that no call copies them; returns how many tensors moved."""
    moved = 0
    for tensor in (layer.weight, layer.weight_scale):
        if tensor.device.type != "meta" and tensor.data_ptr() % ALIGNMENT:
            tensor.data = tensor.data.clone()
            moved += 1
    return moved


def _warm_up_call(backend: str, n: int, k: int, dtype: torch.dtype, device: torch.device) -> None:
    """One GEMM of the layer shape on zero operands: it builds or loads the kernel and checks that it takes the
    shape (the weights may not be on ``device`` yet)."""
    x = torch.zeros(1, k // 2, dtype=torch.uint8, device=device)
    w = torch.zeros(n, k // 2, dtype=torch.uint8, device=device)
    tensor_core_gemm(backend, x, torch.zeros(padded_scale_shape(1, k), dtype=torch.uint8, device=device), w,
                     torch.zeros(padded_scale_shape(n, k), dtype=torch.uint8, device=device),
                     torch.ones((), dtype=torch.float32, device=device), dtype)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warm_up(layers: Sequence[NVFP4LayerShape], device: torch.device) -> dict[str, Any]:
    """Where a tensor-core backend runs on ``device``: zero the layers' scale padding, align their storage, and run
    one GEMM per distinct (N, K, dtype), so that a shape the kernel refuses fails now and FlashInfer builds or loads
    its kernel now. Returns {"backend", "shapes", "seconds"} (empty where nothing ran); raises ``GemmSetupError``
    naming what to install if a call fails."""
    backend = gemm_backend(device)
    if backend not in TENSOR_CORE_BACKENDS:
        return {}
    dirty = sum(zero_scale_padding_(layer) for layer in layers)
    if dirty:
        logger.warning("zeroed %d nonzero padding bytes of 128x4 weight scales (the %s GEMM reads them)", dirty,
                       backend)
    moved = sum(realign_(layer) for layer in layers)
    if moved:
        logger.info("copied %d weight tensors to 16-byte aligned storage for the %s GEMM", moved, backend)
    logger.info("%s GEMM warm-up: %s", backend, _FIRST_CALL[backend])
    start = time.perf_counter()
    shapes = sorted({(m.out_features, m.in_features, m.compute_dtype) for m in layers}, key=str)
    for n, k, dtype in shapes:
        try:
            _warm_up_call(backend, n, k, dtype, device)
        except Exception as error:
            first_line = (str(error).strip().splitlines() or [""])[0]
            raise GemmSetupError(
                f"the {backend} NVFP4 GEMM failed its warm-up call for a [{n}, {k}] {dtype} layer on {device} "
                f"({type(error).__name__}: {first_line}). {_install_hint(backend)}.") from error
    seconds = time.perf_counter() - start
    (logger.warning if seconds > SLOW_WARM_UP_S else logger.info)(
        "%s GEMM warmed up for %d layer shapes in %.1f s", backend, len(shapes), seconds)
    return {"backend": backend, "shapes": len(shapes), "seconds": round(seconds, 3)}


def padded_layers(layers: Iterable[NVFP4LayerShape], device: torch.device) -> dict[str, int]:
    """{padding reason: number of layers} for the tensor-core backend that runs on ``device`` (empty elsewhere)."""
    backend = gemm_backend(device)
    capability = dispatch.gemm_device_capability(device)
    counts: dict[str, int] = {}
    if backend not in TENSOR_CORE_BACKENDS or capability is None:
        return counts
    for layer in layers:
        reason = padding_reason(backend, capability, layer.out_features, layer.in_features)
        if reason is not None:
            counts[reason] = counts.get(reason, 0) + 1
    return counts
