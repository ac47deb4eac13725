# Sourced by the run_h200*.sh device scripts (after their `set -u` and exports): $OUT (default out/h200),
# $LOG = $OUT/${LOG_NAME:-log.txt} headed with the date, GPU, driver and torch / triton versions, and
# `step LIMIT_S CMD...`, which runs CMD under a time limit with its output and exit status in $LOG.
OUT=${OUT:-out/h200}; mkdir -p "$OUT"; LOG=$OUT/${LOG_NAME:-log.txt}
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } >>"$LOG" 2>&1
step() { local t=$1; shift; echo "=== $* (limit ${t}s)" >>"$LOG"; local s=$SECONDS
         timeout "$t" "$@" >>"$LOG" 2>&1; echo "=== rc=$? in $((SECONDS - s))s" >>"$LOG"; }
