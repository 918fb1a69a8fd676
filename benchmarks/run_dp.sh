#!/usr/bin/env bash
# The two-GPU data-parallel comparison of RESULTS.md (run 14) in one go, on a machine with two
# GPUs: fsg on one GPU, fsg data parallel and FSDP on two (graph replay, bf16 reductions), and
# the DDP baselines a user would try (model + loss compiled; with the optimizer step compiled;
# with mix-order reductions off; each on one GPU too, for the scaling): the fastest is the
# baseline. Usage: OUT=out bash benchmarks/run_dp.sh   (about 9 minutes; PROFILE=3 adds the overlap
# profile). One JSON line per run in $OUT/results.jsonl, each run's log in $OUT/<name>.log.
# First, fsg's data-parallel and FSDP steps are checked against one device on NCCL (dp.py --check,
# float32, Inductor): a step that fails is timed all the same but marked in $OUT/checks.txt. This
# check found the layer-norm gradient bug of 2026-12-04 (RESULTS.md, two H200s, 2026-12-04).
set -u
OUT=${OUT:-out}
STEPS=${STEPS:-50}
PROFILE=${PROFILE:-0}
mkdir -p "$OUT"
job() {
  local name=$1 n=$2
  shift 2
  timeout 300 torchrun --nproc-per-node "$n" benchmarks/dp.py "$@" --steps "$STEPS" --profile "$PROFILE" \
    > "$OUT/$name.log" 2>&1
  echo "$name rc=$?" >> "$OUT/runs.txt"
  grep '^RESULT' "$OUT/$name.log" | sed "s/^RESULT /{\"run\": \"$name\", \"r\": /; s/\$/}/" >> "$OUT/results.jsonl"
}
for sharding in dp fsdp; do
  timeout 400 torchrun --nproc-per-node 2 benchmarks/dp.py --impl fsg --sharding "$sharding" --check \
    > "$OUT/check-$sharding.log" 2>&1
  echo "check $sharding rc=$? $(grep -h '^CHECK' "$OUT/check-$sharding.log")" >> "$OUT/checks.txt"
done
job fsg-1gpu 1 --impl fsg
job fsg-dp-graph-bf16 2 --impl fsg-graph --reduce bfloat16
job fsg-fsdp-graph-bf16 2 --impl fsg-graph --sharding fsdp --reduce bfloat16
for impl in ddp ddp-opt ddp-opt-nomix; do
  job "$impl-1gpu" 1 --impl "$impl"
  job "$impl" 2 --impl "$impl"
done
job ddp-opt-bf16 2 --impl ddp-opt --reduce bfloat16  # bf16_compress_hook, as fsg's bf16 reductions
