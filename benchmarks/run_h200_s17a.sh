#!/usr/bin/env bash
# Session 17's first device call (one H200, ~6 min): the mx128 wgrad with BF16 column scales
# (sm90_column_scales): its GPU tests (bitwise equal to the FP32 column scales, against FP64), the scale
# layout tests on the device, then bench_wgrad_column_scales.py balanced and skewed.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
D=$OUT; R=$OUT/s17a; mkdir -p "$R"
OUT=$R; . benchmarks/h200_steps.sh
step 150 python3 benchmarks/bench_wgrad_column_scales.py --out "$R/wgrad_column_scales_balanced.json"
step 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_grouped_gemm_sm90_128.py tests/test_sm90_scales.py
step 120 python3 benchmarks/bench_wgrad_column_scales.py --balance skewed --out "$R/wgrad_column_scales_skewed.json"
grep -E "===|proj|Error|passed|failed" "$LOG" | tail -c 8000
tar czf "$D/s17a.tgz" -C "$R" .
