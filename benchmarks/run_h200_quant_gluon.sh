#!/usr/bin/env bash
# One device call (< 150 s on an H200): the Gluon column-quantization kernel (mxmoe/kernels/quantize_gluon.py,
# MXMOE_QUANT_GLUON=1) -- its GPU tests (bit-exact against the reference), then columnwise / dual / weights
# (both orientations) on the shapes, Triton vs Gluon (5 launch configs) vs device copy, same run.
# -> $OUT/quantize_gluon.json (rows: kernel, shape, config, tbps, copy_tbps, ratio), $OUT/log_quant_gluon.txt
# Usage (repo root, on the GPU machine): OUT=/some/dir bash benchmarks/run_h200_quant_gluon.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-out/h200}; mkdir -p "$OUT"; LOG=$OUT/log_quant_gluon.txt
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } >>"$LOG" 2>&1
step() { local t=$1; shift; echo "=== $* (limit ${t}s)" >>"$LOG"; local s=$SECONDS
         timeout "$t" "$@" >>"$LOG" 2>&1; echo "=== rc=$? in $((SECONDS - s))s" >>"$LOG"; }
# the tests in their own process: a kernel fault there does not take the benchmark down
step 75 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --durations=8 -k gluon tests/test_quantize_kernels.py
CFGS="4,4,4;8,2,4;2,4,1;4,2,8;4,3,4"  # W warps (= 32-row blocks per tile), STAGES, GM (band of m-tiles)
step 70 python3 benchmarks/bench_quantize.py --no-reference --gluon "$CFGS" \
    --kernels columnwise,dual,weight_columnwise,weight_1x32_both --out "$OUT/quantize_gluon.json"
grep -v "it/s" "$LOG" | grep -v "^E  \|^ \|^$" | tail -c 9000
