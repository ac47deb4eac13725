#!/usr/bin/env bash
# One device call: GPU tests, then the layer and GEMM benchmarks, then the main job on the GPU.
# Usage (on the H200): OUT=/some/dir bash benchmarks/run_h200.sh   -- everything lands in $OUT.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0
OUT=${OUT:-out/h200}; mkdir -p "$OUT"; LOG=$OUT/log.txt
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } >>"$LOG" 2>&1
step() { local t=$1; shift; echo "=== $* (limit ${t}s)" >>"$LOG"; local s=$SECONDS
         timeout "$t" "$@" >>"$LOG" 2>&1; echo "=== rc=$? in $((SECONDS - s))s" >>"$LOG"; }
step 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_cuda_paths.py tests/test_quantize_kernels.py tests/test_torch_ops.py
step 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_grouped_gemm_sm90.py  # own process: a crash stays here
step 130 python3 benchmarks/bench_moe_layer.py --iters 5 --out "$OUT/moe_layer.json"
step 120 python3 benchmarks/bench_grouped_gemm.py --quick --out "$OUT/grouped_gemm.json"
step 60 python3 -m mxmoe train --out /tmp/mxmoe_train
cp /tmp/mxmoe_train/metrics.json "$OUT/train_metrics.json" 2>/dev/null; cp /tmp/mxmoe_train/loss.png "$OUT/train_loss.png" 2>/dev/null
tail -c 11000 "$LOG"
