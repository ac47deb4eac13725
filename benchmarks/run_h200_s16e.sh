#!/usr/bin/env bash
# Session 16's fifth device call (one H200, ~4 min): the mx128 wgrad reading its column scales before each stage's
# wait (as fprop does; offline: 120 B of spills at chain 4, 8 B at chain 2): the K-grouped GPU tests, then
# ablate_wgrad_128.py --mode full (wgrad at the default chain 4 and at chain 2, beside fprop).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
D=$OUT; R=$OUT/s16e; mkdir -p "$R"
OUT=$R; . benchmarks/h200_steps.sh
step 100 python3 benchmarks/ablate_wgrad_128.py --mode full --out "$R/wgrad_early.json"
step 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_grouped_gemm_sm90_128.py
grep -E "===|mode|Error|passed|failed" "$LOG" | tail -c 6000
tar czf "$D/s16e.tgz" -C "$R" .
