#!/usr/bin/env bash
# Quantization kernels on one H200 (issue 3), one device call of at most ~150 s:
#   1. every GPU test of tests/test_quantize_kernels.py (= `pytest -m gpu` on that file, run as four
#      parallel shards because the time goes into compiling kernels), while the benchmark's kernels
#      are compiled in the background;
#   2. old (multi-warp tile kernel, 64x64/w2) against new (one-warp strip kernel, three settings)
#      on the shapes, for the families with a columnwise output -> $OUT/quantize.json.
# Usage (repo root): OUT=out/h200 bash benchmarks/run_h200_quant.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-out/h200}; mkdir -p "$OUT"; LOG=$OUT/log.txt
BUDGET=${BUDGET:-148}
KERNELS=columnwise,dual,weight_columnwise,weight_1x32_both,weight_32x32_both
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } >>"$LOG" 2>&1

T=tests/test_quantize_kernels.py
PYT="python3 -m pytest -q -m gpu -p no:cacheprovider --durations=5 $T"
timeout 95 python3 benchmarks/bench_quantize.py --precompile 4 --precompile-only --kernels $KERNELS \
    >"$OUT/precompile.log" 2>&1 &
pids=()
i=0
for sel in "gpu_cases" "gpu_strip_configs" "gpu_candidate_configs" "gpu_real_shapes or gpu_past_2_31"; do
  timeout 95 $PYT -k "$sel" >"$OUT/pytest_$i.log" 2>&1 &
  pids+=($!); i=$((i + 1))
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
wait
echo "=== pytest shards done at ${SECONDS}s (any failure or timeout: rc=$rc)" >>"$LOG"
for f in "$OUT"/pytest_*.log; do echo "--- $f" >>"$LOG"; tail -n 25 "$f" >>"$LOG"; done

left=$((BUDGET - SECONDS))
if [ "$left" -gt 20 ]; then
  timeout "$left" python3 benchmarks/bench_quantize.py --no-reference --sweep --kernels $KERNELS \
      --out "$OUT/quantize.json" >>"$LOG" 2>&1
  echo "=== bench rc=$? at ${SECONDS}s" >>"$LOG"
else
  echo "=== bench skipped: ${left}s left" >>"$LOG"
fi
tail -c 11000 "$LOG"
