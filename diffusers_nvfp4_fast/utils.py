"""Small helpers the examples, the commands and the tests share: one deterministic generation, a PNG's SHA256, a
device checked before any work."""

from __future__ import annotations

import hashlib
import io

import torch


def run_pipeline(pipe, call_kwargs: dict, *, size: int = 64, steps: int = 3, seed: int = 0):
    """One deterministic generation; returns the PIL image."""
    gen = torch.Generator("cpu").manual_seed(seed)
    with torch.inference_mode():
        return pipe(**call_kwargs, height=size, width=size, num_inference_steps=steps, generator=gen).images[0]


def tensor_bytes(module: torch.nn.Module, recurse: bool = True) -> int:
    """Bytes of the parameters and buffers of ``module`` (each tensor counted once)."""
    seen, total = set(), 0
    for t in [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def png_sha256(image) -> str:
    """SHA256 of the image encoded as PNG: the byte-identity check of whole pipelines."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return hashlib.sha256(buf.getvalue()).hexdigest()


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``, refused with a ``ValueError`` of one line when this machine cannot use it
    (not a device name, no CUDA GPU visible, no such GPU index), so commands fail before any work."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={str(device)!r}: not a torch device (expected cuda, cuda:N or cpu)") from e
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ValueError(f"device={str(device)!r}: torch sees no CUDA GPU here (torch {torch.__version__}, "
                             f"{build}); use cpu, or check the driver and CUDA_VISIBLE_DEVICES")
        count = torch.cuda.device_count()
        if resolved.index is not None and resolved.index >= count:
            raise ValueError(f"device={str(device)!r}: torch sees {count} CUDA GPU(s) here (cuda:0 .. "
                             f"cuda:{count - 1})")
    elif resolved.type != "cpu":
        backend = getattr(torch, resolved.type, None)
        available = getattr(backend, "is_available", None)
        if available is None or not available():
            raise ValueError(f"device={str(device)!r}: torch has no {resolved.type} device here")
    return resolved
