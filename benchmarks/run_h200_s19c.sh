#!/usr/bin/env bash
# Session 19's third device call (one H200, ~5 min): the mx128 grouped GEMM table (fprop, dgrad, wgrad; up and down;
# balanced and skewed; the four shapes) with every product and peer timed from CUDA-graph replays, so small products
# are timed by their GPU work, not their host launch work (do_bench's figures in grouped_gemm_128.json are).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
D=$OUT; R=$OUT/s19c; mkdir -p "$R"
OUT=$R; . benchmarks/h200_steps.sh
step 500 python3 benchmarks/bench_grouped_gemm_128.py --quick --cudagraph --out "$R/grouped_gemm_128_cudagraph_s19.json"
grep -v "it/s" "$LOG" | tail -c 9000
tar czf "$D/s19c.tgz" -C "$R" .
