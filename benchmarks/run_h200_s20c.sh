#!/usr/bin/env bash
# Session 20's third device call (one H200, ~8 min): every single-GPU test file (run_h200_suite_parallel.sh's
# list, now with tests/test_router.py), then the MoE layer (eager, balanced and skewed; then under torch.compile's
# cudagraphs backend, balanced), mxfp8_128 / mxfp8 / bf16 in one run, after the router's FP32 product moved to
# BF16 tensor cores (three-piece split) and the fixes of calls 1-2.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0
D=$OUT; R=$OUT/s20c; mkdir -p "$R"
OUT=$R BENCH=0 bash benchmarks/run_h200_suite_parallel.sh >/dev/null 2>&1
OUT=$R LOG_NAME=log.txt; . benchmarks/h200_steps.sh
step 120 python3 benchmarks/bench_moe_layer.py --iters 5 --recipes mxfp8_128,mxfp8,bf16 --balance balanced,skewed \
    --out "$R/moe_layer_128_router_s20.json"
step 150 python3 benchmarks/bench_moe_layer.py --iters 5 --recipes mxfp8_128,bf16 --balance balanced \
    --compile cudagraphs --out "$R/moe_layer_128_cudagraphs_s20.json"
grep -v "it/s" "$LOG" | grep -v "^E  \|^ \|^$" | tail -c 9000
