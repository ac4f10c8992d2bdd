#!/usr/bin/env bash
# The prepared GPU command, on a machine with a CUDA device and no network:
#   bash ci/gpu.sh
# Python: $CUTBCE_PYTHON, else this repository's .venv where it is built, else the machine's python3
# with torch and triton (as on the lent GPU machines: torch 2.11, triton 3.6), the repository on
# PYTHONPATH; nothing is installed.
# runs, each under a time limit, in about 7 minutes at most on an H100:
#   1. tests/test_triton_cuda.py: backend='triton' on CUDA (parity, determinism, TF32, compile, ...);
#   2. tests/test_triton_compile.py with CUTBCE_GPU_COMPILE=1: the sm_80 / sm_90 compiles with this
#      machine's triton (they need no GPU and run in CI with the main .venv's);
#   3. benchmarks/cuda_loss.py with its defaults: forward + backward of every engine, the dense loss
#      and the three-matmul floor at N 32768, D 128, V 2**17 and 2**20, bfloat16 and float32,
#      after the cost model's estimates for the same shapes (python -m torch_cutbce.triton.aot --model,
#      gpu_model.log: the numbers to hold the measured ones against).
# Results and logs go to ${OUT:-benchmarks/results} (cuda_loss.csv / .jsonl, gpu_*.log, junit XML).
# The benchmark runs even if the tests fail; both exit codes are printed at the end, and the script
# exits nonzero if either failed. Time limits (seconds): CUTBCE_GPU_TESTS_S (150),
# CUTBCE_GPU_COMPILE_S (90), CUTBCE_GPU_TOTAL_S (450: the benchmark starts no new contender after it).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
python=${CUTBCE_PYTHON:-.venv/bin/python}
if [ ! -x "$python" ]; then
  python=python3
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
out=${OUT:-benchmarks/results}
mkdir -p "$out"
export PJRT_DEVICE=${PJRT_DEVICE:-CPU}              # torch_xla, where a test imports it, stays on the CPU
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}  # torch.use_deterministic_algorithms
export PYTHONUNBUFFERED=1
pytest=("$python" -m pytest -q -p no:cacheprovider -rs --durations=10)

echo "== GPU"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || nvidia-smi -L || true
else
  echo "nvidia-smi not found"
fi
"$python" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda,
"triton", triton.__version__, "device:", torch.cuda.get_device_name() if torch.cuda.is_available() else None)'

echo "== tests/test_triton_cuda.py"
tests_rc=0 compile_rc=0
timeout "${CUTBCE_GPU_TESTS_S:-150}" "${pytest[@]}" tests/test_triton_cuda.py \
  --junitxml "$out/gpu_tests.xml" 2>&1 | tee "$out/gpu_tests.log" || tests_rc=$?
if [ "${CUTBCE_GPU_COMPILE:-0}" = 1 ]; then
  echo "== tests/test_triton_compile.py"
  timeout "${CUTBCE_GPU_COMPILE_S:-90}" "${pytest[@]}" tests/test_triton_compile.py \
    --junitxml "$out/gpu_compile_tests.xml" 2>&1 | tee "$out/gpu_compile_tests.log" || compile_rc=$?
fi

echo "== the cost model (estimates, not measurements)"
timeout 120 "$python" -m torch_cutbce.triton.aot --model 2>&1 | tee "$out/gpu_model.log" || true

echo "== benchmarks/cuda_loss.py"
elapsed=$(( $(date +%s) - started ))
# The benchmark may overrun its limit by one contender's first calls (about a minute): it gets the rest.
limit=$(( ${CUTBCE_GPU_TOTAL_S:-450} - elapsed - 60 ))
[ "$limit" -ge 120 ] || limit=120
bench_rc=0
"$python" benchmarks/cuda_loss.py --out "$out/cuda_loss.csv" --time-limit-s "$limit" 2>&1 \
  | tee "$out/gpu_bench.log" || bench_rc=$?

echo "== done in $(( $(date +%s) - started )) s: CUDA tests exit $tests_rc, compile tests exit $compile_rc," \
  "benchmark exit $bench_rc (124: timed out; results in $out)"
[ "$tests_rc" -eq 0 ] && [ "$compile_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
