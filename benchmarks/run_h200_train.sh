#!/usr/bin/env bash
# One device call of the main job at GPU scale (issue 23), one H200, <= 600 s.
#   MODE=throughput (default): the gpu-throughput preset, bf16, mxfp8 and mxfp8_128 one after the other
#     -> $OUT/train_gpu_throughput.json (rows: recipe, tokens_per_s, mfu, ms_per_step, peak_mem_gib, vs_bf16),
#        $OUT/train_gpu_throughput_metrics.json, its loss plot and log.
#   MODE=gpu RECIPE=bf16 SEED=0: one recipe and seed of the gpu (convergence) preset
#     -> $OUT/train_gpu_<recipe>_seed<N>.json / _loss.png and log. Checkpoints every 500 steps go to
#        /tmp/train_gpu_<recipe>_seed<N>; RESUME=1 continues a killed run there (a warm machine only: a
#        fresh one has no /tmp of the last call). Compare the seeds and recipes afterwards (CPU is fine):
#        python benchmarks/compare_train_runs.py benchmarks/results/h200/train_gpu_*_seed*.json
# RECIPES=... (throughput) picks recipes; LIMIT=s caps the run (default 540); FLAGS="--steps 50" adds flags (a smoke test).
# Usage (repo root, on the GPU machine): OUT=/some/dir MODE=gpu RECIPE=mxfp8 SEED=1 bash benchmarks/run_h200_train.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-out/h200}; mkdir -p "$OUT"; MODE=${MODE:-throughput}; FLAGS=${FLAGS:-}
case $MODE in
  throughput) NAME=train_gpu_throughput; DIR=/tmp/$NAME
              ARGS="--preset gpu-throughput --recipes ${RECIPES:-bf16,mxfp8,mxfp8_128}";;
  gpu) NAME=train_gpu_${RECIPE:?MODE=gpu needs RECIPE}_seed${SEED:?MODE=gpu needs SEED}; DIR=/tmp/$NAME
       ARGS="--preset gpu --recipes $RECIPE --seed $SEED";;
  *) echo "MODE must be throughput or gpu, got $MODE" >&2; exit 2;;
esac
LOG=$OUT/${NAME}_log.txt
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -m mxmoe info; git log --oneline -1 2>/dev/null; } >>"$LOG" 2>&1
if [ "${RESUME:-0}" = 1 ]; then CMD="python3 -m mxmoe train --resume $DIR"
else rm -rf "$DIR"; CMD="python3 -m mxmoe train $ARGS --device cuda --out $DIR $FLAGS"; fi
echo "=== $CMD" >>"$LOG"; s=$SECONDS
timeout ${LIMIT:-540} $CMD 2>&1 | tr '\r' '\n' | grep -v "it/s" >>"$LOG"
echo "=== rc=${PIPESTATUS[0]} in $((SECONDS - s)) s" >>"$LOG"
if [ -f "$DIR/metrics.json" ]; then
  cp "$DIR/loss.png" "$OUT/${NAME}_loss.png"
  if [ "$MODE" = throughput ]; then
    cp "$DIR/metrics.json" "$OUT/${NAME}_metrics.json"
    python3 -c "from mxmoe.train import write_throughput as w; import json, sys; \
print(json.dumps(w(sys.argv[1], sys.argv[2])['rows'], indent=1))" "$DIR/metrics.json" "$OUT/$NAME.json" >>"$LOG" 2>&1
  else
    cp "$DIR/metrics.json" "$OUT/$NAME.json"
  fi
fi
tail -c 5000 "$LOG"
