#!/usr/bin/env bash
# The first device call session 15 left for the next one (one H200, ~5 min; run in session 16: results/h200/log_session16_next.txt):
#  1. the unfused SwiGLU quantization (elementwise SwiGLU kernel + quantize_dual_128) against the fused kernels;
#  2. the dynamo reset per recipe on the GPU: five recipes in one process under the default inductor-cudagraphs
#     (session 15 saw the fifth run eager at 10x its step time before the fix);
#  3. the GPU tests of the files this session changed.
# Everything lands in $OUT/next.tgz.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
D=$OUT; R=$OUT/next; mkdir -p "$R"
OUT=$R; . benchmarks/h200_steps.sh
step 90 python3 benchmarks/bench_quantize.py --groups128 --no-reference \
  --kernels swiglu_128,swiglu_128_regfed,swiglu_then_dual_128,dual_128 --out "$R/quantize_128_swiglu_pair.json"
step 150 python3 -m mxmoe train --preset tiny --device cuda --dim 128 --ffn-dim 128 --steps 30 --out /tmp/t5 \
  --recipes mxfp8_2d,mxfp8_lowmem,mxfp8_bf16_wgrad,mxfp8,mxfp8_128
step 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_train.py tests/test_quantize_128.py \
  tests/test_grouped_gemm_sm90_128.py
grep -v "it/s\|Warning\|warn(" "$LOG" | grep -E "===|%|recipe|mxfp8|passed|failed" | tail -c 6000
tar czf "$D/next.tgz" -C "$R" .
