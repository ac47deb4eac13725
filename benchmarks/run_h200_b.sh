#!/usr/bin/env bash
# Second device call of 2026-11-30: CUDA-path tests after fixes, the MoE layer on all shapes,
# and the two Hopper GEMM routes on the shapes the first call did not reach.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-out/h200}; mkdir -p "$OUT"; LOG=$OUT/log_b.txt
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; } >>"$LOG" 2>&1
step() { local t=$1; shift; echo "=== $* (limit ${t}s)" >>"$LOG"; local s=$SECONDS
         timeout "$t" "$@" >>"$LOG" 2>&1; echo "=== rc=$? in $((SECONDS - s))s" >>"$LOG"; }
step 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_cuda_paths.py
step 280 python3 benchmarks/bench_moe_layer.py --iters 5 --shapes qwen3-30b-a3b,dsv3-ep32,llama4-scout,mixtral-8x7b --out "$OUT/moe_layer.json"
step 80 python3 benchmarks/bench_grouped_gemm.py --quick --shapes qwen3-30b-a3b,dsv3-ep32 --balances balanced --out "$OUT/grouped_gemm_b.json"
grep -v "it/s" "$LOG" | tail -c 11000
