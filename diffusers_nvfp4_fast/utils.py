"""Small helpers the examples, the demo and the tests share: one deterministic generation, a PNG's SHA256."""

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
