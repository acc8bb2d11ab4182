"""Study, last run 2026-12-03: where do two compiles of the same NVFP4 Qwen-Image model differ, at run time or in
what inductor generates? (docs/history.md, "Compile repeatability"; the answer is exact_inductor's, docs/design.md §1)

    cd benchmarks/studies
    python 20261203_compile_determinism.py               # H200: about two minutes
    python 20261203_compile_determinism.py --caches-off  # every compile with inductor's caches off
    python 20261203_compile_determinism.py --per-block   # three compiles: the first block whose bytes differ
    python 20261203_compile_determinism.py --per-block --caches-off  # the same, each compile generating afresh
    python 20261203_compile_determinism.py --sync        # a device synchronize after every block
    python 20261203_compile_determinism.py --fill        # torch's deterministic mode: fresh memory filled (NaN)
    python 20261203_compile_determinism.py --deterministic-only  # the mode without the fill
    python 20261203_compile_determinism.py --vs-deterministic    # what the mode changes in the generated code

A 6-block Qwen-Image transformer at full width (blocks 0, 1, 4, 5 BF16 under the public exclusion rule, 2 and 3
NVFP4, fast paths off), ``compile_repeated_blocks`` inside ``exact_inductor``: three runs of one compile, then a
second compile with inductor's caches on (it may reuse the first's code), then a third with every cache off. Prints
and writes benchmarks/studies/results/compile_determinism-<device>.json.
"""

from __future__ import annotations

import contextlib

import study  # this folder's shared helpers; puts benchmarks/ on the path
import torch

VARIANTS = ("caches_off", "sync", "fill", "deterministic_only")  # the run's flags; its file name joins the set ones


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bytes (BF16 outputs compared as int16: NaN equals NaN)."""
    return bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))


def _caches(off: bool) -> contextlib.AbstractContextManager:
    """Inductor's caches off inside, where ``off``."""
    import torch._inductor.config as inductor_config

    return inductor_config.patch(force_disable_caches=True) if off else contextlib.nullcontext()


def main() -> None:
    import argparse

    import common

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--caches-off", action="store_true", help="every compile with inductor's caches off")
    p.add_argument("--per-block", action="store_true",
                   help="checksums of every block's inputs and outputs, and the generated code, over three compiles")
    p.add_argument("--sync", action="store_true", help="synchronize the device after every block")
    p.add_argument("--fill", action="store_true",
                   help="torch.use_deterministic_algorithms(warn_only) with fill_uninitialized_memory")
    p.add_argument("--deterministic-only", action="store_true",
                   help="torch.use_deterministic_algorithms(warn_only) without filling fresh memory")
    p.add_argument("--vs-deterministic", action="store_true",
                   help="four compiles, caches off: two plain, two in deterministic mode; how their code differs")
    args = p.parse_args()
    if args.fill or args.deterministic_only:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = args.fill  # type: ignore[attr-defined]
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

    if args.per_block:
        return per_block(model, inputs, args.caches_off)
    if args.vs_deterministic:
        return vs_deterministic(model, inputs)
    if args.sync:
        model.transformer_blocks = torch.nn.ModuleList([_Synchronized(b) for b in model.transformer_blocks])
    eager = run()
    result = common.header("compile_determinism", common.copy_bandwidth_gbps())
    with exact_inductor(), _caches(args.caches_off):
        model.compile_repeated_blocks(fullgraph=True)
        first = [run() for _ in range(3)]
        torch._dynamo.reset()
        model.compile_repeated_blocks(fullgraph=True)
        cached = run()
        torch._dynamo.reset()
        with _caches(True):
            model.compile_repeated_blocks(fullgraph=True)
            uncached = run()
    cases = {"runs_of_one_compile_equal": same(first[0], first[1]) and same(first[0], first[2]),
             "second_compile_caches_on_equal_first": same(cached, first[0]),
             "third_compile_caches_off_equal_first": same(uncached, first[0]),
             "third_equal_second": same(uncached, cached),
             "eager_equal_first": same(eager, first[0]),
             # equal bytes prove nothing if they are NaN (--fill fills fresh memory with NaN)
             "all_finite": {name: bool(torch.isfinite(t).all()) for name, t in
                            (("eager", eager), ("first", first[0]), ("second", cached), ("third", uncached))}}
    print(cases)
    flags = {k: getattr(args, k) for k in VARIANTS}
    variant = "-".join(k.replace("_", "-") for k, on in flags.items() if on)
    result["cases"] = [{**flags, **cases}]
    print("wrote", study.write_result(result, "compile_determinism" + (f"-{variant}" if variant else "")))


class _Synchronized(torch.nn.Module):
    """Calls the block, then waits for the device: the next block starts on an idle GPU."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        out = self.block(*args, **kwargs)
        torch.cuda.synchronize()
        return out


class _Recorder(torch.nn.Module):
    """Calls the block (compiled by ``compile_repeated_blocks``, this wrapper is not) and keeps checksums of its
    inputs and outputs."""

    def __init__(self, block: torch.nn.Module, log: list):
        super().__init__()
        self.block, self.log = block, log

    def forward(self, *args, **kwargs):
        diagnose = study.load("compile_diagnose")
        _tensors, digest = diagnose._tensors, diagnose.digest

        ins = [digest(t) for t in _tensors((args, kwargs))]
        out = self.block(*args, **kwargs)
        self.log.append({"ins": ins, "outs": [digest(t) for t in _tensors(out)]})
        return out


def per_block(model: torch.nn.Module, inputs: dict, caches_off: bool) -> None:
    """Three compiles of ``model`` (dynamo reset between): for each pair, the first block whose outputs differ,
    whether its inputs were equal, and how the generated wrappers of the two compiles differ."""
    import common
    diagnose = study.load("compile_diagnose")
    _wrappers_loaded, code_diff = diagnose._wrappers_loaded, diagnose.code_diff

    from diffusers_nvfp4_fast import NVFP4Linear, exact_inductor

    blocks = model.transformer_blocks
    kinds = ["nvfp4" if any(isinstance(m, NVFP4Linear) for m in b.modules()) else "bf16" for b in blocks]
    runs: list[dict] = []
    for _ in range(3):
        log: list = []
        wrappers: list = []
        model.transformer_blocks = torch.nn.ModuleList([_Recorder(b, log) for b in blocks])
        torch._dynamo.reset()
        with exact_inductor(), _caches(caches_off), _wrappers_loaded(wrappers), torch.inference_mode():
            model.compile_repeated_blocks(fullgraph=True)
            model(**inputs)
            calls = len(log)
            model(**inputs)
        runs.append({"first_call": log[:calls], "second_call": log[calls:], "wrappers": [w for w, _ in wrappers]})
        model.transformer_blocks = blocks
    cases = []
    for i, j in ((0, 1), (0, 2), (1, 2)):
        a, b = runs[i]["first_call"], runs[j]["first_call"]
        first = next((k for k in range(len(a)) if a[k]["outs"] != b[k]["outs"]), None)
        case: dict = {"compiles": [i, j], "block_kinds": kinds, "first_differing_block": first,
                      "outputs_equal_per_block": [x["outs"] == y["outs"] for x, y in zip(a, b)]}
        if first is not None:
            case["its_inputs_equal"] = a[first]["ins"] == b[first]["ins"]
            case["its_kind"] = kinds[first]
        case["wrappers"] = [len(runs[i]["wrappers"]), len(runs[j]["wrappers"])]
        case["code"] = [code_diff(x, y, limit=30) for x, y in zip(runs[i]["wrappers"], runs[j]["wrappers"])]
        cases.append(case)
        print({k: v for k, v in case.items() if k != "code"}, flush=True)
        for n, c in enumerate(case["code"]):
            print(f"  wrapper {n}: identical {c['identical']}, lines changed {c['lines_changed']}, kernels differing "
                  f"{c['kernels_differing'][:6]}", *c["diff_head"][:20], sep="\n    ", flush=True)
    repeat = [runs[k]["first_call"] == runs[k]["second_call"] for k in range(3)]
    print("each compile's two calls equal:", repeat)
    result = common.header("compile_determinism", common.copy_bandwidth_gbps())
    result["cases"] = [{"per_block": True, "caches_off": caches_off, "calls_repeat": repeat}, *cases]
    print("wrote", study.write_result(result, "compile_determinism-per-block" + ("-caches-off" if caches_off else "")))


def vs_deterministic(model: torch.nn.Module, inputs: dict) -> None:
    """Four compiles with inductor's caches off, two plain and two under ``use_deterministic_algorithms(True,
    warn_only=True)``: whether each pair gives the same bytes, and how the generated code of the modes differs."""
    import common
    import torch._inductor.config as inductor_config
    diagnose = study.load("compile_diagnose")
    _wrappers_loaded, code_diff = diagnose._wrappers_loaded, diagnose.code_diff

    runs = []
    for deterministic in (False, False, True, True):
        torch.use_deterministic_algorithms(deterministic, warn_only=True)
        wrappers: list = []
        torch._dynamo.reset()
        # exact_inductor's inductor settings without the mode it now sets itself
        with inductor_config.patch(emulate_precision_casts=True, deterministic=True), _caches(True), \
                _wrappers_loaded(wrappers), torch.inference_mode():
            model.compile_repeated_blocks(fullgraph=True)
            out = model(**inputs)[0].clone()
        runs.append((out, [w for w, _ in wrappers]))
    torch.use_deterministic_algorithms(False)
    case: dict = {"vs_deterministic": True, "plain_twice_equal": same(runs[0][0], runs[1][0]),
                  "deterministic_twice_equal": same(runs[2][0], runs[3][0]),
                  "plain_equal_deterministic": same(runs[0][0], runs[2][0]),
                  "all_finite": [bool(torch.isfinite(o).all()) for o, _ in runs],
                  "plain_code_repeats": [code_diff(a, b)["identical"] for a, b in zip(runs[0][1], runs[1][1])],
                  "code_plain_vs_deterministic": [code_diff(a, b, limit=120) for a, b in zip(runs[0][1], runs[2][1])]}
    print({k: v for k, v in case.items() if k != "code_plain_vs_deterministic"})
    for n, c in enumerate(case["code_plain_vs_deterministic"]):
        print(f"wrapper {n}: identical {c['identical']}, lines changed {c['lines_changed']}, kernels differing "
              f"{c['kernels_differing']}, only plain {c['kernels_only_a']}, only deterministic {c['kernels_only_b']}",
              *c["diff_head"], sep="\n    ", flush=True)
    result = common.header("compile_determinism", common.copy_bandwidth_gbps())
    result["cases"] = [case]
    print("wrote", study.write_result(result, "compile_determinism-vs-deterministic"))


if __name__ == "__main__":
    main()
