#!/usr/bin/env bash
# One-shot GPU verification of the CUDA path (a few minutes on any recent NVIDIA GPU):
#   1. make pycuda (or CuPy) importable: install the cuda extra's pycuda if neither is;
#   2. run every CUDA test -- nvcc compile, device loading, and the kernels against mie.ops on
#      the real GPU *and* on the CPU emulator (no test may skip for want of a GPU);
#   3. run the GPU benchmark (python -m mie.bench.cuda_kernels).
# Results land in $RESULTS (default bench/cuda-<hostname>), each step's full log included.
#
# Usage: scripts/cuda_check.sh [WHEELHOUSE]
#   WHEELHOUSE: for a machine without network, a folder made on a machine with the same Python
#   by `pip download "pycuda>=2022.1" hypothesis pytest -d wheelhouse` (about 4 MB); pip then
#   installs only from it, building pycuda against the local CUDA toolkit with the numpy and
#   setuptools already installed.
set -uo pipefail
cd "$(dirname "$0")/.."
results=${RESULTS:-bench/cuda-$(hostname)}
mkdir -p "$results"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # mie from this checkout, no install needed
pip_args=()
if [ $# -ge 1 ]; then pip_args=(--no-index --find-links "$1" --no-build-isolation); fi

{
  echo "date: $(date -u +%FT%TZ)  commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv 2>&1
  nvcc --version 2>&1 | tail -n 2
  python --version
} | tee "$results/environment.txt"

for module in numpy pytest hypothesis; do
  python -c "import $module" 2>/dev/null || python -m pip install -q "${pip_args[@]}" "$module"
done
if ! python -c "import pycuda" 2>/dev/null && ! python -c "import cupy" 2>/dev/null; then
  python -m pip install -q "${pip_args[@]}" "pycuda>=2022.1" 2>&1 | tail -n 5
fi
python -c "import mie.cuda as c; d = c.get_device(); print('device:', d.name, d.device_name)" \
  2>&1 | tee -a "$results/environment.txt"

status=0
# -rs lists skip reasons; a skipped GPU test here means the GPU was not usable: fail.
python -m pytest tests/test_cuda_compile.py tests/test_cuda_device.py tests/test_cuda_ops.py \
  tests/test_bench_cuda_kernels.py -q -rs -p no:cacheprovider 2>&1 | tee "$results/tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
if grep -q "no CUDA GPU" "$results/tests.txt"; then
  echo "FAIL: GPU tests skipped" | tee -a "$results/tests.txt"
  status=1
fi

python -m mie.bench.cuda_kernels 2>&1 | tee "$results/bench.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "results in $results (status $status)"
exit $status
