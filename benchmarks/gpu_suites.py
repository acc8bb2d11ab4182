"""The GPU suites: what runs on the GPU machine, as data, and one small runner.

    OUT=/some/dir python benchmarks/gpu_suites.py graphs steps_graph      # suites, in order
    OUT=/some/dir python benchmarks/gpu_suites.py --step graph_qwen       # single steps, by name
    python benchmarks/gpu_suites.py --list

Each step is (name, command, time limit in seconds); its output goes to ``$OUT/<name>.log``, the last lines are
printed, and ``benchmarks/results`` is packed into ``$OUT/results.tgz`` after every step (the device tool brings back
only a few files per call). ``benchmarks/gpu_run.sh`` prepares the machine (wheels, the package, Triton's cache) and
calls this. Tests are picked by file; the ``gpu`` marker selects the GPU cases. The suites re-run the product's tests
and measurements only; the one-off studies of ``benchmarks/studies/`` say in their docstrings how to run them.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

PY = sys.executable
GPU_TESTS = [PY, "-m", "pytest", "-q", "-rfs", "-p", "no:cacheprovider", "--tb=short", "-n", "0", "-m", "gpu",
             "--durations=5"]
STEP = [PY, "benchmarks/bench_transformer_step.py"]
KERNEL_TESTS = ["tests/test_quantize.py", "tests/test_token_cat_quantize.py", "tests/test_swiglu_quantize.py",
                "tests/test_rotary.py", "tests/test_launch.py", "tests/test_gelu_quantize.py",
                "tests/test_qk_norm_rotary.py", "tests/test_kernel_source.py"]
# the fast-path tests by subject: pipelines, hooks and processors, verification, compile and graphs, per-model sites
FAST_PATH_TESTS = ["tests/test_fast_paths.py", "tests/test_hooks_and_processors.py", "tests/test_verification.py",
                   "tests/test_compiled_fast_paths.py", "tests/test_flux2_sites.py", "tests/test_qwen_sites.py"]
MODEL_TESTS = [*FAST_PATH_TESTS, "tests/test_offload.py", "tests/test_lora.py", "tests/test_hygiene.py",
               "tests/test_diffusers_native.py", "tests/test_cache_hooks.py", "tests/test_budget.py"]

SUITES: dict[str, list[tuple[str, list[str], int]]] = {
    # with a cold Triton cache the kernel files took over 420 s (418 tests), the adaptive-LayerNorm file over 240 s
    "kernels": [("t_kernels", GPU_TESTS + KERNEL_TESTS, 420),
                ("t_adaln", GPU_TESTS + ["tests/test_adaln_quantize.py"], 400),
                ("t_qwen_kernel", GPU_TESTS + ["tests/test_layer_norm_quantize.py"], 200),
                ("t_gemm", GPU_TESTS + ["tests/test_gemm.py"], 330)],
    "sm90": [("t_sm90", GPU_TESTS + ["tests/test_gemm.py", "-k", "sm90"], 200),
             ("t_pdl", GPU_TESTS + ["tests/test_grid_dependency.py"], 120)],
    "rotary": [("t_rotary", GPU_TESTS + ["tests/test_qk_norm_rotary.py"], 120)],
    "gemv": [("t_gemv", GPU_TESTS + ["tests/test_gemv.py", "tests/test_gemm.py", "tests/test_launch.py", "-k",
                                      "gemv or bitwise_repeatable or all_codes or small_gemm_sites or layer_plans"],
              200)],
    "quantize": [("t_quantize", GPU_TESTS + ["tests/test_quantize.py", "tests/test_gelu_quantize.py"], 200),
                 ("t_gelu_values", GPU_TESTS + ["tests/test_gelu_quantize.py", "-k", "every_value or fc2_on_gelu"],
                  120)],
    "models": [("t_models", GPU_TESTS + MODEL_TESTS, 400)],
    "graphs": [("t_graphs", GPU_TESTS + ["tests/test_cuda_graphs.py", "tests/test_launch.py"], 300)],
    "selftest": [("selftest", [PY, "-m", "diffusers_nvfp4_fast", "selftest"], 300),
                 ("t_selftest", GPU_TESTS[:-3] + ["tests/test_selftest.py", "tests/test_blackwell_contract.py"], 200)],
    "plans": [("t_plans", GPU_TESTS + ["tests/test_launch.py"], 150),
              ("t_qwen21", GPU_TESTS + ["tests/test_qwenimage21.py"], 150),
              ("step_qwen21", STEP + ["--model", "qwen-image-2.1", "--steps-timed", "11"], 150)],
    "steps": [("step_flux2", STEP + ["--model", "flux2-dev"], 150),
              ("step_qwen", STEP + ["--model", "qwen-image", "--steps-timed", "11"], 130)],
    "steps_graph": [("graph_qwen", STEP + ["--model", "qwen-image", "--cuda-graphs", "--steps-timed", "11"], 170),
                    ("graph_flux2", STEP + ["--model", "flux2-dev", "--cuda-graphs", "--steps-timed", "9"], 220)],
    "steps_klein": [("graph_klein4", STEP + ["--model", "flux2-klein-4b", "--cuda-graphs", "--steps-timed", "11"], 150),
                    ("graph_klein9", STEP + ["--model", "flux2-klein-9b", "--cuda-graphs", "--steps-timed", "11"], 170),
                    ("step_klein4", STEP + ["--model", "flux2-klein-4b", "--steps-timed", "11"], 120)],
    "compiled": [("t_inductor", GPU_TESTS + FAST_PATH_TESTS + ["tests/test_compile.py"], 240),
                 ("compile_qwen", STEP + ["--model", "qwen-image", "--compile", "blocks", "--steps-timed", "11"], 300),
                 ("compile_flux2", STEP + ["--model", "flux2-dev", "--compile", "blocks"], 300)],
    "compile_exact": [("t_compile", GPU_TESTS + ["tests/test_compile.py"], 400)],
    "compile_profile": [("profile_compiled_qwen", [PY, "benchmarks/profile_step.py", "--model", "qwen-image",
                                                   "--compile", "blocks"], 150),
                        ("profile_compiled_qwen_bf16", [PY, "benchmarks/profile_step.py", "--model", "qwen-image",
                                                        "--compile", "blocks", "--bf16"], 150),
                        ("profile_host_compiled_qwen", [PY, "benchmarks/profile_step.py", "--model", "qwen-image",
                                                        "--host", "--compile", "blocks"], 240)],
    "profiles": [("profile_flux2", [PY, "benchmarks/profile_step.py", "--model", "flux2-dev"], 120),
                 ("profile_qwen", [PY, "benchmarks/profile_step.py", "--model", "qwen-image"], 100),
                 ("profile_host_qwen", [PY, "benchmarks/profile_step.py", "--model", "qwen-image", "--host"], 100)],
    "benches": [("bench_token_cat", [PY, "benchmarks/bench_token_cat.py", "--sweep"], 60),
                ("bench_swiglu", [PY, "benchmarks/bench_swiglu.py", "--sweep"], 90),
                ("bench_rotary", [PY, "benchmarks/bench_rotary.py"], 60),
                ("bench_qwen", [PY, "benchmarks/bench_qwen_resnorm.py"], 90),
                ("bench_adaln", [PY, "benchmarks/bench_adaln.py"], 120),
                ("bench_gelu", [PY, "benchmarks/bench_gelu.py", "--sweep"], 60),
                ("bench_qk", [PY, "benchmarks/bench_qk_norm_rotary.py"], 130)],
    "gemm": [("bench_gemm_tiles", [PY, "benchmarks/bench_gemm_tiles.py"], 330),
             ("bench_gemm", [PY, "benchmarks/bench_gemm.py"], 420)],
    "native": [("bench_native", [PY, "benchmarks/bench_native.py"], 420)],
    "pipeline": [("pipeline_qwen", [PY, "benchmarks/bench_pipeline.py", "--model", "qwen-image"], 480),
                 ("pipeline_klein", [PY, "benchmarks/bench_pipeline.py", "--model", "flux2-klein-4b"], 300),
                 ("pipeline_flux2", [PY, "benchmarks/bench_pipeline.py", "--model", "flux2-dev"], 540)],
    # Qwen-Image with an NVFP4 text encoder: its resident plan near the 24 GiB cap is measured beside the chosen one
    "budget": [(f"budget_{m}_{d}", [PY, "benchmarks/bench_pipeline_budget.py", "--model", m, "--dtype", d]
                + (["--plans", "resident,text_encoder_offload"] if (m, d) == ("qwen-image", "nvfp4-te") else []), 330)
               for m in ("flux2-dev", "qwen-image") for d in ("nvfp4", "nvfp4-te", "bf16")] + [
        # klein at its cap (8 / 12 GiB): the estimate's 4 GiB headroom rules resident out, so it is measured too
        (f"budget_{m}_{d}", [PY, "benchmarks/bench_pipeline_budget.py", "--model", m, "--dtype", d]
         + (["--plans", "resident,text_encoder_offload"] if d == "nvfp4-te" else []), limit)
        for m, limit in (("flux2-klein-4b", 240), ("flux2-klein-9b", 270)) for d in ("nvfp4", "nvfp4-te")],
    "cp": [("t_cp", GPU_TESTS + ["tests/test_context_parallel.py"], 150)] + [
        (f"cp_{m}_{mode}", ["torchrun", "--standalone", "--nproc-per-node", "2", "benchmarks/bench_context_parallel.py",
                            "--model", m, "--mode", mode] + (["--skip-bf16"] if mode == "ring" else []), 150)
        for m in ("flux2-dev", "qwen-image") for mode in ("ulysses", "ring")],
}
TAIL = 12


def run_step(name: str, command: list[str], limit: int, out: Path) -> int:
    print(f"=== {name} (limit {limit} s)", flush=True)
    start = time.time()
    with open(out / f"{name}.log", "w") as log:
        try:
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=limit,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
        except subprocess.TimeoutExpired:
            code = 124
    lines = (out / f"{name}.log").read_text(errors="replace").splitlines()
    print(f"exit {code} after {time.time() - start:.0f} s", *lines[-TAIL:], sep="\n", flush=True)
    with tarfile.open(out / "results.tgz", "w:gz") as tar:
        tar.add("benchmarks/results")
    return code


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("suites", nargs="*", help=f"suites to run, in order: {', '.join(SUITES)}")
    ap.add_argument("--step", nargs="*", action="extend", default=[],
                    help="single steps by name (after the suites); NAME:SECONDS sets another time limit")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args()
    steps = {name: (cmd, limit) for suite in SUITES.values() for name, cmd, limit in suite}
    if args.list:
        for suite, members in SUITES.items():
            print(f"{suite}: " + ", ".join(f"{n} ({limit} s)" for n, _, limit in members))
        return
    picked = [(name, int(limit) if limit else None) for name, _, limit in (s.partition(":") for s in args.step)]
    unknown = [s for s in args.suites if s not in SUITES] + [n for n, _ in picked if n not in steps]
    if unknown:
        sys.exit(f"unknown suite or step: {unknown} (see --list)")
    out = Path(os.environ.get("OUT", "/tmp/gpu_out"))
    out.mkdir(parents=True, exist_ok=True)
    chosen = [(n, c, limit) for s in args.suites for n, c, limit in SUITES[s]]
    chosen += [(n, steps[n][0], limit or steps[n][1]) for n, limit in picked]
    failed = [name for name, command, limit in chosen if run_step(name, command, limit, out) != 0]
    print("failed steps:", failed or "none")


if __name__ == "__main__":
    main()
