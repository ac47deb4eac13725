#!/usr/bin/env bash
# One device call (<= 600 s; one H200, its torch 2.11, no network), issue 24: torchtitan 0.2.2's own training
# entry point (torchtitan.train under torchrun) on its DeepSeek-V3 debug model (6 layers, 5 MoE of 8 experts,
# dim 256, top 3; 8 x 2048 tokens a step) with torch.compile and selective activation checkpointing, once
# with torchtitan's BF16 experts and once per mxmoe recipe through mxmoe.integrations.torchtitan (the
# `mxmoe` model converter); tokens/s from torchtitan's own log lines. (torchtitan 0.2.2, not 0.3.0: 0.3.0
# does not import under torch 2.11; benchmarks/NOTES_torchtitan.md.)
# Carry: .whl (torchtitan and what the image lacks: benchmarks/NOTES_torchtitan.md has the pip download lines).
# Usage: OUT=/some/dir bash benchmarks/run_h200_torchtitan.sh -> $OUT/torchtitan_log.txt, $OUT/torchtitan.json
# RECIPES="bf16 mxfp8_128 mxfp8" picks the runs (bf16: torchtitan's own experts, no converter); STEPS=40;
# RUN_S=165 caps each run; FLAGS adds torchtitan flags to every run; DRY_RUN=1 only parses each run's config
# and builds its model on the meta device with the converters (CPU is enough: checks the flags, the
# converter and the assets).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 HF_DATASETS_CACHE=/tmp/tt_hf WANDB_MODE=disabled
OUT=${OUT:-out/h200}; mkdir -p "$OUT"; LOG=$OUT/torchtitan_log.txt; : >"$LOG"
RECIPES=${RECIPES:-bf16 mxfp8_128 mxfp8}; STEPS=${STEPS:-40}; RUN_S=${RUN_S:-165}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >>"$LOG" 2>&1 || { echo "wheel install failed"; tail -20 "$LOG"; exit 1; }
  export PYTHONPATH=$PWD:/tmp/site
else
  export PYTHONPATH=$PWD
fi
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv 2>/dev/null
  python3 -c "import torch, triton, torchtitan; print('torch', torch.__version__, 'triton', triton.__version__,
'torchtitan', torchtitan.__version__, 'cuda', torch.cuda.is_available())"
  git log -1 --format='mxmoe %h %s' 2>/dev/null; } >>"$LOG" 2>&1
python3 benchmarks/torchtitan_assets.py /tmp/tt_assets >>"$LOG" 2>&1 || { echo "assets failed"; tail -20 "$LOG"; exit 1; }
# The settings of torchtitan's DeepSeek-V3 debug config (0.2.2's wheel ships no TOML; these are
# 0.3.0's deepseek_v3_debugmodel's), the data set and tokenizer the offline assets.
base=(--model.name deepseek_v3 --model.flavor debugmodel --model.hf_assets_path /tmp/tt_assets/tokenizer
      --training.dataset c4_test --training.dataset_path /tmp/tt_assets/data --training.local_batch_size 8
      --training.seq_len 2048 --training.steps "$STEPS" --optimizer.lr 8e-4 --lr_scheduler.warmup_steps 2
      --lr_scheduler.decay_ratio 0.8 --lr_scheduler.decay_type linear --lr_scheduler.min_lr_factor 0.0
      --parallelism.expert_parallel_degree 1 --activation_checkpoint.mode selective --metrics.log_freq 5
      --compile.enable)
for r in $RECIPES; do
  args=("${base[@]}" --job.dump_folder "/tmp/tt_out_$r")
  [ "$r" != bf16 ] && args+=(--job.custom_config_module mxmoe.integrations.torchtitan --model.converters mxmoe
                             --mxmoe.recipe "$r")
  echo "=== run $r: ${args[*]} ${FLAGS:-}" >>"$LOG"
  s=$SECONDS
  if [ -n "${DRY_RUN:-}" ]; then
    python3 -c "import sys, torch
from torchtitan.config import ConfigManager
from torchtitan.protocols.model_converter import build_model_converters
from torchtitan.protocols.train_spec import get_train_spec
c = ConfigManager().parse_args(sys.argv[1:]); spec = get_train_spec(c.model.name)
args = spec.model_args[c.model.flavor]; args.update_from_config(c)
with torch.device('meta'):
    model = spec.model_cls(args)
build_model_converters(c, None).convert(model)
tok = spec.build_tokenizer_fn(c)
kinds = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith('Experts')})
print('parsed', c.model.converters, getattr(c, 'mxmoe', None), 'experts', kinds, 'vocab', tok.get_vocab_size())" \
      "${args[@]}" ${FLAGS:-} >>"$LOG" 2>&1
  else
    timeout "$RUN_S" torchrun --standalone --nproc-per-node 1 -m torchtitan.train "${args[@]}" ${FLAGS:-} >>"$LOG" 2>&1
  fi
  echo "=== end $r: rc $? wall $((SECONDS - s)) s" >>"$LOG"
done
python3 - "$LOG" "$OUT/torchtitan.json" <<'EOF'
import json, re, statistics, sys
log, out = sys.argv[1], sys.argv[2]
text = re.sub(r"\x1b\[[0-9;]*m", "", open(log, errors="replace").read())
runs, cur = {}, None
for line in text.splitlines():
    m = re.match(r"=== run (\S+?):", line)
    if m:
        cur = runs.setdefault(m.group(1), {"steps": [], "tps": [], "loss": []})
    m = re.search(r"step:\s*(\d+)\s+loss:\s*([\d.]+).*tps:\s*([\d,]+)", line)
    if m and cur is not None:
        cur["steps"].append(int(m.group(1))); cur["loss"].append(float(m.group(2)))
        cur["tps"].append(int(m.group(3).replace(",", "")))
    m = re.match(r"=== end (\S+?): rc (\d+) wall (\d+)", line)
    if m:
        runs[m.group(1)].update(rc=int(m.group(2)), wall_s=int(m.group(3)))
for r in runs.values():  # the first logged interval holds the compilation: left out of the median
    r["median_tps"] = statistics.median(r["tps"][1:]) if len(r["tps"]) > 1 else None
base = runs.get("bf16", {}).get("median_tps")
for name, r in runs.items():
    ratio = r["median_tps"] / base if base and r["median_tps"] else None
    print(f"{name:10s} rc {r.get('rc')} wall {r.get('wall_s')} s  median tps {r['median_tps']}  vs bf16 "
          f"{ratio and round(ratio, 3)}  last loss {r['loss'][-1] if r['loss'] else None}")
head = text.splitlines()[:6]
json.dump({"header": head, "runs": runs, "note": "tps: torchtitan's tokens/s per device, median of the "
           "log intervals after the first; bf16 = torchtitan's own experts"}, open(out, "w"), indent=1)
EOF
tail -c 3000 "$LOG"
