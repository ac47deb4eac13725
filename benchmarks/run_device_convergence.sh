#!/usr/bin/env bash
# One device call (one H200, <= 600 s): one recipe and seed of the main job's convergence preset (`mxmoe train
# --preset gpu`, 2000 steps) -> $OUT/train_gpu_<recipe>_seed<N>.json (its metrics), _loss.png and _log.txt.
# Checkpoints every 500 steps go to /tmp/train_gpu_<recipe>_seed<N>; RESUME=1 continues a killed run there (a
# warm machine only: a fresh one has no /tmp of the last call). LIMIT=s caps the run (default 540); FLAGS adds
# flags (FLAGS="--steps 50": a smoke test). Throughput is the train suite: bash benchmarks/run_device.sh train.
# Afterwards (CPU), put the seeds into the train suite's file and RESULTS.md:
#   python -m benchmarks.bench_train --convergence <dir>/train_gpu_*_seed*.json && python -m benchmarks report
# Usage (repo root, on the GPU machine): OUT=/some/dir RECIPE=mxfp8 SEED=1 bash benchmarks/run_device_convergence.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-out/h200}; mkdir -p "$OUT"; FLAGS=${FLAGS:-}
NAME=train_gpu_${RECIPE:?needs RECIPE}_seed${SEED:?needs SEED}; DIR=/tmp/$NAME; LOG=$OUT/${NAME}_log.txt
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -m mxmoe info; git log --oneline -1 2>/dev/null; } >>"$LOG" 2>&1
if [ "${RESUME:-0}" = 1 ]; then CMD="python3 -m mxmoe train --resume $DIR"
else rm -rf "$DIR"; CMD="python3 -m mxmoe train --preset gpu --recipes $RECIPE --seed $SEED --device cuda --out $DIR $FLAGS"; fi
echo "=== $CMD" >>"$LOG"; s=$SECONDS
timeout "${LIMIT:-540}" $CMD 2>&1 | tr '\r' '\n' | grep -v "it/s" >>"$LOG"
echo "=== rc=${PIPESTATUS[0]} in $((SECONDS - s)) s" >>"$LOG"
if [ -f "$DIR/metrics.json" ]; then cp "$DIR/loss.png" "$OUT/${NAME}_loss.png"; cp "$DIR/metrics.json" "$OUT/$NAME.json"; fi
tail -c 5000 "$LOG"
