#!/usr/bin/env bash
# One device session: GPU tests and every benchmark, each under its own time limit, logs and JSON under $OUT.
# Usage (repository root, on the GPU machine): OUT=/some/dir bash benchmarks/gpu_session.sh
set -o pipefail
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
P="python3 -m pytest -q -rf -p no:cacheprovider --tb=short"
save() { cp benchmarks/results/*.json "$OUT"/ 2>/dev/null; true; }
step() { local limit=$1 name=$2; shift 2; echo "=== $name (limit ${limit}s)"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "exit $?"; tail -n "${TAIL:-6}" "$OUT/$name.log"; save; }
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)"
step 45 t_token_cat $P tests/gpu/test_token_cat_kernel.py
TAIL=14 step 50 bench_token_cat python3 benchmarks/bench_token_cat.py --sweep
TAIL=12 step 130 t_fast_paths $P tests/gpu/test_fast_paths_gpu.py --durations=8
step 50 t_gemm $P tests/gpu/test_gemm.py -s
TAIL=30 step 80 bench_gemm python3 benchmarks/bench_gemm.py --m 17 4608
TAIL=12 step 100 step_flux2 python3 benchmarks/bench_transformer_step.py --model flux2-dev --height 1024 --width 1024
TAIL=12 step 80 step_qwen python3 benchmarks/bench_transformer_step.py --model qwen-image --height 1024 --width 1024
