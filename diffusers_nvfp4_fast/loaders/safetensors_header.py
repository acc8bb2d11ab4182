"""The one safetensors header reader: tensor names, dtypes, shapes and byte ranges, without reading tensor data.

Unlike ``safe_open`` it keeps dtypes torch may not know (reported, not crashed on) and the raw ``__metadata__``
strings, and it refuses truncated or corrupt files with an ``NVFP4CheckpointError`` that names the file.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from .errors import NVFP4CheckpointError

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
_MAX_HEADER_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry: safetensors dtype string (``"U8"``, ``"BF16"``...), shape, byte range."""

    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return self.offsets[1] - self.offsets[0]

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The torch dtype, or None for a dtype torch does not have."""
        return SAFETENSORS_DTYPES.get(self.dtype)


def _corrupt(path: Path, what: str) -> NVFP4CheckpointError:
    return NVFP4CheckpointError(f"{path}: truncated or corrupt safetensors file ({what}); download or copy it again")


def _not_safetensors(path: Path, start: bytes) -> NVFP4CheckpointError | None:
    """The error for a file that is not safetensors at all (its header JSON must begin right after the length)."""
    if start[8:9] == b"{":
        return None
    if start.startswith(b"PK\x03\x04"):
        kind = "a zip archive, as torch.save writes (.bin / .pt)"
    elif start[:1] == b"\x80":
        kind = "a Python pickle (.bin / .pt / .ckpt)"
    else:
        kind = "it does not begin with a safetensors header"
    return NVFP4CheckpointError(f"{path}: not a safetensors file ({kind}); these tools read .safetensors checkpoints")


def _read_header_json(path: Path) -> tuple[dict, int]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        start = f.read(9)
        if len(start) < 9:
            raise _corrupt(path, f"{size} bytes, too short for a header")
        wrong_format = _not_safetensors(path, start)
        if wrong_format is not None:
            raise wrong_format
        f.seek(8)
        (n,) = struct.unpack("<Q", start[:8])
        if n > min(size - 8, _MAX_HEADER_BYTES):
            raise _corrupt(path, f"the header claims {n} bytes, the file has {size - 8} after the length field")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _corrupt(path, f"the header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise _corrupt(path, "the header is not a JSON object")
    return header, 8 + n


def _tensor_info(path: Path, key: str, entry) -> TensorInfo:
    try:
        info = TensorInfo(str(entry["dtype"]), tuple(int(d) for d in entry["shape"]),
                          cast("tuple[int, int]", tuple(int(o) for o in entry["data_offsets"])))  # checked below
    except (KeyError, TypeError, ValueError) as e:
        raise _corrupt(path, f"header entry {key!r} is malformed: {entry!r}") from e
    if len(info.offsets) != 2 or not 0 <= info.offsets[0] <= info.offsets[1]:
        raise _corrupt(path, f"header entry {key!r} has data_offsets {list(info.offsets)}")
    return info


class SafetensorsHeader:
    """The parsed header of one ``.safetensors`` file; checks that every tensor's bytes lie inside the file."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        header, self.data_start = _read_header_json(self.path)
        metadata = header.pop("__metadata__", None) or {}
        self.metadata: dict[str, str] = metadata if isinstance(metadata, dict) else {}
        self.tensors: dict[str, TensorInfo] = {k: _tensor_info(self.path, k, v) for k, v in header.items()}
        data_bytes = self.path.stat().st_size - self.data_start
        end = max((t.offsets[1] for t in self.tensors.values()), default=0)
        if end > data_bytes:
            last = max(self.tensors, key=lambda k: self.tensors[k].offsets[1])
            raise _corrupt(self.path, f"tensor data ends at byte {end} (tensor {last}), the file holds {data_bytes}")

    def read_bytes(self, key: str) -> bytes:
        """Raw bytes of one (small) tensor, e.g. a ``comfy_quant`` marker."""
        info = self.tensors[key]
        with open(self.path, "rb") as f:
            f.seek(self.data_start + info.offsets[0])
            return f.read(info.nbytes)

    def open(self):
        """A ``safe_open`` handle (context manager) for reading tensors one at a time."""
        from safetensors import safe_open

        return safe_open(str(self.path), framework="pt")

    def load(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        with self.open() as handle:
            return {k: handle.get_tensor(k) for k in keys}


class CheckpointIndex:
    """Key -> (file, TensorInfo) across one or several (sharded) safetensors files."""

    def __init__(self, files: Sequence[Path]) -> None:
        self.headers = [SafetensorsHeader(f) for f in files]
        self.entries: dict[str, tuple[Path, TensorInfo]] = {}
        for header in self.headers:
            self.entries.update({k: (header.path, info) for k, info in header.tensors.items()})
        self._by_path = {h.path: h for h in self.headers}

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def info(self, key: str) -> TensorInfo | None:
        entry = self.entries.get(key)
        return entry[1] if entry else None

    def file_key(self, key: str) -> str:
        """The name ``key`` is stored under in its file (the same here; a renaming index maps it)."""
        return key

    def load(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        by_file: dict[Path, list[str]] = {}
        for k in keys:
            by_file.setdefault(self.entries[k][0], []).append(k)
        out: dict[str, torch.Tensor] = {}
        for path, ks in by_file.items():
            stored = self._by_path[path].load(self.file_key(k) for k in ks)
            out.update({k: stored[self.file_key(k)] for k in ks})
        return out
