"""The Triton GEMM's candidate configs and the configs shipped as data (``gemm_configs.json`` beside this file).

A config (tile sizes, warps, pipeline depth) changes only the speed of ``nvfp4_gemm``'s Triton kernel, never its
bytes (docs/design.md §7), so it is chosen offline, per GPU architecture and shape class, by
``benchmarks/tune_gemm_configs.py``, and looked up at the first launch of each class. Nothing is timed on the user's
machine unless ``DIFFUSERS_NVFP4_GEMM_AUTOTUNE=1`` asks for Triton's autotuner (``nvfp4_gemm``).

Key: architecture (``sm_90``: ``sm_`` + the CUDA capability's major and minor), variant (``packed``: X decoded in
the kernel, M <= 64; ``fp16_x``: X pre-decoded to FP16), M bucket (``m_bucket``), N, K. A shape class without an entry
takes the **default rule**, a function of the variant and the M bucket only: among the candidates ``prune`` keeps
(tiles no taller than ``max(16, bucket)``, else the first shortest), the first in candidate order of the tallest
tile. Candidate order is the sweep's, fastest first (docs/history.md, "Kernel tuning constants").
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import triton

from .launch import next_power_of_2

__all__ = ["CONFIGS_FILE", "arch_name", "config_fields", "default_config", "gemm_configs", "m_bucket", "prune",
           "shipped_config", "table_key", "variant_name"]

CONFIGS_FILE = Path(__file__).with_name("gemm_configs.json")
FIELDS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "W_IN_REGS")


def _cfg(bm: int, bn: int, bk: int, warps: int, stages: int, group: int = 8, w_in_regs: bool = False) -> triton.Config:
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_N": group, "W_IN_REGS": w_in_regs},
                         num_warps=warps, num_stages=stages)


# Small M, X decoded in the kernel. BLOCK_M (tokens) is the MMA's N side (16..64); weight rows fill the 64-row
# side. Bound by decoding the weight (ALU) and streaming it (HBM): long K steps, deep pipelines.
_PACKED_CONFIGS = [
    _cfg(16, 128, 128, 4, 4),
    _cfg(32, 128, 128, 4, 4),
    _cfg(16, 64, 256, 4, 4),
    _cfg(64, 128, 128, 8, 3),
]
# Large M, X pre-decoded to FP16: the fastest configurations of a sweep, register-A first (docs/history.md, "Kernel
# tuning constants").
_FP16_X_CONFIGS = [
    _cfg(256, 128, 64, 8, 4, w_in_regs=True),
    _cfg(256, 128, 64, 8, 5, w_in_regs=True),
    _cfg(256, 128, 128, 8, 2, w_in_regs=True),
    _cfg(128, 128, 64, 8, 4, w_in_regs=True),
    _cfg(128, 128, 64, 8, 4),
    _cfg(128, 128, 64, 4, 4),
    _cfg(256, 128, 64, 8, 4),
]


def gemm_configs(x_packed: bool) -> list[triton.Config]:
    """The candidate configs of the in-kernel-X (True, M <= 64) or FP16-X (False) variant, in sweep order."""
    return list(_PACKED_CONFIGS if x_packed else _FP16_X_CONFIGS)


def variant_name(x_packed: bool) -> str:
    return "packed" if x_packed else "fp16_x"


def m_bucket(m: int) -> int:
    """The shape class's M: next power of two, capped (the best tile stops changing long before 8192 rows)."""
    return min(next_power_of_2(max(m, 1)), 8192)


def arch_name(capability: tuple[int, int]) -> str:
    """``(9, 0)`` -> ``"sm_90"``: the table's architecture key."""
    return f"sm_{capability[0]}{capability[1]}"


def table_key(x_packed: bool, bucket: int, n: int, k: int) -> str:
    """A shape class's key inside one architecture's table: ``variant/M bucket/N/K``."""
    return f"{variant_name(x_packed)}/{bucket}/{n}/{k}"


def prune(configs, named_args, **kwargs):
    """Triton's ``early_config_prune`` hook: drop tiles taller than the M bucket (wasted MMA work); keep the first
    shortest when none fits."""
    bucket = named_args["m_bucket"]
    keep = [c for c in configs if c.kwargs["BLOCK_M"] <= max(16, bucket)]
    return keep or [min(configs, key=lambda c: c.kwargs["BLOCK_M"])]


def default_config(x_packed: bool, bucket: int) -> triton.Config:
    """The default rule (module docstring): deterministic, and never timed."""
    keep = prune(gemm_configs(x_packed), {"m_bucket": bucket})
    tallest = max(c.kwargs["BLOCK_M"] for c in keep)
    return next(c for c in keep if c.kwargs["BLOCK_M"] == tallest)


def config_fields(config: triton.Config) -> dict:
    """A config as the table writes it."""
    kw = config.kwargs
    return {"BLOCK_M": kw["BLOCK_M"], "BLOCK_N": kw["BLOCK_N"], "BLOCK_K": kw["BLOCK_K"],
            "num_warps": config.num_warps, "num_stages": config.num_stages, "W_IN_REGS": bool(kw["W_IN_REGS"])}


def _candidate(entry: dict, x_packed: bool, where: str) -> triton.Config:
    wanted = {name: entry.get(name) for name in FIELDS}
    for config in gemm_configs(x_packed):
        if config_fields(config) == wanted:
            return config
    raise ValueError(f"{where}: {wanted} is not a candidate config of the {variant_name(x_packed)} variant "
                     f"(kernels/gemm_config_table.py, gemm_configs)")


def parse_table(raw: dict, source: str) -> dict[str, dict[str, tuple[triton.Config, str]]]:
    """architecture -> key -> (candidate config, where it came from); a bad entry raises naming file and key."""
    table: dict[str, dict[str, tuple[triton.Config, str]]] = {}
    for arch, part in raw.get("architectures", {}).items():
        entries = table.setdefault(arch, {})
        for key, entry in part.get("configs", {}).items():
            variant, *numbers = key.split("/")
            if variant not in ("packed", "fp16_x") or len(numbers) != 3 or not all(s.isdigit() for s in numbers):
                raise ValueError(f"{source}: architecture {arch}: bad key {key!r} (want variant/M bucket/N/K, "
                                 f"variant packed or fp16_x)")
            config = _candidate(entry, variant == "packed", f"{source}: architecture {arch}, key {key!r}")
            entries[key] = (config, str(entry.get("source", "")))
    return table


@functools.cache
def shipped_table() -> dict[str, dict[str, tuple[triton.Config, str]]]:
    """``gemm_configs.json``, parsed once per process."""
    return parse_table(json.loads(CONFIGS_FILE.read_text()), str(CONFIGS_FILE))


def shipped_config(arch: str, x_packed: bool, bucket: int, n: int, k: int) -> tuple[triton.Config, str]:
    """(the config for this shape class on ``arch``, its source: the table's or ``"default rule"``)."""
    entry = shipped_table().get(arch, {}).get(table_key(x_packed, bucket, n, k))
    return entry if entry is not None else (default_config(x_packed, bucket), "default rule")
