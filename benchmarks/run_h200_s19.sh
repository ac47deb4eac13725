#!/usr/bin/env bash
# Session 19's device call (one H200, ~7 min): the training job's GPU tests, then the gpu-throughput preset with
# 8 micro-batches per optimizer step (131072 tokens) for all three recipes in one process, so bf16, mxfp8 and
# mxfp8_128 are compared in one run (session 18 ran mxfp8 in a separate call). Everything lands in $OUT/s19.tgz.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
D=$OUT; R=$OUT/s19; mkdir -p "$R"
OUT=$R; . benchmarks/h200_steps.sh
step 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_train.py
name=accum8_3recipes_s19
step 400 python3 -m mxmoe train --preset gpu-throughput --device cuda --recipes bf16,mxfp8,mxfp8_128 --out /tmp/$name \
    --grad-accum 8 --steps 40 --warmup 4 --eval-every 40
cp /tmp/$name/metrics.json "$R/train_gpu_throughput_${name}_metrics.json" 2>/dev/null
python3 -c "from mxmoe.train import write_throughput as w; import json, sys; \
print(json.dumps(w(sys.argv[1], sys.argv[2])['rows'], indent=1))" /tmp/$name/metrics.json "$R/train_gpu_throughput_${name}.json" >>"$LOG" 2>&1
grep -E "===|Error|passed|failed|bf16 |mxfp8 |mxfp8_128 |tokens_per_s|vs_bf16|tokens_per_step" "$LOG" | tail -c 9000
tar czf "$D/s19.tgz" -C "$R" .
