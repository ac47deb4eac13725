#!/usr/bin/env bash
# One device call (~9 min on an H200): bit-identity of MoE outputs/gradients between a given older tree
# ($OLD, e.g. a `git archive` of the commit before the structure refactor) and this one; the mx128 grouped
# GEMM on the shapes where it trails BF16 (do_bench beside its variants and peers, then ncu counters of one
# launch each); the MoE layer with skewed routing.
# Usage (repo root, on the GPU machine): OUT=/some/dir OLD=old_tree bash benchmarks/run_h200_s13.sh
set -u
export PYTHONUNBUFFERED=1
. "$(dirname "$0")/h200_steps.sh"
if [ -n "${OLD:-}" ]; then
  PYTHONPATH=. step 90 python3 benchmarks/check_same_outputs.py --out "$OUT/hashes_new.json"
  PYTHONPATH=$OLD step 90 python3 benchmarks/check_same_outputs.py --out "$OUT/hashes_old.json"
  python3 - "$OUT" >>"$LOG" 2>&1 <<'PY'
import json, sys
a, b = (json.load(open(f"{sys.argv[1]}/hashes_{n}.json")) for n in ("old", "new"))
keys = [k for k in a if "/" in k]
diff = [k for k in keys if a[k] != b.get(k)]
print(f"bit-identity: {len(keys) - len(diff)} of {len(keys)} (recipe, shape) cases identical; differ: {diff}")
PY
fi
export PYTHONPATH=.
P=benchmarks/profile_grouped_gemm.py
CASES=mx128,mx128_stages5,mx128_group_m16,mx128_chain2,cublas_block_loop_mx128,cutlass_bf16_grouped
step 70 python3 $P time dsv3-ep32 down $CASES
step 70 python3 $P time qwen3-30b-a3b down $CASES
step 60 python3 $P time 8:131072:2048:768 down mx128,cutlass_bf16_grouped
step 60 python3 $P time 32:32768:7168:2048 down mx128,cutlass_bf16_grouped
NCU="ncu --clock-control none --nvtx --nvtx-include prof/ -k regex:sm90_mxfp8 --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --metrics sm__pipe_tensor_op_hmma_type_hmma_hgmma_qgmma_cycles_active.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct --csv --page details"
for sh in "mixtral-8x7b up" "dsv3-ep32 down" "qwen3-30b-a3b down"; do
  set -- $sh
  echo "=== ncu $1 $2 -> ncu_$1_$2.csv" >>"$LOG"
  timeout 60 $NCU python3 $P prof $1 $2 mx128 >"$OUT/ncu_$1_$2.csv" 2>>"$LOG"; echo "=== rc=$?" >>"$LOG"
done
step 150 python3 benchmarks/bench_moe_layer.py --iters 5 --recipes mxfp8_128,mxfp8,bf16 --balance skewed --out "$OUT/moe_layer_128_skewed.json"
grep -v "it/s" "$LOG" | grep -v "^E  \|^ \|^$\|^==PROF==" | tail -c 11000
