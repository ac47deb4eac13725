#!/usr/bin/env bash
# Session 19's second device call (one H200, ~6 min): the GPU tests of the new recipe mxfp8_128_lowmem
# (mxfp8_128 with the SwiGLU input kept as 1x128 MXFP8 and the weights requantized in backward) and of
# requantize_weights under 128x128 tiles, then the MoE layer (eager, balanced, 16384 tokens) for mxfp8_128,
# mxfp8_128_lowmem and bf16 in one run: time, memory saved for backward, peak memory.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
D=$OUT; R=$OUT/s19b; mkdir -p "$R"
OUT=$R; . benchmarks/h200_steps.sh
step 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_grouped_128.py tests/test_moe.py \
    "tests/test_cuda_paths.py::test_requantize_weights_same_bits_less_held"
step 200 python3 benchmarks/bench_moe_layer.py --iters 5 --recipes mxfp8_128,mxfp8_128_lowmem,bf16 --balance balanced \
    --out "$R/moe_layer_128_lowmem_s19.json"
grep -v "it/s" "$LOG" | grep -v "^E  \|^ \|^$" | tail -c 9000
tar czf "$D/s19b.tgz" -C "$R" .
