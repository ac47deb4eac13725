#!/usr/bin/env bash
# Session 16's second device call (one H200, ~3 min); the first one's results are in results/h200/
# (silu_exhaustive_s16_fastdiv.json, train_gpu_throughput_s16*.json, log_session16_call1.txt):
#  1. SwiGLU's exact BF16 arithmetic on its whole domain, the kernels' timings on N(0, 1) h and their tile sweep;
#  2. the 1x128 quantization kernels' SwiGLU rows on N(0, 1) h (bench_quantize.py now gives SwiGLU that input);
#  3. the training step's kernel profile (bf16, mxfp8_128, inductor) with the MoE layer's launches in order.
# Everything lands in $OUT/s16b.tgz.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
D=$OUT; R=$OUT/s16b; mkdir -p "$R"
OUT=$R; . benchmarks/h200_steps.sh
step 120 python3 benchmarks/check_silu_exhaustive.py --sweep --out "$R/silu_exhaustive.json"
step 150 python3 benchmarks/bench_quantize.py --groups128 --no-reference \
  --kernels swiglu_128,swiglu_128_regfed,swiglu_128_save_h,swiglu_then_dual_128,swiglu_qdq,dual_128 \
  --out "$R/quantize_128_swiglu_act.json"
step 200 python3 benchmarks/profile_train_step.py --recipes bf16,mxfp8_128 --compile inductor --steps 3 \
  --out "$R/train_step_profile_s16.json"
python3 -c "import json, sys; [print(r['ms'], r['name']) for r in json.load(open(sys.argv[1]))['recipes']['mxfp8_128']['layer_sequence']]" \
  "$R/train_step_profile_s16.json" >>"$LOG" 2>&1
grep -v "it/s\|Warning\|warn(" "$LOG" | grep -E "===|forward|backward|%|Error|ms|^0" | tail -c 9000
tar czf "$D/s16b.tgz" -C "$R" .
