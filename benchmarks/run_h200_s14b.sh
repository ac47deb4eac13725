#!/usr/bin/env bash
# One device call (~6-7 min on an H200): the main job's tiny preset; torchtitan 0.2.2's entry point with
# its own BF16 experts and with the mxmoe converter (benchmarks/run_h200_torchtitan.sh; carry .whl); one
# expert linear fwd+bwd against torchao 0.18's FP8 rowwise (benchmarks/bench_linear_peers.py; carry
# .whl_ao, the torchao wheel, installed with --no-deps beside the machine's torch). Everything lands in
# $OUT/s14b.tgz (one file).
# Usage (repo root, on the GPU machine): OUT=/some/dir bash benchmarks/run_h200_s14b.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0
FINAL=$OUT; OUT=$FINAL/s14b; mkdir -p "$OUT"
. "$(dirname "$0")/h200_steps.sh"
step 50 python3 -m mxmoe train --preset tiny --device cuda --out /tmp/mxmoe_tiny
OUT=$OUT RUN_S=${RUN_S:-105} RECIPES=${TT_RECIPES:-bf16 mxfp8_128} timeout 230 bash benchmarks/run_h200_torchtitan.sh >/dev/null 2>&1
echo "=== torchtitan rc=$?: $(python3 -c "import json; r=json.load(open('$OUT/torchtitan.json'))['runs']; \
print({k: (v.get('rc'), v.get('median_tps')) for k, v in r.items()})" 2>&1)" >>"$LOG"
grep -E "tps|Error|error" "$OUT/torchtitan_log.txt" | tail -12 >>"$LOG"
tar czf "$FINAL/s14b.tgz" -C "$FINAL" s14b  # again at the end: what a cut-off call still brings back
if ls .whl_ao/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/site_ao .whl_ao/*.whl >>"$LOG" 2>&1
fi
PYTHONPATH=.:/tmp/site_ao step 120 python3 benchmarks/bench_linear_peers.py --quick --balances balanced \
    --out "$OUT/linear_peers.json"
tar czf "$FINAL/s14b.tgz" -C "$FINAL" s14b
grep -v "it/s" "$LOG" | grep -v "^E  \|^ \|^$" | tail -c 9000
