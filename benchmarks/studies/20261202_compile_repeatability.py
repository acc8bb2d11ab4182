"""Study, last run 2026-12-02: does inductor give the same bytes when it compiles the same full-size block twice?
Compiled fast paths on can only equal compiled off where compiled off equals itself, so this separates the two
questions (docs/history.md, "Tried: compiled, on == off for both models").

    python benchmarks/studies/20261202_compile_repeatability.py          # H200: about a minute

For one Qwen-Image and one FLUX.2-dev double-stream block (batch 1, 1024x1024 image tokens, 512 text tokens), each
as BF16 and as NVFP4 with fast paths off: compile with ``torch.compile(fullgraph=True)`` inside ``exact_inductor``,
run, reset dynamo, compile and run again, and compare bytes. Writes
benchmarks/studies/results/compile_repeatability-<device>.json.
"""

from __future__ import annotations

import study  # this folder's shared helpers; puts benchmarks/ on the path
import torch
from torch import nn


class _Holder(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.transformer_blocks = nn.ModuleList([block])


def _block(model: str, nvfp4: bool, *, device: str = "cuda", tiny: bool = False) -> tuple[nn.Module, tuple, dict]:
    """(block, positional inputs, keyword inputs) on ``device``, seed 0: full size (batch 1, 1024x1024 image tokens,
    512 text tokens), or with ``tiny`` two heads and 64 + 16 tokens (compile checks on a CPU)."""
    from diffusers_nvfp4_fast.ops.qk_norm_rotary import flux2_tables, probe_inputs
    from diffusers_nvfp4_fast.testing import export

    torch.manual_seed(0)
    kw = dict(device=device, dtype=torch.bfloat16)
    img_tokens, txt_tokens = (64, 16) if tiny else (4096, 512)
    if model == "qwen-image":
        from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock

        dim, heads = (256, 2) if tiny else (3072, 24)
        block = QwenImageTransformerBlock(dim=dim, num_attention_heads=heads, attention_head_dim=128).to(**kw)
        img, txt = torch.randn(1, img_tokens, dim, **kw), torch.randn(1, txt_tokens, dim, **kw)
        temb = torch.randn(1, dim, **kw)
        rotary = (probe_inputs(1, img_tokens, 1, device, 1)[2], probe_inputs(1, txt_tokens, 1, device, 2)[2])
        args, kwargs = (img, txt, None, temb, rotary), {}
    else:
        from diffusers.models.transformers.transformer_flux2 import Flux2TransformerBlock

        dim, heads = (256, 2) if tiny else (6144, 48)
        block = Flux2TransformerBlock(dim=dim, num_attention_heads=heads, attention_head_dim=128, mlp_ratio=3.0)
        block = block.to(**kw)
        img, txt = torch.randn(1, img_tokens, dim, **kw), torch.randn(1, txt_tokens, dim, **kw)
        temb = torch.randn(1, 6 * dim, **kw) * 0.1
        cos, sin = flux2_tables(probe_inputs(1, img_tokens + txt_tokens, 1, device, 3)[2])
        args, kwargs = (img, txt, temb, temb), {"image_rotary_emb": (cos, sin)}
    if nvfp4:
        export.quantize_model_inplace(_Holder(block), (), 16.0 if model == "qwen-image" else 12.0)
    return block, args, kwargs


def compiled_twice(block: nn.Module, args: tuple, kwargs: dict) -> bool:
    from diffusers_nvfp4_fast import exact_inductor

    outs = []
    with exact_inductor(), torch.inference_mode():
        for _ in range(2):
            torch._dynamo.reset()
            out = torch.compile(block, fullgraph=True)(*args, **kwargs)
            outs.append(torch.cat([t.flatten() for t in out]).view(torch.int16).clone())
    return torch.equal(*outs)


def main() -> None:
    import common

    result = common.header("compile_repeatability", common.copy_bandwidth_gbps())
    for model in ("qwen-image", "flux2-dev"):
        for nvfp4 in (False, True):
            block, args, kwargs = _block(model, nvfp4)
            same = compiled_twice(block, args, kwargs)
            case = {"model": model, "weights": "nvfp4, fast paths off" if nvfp4 else "bf16", "same_bytes": same}
            print(case, flush=True)
            result["cases"].append(case)
            del block, args, kwargs
            torch.cuda.empty_cache()
    print("wrote", study.write_result(result, "compile_repeatability"))


if __name__ == "__main__":
    main()
