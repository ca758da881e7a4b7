#!/usr/bin/env bash
# The GPU checks, for a machine with a CUDA GPU and Triton (the device machine; CI has no GPU):
# the `cuda`-marked tests, then the GPU benchmark (offline/gpu_bench.py). Logs and figures go to
# $OUT (the device tool's folder) or runs/. Extra pytest arguments: GPU_TESTS (default: all cuda
# tests); benchmark arguments: GPU_BENCH_ARGS (default: --shape-only, random weights of the
# shipped model's shapes, where its package is not installed).
set -o pipefail
out=${OUT:-runs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 GRADIO_ANALYTICS_ENABLED=False HF_HUB_OFFLINE=1
status=0
python3 -m pytest -q -p no:cacheprovider -m cuda ${GPU_TESTS:-tests/test_gpu.py} 2>&1 | tee "$out/gpu_tests.log" || status=1
python3 -m offline.gpu_bench ${GPU_BENCH_ARGS---shape-only} --out "$out/gpu_bench.json" 2>&1 | tee "$out/gpu_bench.log" || status=1
exit $status
