#!/usr/bin/env bash
# The GPU machine's specifics, then benchmarks/gpu_suites.py with the same arguments (suites, --step NAME ...).
# Run from the repository root on the GPU machine. For a machine without an index, put diffusers, ModelOpt and
# their needs as wheels in .whl/ first (pip download on a connected machine) and bring .whl and .triton_cache along.
# Triton's kernel cache comes back as $OUT/triton_cache.tgz (under 15 MiB); put it at .triton_cache/cache.tgz.
set -o pipefail
export OUT=${OUT:-/tmp/gpu_out} TRITON_CACHE_DIR=/tmp/triton_cache PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$TRITON_CACHE_DIR"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . || exit 1
[ -f .triton_cache/cache.tgz ] && tar xzf .triton_cache/cache.tgz -C "$TRITON_CACHE_DIR"
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)"
python3 benchmarks/gpu_suites.py "$@"
tar czf "$OUT/triton_cache.tgz" -C "$TRITON_CACHE_DIR" . 2>/dev/null
[ "$(stat -c %s "$OUT/triton_cache.tgz")" -lt 15728640 ] || rm -f "$OUT/triton_cache.tgz"
