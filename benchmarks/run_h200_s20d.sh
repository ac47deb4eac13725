#!/usr/bin/env bash
# Session 20's fifth device call (one H200, ~3 min): the router's GPU tests after call 3 found the tensor cores'
# FP32 sums coarser than SGEMM (exact one-hot cases, 1e-5 bounds, per-BK partials), the layer tests, and the
# MoE layer, eager, balanced and skewed, mxfp8_128 / mxfp8 / bf16 in one run.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
R=$OUT/s20d; mkdir -p "$R"
OUT=$R; . benchmarks/h200_steps.sh
printf '%s\n' tests/test_router.py tests/test_layer_kernels.py tests/test_moe.py tests/test_train.py | xargs -P 4 -I{} sh -c \
  'f={}; n=$(basename $f .py); timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider $f >"$0/pytest_$n.txt" 2>&1; \
   echo "$n rc=$? $(grep -E "[0-9]+ (passed|failed)" "$0/pytest_$n.txt" | tail -1)" >>"$0/log.txt"' "$R"
grep -h -A40 "= FAILURES =" "$R"/pytest_*.txt | grep -E "^E |^FAILED|Error" | head -40 >>"$LOG"
step 120 python3 benchmarks/bench_moe_layer.py --iters 5 --recipes mxfp8_128,mxfp8,bf16 --balance balanced,skewed \
    --out "$R/moe_layer_128_router_s20d.json"
grep -v "it/s" "$LOG" | grep -v "^ \|^$" | tail -c 6000
