#!/usr/bin/env bash
# One device call (~8 min on an H200): the gpu (convergence) preset's seed-0 runs of bf16, mxfp8 and
# mxfp8_128 in the background, side by side (their losses do not depend on sharing the GPU; their times are
# not quoted), while every single-GPU test file runs (benchmarks/run_h200_suite_parallel.sh, BENCH=0).
# Usage (repo root, on the GPU machine): OUT=/some/dir SEED=0 bash benchmarks/run_h200_s14a.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-out/h200}; mkdir -p "$OUT"; SEED=${SEED:-0}; TESTS=${TESTS:-1}
for r in bf16 mxfp8 mxfp8_128; do
  OUT=$OUT MODE=gpu RECIPE=$r SEED=$SEED LIMIT=${LIMIT:-520} bash benchmarks/run_h200_train.sh >/dev/null 2>&1 &
done
[ "$TESTS" = 1 ] && OUT=$OUT BENCH=0 bash benchmarks/run_h200_suite_parallel.sh >/dev/null 2>&1
wait
for r in bf16 mxfp8 mxfp8_128; do tail -n 4 "$OUT/train_gpu_${r}_seed${SEED}_log.txt"; done
[ "$TESTS" = 1 ] && grep -v "it/s" "$OUT/log.txt" | grep -v "^E  \|^ \|^$" | tail -c 7000
exit 0
