"""Write a checkpoint directory whole or not at all: safetensors shards written one after another into a temporary
directory beside the target (``workdir.py``), then ``config.json``, then one rename (as ``loaders/save.py`` does for
saves).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from ..loaders.modelopt_export import WEIGHTS_INDEX_NAME, WEIGHTS_NAME
from .workdir import seal, swap_into_place

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: int | str) -> int:
    """``10_000``, ``"500MB"``, ``"10GB"``, ``"2GiB"`` -> bytes (diffusers' ``max_shard_size`` spelling)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
    if match is None or match.group(2).upper() not in _SIZE_UNITS:
        raise ValueError(f"max_shard_size={size!r}: expected bytes or a size like '10GB', '500MB', '2GiB'")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])


def check_target(out_dir: Path, overwrite: bool) -> None:
    """Refuse a target that is a file, or a non-empty directory unless ``overwrite``."""
    if out_dir.is_file():
        raise FileExistsError(f"{out_dir}: is a file; the checkpoint is a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir}: exists and is not empty; pass --overwrite (overwrite=True) to replace it")


class ShardWriter:
    """Collects tensors and writes a safetensors shard whenever ``max_shard_size`` bytes are held; ``finish`` names
    the shards as diffusers does and writes the index (a single shard is ``diffusion_pytorch_model.safetensors``;
    ``weights_name="model.safetensors"`` names them as transformers does)."""

    def __init__(self, directory: Path, max_shard_size: int | str, weights_name: str = WEIGHTS_NAME,
                 index_name: str = WEIGHTS_INDEX_NAME) -> None:
        self.directory = directory
        self.weights_name, self.index_name = weights_name, index_name
        self.max_bytes = parse_size(max_shard_size)
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self._flush()
        self.pending[key] = tensor.detach().to("cpu").contiguous()
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.directory / f".shard-{len(self.shards):05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.shards.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> list[str]:
        """Write the last shard, rename the shards, write the index when sharded; returns the file names."""
        if self.pending or not self.shards:
            self._flush()
        count = len(self.shards)
        names = [self.weights_name] if count == 1 else [
            self.weights_name.replace(".safetensors", f"-{i + 1:05d}-of-{count:05d}.safetensors")
            for i in range(count)]
        weight_map = {}
        for (path, keys), name in zip(self.shards, names):
            os.replace(path, self.directory / name)
            weight_map.update(dict.fromkeys(keys, name))
        if count > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.directory / self.index_name).write_text(json.dumps(index, indent=2, sort_keys=True))
            names.append(self.index_name)
        return names


def publish(work_dir: Path, config: dict[str, Any], out_dir: Path, overwrite: bool) -> None:
    """Write ``config.json`` last, give the directory the modes of the umask, then put ``work_dir`` where ``out_dir``
    is (an old one is removed only after; ``workdir.swap_into_place``)."""
    (work_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=list) + "\n")
    check_target(out_dir, overwrite)
    seal(work_dir)
    swap_into_place(work_dir, out_dir)
