#!/usr/bin/env bash
# One device call (~6 min on an H200): the mxfp8_128 recipe beside bf16 and mxfp8 in the MoE layer, and the
# quantization kernels of its scale groups against a device copy -> $OUT/*.json.
# Usage (repo root, on the GPU machine): OUT=/some/dir bash benchmarks/run_h200_s12_bench.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-out/h200}; mkdir -p "$OUT"; LOG=$OUT/log_bench.txt
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } >>"$LOG" 2>&1
step() { local t=$1; shift; echo "=== $* (limit ${t}s)" >>"$LOG"; local s=$SECONDS
         timeout "$t" "$@" >>"$LOG" 2>&1; echo "=== rc=$? in $((SECONDS - s))s" >>"$LOG"; }
python3 -m mxmoe.backend >>"$LOG" 2>&1
step 260 python3 benchmarks/bench_moe_layer.py --iters 5 --recipes mxfp8_128,mxfp8,bf16 --out "$OUT/moe_layer_128.json"
step 120 python3 benchmarks/bench_quantize.py --groups128 --no-reference --out "$OUT/quantize_128.json"
grep -v "it/s" "$LOG" | tail -c 11000
