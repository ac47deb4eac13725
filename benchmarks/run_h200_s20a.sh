#!/usr/bin/env bash
# Session 20's first device call (one H200, ~7 min): the mx128 tile-field A/B (chain, group_m, stages, split_wg)
# timed from CUDA-graph replays, interleaved rounds, every shape and pass (balanced). Session 13 deferred tile
# retuning until graph-replay timing was in place (do_bench timed the small products by their host work).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
D=$OUT; R=$OUT/s20a; mkdir -p "$R"
OUT=$R; . benchmarks/h200_steps.sh
CFGS="chain=4;chain=2;group_m=1;group_m=4;group_m=16;stages=3;split_wg=0"
step 300 python3 benchmarks/bench_grouped_gemm_128.py --quick --cudagraph --sweep "$CFGS" --rounds 3 \
    --shapes dsv3-ep32,qwen3-30b-a3b --out "$R/grouped_gemm_128_sweep_small_s20.json"
step 230 python3 benchmarks/bench_grouped_gemm_128.py --quick --cudagraph --sweep "$CFGS" --rounds 2 \
    --shapes llama4-scout,mixtral-8x7b --out "$R/grouped_gemm_128_sweep_large_s20.json"
grep -v "it/s" "$LOG" | tail -c 9000
