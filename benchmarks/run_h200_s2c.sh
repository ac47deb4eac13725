#!/usr/bin/env bash
# Session 2, last device call: GPU tests (quantize, QDQ, fused SwiGLU / permute, CUDA paths, layer),
# the MoE layer benchmark with and without the fused permute, the quantization benchmark, and a
# torch.compile check of the layer.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-out/h200}; mkdir -p "$OUT"; LOG=$OUT/log.txt
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } >>"$LOG" 2>&1
step() { local t=$1; shift; echo "=== $* (limit ${t}s)" >>"$LOG"; local s=$SECONDS
         timeout "$t" "$@" >>"$LOG" 2>&1; echo "=== rc=$? in $((SECONDS - s))s" >>"$LOG"; }
step 140 python3 -m pytest -q -m gpu -p no:cacheprovider -k "not torch_compile" tests/test_qdq_kernels.py tests/test_cuda_paths.py tests/test_quantize_kernels.py tests/test_torch_ops.py tests/test_moe.py tests/test_dequantize_kernel.py
step 80 python3 benchmarks/bench_moe_layer.py --iters 5 --out "$OUT/moe_layer.json"
MXMOE_FUSED_PERMUTE=0 step 45 python3 benchmarks/bench_moe_layer.py --iters 5 --recipes mxfp8,bf16 --balance balanced --out "$OUT/moe_layer_unfused_permute.json"
step 60 python3 benchmarks/bench_quantize.py --no-reference --out "$OUT/quantize.json"
step 90 python3 -m pytest -q -m gpu -p no:cacheprovider -k torch_compile tests/test_moe.py
grep -v "it/s" "$LOG" | grep -v "^E  \|^ \|^$" | tail -c 9000
