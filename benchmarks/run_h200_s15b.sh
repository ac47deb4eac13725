#!/usr/bin/env bash
# Session 15, device call 2 (one H200, <= 600 s): the single-GPU test suite (files in parallel processes,
# run_h200_suite_parallel.sh with BENCH=0), then alone on the GPU the SwiGLU + 1x128 quantization kernel
# fed by TMA against the register-fed one and its neighbours (quantize_128_swiglu_tma.json), and the MoE
# layer, mxfp8_128 against bf16, eager, balanced and skewed (moe_layer_128.json). All in $OUT/s15b.tgz.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
D=$OUT; R=$OUT/s15b; mkdir -p "$R"
OUT=$R BENCH=0 bash benchmarks/run_h200_suite_parallel.sh >/dev/null 2>&1
OUT=$R; . benchmarks/h200_steps.sh  # LOG=$R/log.txt, where the suite wrote its summary too
step 90 python3 benchmarks/bench_quantize.py --groups128 --no-reference \
  --kernels swiglu_128,swiglu_128_regfed,swiglu_128_save_h,dual_128,permute_128 --out "$R/quantize_128_swiglu_tma.json"
step 150 python3 benchmarks/bench_moe_layer.py --iters 5 --recipes mxfp8_128,bf16 --balance balanced,skewed \
  --out "$R/moe_layer_128.json"
grep -v "it/s" "$LOG" | grep -v "^E  \|^ \|^$" | tail -c 7000
tar czf "$D/s15b.tgz" -C "$R" .
