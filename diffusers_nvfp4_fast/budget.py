"""Fit a pipeline into a GPU memory budget with diffusers' own offloading tools.

Five plans, fastest first; :func:`fit_to_budget` applies the first whose estimated peak fits:

- ``resident``: everything on the GPU (``pipe.to(device)``).
- ``text_encoder_offload``: the text encoder(s) group-offloaded at leaf level with CUDA streams (each layer is copied
  in while the previous one computes); the denoiser and the VAE stay on the GPU. The text encoder runs once per
  prompt, so the copies cost once per image, and the denoising loop runs at full speed.
- ``model_cpu_offload``: ``pipe.enable_model_cpu_offload()``: one whole component on the GPU at a time.
- ``group_offload_block``: the denoiser group-offloaded block by block with streams, the text encoder as in
  ``text_encoder_offload``; the VAE stays.
- ``group_offload_leaf``: ``pipe.enable_group_offload(..., offload_type="leaf_level", use_stream=True)``: every
  component, leaf by leaf.

The estimate of a plan is the largest, over text encoding, denoising and decoding, of the weights that stage keeps on
the GPU (two offload groups where a stream prefetches the next one) plus that stage's activations and workspaces.
Offloading moves weights and never changes a computation, so every plan gives the image of the resident pipeline byte
for byte (tested). A plan also needs host memory for the weights it offloads: a plan whose weights cannot fit the free
host memory is skipped, so that the process is not killed by the out-of-memory killer halfway through setup. Call
:func:`~diffusers_nvfp4_fast.enable_fast_paths` before fitting: diffusers' offload hooks wrap the modules that exist
when they are applied. Estimates per model, and the benchmark that measures them: docs/budget.md.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from .switches import ALLOC_CONF, EXPANDABLE_SEGMENTS, env_value
from .utils import tensor_bytes

logger = logging.getLogger("diffusers_nvfp4_fast")

PLANS = ("resident", "text_encoder_offload", "model_cpu_offload", "group_offload_block", "group_offload_leaf")
DEFAULT_HEADROOM_GIB = 4.0  # denoising or VAE-decoding activations and workspaces at 1024x1024 (docs/budget.md)
TEXT_HEADROOM_GIB = 1.0  # text-encoder activations for 512 tokens, with every layer's hidden states kept
CUDA_CONTEXT_GIB = 0.75  # held outside PyTorch's allocator: 0.61 GiB measured on the H100, 0.73-0.85 on the H200
GIB = 2**30
TIGHT_FRACTION = 0.85  # above this share of the budget: other decode bytes, slower, or out of memory (docs/budget.md)
# Measured host peak over the offloaded weights when they start on the GPU (1.64x FLUX.2-dev, 1.70x Qwen-Image on the
# H200 machine): pageable and pinned copies coexist during setup (docs/budget.md).
HOST_PEAK_FACTOR = 1.75


def _largest_leaf(module: nn.Module) -> int:
    return max((tensor_bytes(m, recurse=False) for m in module.modules()), default=0)


def _block_level_resident(module: nn.Module) -> int:
    """Bytes on the GPU under block-level group offload with streams: two blocks of the largest ModuleList (the one
    computing and the one being copied in) plus everything outside the block lists, which diffusers keeps onloaded
    while the module runs."""
    blocks = [b for child in module.children() if isinstance(child, (nn.ModuleList, nn.Sequential)) for b in child]
    in_blocks = sum(tensor_bytes(b) for b in blocks)
    largest = max((tensor_bytes(b) for b in blocks), default=0)
    return tensor_bytes(module) - in_blocks + 2 * largest


def _components(pipe) -> tuple[nn.Module, list[nn.Module], list[nn.Module]]:
    """(denoiser, text encoders, the other modules) of a diffusers pipeline."""
    modules = {name: m for name, m in pipe.components.items() if isinstance(m, nn.Module)}
    denoiser = modules.pop("transformer", None) or modules.pop("unet", None)
    if denoiser is None:
        raise ValueError(f"{type(pipe).__name__} has no 'transformer' or 'unet' component; found {sorted(modules)}")
    texts = [modules.pop(name) for name in sorted(modules) if name.startswith("text_encoder")]
    return denoiser, texts, list(modules.values())


def _offloaded_modules(pipe, plan: str) -> list[nn.Module]:
    denoiser, texts, others = _components(pipe)
    return {"resident": [], "text_encoder_offload": texts, "group_offload_block": [denoiser, *texts],
            "model_cpu_offload": [denoiser, *texts, *others], "group_offload_leaf": [denoiser, *texts, *others]}[plan]


def offloaded_bytes(pipe, plan: str) -> int:
    """Bytes of the weights ``plan`` keeps in host memory (pinned, where streams are used)."""
    return sum(tensor_bytes(m) for m in _offloaded_modules(pipe, plan))


def host_bytes_needed(pipe, plan: str) -> int:
    """Host bytes ``plan`` adds: the weights it offloads that are not in host memory yet (on the GPU, or meta).

    Weights already on the CPU stay there (diffusers pins them group by group), so they add nothing lasting."""
    tensors = [t for m in _offloaded_modules(pipe, plan) for t in [*m.parameters(), *m.buffers()]]
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values() if t.device.type != "cpu")


def available_host_gib() -> float | None:
    """Free host memory in GiB (``MemAvailable`` of /proc/meminfo), or None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / GIB
    except (OSError, ValueError, IndexError):
        pass
    return None


def plan_estimates(pipe, headroom_gib: float = DEFAULT_HEADROOM_GIB) -> dict[str, float]:
    """Estimated peak GPU memory of each plan in GiB: the largest over the three stages (text encoding, denoising,
    VAE decoding) of the weights on the GPU during that stage plus its workspace (``TEXT_HEADROOM_GIB`` for the
    text stage, ``headroom_gib`` for the other two), plus the CUDA context (``CUDA_CONTEXT_GIB``)."""
    denoiser, texts, others = _components(pipe)
    size = {id(m): tensor_bytes(m) for m in [denoiser, *texts, *others]}
    den, rest, text_all = size[id(denoiser)], sum(size[id(m)] for m in others), sum(size[id(m)] for m in texts)
    text_streamed = sum(2 * _largest_leaf(m) for m in texts)
    text_h, h = TEXT_HEADROOM_GIB * GIB, headroom_gib * GIB
    stages = {  # (text, denoise, decode) bytes on the GPU
        "resident": [den + rest + text_all + x for x in (text_h, h, h)],
        "text_encoder_offload": [den + rest + text_streamed + text_h, den + rest + h, den + rest + h],
        "model_cpu_offload": [max(size[id(m)] for m in texts) + text_h if texts else 0, den + h, rest + h],
        "group_offload_block": [rest + text_streamed + text_h, rest + _block_level_resident(denoiser) + h, rest + h],
        "group_offload_leaf": [text_streamed + text_h, 2 * _largest_leaf(denoiser) + h,
                               2 * max((_largest_leaf(m) for m in others), default=0) + h],
    }
    return {plan: max(b) / GIB + CUDA_CONTEXT_GIB for plan, b in stages.items()}


def choose_plan(pipe, budget_gib: float, headroom_gib: float = DEFAULT_HEADROOM_GIB,
                estimates: dict[str, float] | None = None, host_gib: float | None = None) -> str:
    """The fastest plan whose estimate fits ``budget_gib`` (``estimates``: ``plan_estimates``' result, if already
    computed) and, when ``host_gib`` is given, whose ``host_bytes_needed`` fit ``host_gib`` GiB of free host memory;
    ``ValueError`` naming the estimates and the host needs when none fits. ``resident`` estimated above
    ``TIGHT_FRACTION`` of the budget gives way to ``text_encoder_offload`` where that one is not (``roomier``)."""
    if budget_gib <= 0:
        raise ValueError(f"budget_gib must be positive, got {budget_gib}")
    estimates = estimates or plan_estimates(pipe, headroom_gib)
    host_need = {} if host_gib is None else {plan: host_bytes_needed(pipe, plan) / GIB for plan in PLANS}
    fitting = [plan for plan in PLANS
               if estimates[plan] <= budget_gib and (host_gib is None or host_need[plan] <= host_gib)]
    if fitting:
        return roomier(fitting, estimates, budget_gib)
    host = "" if host_gib is None else (
        f" and {host_gib:.1f} GiB of free host memory (host GiB each plan adds: "
        f"{ {p: round(v, 2) for p, v in host_need.items()} })")
    raise ValueError(f"no offload plan fits a {budget_gib} GiB GPU budget{host} for {type(pipe).__name__}: the "
                     f"smallest, group_offload_leaf, needs about {estimates['group_offload_leaf']:.2f} GiB of GPU "
                     f"memory (estimates with {headroom_gib} GiB of headroom: "
                     f"{ {p: round(v, 2) for p, v in estimates.items()} })")


def tight(gib: float, budget_gib: float) -> bool:
    """Whether ``gib`` (an estimate or a measured peak) is above ``TIGHT_FRACTION`` of ``budget_gib``."""
    return gib > TIGHT_FRACTION * budget_gib


def roomier(fitting: list[str], estimates: dict[str, float], budget_gib: float) -> str:
    """The first of ``fitting``, unless it is ``resident`` near the cap and ``text_encoder_offload`` has room: close to
    the cap a run is slower or decodes other bytes (Qwen-Image under 24 GiB, docs/budget.md), while offloading the
    text encoder costs one copy of it per prompt."""
    if fitting[0] == "resident" and tight(estimates["resident"], budget_gib) and "text_encoder_offload" in fitting \
            and not tight(estimates["text_encoder_offload"], budget_gib):
        return "text_encoder_offload"
    return fitting[0]


def apply_plan(pipe, plan: str, device: str | torch.device = "cuda") -> None:
    """Apply ``plan`` (one of :data:`PLANS`) to ``pipe`` with ``device`` as the compute device.

    CUDA streams are used where the device is a CUDA device; on the CPU the same hooks run without them.
    """
    from diffusers.hooks import apply_group_offloading

    if plan not in PLANS:
        raise ValueError(f"unknown offload plan {plan!r}; choose one of {PLANS}")
    device = torch.device(device)
    cpu, streams = torch.device("cpu"), device.type == "cuda"
    denoiser, texts, others = _components(pipe)
    if plan == "resident":
        pipe.to(device)
    elif plan == "model_cpu_offload":
        pipe.enable_model_cpu_offload(device=device)
    elif plan == "group_offload_leaf":
        pipe.enable_group_offload(device, offload_device=cpu, offload_type="leaf_level", use_stream=streams)
    else:
        for module in others:
            module.to(device)
        for text_encoder in texts:
            apply_group_offloading(text_encoder, device, offload_device=cpu, offload_type="leaf_level",
                                   use_stream=streams)
        if plan == "text_encoder_offload":
            denoiser.to(device)
        else:
            model = cast(Any, denoiser)  # a diffusers ModelMixin: its own enable_group_offload knows its blocks
            model.enable_group_offload(device, offload_device=cpu, offload_type="block_level", num_blocks_per_group=1,
                                       use_stream=streams)


def expandable_segments() -> bool:
    """Whether PyTorch's allocator was told to map segments on demand (its environment variables, read at start)."""
    wanted = EXPANDABLE_SEGMENTS.lower()
    return any(wanted in (env_value(name) or "").replace(" ", "").lower() for name in ALLOC_CONF)


def fit_to_budget(pipe, budget_gib: float, device: str | torch.device | None = None,
                  headroom_gib: float = DEFAULT_HEADROOM_GIB, host_gib: float | None = None) -> str:
    """Choose the fastest plan that fits ``budget_gib`` GiB of GPU memory and the free host memory, apply it, and
    return its name.

    ``device``: the compute device; by default the GPU where there is one, else the CPU (where the plans still run,
    without streams, and save nothing: a warning says so). ``host_gib``: free host memory in GiB; by default what the
    OS reports (no host check where it reports nothing). Logs a warning when setting the plan up may peak above the
    free host memory, and when the plan's estimate is above ``TIGHT_FRACTION`` of the budget (the decode's bytes and
    the speed at risk; naming ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` where it is not set).

    >>> enable_fast_paths(pipe)
    >>> fit_to_budget(pipe, 24)        # e.g. 'text_encoder_offload' for FLUX.2-dev with NVFP4 weights
    """
    estimates = plan_estimates(pipe, headroom_gib)
    host_gib = available_host_gib() if host_gib is None else host_gib
    plan = choose_plan(pipe, budget_gib, headroom_gib, estimates, host_gib)
    need = host_bytes_needed(pipe, plan) / GIB
    logger.info("diffusers-nvfp4-fast: %s fits %s GiB with plan %s (estimated peak %.2f GiB, %.2f GiB to host memory)",
                type(pipe).__name__, budget_gib, plan, estimates[plan], need)
    if host_gib is not None and need * HOST_PEAK_FACTOR > host_gib:
        logger.warning("diffusers-nvfp4-fast: plan %s moves %.1f GiB of weights to host memory; setting it up can peak "
                       "at about %.0f GiB (measured %.2fx, docs/budget.md), and %.1f GiB is free", plan, need,
                       need * HOST_PEAK_FACTOR, HOST_PEAK_FACTOR, host_gib)
    if tight(estimates[plan], budget_gib):
        logger.warning("diffusers-nvfp4-fast: plan %s is estimated at %.2f of %s GiB. This close to the cap PyTorch "
                       "can run the VAE decode's convolutions with another algorithm, one needing less workspace, "
                       "which changes the image's bytes, and the allocator frees and maps memory during the run "
                       "(slower); a larger budget keeps both (docs/budget.md).%s", plan, estimates[plan], budget_gib,
                       "" if expandable_segments() else f" Start Python with {ALLOC_CONF[0]}={EXPANDABLE_SEGMENTS} "
                       "so that fragmentation cannot fail it.")
    if device is None and not torch.cuda.is_available():
        warnings.warn(f"fit_to_budget: no CUDA device here, so the {budget_gib} GiB GPU budget does not apply; plan "
                      f"{plan!r} (chosen from GPU estimates) runs on the CPU, where offloading saves nothing. Pass "
                      "device='cpu' to say that this is meant.", UserWarning, stacklevel=2)
    apply_plan(pipe, plan, device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return plan
