#!/usr/bin/env bash
# Session 16's fourth device call (one H200, ~3 min): ncu of the mx128 wgrad (K-grouped, FP32 out) beside the fprop
# of the same product (the gpu-throughput layer's up projection): speed of light, warp stall reasons, issue.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
D=$OUT; R=$OUT/s16d; mkdir -p "$R"
OUT=$R; . benchmarks/h200_steps.sh
step 300 ncu -k regex:sm90_mxfp8_grouped_gemm_kernel --launch-count 2 --section SpeedOfLight --section WarpStateStats \
  --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
  -o "$R/wgrad_fprop" python3 benchmarks/ablate_wgrad_128.py --once
ncu --import "$R/wgrad_fprop.ncu-rep" --csv --page details > "$R/wgrad_fprop_ncu.csv" 2>>"$LOG"
ncu --import "$R/wgrad_fprop.ncu-rep" --csv --page raw > "$R/wgrad_fprop_ncu_raw.csv" 2>>"$LOG"
grep -E "===|Error|ERR" "$LOG" | tail -c 3000
python3 benchmarks/ncu_summary.py "$R/wgrad_fprop_ncu.csv" "$R/wgrad_fprop_ncu_raw.csv"
tar czf "$D/s16d.tgz" -C "$R" .
