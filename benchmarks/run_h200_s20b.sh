#!/usr/bin/env bash
# Session 20's second device call (one H200, ~8 min): the GPU tests of the files the session's changes touch
# (the fused quantizers' autograd functions no longer materialize zero FP8 gradients; the M-grouped scale
# layout kernel with one reduction and three gathers), six pytest processes at a time; then the MoE layer,
# eager, balanced and skewed, mxfp8_128 / mxfp8 / bf16 in one run.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
D=$OUT; R=$OUT/s20b; mkdir -p "$R"
OUT=$R; . benchmarks/h200_steps.sh
FILES="tests/test_sm90_scales.py tests/test_moe.py tests/test_grouped_gemm_sm90_128.py tests/test_grouped_128.py
 tests/test_quantize_128.py tests/test_qdq_kernels.py tests/test_cuda_paths.py tests/test_train.py"
s=$SECONDS
echo "=== test files, 6 processes at a time (limit 300s each)" >>"$LOG"
printf '%s\n' $FILES | xargs -P 6 -I{} sh -c 'f={}; n=$(basename $f .py); \
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider $f >"$0/pytest_$n.txt" 2>&1; \
  echo "$n rc=$? $(grep -E "[0-9]+ (passed|failed)" "$0/pytest_$n.txt" | tail -1)" >>"$0/log.txt"' "$R"
echo "=== test files done in $((SECONDS - s))s" >>"$LOG"
grep -h -B2 -A25 "^FAILED\|^ERROR\|= FAILURES =" "$R"/pytest_*.txt | head -c 5000 >>"$LOG"
step 170 python3 benchmarks/bench_moe_layer.py --iters 5 --recipes mxfp8_128,mxfp8,bf16 --balance balanced,skewed \
    --out "$R/moe_layer_128_s20.json"
grep -v "it/s" "$LOG" | grep -v "^E  \|^ \|^$" | tail -c 9000
