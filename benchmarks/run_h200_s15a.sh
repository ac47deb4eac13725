#!/usr/bin/env bash
# Session 15, device call 1 (one H200, <= 600 s): the gpu-throughput preset's end-to-end tokens/s with
# the default CUDA graphs and with inductor + CUDA graphs (--compile inductor-cudagraphs), bf16 and
# mxfp8_128 in the same call; the GPU test of the new backend; a kernel profile of the inductor step.
# Everything lands in $OUT/s15a.tgz (the device returns few files).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
R=$OUT/s15a; mkdir -p "$R"
OUT=$R/graphs RECIPES=bf16,mxfp8_128 LIMIT=150 bash benchmarks/run_h200_train.sh >/dev/null 2>&1
OUT=$R/inductor RECIPES=bf16,mxfp8_128 LIMIT=260 FLAGS="--compile inductor-cudagraphs" \
  bash benchmarks/run_h200_train.sh >/dev/null 2>&1
for d in graphs inductor; do echo "== $d"; cat "$R/$d/train_gpu_throughput.json" 2>/dev/null | head -40; done
timeout 150 python3 benchmarks/profile_train_step.py --recipes bf16,mxfp8_128 --compile inductor \
  --out "$R/train_step_profile_inductor.json" >"$R/profile_log.txt" 2>&1; echo "profile rc=$?"
head -40 "$R/profile_log.txt"
tar czf "$OUT/s15a.tgz" -C "$R" .
