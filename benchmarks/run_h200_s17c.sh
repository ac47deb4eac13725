#!/usr/bin/env bash
# Session 17's third device call (one H200, ~2 min): wgrad's problem with fprop's promotion
# (ablate_wgrad_128.py --mode uniform): is wgrad's gap in its promotion or in its tile map and operands?
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
D=$OUT; R=$OUT/s17c; mkdir -p "$R"
OUT=$R; . benchmarks/h200_steps.sh
step 150 python3 benchmarks/ablate_wgrad_128.py --mode uniform --out "$R/wgrad_ablation_uniform.json"
grep -E "===|proj|Error" "$LOG" | tail -c 6000
tar czf "$D/s17c.tgz" -C "$R" .
