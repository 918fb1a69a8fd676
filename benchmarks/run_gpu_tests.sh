#!/usr/bin/env bash
# tests/gpu whole on one GPU, in two halves that each fit one 10-minute device call (the whole
# directory does not). Usage: bash benchmarks/run_gpu_tests.sh 1|2|all; logs under ${OUT:-out}/.
# Run from a checkout: the repository root goes on PYTHONPATH (fsg need not be installed).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/fsg_inductor_cache}
# the FP8 and fused-kernel files (about half the time), then everything else in tests/gpu
FIRST=(tests/gpu/test_float8_cuda.py tests/gpu/test_gated_fp8_cuda.py tests/gpu/test_weight_fp8_cuda.py
       tests/gpu/test_linear_gelu_cuda.py tests/gpu/test_kernels_cuda.py)
SECOND=()
for f in tests/gpu/test_*.py; do
  [[ " ${FIRST[*]} " == *" $f "* ]] || SECOND+=("$f")
done
case "${1:-all}" in
  1) files=("${FIRST[@]}") ;;
  2) files=("${SECOND[@]}") ;;
  all) files=(tests/gpu) ;;
  *) echo "usage: $0 1|2|all" >&2; exit 2 ;;
esac
nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit --format=csv > "$OUT/gpu.txt" 2>&1
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu.txt"
set -o pipefail
python -m pytest -q -p no:cacheprovider -rfEs --durations=15 "${files[@]}" 2>&1 | tee "$OUT/gpu_tests_${1:-all}.log"
