#!/usr/bin/env bash
# GPU tests and benchmarks in groups that each fit one device call, every step under its own time limit; logs and
# JSON go to $OUT. Usage (repository root, on the GPU machine): OUT=/some/dir bash benchmarks/gpu_session.sh GROUP...
#   kernels: token-cat and Qwen kernel tests + their benchmarks, launch tests + host cost per launch, fast-path tests
#   qwen:    after a change to the fused Qwen kernel: its tests and benchmark, launch tests, Qwen fast-path tests
#   gemm:    GEMM tests + the GEMM benchmark with a config sweep at M=4608
#   steps:   full-size FLUX.2-dev and Qwen-Image step benchmarks, eager and as CUDA-graph replays
set -o pipefail
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
P="python3 -m pytest -q -rf -p no:cacheprovider --tb=short"
save() { cp benchmarks/results/*.json "$OUT"/ 2>/dev/null; true; }
step() { local limit=$1 name=$2; shift 2; echo "=== $name (limit ${limit}s)"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "exit $?"; tail -n "${TAIL:-6}" "$OUT/$name.log"; save; }
# The fused Qwen kernel's tests and benchmark, and the launch tests (shared by the kernels and qwen groups).
qwen_kernel_steps() {
  TAIL=8 step 200 t_qwen_kernel $P tests/gpu/test_qwen_resnorm_kernel.py --durations=5
  TAIL=10 step 90 bench_qwen python3 benchmarks/bench_qwen_resnorm.py
  step 60 t_launch $P tests/gpu/test_launch.py
}
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)"
for group in ${@:-kernels gemm steps}; do
  case $group in
    kernels)
      step 60 t_token_cat $P tests/gpu/test_token_cat_kernel.py
      TAIL=14 step 60 bench_token_cat python3 benchmarks/bench_token_cat.py --sweep
      qwen_kernel_steps
      TAIL=3 step 90 bench_launch python3 benchmarks/bench_launch_overhead.py
      TAIL=12 step 240 t_fast_paths $P tests/gpu/test_fast_paths_gpu.py --durations=8 ;;
    qwen)
      qwen_kernel_steps
      TAIL=12 step 150 t_fast_paths_qwen $P tests/gpu/test_fast_paths_gpu.py -k qwen --durations=8 ;;
    gemm)
      TAIL=8 step 300 t_gemm $P tests/gpu/test_gemm.py --durations=5
      TAIL=40 step 420 bench_gemm python3 benchmarks/bench_gemm.py --sweep-configs ;;
    steps)
      TAIL=12 step 120 step_flux2 python3 benchmarks/bench_transformer_step.py --model flux2-dev --height 1024 --width 1024
      TAIL=12 step 120 step_qwen python3 benchmarks/bench_transformer_step.py --model qwen-image --height 1024 --width 1024 --steps-timed 21
      TAIL=12 step 150 graph_flux2 python3 benchmarks/bench_transformer_step.py --model flux2-dev --cuda-graph --steps-timed 15
      TAIL=12 step 100 graph_qwen python3 benchmarks/bench_transformer_step.py --model qwen-image --cuda-graph --steps-timed 7 ;;
    *) echo "unknown group $group"; exit 2 ;;
  esac
done
