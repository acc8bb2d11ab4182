#!/usr/bin/env bash
# GPU tests and benchmarks in groups that each fit one device call (10 minutes), every step under its own time limit;
# logs and results.tgz (benchmarks/results) go to $OUT.
# Usage (repository root, on the GPU machine): OUT=/some/dir bash benchmarks/gpu_session.sh GROUP...
#   kernels:  quantize, token-cat, SwiGLU, rotary, GEMM and launch tests (gpu-marked)
#   models:   Qwen kernel, fast-path, offload, LoRA and hygiene tests (gpu-marked)
#   native:   bench_native.py (diffusers' own NVFP4 modules vs enable_fast_paths) and the step profiles
#   benches:  token-cat, SwiGLU, Qwen kernel, adaptive LayerNorm, GEMM and launch benchmarks
#   tiles:    the GEMM epilogue, tile-height and quantize-to-FP16 tests, then bench_gemm_tiles.py
#   verify:   the GELU kernel tests, the Qwen-Image fast-path GPU tests, the Qwen steps (CUDA graph, eager),
#             bench_gelu.py
#   verify_gemm: GEMM tests touched by the epilogue bias and tile heights
#   fusions:  the SwiGLU and rotary kernel tests, the FLUX.2 fast-path GPU tests, bench_swiglu.py, bench_rotary.py
#   flux2_steps: the FLUX.2 fast-path GPU tests, then the FLUX.2-dev steps (eager, CUDA graph)
#   adaln:    the adaptive-LayerNorm and decoded norm kernel tests, the full-size block and compile/graph GPU tests,
#             the Qwen-Image steps (CUDA graph, eager)
#   flux2_adaln: the FLUX.2-dev steps (eager, CUDA graph), then the adaptive-LayerNorm kernel tests
#   steps:    full-size FLUX.2-dev and Qwen-Image step benchmarks, eager and as CUDA-graph replays
#   qk:       the QK-norm + rotary and rotary kernel tests, bench_qk_norm_rotary.py (its probe of torch's
#             arithmetic, then the timings), the full-size Qwen-Image block tests, the Qwen-Image steps (graph, eager)
#   compiled: the full-size inductor on == off tests, then the steps with each block compiled as
#             compile_repeated_blocks does (inductor, inside exact_inductor)
#   qwen_modes: the full-size Qwen-Image block tests, where the eager step's host time goes (cProfile), the profile of
#             the compiled step and the compiled steps, then the FLUX.2-dev eager profile
#   host:     the full-size Qwen-Image block tests, the SM90 GEMM and launch tests, compile_repeatability.py, the
#             Qwen-Image steps (eager, CUDA graph) and the host profile of its eager step
#   qwen_compiled: the full-size Qwen-Image block tests (eager, inductor), then its compiled steps
#   flux2_qk: the full-size FLUX.2-dev block tests and the 512-wide norm-sites test (all with flux2_qk_rotary), then
#             the FLUX.2-dev steps (eager, CUDA graph)
#   sites:    the launch, SM90 GEMM and decoded-quantize tests (site-keyed launches), bench_launch_overhead.py, the
#             Qwen-Image steps (eager, CUDA graph), the FLUX.2-dev eager step and its profile
#   flux2_compiled: the FLUX.2 residual-norm and compile/graph GPU tests, FLUX.2-dev compiled steps, its profile
#   budget_flux2, budget_qwen: whole pipelines under 24 and 32 GiB caps, NVFP4 and BF16 (bench_pipeline_budget.py)
#   selftest: `diffusers-nvfp4-fast selftest` (report and --json), then its GPU test and the Blackwell contract tests
#   cp:       two GPUs (nvidia-h200-x2): context-parallel tests, then bench_context_parallel.py for both models, Ulysses
#             and ring
# Triton's kernel cache travels between device calls: a fresh machine otherwise rebuilds every kernel variant (over
# 100 s for one test of the D = 6144 norm kernels). The cache comes back as $OUT/triton_cache.tgz (when under 15 MiB);
# put it at .triton_cache/cache.tgz (git-excluded) and name .triton_cache in the next call's carry.
set -o pipefail
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=/tmp/triton_cache
mkdir -p "$TRITON_CACHE_DIR"
[ -f .triton_cache/cache.tgz ] && tar xzf .triton_cache/cache.tgz -C "$TRITON_CACHE_DIR"
save_cache() {
  tar czf "$OUT/triton_cache.tgz" -C "$TRITON_CACHE_DIR" . 2>/dev/null
  [ "$(stat -c %s "$OUT/triton_cache.tgz")" -lt 15728640 ] || rm -f "$OUT/triton_cache.tgz"
}
P="python3 -m pytest -q -rfs -p no:cacheprovider --tb=short -m gpu"
# One archive, not one file per result: the device tool brings back only a few files per call.
save() { tar czf "$OUT/results.tgz" benchmarks/results 2>/dev/null; true; }
step() { local limit=$1 name=$2; shift 2; echo "=== $name (limit ${limit}s)"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "exit $?"; tail -n "${TAIL:-4}" "$OUT/$name.log"; save; }
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)"
for group in ${@:-kernels models}; do
  case $group in
    kernels)
      step 200 t_quantize $P tests/test_quantize.py tests/test_token_cat_quantize.py tests/test_swiglu_quantize.py tests/test_rotary.py tests/test_launch.py
      step 330 t_gemm $P tests/test_gemm.py --durations=5 ;;
    models)
      step 200 t_qwen_kernel $P tests/test_qwen_resnorm_quantize.py --durations=3
      TAIL=8 step 330 t_models $P tests/test_fast_paths.py tests/test_offload.py tests/test_lora.py tests/test_hygiene.py tests/test_diffusers_native.py tests/test_cache_hooks.py tests/test_budget.py --durations=8 ;;
    native)
      TAIL=8 step 300 bench_native python3 benchmarks/bench_native.py
      TAIL=20 step 120 profile_flux2 python3 benchmarks/profile_step.py --model flux2-dev
      TAIL=20 step 100 profile_qwen python3 benchmarks/profile_step.py --model qwen-image ;;
    benches)
      TAIL=14 step 60 bench_token_cat python3 benchmarks/bench_token_cat.py --sweep
      TAIL=10 step 90 bench_swiglu python3 benchmarks/bench_swiglu.py --sweep
      TAIL=8 step 60 bench_rotary python3 benchmarks/bench_rotary.py
      TAIL=10 step 90 bench_qwen python3 benchmarks/bench_qwen_resnorm.py
      TAIL=24 step 120 bench_adaln python3 benchmarks/bench_adaln.py
      TAIL=3 step 90 bench_launch python3 benchmarks/bench_launch_overhead.py
      TAIL=40 step 420 bench_gemm python3 benchmarks/bench_gemm.py --sweep-configs ;;
    steps)
      TAIL=12 step 120 step_flux2 python3 benchmarks/bench_transformer_step.py --model flux2-dev --height 1024 --width 1024
      TAIL=12 step 120 step_qwen python3 benchmarks/bench_transformer_step.py --model qwen-image --height 1024 --width 1024 --steps-timed 21
      TAIL=12 step 150 graph_flux2 python3 benchmarks/bench_transformer_step.py --model flux2-dev --cuda-graph --steps-timed 15
      TAIL=12 step 100 graph_qwen python3 benchmarks/bench_transformer_step.py --model qwen-image --cuda-graph --steps-timed 7 ;;
    tiles)
      TAIL=8 step 200 t_tiles $P tests/test_gemm.py tests/test_quantize.py -k "bias or tile_heights or decoded or quantized_linear or sm90_kernel_equals" --durations=5
      TAIL=80 step 330 bench_gemm_tiles python3 benchmarks/bench_gemm_tiles.py ;;
    verify)
      TAIL=6 step 150 t_gelu $P tests/test_gelu_quantize.py --durations=3
      TAIL=8 step 240 t_qwen $P tests/test_fast_paths.py tests/test_offload.py tests/test_lora.py -k "qwen" --durations=5
      TAIL=12 step 110 graph_qwen python3 benchmarks/bench_transformer_step.py --model qwen-image --cuda-graph --steps-timed 7
      TAIL=12 step 130 step_qwen python3 benchmarks/bench_transformer_step.py --model qwen-image --height 1024 --width 1024 --steps-timed 21
      TAIL=12 step 60 bench_gelu python3 benchmarks/bench_gelu.py --sweep ;;
    verify_gemm)
      TAIL=6 step 200 t_gemm_touched $P tests/test_gemm.py -k "dtype2 or split_k or every_config or matches_emulation or padding or repeatable" --durations=3 ;;
    fusions)
      TAIL=6 step 150 t_fused_kernels $P tests/test_swiglu_quantize.py tests/test_rotary.py --durations=3
      TAIL=8 step 240 t_flux2 $P tests/test_fast_paths.py tests/test_offload.py tests/test_budget.py -k "flux2 or full_size or leaf" --durations=5
      TAIL=14 step 90 bench_swiglu python3 benchmarks/bench_swiglu.py --sweep
      TAIL=8 step 60 bench_rotary python3 benchmarks/bench_rotary.py ;;
    flux2_steps)
      TAIL=8 step 230 t_flux2 $P tests/test_fast_paths.py tests/test_offload.py tests/test_budget.py -k "flux2 or full_size or leaf" --durations=5
      TAIL=12 step 110 step_flux2 python3 benchmarks/bench_transformer_step.py --model flux2-dev --height 1024 --width 1024
      TAIL=12 step 150 graph_flux2 python3 benchmarks/bench_transformer_step.py --model flux2-dev --cuda-graph --steps-timed 15 ;;
    adaln)
      TAIL=6 step 150 t_adaln $P tests/test_adaln_quantize.py --durations=3
      TAIL=8 step 260 t_blocks $P tests/test_fast_paths.py -k "full_size or norm_sites or compile_fullgraph or tiny_pipeline" --durations=5
      TAIL=12 step 100 graph_qwen python3 benchmarks/bench_transformer_step.py --model qwen-image --cuda-graph --steps-timed 7
      TAIL=12 step 80 step_qwen python3 benchmarks/bench_transformer_step.py --model qwen-image --height 1024 --width 1024 --steps-timed 11 ;;
    flux2_adaln)
      TAIL=12 step 150 step_flux2 python3 benchmarks/bench_transformer_step.py --model flux2-dev --height 1024 --width 1024
      TAIL=12 step 170 graph_flux2 python3 benchmarks/bench_transformer_step.py --model flux2-dev --cuda-graph --steps-timed 15
      TAIL=8 step 180 t_adaln $P tests/test_adaln_quantize.py -x --durations=5 ;;
    qk)
      TAIL=6 step 130 t_qk $P tests/test_qk_norm_rotary.py tests/test_rotary.py tests/test_kernel_source.py --durations=3
      TAIL=30 step 130 bench_qk python3 benchmarks/bench_qk_norm_rotary.py
      TAIL=8 step 180 t_qwen_block $P tests/test_fast_paths.py -k "full_size_qwen" --durations=3
      TAIL=12 step 100 graph_qwen python3 benchmarks/bench_transformer_step.py --model qwen-image --cuda-graph --steps-timed 7
      TAIL=12 step 100 step_qwen python3 benchmarks/bench_transformer_step.py --model qwen-image --steps-timed 11 ;;
    compiled)
      TAIL=8 step 200 t_inductor $P tests/test_fast_paths.py -k "inductor_on_equals_off or norm_sites" --durations=3
      TAIL=12 step 300 compile_flux2 python3 benchmarks/bench_transformer_step.py --model flux2-dev --compile blocks
      TAIL=12 step 280 compile_qwen python3 benchmarks/bench_transformer_step.py --model qwen-image --compile blocks --steps-timed 11 ;;
    qwen_modes)
      TAIL=8 step 150 t_qwen_block $P tests/test_fast_paths.py -k "full_size_qwen" --durations=3
      TAIL=30 step 90 profile_host_qwen python3 benchmarks/profile_step.py --model qwen-image --host
      TAIL=20 TORCH_LOGS=recompiles step 150 profile_compiled_qwen python3 benchmarks/profile_step.py --model qwen-image --compile blocks
      TAIL=12 step 120 compile_qwen python3 benchmarks/bench_transformer_step.py --model qwen-image --compile blocks --steps-timed 11
      TAIL=20 step 110 profile_flux2 python3 benchmarks/profile_step.py --model flux2-dev ;;
    host)
      TAIL=8 step 150 t_qwen_block $P tests/test_fast_paths.py -k "full_size_qwen" -rxXs --durations=3
      TAIL=8 step 150 t_sm90 $P tests/test_gemm.py tests/test_launch.py -k "sm90 or launch" --durations=3
      TAIL=8 step 130 compile_repeat python3 benchmarks/compile_repeatability.py
      TAIL=12 step 100 step_qwen python3 benchmarks/bench_transformer_step.py --model qwen-image --steps-timed 11
      TAIL=12 step 80 graph_qwen python3 benchmarks/bench_transformer_step.py --model qwen-image --cuda-graph --steps-timed 7
      TAIL=30 step 80 profile_host_qwen python3 benchmarks/profile_step.py --model qwen-image --host ;;
    qwen_compiled)
      TAIL=8 step 80 t_qwen_block $P tests/test_fast_paths.py -k "full_size_qwen" -rxXs --durations=3
      TAIL=12 step 90 compile_qwen python3 benchmarks/bench_transformer_step.py --model qwen-image --compile blocks --steps-timed 11 ;;
    flux2_qk)
      TAIL=8 step 200 t_flux2_blocks $P tests/test_fast_paths.py -k "full_size_flux2 or norm_sites" --durations=3
      TAIL=12 step 150 step_flux2 python3 benchmarks/bench_transformer_step.py --model flux2-dev --height 1024 --width 1024
      TAIL=12 step 170 graph_flux2 python3 benchmarks/bench_transformer_step.py --model flux2-dev --cuda-graph --steps-timed 15 ;;
    sites)
      TAIL=8 step 150 t_sites $P tests/test_launch.py tests/test_gemm.py tests/test_quantize.py tests/test_gelu_quantize.py -k "sm90 or launch or site or decoded or bias_epilogue or quantized_linear" --durations=3
      TAIL=10 step 60 launch_overhead python3 benchmarks/bench_launch_overhead.py
      TAIL=12 step 100 step_qwen python3 benchmarks/bench_transformer_step.py --model qwen-image --steps-timed 11
      TAIL=12 step 80 graph_qwen python3 benchmarks/bench_transformer_step.py --model qwen-image --cuda-graph --steps-timed 7
      TAIL=12 step 80 step_flux2 python3 benchmarks/bench_transformer_step.py --model flux2-dev
      TAIL=24 step 100 profile_flux2 python3 benchmarks/profile_step.py --model flux2-dev ;;
    flux2_compiled)
      TAIL=8 step 140 t_resnorm $P tests/test_fast_paths.py -k "flux2_resnorm or compile_fullgraph" --durations=3
      TAIL=12 step 280 compile_flux2 python3 benchmarks/bench_transformer_step.py --model flux2-dev --compile blocks
      TAIL=24 step 110 profile_flux2 python3 benchmarks/profile_step.py --model flux2-dev ;;
    budget_flux2)
      TAIL=6 step 330 budget_flux2_nvfp4 python3 benchmarks/bench_pipeline_budget.py --model flux2-dev --dtype nvfp4
      TAIL=6 step 260 budget_flux2_bf16 python3 benchmarks/bench_pipeline_budget.py --model flux2-dev --dtype bf16 ;;
    budget_qwen)
      TAIL=6 step 280 budget_qwen_nvfp4 python3 benchmarks/bench_pipeline_budget.py --model qwen-image --dtype nvfp4
      TAIL=6 step 300 budget_qwen_bf16 python3 benchmarks/bench_pipeline_budget.py --model qwen-image --dtype bf16 ;;
    selftest)
      TAIL=60 step 400 selftest python3 -m diffusers_nvfp4_fast selftest
      timeout 300 python3 -m diffusers_nvfp4_fast selftest --json > "$OUT/selftest.json" 2>"$OUT/selftest_json.log"; echo "exit $?"
      TAIL=6 step 150 t_selftest python3 -m pytest -q -rfs -p no:cacheprovider --tb=short tests/test_selftest.py tests/test_blackwell_contract.py ;;
    cp)
      export NCCL_NVLS_ENABLE=0
      R="torchrun --standalone --nproc-per-node 2 benchmarks/bench_context_parallel.py"
      TAIL=6 step 150 t_cp $P tests/test_context_parallel.py
      TAIL=14 step 120 cp_flux2_ulysses $R --model flux2-dev --mode ulysses
      TAIL=14 step 100 cp_flux2_ring $R --model flux2-dev --mode ring --skip-bf16
      TAIL=14 step 100 cp_qwen_ulysses $R --model qwen-image --mode ulysses
      TAIL=14 step 90 cp_qwen_ring $R --model qwen-image --mode ring --skip-bf16 ;;
    *) echo "unknown group $group"; exit 2 ;;
  esac
done
save_cache
