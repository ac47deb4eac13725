#!/usr/bin/env bash
# Session 15, device call 3 (one H200, <= 600 s): SwiGLU-quantization launch variants (bench_swiglu_variants.py),
# then the gpu-throughput preset with the steps timed between syncs, bf16 / mxfp8 / mxfp8_128, under the
# default CUDA graphs and under inductor + CUDA graphs. All in $OUT/s15c.tgz.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
D=$OUT; R=$OUT/s15c; mkdir -p "$R"
PYTHONPATH=.:benchmarks timeout 100 python3 benchmarks/bench_swiglu_variants.py --out "$R/swiglu_variants.json" >"$R/swiglu_variants_log.txt" 2>&1
grep -v Warning "$R/swiglu_variants_log.txt" | tail -25
OUT=$R/graphs LIMIT=200 bash benchmarks/run_h200_train.sh >/dev/null 2>&1
OUT=$R/inductor LIMIT=230 FLAGS="--compile inductor-cudagraphs" bash benchmarks/run_h200_train.sh >/dev/null 2>&1
for d in graphs inductor; do echo "== $d"; grep -A12 "recipe      train" "$R/$d/train_gpu_throughput_log.txt"; done
tar czf "$D/s15c.tgz" -C "$R" .
