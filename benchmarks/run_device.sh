#!/usr/bin/env bash
# One device call (<= 600 s): benchmark suites one after the other, each writing $OUT/<suite>.json as it goes
# (`python -m benchmarks SUITE --out-dir $OUT`), their output in $OUT/log.txt (headed with date, GPU, driver,
# torch / triton versions and `mxmoe info`).
# Refuses up front, printing how to split the list, when the suites' estimated seconds (the SUITES table in
# benchmarks/__main__.py: full and --quick) exceed BUDGET (default 540 s); each suite runs under the time left.
# Usage (repo root, on the GPU machine): OUT=/some/dir bash benchmarks/run_device.sh SUITE... [--quick]
# Afterwards, on this side: cp <files>/*.json benchmarks/results/h200/ && python -m benchmarks report
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0
QUICK=""; SUITES=()
for a in "$@"; do case $a in --quick) QUICK=--quick;; *) SUITES+=("$a");; esac; done
if [ ${#SUITES[@]} = 0 ]; then
  echo "usage: OUT=DIR bash benchmarks/run_device.sh SUITE... [--quick]"; python3 -m benchmarks --list; exit 2
fi
python3 -m benchmarks --plan --budget "${BUDGET:-540}" $QUICK "${SUITES[@]}" || exit 2
. "$(dirname "$0")/device_steps.sh"
# peers the image lacks (torchtitan 0.2.2 and its needs, torchao 0.18) travel as wheels in .whl (carry it):
# docs/torchtitan.md has the pip download line
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >>"$LOG" 2>&1 && export PYTHONPATH=$PWD:/tmp/site || echo "=== wheel install failed" >>"$LOG"
fi
python3 -m mxmoe info >>"$LOG" 2>&1
for s in "${SUITES[@]}"; do
  left=$((${BUDGET:-540} + 30 - SECONDS))
  [ "$left" -gt 10 ] || { echo "=== no time left for $s" >>"$LOG"; continue; }
  step "$left" python3 -m benchmarks "$s" $QUICK --out-dir "$OUT"
done
grep -v "it/s" "$LOG" | tail -c 9000
