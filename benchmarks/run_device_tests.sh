#!/usr/bin/env bash
# One device call (~7-8 min on an H200): every single-GPU test file in its own pytest process, six at a
# time (the files mostly wait on Triton / Gluon compiles, which use the CPUs), the main job's tiny preset;
# then, alone on the GPU, the layer and gemm suites' smoke runs (--quick: one shape, CUDA graphs) -> $OUT/*.json.
# Each test file's output: $OUT/pytest_<file>.txt; the summary lines go to $OUT/log.txt. BENCH=0: tests only.
# Usage (repo root, on the GPU machine): OUT=/some/dir bash benchmarks/run_device_tests.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0
. "$(dirname "$0")/device_steps.sh"
# torchtitan 0.2.2 and its needs travel as wheels in .whl (carry it; docs/torchtitan.md): test_torchtitan's GPU tests
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >>"$LOG" 2>&1 && export PYTHONPATH=$PWD:/tmp/site || echo "=== wheel install failed" >>"$LOG"
fi
python3 -m mxmoe info >>"$LOG" 2>&1
FILES="tests/test_grouped_gemm_sm90.py tests/test_grouped_gemm_sm90_128.py tests/test_moe.py tests/test_layer_kernels.py
 tests/test_quantize_kernels.py tests/test_qdq_kernels.py tests/test_cuda_paths.py
 tests/test_quantize_128.py tests/test_grouped_128.py tests/test_out_dtype.py
 tests/test_train.py tests/test_sm90_scales.py tests/test_router.py tests/test_grouped.py tests/test_torchtitan.py"
gpu_test_files 330 $FILES
step 120 python3 -m mxmoe train --preset tiny --device cuda --overwrite --out /tmp/mxmoe_tiny
[ "${BENCH:-1}" = 1 ] || exit 0
step 150 python3 -m benchmarks layer gemm --quick --out-dir "$OUT"
grep -v "it/s" "$LOG" | grep -v "^E  \|^ \|^$" | tail -c 9000
