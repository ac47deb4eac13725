#!/usr/bin/env bash
# One device call (~6-7 min on an H200; written in session 13, not yet run): the grouped GEMM tests after the
# scale-layout kernels and the ablation removal, the MoE layer (mxfp8_128 / mxfp8 / bf16; eager balanced and
# skewed, then under torch.compile's cudagraphs backend), and the mx128 GEMM on the small-product shapes
# timed from CUDA-graph replays.
# Usage (repo root, on the GPU machine): OUT=/some/dir bash benchmarks/run_h200_s13c.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
. "$(dirname "$0")/h200_steps.sh"
PYT="python3 -m pytest -q -m gpu -p no:cacheprovider -x"
step 100 $PYT tests/test_grouped_gemm_sm90_128.py tests/test_grouped_gemm_sm90.py -k "m_grouped_matches_fp64 or k_grouped_matches_fp64"
step 90 python3 benchmarks/bench_moe_layer.py --iters 5 --recipes mxfp8_128,mxfp8,bf16 --balance balanced,skewed \
    --out "$OUT/moe_layer_128.json"
step 120 python3 benchmarks/bench_moe_layer.py --iters 5 --recipes mxfp8_128,mxfp8,bf16 --balance balanced \
    --compile cudagraphs --out "$OUT/moe_layer_128_cudagraphs.json"
step 70 python3 benchmarks/bench_grouped_gemm_128.py --quick --cudagraph --shapes qwen3-30b-a3b,dsv3-ep32 \
    --balances balanced --out "$OUT/grouped_gemm_128_cudagraph.json"
grep -v "it/s" "$LOG" | grep -v "^E  \|^ \|^$" | tail -c 9000
