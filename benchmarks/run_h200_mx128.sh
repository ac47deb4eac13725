#!/bin/bash
# One device call for the mx128 grouped GEMMs: GPU tests (new and old grouped GEMM files), then the benchmark.
#   MX128_BENCH_ARGS="--quick --shapes mixtral-8x7b" bash benchmarks/run_h200_mx128.sh   (logs under $OUT)
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-/tmp/mx128_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv | tee "$OUT/gpu.txt"
if [ "${MX128_TESTS:-1}" = 1 ]; then
  timeout ${MX128_TEST_TIMEOUT:-200} python -m pytest -q -rs -s ${MX128_TEST_FILES:-tests/test_grouped_gemm_sm90_128.py tests/test_grouped_gemm_sm90.py} 2>&1 \
    | tee "$OUT/tests.txt" | grep -v "^mx128\|^m_grouped\|^k_grouped" | tail -40
  TESTS_RC=$?
  grep "rel_err" "$OUT/tests.txt" | head -60 > "$OUT/test_rel_err.txt"
fi
if [ -n "${MX128_SWEEP+x}" ]; then
  timeout ${MX128_SWEEP_TIMEOUT:-200} python benchmarks/bench_grouped_gemm_128.py --out "$OUT/sweep_128.json" --sweep "$MX128_SWEEP" $MX128_SWEEP_ARGS 2>&1 | tee "$OUT/sweep.txt"
fi
if [ -n "${MX128_BENCH_ARGS+x}" ]; then
  # a failing test run falls back to the chain that ran on the GPU before (MX128_FALLBACK, e.g. "--chain 2")
  [ "${TESTS_RC:-0}" != 0 ] && MX128_BENCH_ARGS="$MX128_BENCH_ARGS ${MX128_FALLBACK:-}" && echo "tests failed: bench $MX128_BENCH_ARGS"
  timeout ${MX128_BENCH_TIMEOUT:-250} python benchmarks/bench_grouped_gemm_128.py --out "$OUT/grouped_gemm_128.json" $MX128_BENCH_ARGS 2>&1 | tee "$OUT/bench.txt"
fi
