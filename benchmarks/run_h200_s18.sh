#!/usr/bin/env bash
# Session 18's device call (one H200, ~9 min): the GPU tests of the training job (--grad-accum under CUDA-graph
# replays among them), then the gpu-throughput preset (bf16, mxfp8_128) with 8 micro-batches per optimizer step
# (131072 tokens) and, in the same call, with one (16384 tokens, the preset as sessions 15-16 measured it).
# Everything lands in $OUT/s18.tgz.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
D=$OUT; R=$OUT/s18; mkdir -p "$R"
OUT=$R; . benchmarks/h200_steps.sh
step 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_train.py
tp() {  # tp NAME FLAGS...: one throughput run, its metrics and rows under $R
  local name=$1; shift
  step 260 python3 -m mxmoe train --preset gpu-throughput --device cuda --recipes bf16,mxfp8_128 --out /tmp/$name "$@"
  cp /tmp/$name/metrics.json "$R/train_gpu_throughput_${name}_metrics.json" 2>/dev/null
  python3 -c "from mxmoe.train import write_throughput as w; import json, sys; \
print(json.dumps(w(sys.argv[1], sys.argv[2])['rows'], indent=1))" /tmp/$name/metrics.json "$R/train_gpu_throughput_${name}.json" >>"$LOG" 2>&1
}
tp accum8_s18 --grad-accum 8 --steps 40 --warmup 4 --eval-every 40
[ "${ACCUM1:-1}" = 1 ] && tp accum1_s18  # ACCUM1=0: the second call of the session (the first had run it)
grep -E "===|Error|passed|failed|bf16 |mxfp8_128 |tokens_per_s|vs_bf16|tokens_per_step" "$LOG" | tail -c 9000
tar czf "$D/s18.tgz" -C "$R" .
