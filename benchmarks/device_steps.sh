# Sourced by the run_device*.sh scripts (after their `set -u` and exports): $OUT (default out/h200),
# $LOG = $OUT/${LOG_NAME:-log.txt} headed with the date, GPU, driver and torch / triton versions, and
# `step LIMIT_S CMD...`, which runs CMD under a time limit with its output and exit status in $LOG.
OUT=${OUT:-out/h200}; mkdir -p "$OUT"; LOG=$OUT/${LOG_NAME:-log.txt}
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } >>"$LOG" 2>&1
step() { local t=$1; shift; echo "=== $* (limit ${t}s)" >>"$LOG"; local s=$SECONDS
         timeout "$t" "$@" >>"$LOG" 2>&1; echo "=== rc=$? in $((SECONDS - s))s" >>"$LOG"; }
# `gpu_test_files LIMIT_S FILE...`: each test file's GPU tests in its own pytest process, six at a time (the
# files mostly wait on Triton / Gluon compiles, which use the CPUs), under a time limit each; its output in
# $OUT/pytest_<file>.txt, a summary line per file and the first failures' tracebacks (6 KB) in $LOG.
gpu_test_files() { local t=$1; shift; local s=$SECONDS
  echo "=== test files, 6 processes at a time (limit ${t}s each)" >>"$LOG"
  printf '%s\n' "$@" | xargs -P 6 -I{} sh -c 'f={}; n=$(basename $f .py); \
    timeout "$1" python3 -m pytest -q -m gpu -p no:cacheprovider $f >"$0/pytest_$n.txt" 2>&1; \
    echo "$n rc=$? $(grep -E "[0-9]+ (passed|failed)" "$0/pytest_$n.txt" | tail -1)" >>"$2"' "$OUT" "$t" "$LOG"
  echo "=== test files done in $((SECONDS - s))s" >>"$LOG"
  grep -h -B2 -A25 "^FAILED\|^ERROR\|= FAILURES =" "$OUT"/pytest_*.txt | head -c 6000 >>"$LOG"; }
