"""Where do two compiles of the same NVFP4 Qwen-Image model differ: at run time, or in what inductor generates?

    python benchmarks/compile_determinism.py               # H200: about two minutes
    python benchmarks/compile_determinism.py --caches-off  # every compile with inductor's caches off

A 6-block Qwen-Image transformer at full width (blocks 0, 1, 4, 5 BF16 under the public exclusion rule, 2 and 3
NVFP4, fast paths off), ``compile_repeated_blocks`` inside ``exact_inductor``: three runs of one compile, then a
second compile with inductor's caches on (it may reuse the first's code), then a third with every cache off. Prints
and writes benchmarks/results/compile_determinism-<device>.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    import argparse
    import contextlib

    import common
    import torch._inductor.config as inductor_config

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--caches-off", action="store_true", help="every compile with inductor's caches off")
    args = p.parse_args()
    import diffusers
    from accelerate import init_empty_weights
    from bench_transformer_step import make_inputs, materialize

    from diffusers_nvfp4_fast import exact_inductor

    with init_empty_weights(include_buffers=False):
        model = diffusers.QwenImageTransformer2DModel(num_layers=6).eval()
    materialize(model, "qwen-image", torch.device("cuda"), nvfp4=True)
    model.eval()
    inputs = make_inputs("qwen-image", model, 1024, 1024, 512, "cuda")

    def run() -> torch.Tensor:
        with torch.inference_mode():
            return model(**inputs)[0].clone()

    def same(a, b) -> bool:
        return bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))

    eager = run()
    result = common.header("compile_determinism", common.copy_bandwidth_gbps())
    caches_off = inductor_config.patch(force_disable_caches=True) if args.caches_off else contextlib.nullcontext()
    with exact_inductor(), caches_off:
        model.compile_repeated_blocks(fullgraph=True)
        first = [run() for _ in range(3)]
        torch._dynamo.reset()
        model.compile_repeated_blocks(fullgraph=True)
        cached = run()
        torch._dynamo.reset()
        with inductor_config.patch(force_disable_caches=True):
            model.compile_repeated_blocks(fullgraph=True)
            uncached = run()
    cases = {"runs_of_one_compile_equal": same(first[0], first[1]) and same(first[0], first[2]),
             "second_compile_caches_on_equal_first": same(cached, first[0]),
             "third_compile_caches_off_equal_first": same(uncached, first[0]),
             "third_equal_second": same(uncached, cached),
             "eager_equal_first": same(eager, first[0])}
    print(cases)
    result["cases"] = [{"caches_off_throughout": args.caches_off, **cases}]
    print("wrote", common.write_result(result, "compile_determinism" + ("-caches-off" if args.caches_off else "")))


if __name__ == "__main__":
    main()
