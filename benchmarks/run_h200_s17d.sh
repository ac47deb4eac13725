#!/usr/bin/env bash
# Session 17's fourth device call (one H200, ~4 min): BF16 column scales read before each stage's wgmma wait
# (16 packed words live across it): bench_mx128_variants.py --set early balanced and skewed, then the mx128 GPU
# tests (every column-scale variant bitwise the FP32 one, against FP64).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
D=$OUT; R=$OUT/s17d; mkdir -p "$R"
OUT=$R; . benchmarks/h200_steps.sh
step 200 python3 benchmarks/bench_mx128_variants.py --set early --out "$R/mx128_variants_early_balanced.json"
step 150 python3 benchmarks/bench_mx128_variants.py --set early --balance skewed --out "$R/mx128_variants_early_skewed.json"
step 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_grouped_gemm_sm90_128.py
grep -E "===|proj|Error|passed|failed" "$LOG" | tail -c 9000
tar czf "$D/s17d.tgz" -C "$R" .
