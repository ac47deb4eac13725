#!/usr/bin/env bash
# Session 20's second device call (one H200, ~8 min): the GPU tests of the files the session's changes touch
# (the fused quantizers' autograd functions no longer materialize zero FP8 gradients; the M-grouped scale
# layout kernel with one reduction and three gathers), six pytest processes at a time; then the MoE layer,
# eager, balanced and skewed, mxfp8_128 / mxfp8 / bf16 in one run.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
D=$OUT; R=$OUT/s20b; mkdir -p "$R"
OUT=$R; . benchmarks/h200_steps.sh
FILES="tests/test_sm90_scales.py tests/test_moe.py tests/test_grouped_gemm_sm90_128.py tests/test_grouped_128.py
 tests/test_quantize_128.py tests/test_qdq_kernels.py tests/test_cuda_paths.py tests/test_train.py"
gpu_test_files 300 $FILES
step 170 python3 benchmarks/bench_moe_layer.py --iters 5 --recipes mxfp8_128,mxfp8,bf16 --balance balanced,skewed \
    --out "$R/moe_layer_128_s20.json"
grep -v "it/s" "$LOG" | grep -v "^E  \|^ \|^$" | tail -c 9000
