#!/usr/bin/env bash
# Session 2, device call 5: GPU tests of the quantize / QDQ / fused SwiGLU / CUDA-path code, then the
# MoE layer benchmark (all shapes) and the quantization benchmark (defaults + sweep, no reference).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-out/h200}; mkdir -p "$OUT"; LOG=$OUT/log.txt
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } >>"$LOG" 2>&1
step() { local t=$1; shift; echo "=== $* (limit ${t}s)" >>"$LOG"; local s=$SECONDS
         timeout "$t" "$@" >>"$LOG" 2>&1; echo "=== rc=$? in $((SECONDS - s))s" >>"$LOG"; }
step 190 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_qdq_kernels.py tests/test_cuda_paths.py tests/test_quantize_kernels.py tests/test_torch_ops.py tests/test_moe.py tests/test_dequantize_kernel.py
step 100 python3 benchmarks/bench_moe_layer.py --iters 5 --out "$OUT/moe_layer.json"
step 130 python3 benchmarks/bench_quantize.py --no-reference --sweep --out "$OUT/quantize.json"
grep -v "it/s" "$LOG" | grep -v "^E  \|^ \|^$" | tail -c 9000
