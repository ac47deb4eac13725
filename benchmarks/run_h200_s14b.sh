#!/usr/bin/env bash
# One device call (~8-9 min on an H200): the GPU tests of the files that changed after the suite's run
# (the grouped quantizer's row-major scales, the train / MoE input checks), the tiny preset; then alone on
# the GPU: torchtitan's entry point with and without the converter (benchmarks/run_h200_torchtitan.sh,
# carry .whl), the MoE layer under torch.compile's cudagraphs backend, and the gpu-throughput step's
# kernel time per recipe (benchmarks/profile_train_step.py). Everything lands in $OUT/s14b.tgz (one file).
# Usage (repo root, on the GPU machine): OUT=/some/dir bash benchmarks/run_h200_s14b.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0
FINAL=$OUT; OUT=$FINAL/s14b; mkdir -p "$OUT"
. "$(dirname "$0")/h200_steps.sh"
s=$SECONDS
for t in "tests/test_quantize_kernels.py -k grouped" "tests/test_train.py" "tests/test_moe.py"; do
  n=$(basename ${t%% *} .py)
  (timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider $t >"$OUT/pytest_$n.txt" 2>&1
   echo "$n rc=$? $(grep -E "[0-9]+ (passed|failed)" "$OUT/pytest_$n.txt" | tail -1)" >>"$LOG") &
done
wait; echo "=== tests done in $((SECONDS - s))s" >>"$LOG"
step 50 python3 -m mxmoe train --preset tiny --device cuda --out /tmp/mxmoe_tiny
OUT=$OUT RUN_S=${RUN_S:-110} RECIPES=${TT_RECIPES:-bf16 mxfp8_128} timeout 240 bash benchmarks/run_h200_torchtitan.sh >/dev/null 2>&1
echo "=== torchtitan rc=$?: $(python3 -c "import json; r=json.load(open('$OUT/torchtitan.json'))['runs']; \
print({k: (v.get('rc'), v.get('median_tps')) for k, v in r.items()})" 2>&1)" >>"$LOG"
step 150 python3 benchmarks/bench_moe_layer.py --iters 5 --recipes mxfp8_128,mxfp8,bf16 --balance balanced \
    --compile cudagraphs --out "$OUT/moe_layer_128_cudagraphs.json"
step 90 python3 benchmarks/profile_train_step.py --out "$OUT/train_step_profile.json"
tar czf "$FINAL/s14b.tgz" -C "$FINAL" s14b
grep -v "it/s" "$LOG" | grep -v "^E  \|^ \|^$" | tail -c 9000
