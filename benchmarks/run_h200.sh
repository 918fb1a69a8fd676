#!/usr/bin/env bash
# Everything measured on one H200 in one go: the CUDA tests, the kernel benchmark and the GPT
# step benchmark. Logs go to ${OUT:-out}/. Usage: bash benchmarks/run_h200.sh ["124m 355m"]
# (about 25 minutes for both models; the device tool's 10-minute calls ran the pieces apart)
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/fsg_inductor_cache}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
timeout 600 python -m pytest -q tests/gpu tests/kernels tests/test_step.py -p no:cacheprovider > "$OUT/tests.log" 2>&1
echo "tests rc=$?" >> "$OUT/tests.log"
timeout 300 python benchmarks/kernels.py > "$OUT/kernels.md" 2>&1
for model in ${1:-124m}; do
  timeout 1200 python benchmarks/gpt.py --model "$model" --impl "${IMPLS:-eager,compile,jax,fsg,fsg}" \
    > "$OUT/gpt_$model.md" 2>&1
done
