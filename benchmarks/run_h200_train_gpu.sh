#!/usr/bin/env bash
# One device call: the main job at the GPU preset (issue 7), both recipes, one H200.
# Usage: OUT=/some/dir bash benchmarks/run_h200_train_gpu.sh -> metrics.json, loss.png, log in $OUT.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-out/h200}; mkdir -p "$OUT"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } >"$OUT/train_gpu_log.txt" 2>&1
s=$SECONDS
timeout 560 python3 -m mxmoe train --preset gpu --device cuda --out /tmp/train_gpu 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" >>"$OUT/train_gpu_log.txt"
echo "total wall $((SECONDS - s)) s" >>"$OUT/train_gpu_log.txt"
cp /tmp/train_gpu/metrics.json "$OUT/train_gpu.json"; cp /tmp/train_gpu/loss.png "$OUT/train_gpu_loss.png"
tail -c 4000 "$OUT/train_gpu_log.txt"
