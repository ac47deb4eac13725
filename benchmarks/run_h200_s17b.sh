#!/usr/bin/env bash
# Session 17's second device call (one H200, ~5 min): the two consumer warpgroups' wgmma chains staggered by
# half a chain (Sm90TileConfig.stagger): bench_mx128_variants.py --set stagger balanced and skewed, then the
# mx128 GPU tests (the staggered chains bitwise the plain ones, against FP64).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
D=$OUT; R=$OUT/s17b; mkdir -p "$R"
OUT=$R; . benchmarks/h200_steps.sh
step 200 python3 benchmarks/bench_mx128_variants.py --set stagger --out "$R/mx128_variants_stagger_balanced.json"
step 150 python3 benchmarks/bench_mx128_variants.py --set stagger --balance skewed --out "$R/mx128_variants_stagger_skewed.json"
step 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_grouped_gemm_sm90_128.py
grep -E "===|proj|Error|passed|failed" "$LOG" | tail -c 9000
tar czf "$D/s17b.tgz" -C "$R" .
