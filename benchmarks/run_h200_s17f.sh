#!/usr/bin/env bash
# Session 17's sixth device call (one H200, ~7 min): the mx128 wgrad reading its column scales four per load
# (sm90_column_scales) A/B against the committed kernel (ab_wgrad_column_quads.py; needs
# benchmarks/ab_old/sm90_gg_2524c40.py, see its docstring), then every single-GPU test file
# (run_h200_suite_parallel.sh with BENCH=0).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
D=$OUT; R=$OUT/s17f; mkdir -p "$R"
OUT=$R; . benchmarks/h200_steps.sh
step 200 python3 benchmarks/ab_wgrad_column_quads.py --out "$R/ab_wgrad_column_quads.json"
OUT=$R/suite BENCH=0 bash benchmarks/run_h200_suite_parallel.sh
cat "$R/suite/log.txt" >>"$LOG"
grep -E "===|proj|Error|rc=|passed|failed" "$LOG" | tail -c 9000
tar czf "$D/s17f.tgz" -C "$R" .
