#!/usr/bin/env bash
# One device call (~7 min on an H200): the sm90 scale-layout kernels (mxmoe/kernels/sm90_scales.py) and the
# grouped GEMMs that read them, then host vs GPU time (probe_host_overhead) and the MoE layer, eager and
# replayed from a CUDA graph, mxfp8_128 beside mxfp8 and bf16.
# Usage (repo root, on the GPU machine): OUT=/some/dir bash benchmarks/run_h200_s13b.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-out/h200}; mkdir -p "$OUT"; LOG=$OUT/log.txt
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } >>"$LOG" 2>&1
step() { local t=$1; shift; echo "=== $* (limit ${t}s)" >>"$LOG"; local s=$SECONDS
         timeout "$t" "$@" >>"$LOG" 2>&1; echo "=== rc=$? in $((SECONDS - s))s" >>"$LOG"; }
PYT="python3 -m pytest -q -m gpu -p no:cacheprovider -x"
step 200 $PYT tests/test_sm90_scales.py tests/test_grouped_gemm_sm90_128.py tests/test_grouped_128.py
step 100 $PYT tests/test_grouped_gemm_sm90.py -k "test_m_grouped_matches_fp64 or nan_scale or odd_n or k_grouped_matches"
step 60 python3 benchmarks/probe_host_overhead.py --out "$OUT/host_overhead.json"
step 150 python3 benchmarks/bench_moe_layer.py --iters 5 --recipes mxfp8_128,mxfp8,bf16 --balance balanced --cuda-graph \
    --out "$OUT/moe_layer_128.json"
grep -v "it/s" "$LOG" | grep -v "^E  \|^ \|^$\|^\s*[0-9]* *[0-9.]* *[0-9.]* *[0-9.]* *[0-9.]* " | tail -c 9000
