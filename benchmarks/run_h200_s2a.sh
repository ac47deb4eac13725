#!/usr/bin/env bash
# Session 2, first device call: every GPU test on the current tree, a short timing of the
# `--preset gpu` main job (to size the full run), and the MoE layer benchmark with kernel breakdown.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0
OUT=${OUT:-out/h200}; mkdir -p "$OUT"; LOG=$OUT/log.txt
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } >>"$LOG" 2>&1
step() { local t=$1; shift; echo "=== $* (limit ${t}s)" >>"$LOG"; local s=$SECONDS
         timeout "$t" "$@" >>"$LOG" 2>&1; echo "=== rc=$? in $((SECONDS - s))s" >>"$LOG"; }
step 200 python3 -m pytest -q -m gpu -p no:cacheprovider -x --durations=8 tests/test_cuda_paths.py tests/test_quantize_kernels.py tests/test_torch_ops.py tests/test_dequantize_kernel.py tests/test_moe.py tests/test_grouped.py
step 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_grouped_gemm_sm90.py
step 100 python3 -m mxmoe train --preset gpu --device cuda --steps 40 --eval-every 40 --eval-batches 2 --out /tmp/train_probe
cp /tmp/train_probe/metrics.json "$OUT/train_probe_metrics.json" 2>/dev/null
step 170 python3 benchmarks/bench_moe_layer.py --iters 5 --out "$OUT/moe_layer.json"
grep -v "it/s\|s/it" "$LOG" | tail -c 11000
