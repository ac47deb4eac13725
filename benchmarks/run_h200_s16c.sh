#!/usr/bin/env bash
# Session 16's third device call (one H200, ~2 min): the mx128 wgrad product's promotion against its tile pipeline
# (ablate_wgrad_128.py: full / row-scale only / no scales, each in its own process), with the wgrad tile-config
# sweep in the full run; swiglu_backward at one row per program (layer._BWD_ROWS): exhaustive check, timing, its
# GPU tests; the gpu-throughput preset (bf16, mxfp8_128) with it. Everything lands in $OUT/s16c.tgz.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
D=$OUT; R=$OUT/s16c; mkdir -p "$R"
OUT=$R; . benchmarks/h200_steps.sh
for m in full row none; do step 120 python3 benchmarks/ablate_wgrad_128.py --mode $m --out "$R/wgrad_$m.json"; done
step 100 python3 benchmarks/check_silu_exhaustive.py --out "$R/silu_exhaustive_bwd_rows1.json"
step 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_layer_kernels.py tests/test_swiglu_lowmem.py
step 170 python3 -m mxmoe train --preset gpu-throughput --device cuda --recipes bf16,mxfp8_128 --out /tmp/tp16
cp /tmp/tp16/metrics.json "$R/train_gpu_throughput_s16c_metrics.json" 2>/dev/null
python3 -c "from mxmoe.train import write_throughput as w; import json, sys; \
print(json.dumps(w(sys.argv[1], sys.argv[2])['rows'], indent=1))" /tmp/tp16/metrics.json "$R/train_gpu_throughput_s16c.json" >>"$LOG" 2>&1
grep -E "===|mode|Error|forward|backward|swiglu|passed|failed|bf16 |mxfp8_128 |tokens_per_s|vs_bf16" "$LOG" | tail -c 9000
tar czf "$D/s16c.tgz" -C "$R" .
