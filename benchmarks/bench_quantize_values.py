"""The activation quantize inside inductor's producer kernels vs the opaque quantize kernel after them.

Usage: python benchmarks/bench_quantize_values.py
The two producers of Qwen-Image's compiled block that feed a layer quantizing to FP16 values: FC2's ``gelu(h,
approximate="tanh")`` (K = 12288) and FC1's modulated LayerNorm (K = 3072), at 4096 and 512 rows. Per case, the
GPU microseconds (CUDA-graph replays) of: ``bf16`` the compiled producer alone (what the BF16 model runs);
``opaque`` the compiled producer, then ``kernels.quantize_nvfp4_decoded``; ``fused`` the compiled
``ops.quantize_values`` of the producer inside ``exact_inductor`` (what ``ActivationQuantizePass`` makes of it);
``fused_tuned`` the same with inductor's reduction configs timed (outside ``exact_inductor``: the block maximum's
bytes do not depend on the config, the producer's may). ``exact``: fused == opaque, bytes. Writes
benchmarks/results/quantize_values-<device>.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import copy_bandwidth_gbps, header, time_us, write_result  # noqa: E402

from diffusers_nvfp4_fast import exact_inductor, kernels  # noqa: E402
from diffusers_nvfp4_fast.ops.quantize_values import quantize_values, register_reciprocal_lowering  # noqa: E402


def gelu(h: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    return F.gelu(h, approximate="tanh")


def modulated_norm(h: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(h, h.shape[-1:], eps=1e-6) * (1 + scale) + shift


PRODUCERS = {"gelu": (gelu, 12288), "modulated_norm": (modulated_norm, 3072)}


def case(name: str, rows: int, g: torch.Tensor, copy: float) -> dict:
    producer, width = PRODUCERS[name]
    h = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16) * 3
    scale = torch.randn(width, device="cuda", dtype=torch.bfloat16) * 0.1
    shift = torch.randn(width, device="cuda", dtype=torch.bfloat16) * 0.1
    out: dict = {"producer": name, "rows": rows, "K": width}
    us, results = {}, {}
    variants = {
        "bf16": (lambda a, s, t: producer(a, s, t), True),
        "opaque": (lambda a, s, t: producer(a, s, t), True),
        "fused": (lambda a, s, t: quantize_values(producer(a, s, t), g, True), True),
        "fused_tuned": (lambda a, s, t: quantize_values(producer(a, s, t), g, True), False),
    }
    for variant, (fn, exact) in variants.items():
        torch._dynamo.reset()
        with exact_inductor() if exact else torch._inductor.config.patch(deterministic=False,
                                                                           emulate_precision_casts=True):
            compiled = torch.compile(fn, fullgraph=True)
            if variant == "opaque":
                def run(c=compiled):
                    return kernels.quantize_nvfp4_decoded(c(h, scale, shift), g)
            else:
                def run(c=compiled):
                    return c(h, scale, shift)
            results[variant] = run()
            us[variant] = round(time_us(run), 2)
    out["us"] = us
    out["exact"] = torch.equal(results["fused"].view(torch.int16), results["opaque"].view(torch.int16))
    out["tuned_exact"] = torch.equal(results["fused_tuned"].view(torch.int16), results["opaque"].view(torch.int16))
    nbytes = rows * width * 4  # read the producer's input, write 2-byte values
    out["pct_of_copy_bw"] = {k: round(100 * nbytes / (v * 1e-6) / (copy * 1e9), 1) for k, v in us.items()}
    print(out, flush=True)
    return out


def main() -> None:
    assert register_reciprocal_lowering()
    copy = copy_bandwidth_gbps()
    result = header("quantize_values", copy)
    g = torch.tensor([448.0 * 6.0 / 8.0], device="cuda")
    for name in PRODUCERS:
        for rows in (4096, 512):
            result["cases"].append(case(name, rows, g, copy))
    print("wrote", write_result(result))


if __name__ == "__main__":
    main()
