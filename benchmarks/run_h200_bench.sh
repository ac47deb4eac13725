#!/usr/bin/env bash
# One device call (~7-8 min on an H200): the MoE layer (with and without the layer kernels, and the fused permutation), the
# quantization kernels and the grouped GEMMs, each against its peers in the same run -> $OUT/*.json.
# Usage (repo root, on the GPU machine): OUT=/some/dir bash benchmarks/run_h200_bench.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
LOG_NAME=log_bench.txt . "$(dirname "$0")/h200_steps.sh"
step 170 python3 benchmarks/bench_moe_layer.py --iters 5 --out "$OUT/moe_layer.json"  # ~110-150 s with mxfp8_lowmem
MXMOE_LAYER_KERNELS=0 step 50 python3 benchmarks/bench_moe_layer.py --iters 5 --recipes mxfp8,bf16 \
    --balance balanced --out "$OUT/moe_layer_no_layer_kernels.json"
MXMOE_FUSED_PERMUTE=0 step 50 python3 benchmarks/bench_moe_layer.py --iters 5 --recipes mxfp8,bf16 \
    --balance balanced --out "$OUT/moe_layer_unfused_permute.json"
step 150 python3 benchmarks/bench_quantize.py --no-reference --qdq --ceiling --out "$OUT/quantize.json"
step 120 python3 benchmarks/bench_grouped_gemm.py --quick --out "$OUT/grouped_gemm.json"
grep -v "it/s" "$LOG" | tail -c 9000
