#!/usr/bin/env bash
# One short device call (~8 min on an H200) for this session's new code when device time is short: the GPU tests
# of the changed paths, then the mxfp8_128 layer beside bf16 / mxfp8 and the 128-group quantization kernels.
# Usage (repo root, on the GPU machine): OUT=/some/dir bash benchmarks/run_h200_s12.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
. "$(dirname "$0")/h200_steps.sh"
python3 -m mxmoe.backend >>"$LOG" 2>&1
PYT="python3 -m pytest -q -m gpu -p no:cacheprovider -x"
step 240 $PYT tests/test_grouped_128.py tests/test_quantize_128.py tests/test_moe.py tests/test_cuda_paths.py tests/test_torch_ops.py tests/test_layer_kernels.py
step 150 python3 benchmarks/bench_moe_layer.py --iters 5 --recipes mxfp8_128,mxfp8,bf16 --balance ${BALANCE:-balanced} --out "$OUT/moe_layer_128.json"
step 100 python3 benchmarks/bench_quantize.py --groups128 --no-reference --out "$OUT/quantize_128.json"
grep -v "it/s" "$LOG" | grep -v "^E  \|^ \|^$" | tail -c 11000
