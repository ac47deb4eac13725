#!/usr/bin/env bash
# Issue 5, one device call (~200 s): the QDQ expansion route's GPU tests (kernels bit for bit, the
# layer against the old quantize+expand composition and the CPU reference), the CUDA path tests,
# then the MoE layer benchmark (all shapes; mxfp8, mxfp8_2d, bf16, loop; both balances).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0
OUT=${OUT:-out/h200}; mkdir -p "$OUT"; LOG=$OUT/log.txt
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } >>"$LOG" 2>&1
step() { local t=$1; shift; echo "=== $* (limit ${t}s)" >>"$LOG"; local s=$SECONDS
         timeout "$t" "$@" >>"$LOG" 2>&1; echo "=== rc=$? in $((SECONDS - s))s" >>"$LOG"; }
step 110 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=6 tests/test_qdq_kernels.py tests/test_cuda_paths.py
step 85 python3 benchmarks/bench_moe_layer.py --iters 5 --out "$OUT/moe_layer.json"
grep -v "it/s\|s/it" "$LOG" | tail -c 11000
