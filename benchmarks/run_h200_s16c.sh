#!/usr/bin/env bash
# Session 16's third device call (one H200, ~2 min): the mx128 wgrad product's promotion against its tile pipeline
# (ablate_wgrad_128.py: full / row-scale only / no scales, each in its own process), with the wgrad tile-config
# sweep in the full run. Everything lands in $OUT/s16c.tgz.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
D=$OUT; R=$OUT/s16c; mkdir -p "$R"
OUT=$R; . benchmarks/h200_steps.sh
for m in full row none; do step 120 python3 benchmarks/ablate_wgrad_128.py --mode $m --out "$R/wgrad_$m.json"; done
grep -E "===|mode|Error" "$LOG" | tail -c 8000
tar czf "$D/s16c.tgz" -C "$R" .
