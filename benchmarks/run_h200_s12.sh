#!/usr/bin/env bash
# One short device call (~8 min on an H200) for this session's new code when device time is short: the GPU tests
# of the changed paths, then the mxfp8_128 layer beside bf16 / mxfp8 and the 128-group quantization kernels.
# Usage (repo root, on the GPU machine): OUT=/some/dir bash benchmarks/run_h200_s12.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-out/h200}; mkdir -p "$OUT"; LOG=$OUT/log.txt
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } >>"$LOG" 2>&1
step() { local t=$1; shift; echo "=== $* (limit ${t}s)" >>"$LOG"; local s=$SECONDS
         timeout "$t" "$@" >>"$LOG" 2>&1; echo "=== rc=$? in $((SECONDS - s))s" >>"$LOG"; }
python3 -m mxmoe.backend >>"$LOG" 2>&1
PYT="python3 -m pytest -q -m gpu -p no:cacheprovider -x"
step 240 $PYT tests/test_grouped_128.py tests/test_quantize_128.py tests/test_moe.py tests/test_cuda_paths.py tests/test_torch_ops.py tests/test_layer_kernels.py
step 150 python3 benchmarks/bench_moe_layer.py --iters 5 --recipes mxfp8_128,mxfp8,bf16 --balance ${BALANCE:-balanced} --out "$OUT/moe_layer_128.json"
step 100 python3 benchmarks/bench_quantize.py --groups128 --no-reference --out "$OUT/quantize_128.json"
grep -v "it/s" "$LOG" | grep -v "^E  \|^ \|^$" | tail -c 11000
