#!/usr/bin/env bash
# Superseded by run_h200_train.sh (issue 23): the gpu preset is now 171M parameters x 2000 steps, one
# recipe and seed per call; kept for the issue-7 results' provenance (it ran the old 110M preset).
# One device call: the main job at the GPU preset (issue 7), both recipes, two seeds, one H200.
# Usage: OUT=/some/dir bash benchmarks/run_h200_train_gpu.sh -> train_gpu_seed{0,1}.json/.png, log.
# SEEDS="0" picks seeds; FLAGS="--compile inductor --steps 300" adds flags; TAG names the outputs
# (train_gpu<TAG>_seed<N>.json).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-out/h200}; mkdir -p "$OUT"; TAG=${TAG:-}; LOG=$OUT/train_gpu${TAG}_log.txt
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } >"$LOG" 2>&1
for seed in ${SEEDS:-0 1}; do
  s=$SECONDS
  timeout 280 python3 -m mxmoe train --preset gpu --device cuda --seed "$seed" ${FLAGS:-} --overwrite --out /tmp/train_gpu_$seed 2>&1 \
    | tr '\r' '\n' | grep -v "it/s" >>"$LOG"
  echo "seed $seed: wall $((SECONDS - s)) s" >>"$LOG"
  cp /tmp/train_gpu_$seed/metrics.json "$OUT/train_gpu${TAG}_seed$seed.json"; cp /tmp/train_gpu_$seed/loss.png "$OUT/train_gpu${TAG}_seed$seed.png"
done
tail -c 4000 "$LOG"
