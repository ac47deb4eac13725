"""Torchtitan suite: torchtitan 0.2.2's own training entry point at real MoE sizes on one GPU, its BF16 experts
beside torchao 0.18's FP8 rowwise MoE and mxmoe's recipes, back to back in one call.

    python -m benchmarks torchtitan [--quick] [--out benchmarks/results/<gpu>/torchtitan.json]
        [--models dsv3-16b,qwen3-30b-a3b,llama4-17bx16e] [--methods bf16,torchao_fp8,mxfp8_128,...]
        [--steps 110] [--run-s 170] [--dry-run] [--parity] [--resume-check] [--launch-counts]

Models (``MODELS``): torchtitan's published flavors with the layer count cut to fit one H200 with FP32 master
weights and AdamW (``benchmarks/torchtitan_job.py`` registers the cut flavors from outside torchtitan), their own
vocabularies (LM heads of 102,400 / 151,936 / 202,048), sequence length 4096 with 4 sequences a step (8192 x 1
for Llama-4: memory). Data: this Python's standard library sources as JSON lines through torchtitan's own
``c4_test`` data set path, tokenized by a byte-level BPE tokenizer of 32,768 tokens trained on them
(``torchtitan_assets.py``); no network.

Methods (``METHODS``): ``bf16`` torchtitan's ``GroupedExperts``; ``torchao_fp8`` torchao 0.18's FP8 rowwise grouped
GEMMs on the routed experts, mxmoe's scope (``torchao.fp8_grouped``: torchtitan's ``quantize.grouped_mm.float8`` needs
an API torchao 0.18 dropped, see torchtitan_job.py); ``torchao_fp8+shared`` the same with the shared experts' linears
in FP8 rowwise too, where a model has them (``fqns experts``, as torchtitan's converter is documented);
``mxfp8_128``, ``mxfp8_128_lowmem``, ``mxfp8`` mxmoe's converter; ``*+linear_fp8`` the same with torchtitan's
``quantize.linear.float8`` (rowwise; LM head and router gate left out) on the dense linears; ``mxfp8_128+keep``
``mxfp8_128`` with ``--mxmoe.keep-fp8-weights`` (the checkpointed layers keep their forward's FP8 weights for the
recompute). Every run: ``--compile.enable`` (mxmoe's experts compiled too, fullgraph) and
selective activation checkpointing, seed 0, the same data order.

Per run (a row): ``tokens_per_s`` median of torchtitan's logged intervals after the warm-up steps (``--warmup``,
default 10; the first interval holds the compilation), ``mfu`` (torchtitan's, a fraction of its BF16 peak),
``peak_gib`` (torchtitan's max reserved), ``peak_active_gib`` (the allocator's peak active memory of a step)
and ``backward_start_gib`` (the most memory allocated as a backward began: the weights and AdamW's moments plus
what the forward saved), both over the steps after the warm-up and printed by the trainer at exit
(``torchtitan_job.report_step_memory``), ``loss`` (every logged step), ``steps``, ``wall_s``, ``rc``. mxmoe rows
also carry ``expert_share`` (s: the routed experts' share of the BF16 step: their forward + backward timed alone
at the run's shape, torchtitan's compiled BF16 experts, times the MoE layers, over the BF16 step time),
``layer_ratio`` (r: BF16 experts' time over this recipe's converted experts', same timing) and ``ideal_speedup``
= 1 / (1 - s + s / r). Rows are written after every run, merged into the file by (model, method, kind, seed), each
stamped with the call's commit and date, so split calls add up; a row it replaces is kept (without its curves) in
the header's ``replaced_rows``.

``--parity``: loss parity instead of speed, ``--parity-methods`` (bf16,mxfp8_128) x seeds 0 and 1 on
``--parity-model`` (dsv3-16b), 1000 steps of ``--parity-batch`` (1) sequences, ``--parallel`` (2) runs at a time
on the GPU; rows of kind "parity" (the loss curve) and the header's ``parity`` summary (final loss: the mean of
the last ``--parity-tail`` logged losses; bf16's seed spread; each method's gap). ``--resume-check``: a
kill-and-resume through torchtitan's distributed checkpoints with the converter (``--resume-model`` dsv3-debug,
torchtitan's DeepSeek-V3 debug model; an uninterrupted run, the same with ``--checkpoint.enable`` SIGKILLed
after step ``--resume-kill``, then resumed); a row of kind "resume" (``resume_row``). ``--launch-counts``: 30-step
runs with step 25 profiled, rows of kind "launch_counts" beside the speed rows (the experts kernels' launches a
step in ``profile.experts_kernels``: e.g. whether ``mxfp8_128+keep``'s recompute skips the weights'
quantization); their trainer waits for the GPU at each step's end, so the profiled window holds one step. All
are orchestrated as the speed runs are; on the CPU they are tested against a fake trainer (tests/test_benchmarks.py).

``--merge FILE [FILE ...]`` (CPU is enough): folds the result files of device calls into the canonical file
(``--out``, default ``benchmarks/results/<their gpu>/torchtitan.json``): rows by (model, method, kind, seed),
stamped with their file's commit and date where they lack them; each file's command line and a line for it
appended to the header's ``argv`` and ``runs``; replaced rows into ``replaced_rows``; the parity summary
recomputed; ``git.note`` regenerated from the rows; the logs beside each file (``torchtitan_logs/``) copied.

``--dry-run`` (CPU is enough): parses every run's configuration through torchtitan's ConfigManager and builds
its model on the meta device with the converters: the flags, the flavors and the converters, checked.
Needs torchtitan 0.2.2 (and torchao 0.18 for ``torchao_fp8``) importable: on the GPU machine the wheels travel
in ``.whl`` (``benchmarks/run_device.sh`` installs them).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import common as C

SUITE = "torchtitan"
ASSETS = Path(os.environ.get("MXMOE_TT_ASSETS", "/tmp/tt_assets"))
VOCAB = 32768
SYNC_STEPS_ENV = "MXMOE_BENCH_SYNC_STEPS"  # "1": the job waits for the GPU at each step's end (torchtitan_job)

# name -> torchtitan model, cut flavor (torchtitan_job.CUT_FLAVORS), tokens per step, expert shape
MODELS = {
    "dsv3-16b": dict(model="deepseek_v3", flavor="16B-cut4", seq_len=4096, batch=4),
    "qwen3-30b-a3b": dict(model="qwen3", flavor="30B-A3B-cut4", seq_len=4096, batch=4),
    "llama4-17bx16e": dict(model="llama4", flavor="17bx16e-cut2", seq_len=8192, batch=1),
    # torchtitan's own DeepSeek-V3 debug model (dim 256, 8 experts of 256, top-3; the tokenizer's vocabulary): the
    # kill-and-resume check
    "dsv3-debug": dict(model="deepseek_v3", flavor="debugmodel-v32k", seq_len=2048, batch=2),
}
_LINEAR_FP8 = ["--quantize.linear.float8.recipe_name", "rowwise", "--quantize.linear.float8.filter_fqns",
               "output,router.gate"]
METHODS = {
    "bf16": [],
    "torchao_fp8": ["--model.converters", "torchao.fp8_grouped"],
    "torchao_fp8+shared": ["--model.converters", "torchao.fp8_grouped_shared"],
    "mxfp8_128": ["--model.converters", "mxmoe", "--mxmoe.recipe", "mxfp8_128"],
    "mxfp8_128_lowmem": ["--model.converters", "mxmoe", "--mxmoe.recipe", "mxfp8_128_lowmem"],
    "mxfp8": ["--model.converters", "mxmoe", "--mxmoe.recipe", "mxfp8"],
    "torchao_fp8+linear_fp8": ["--model.converters", "torchao.fp8_grouped,quantize.linear.float8"] + _LINEAR_FP8,
    "mxfp8_128+linear_fp8": ["--model.converters", "mxmoe,quantize.linear.float8", "--mxmoe.recipe", "mxfp8_128"]
    + _LINEAR_FP8,
    # the checkpointed layers keep their forward's FP8 weights for the recompute (memory for time)
    "mxfp8_128+keep": ["--model.converters", "mxmoe", "--mxmoe.recipe", "mxfp8_128", "--mxmoe.keep-fp8-weights"],
}
# mxmoe's methods -> their recipe (the --mxmoe.recipe each passes)
MX_RECIPE = {m: a[a.index("--mxmoe.recipe") + 1] for m, a in METHODS.items() if "--mxmoe.recipe" in a}
DEFAULT_PLAN = [("dsv3-16b", m) for m in METHODS] + [
    (mod, m) for mod in ("qwen3-30b-a3b", "llama4-17bx16e")
    for m in ("bf16", "torchao_fp8", "mxfp8_128", "mxfp8_128_lowmem", "mxfp8")]


def run_args(model: str, method: str, steps: int, dump: str, seed: int = 0, batch: int | None = None,
             extra: tuple[str, ...] = ()) -> list[str]:
    """torchtitan.train's flags for one (model, method) run (``batch``: sequences a step instead of the
    model's; ``extra``: further flags, e.g. the checkpoint's)."""
    m = dict(MODELS[model], **({"batch": batch} if batch else {}))
    return ["--job.custom_config_module", "benchmarks.torchtitan_job", "--job.dump_folder", dump,
            "--model.name", m["model"], "--model.flavor", m["flavor"],
            "--model.hf_assets_path", str(ASSETS / "tokenizer"),
            "--training.dataset", "c4_test", "--training.dataset_path", str(ASSETS / "data"),
            "--training.local_batch_size", str(m["batch"]), "--training.seq_len", str(m["seq_len"]),
            "--training.steps", str(steps), "--debug.seed", str(seed),
            "--optimizer.lr", "3e-4", "--lr_scheduler.warmup_steps", "10",
            "--parallelism.expert_parallel_degree", "1", "--activation_checkpoint.mode", "selective",
            "--metrics.log_freq", "5", "--compile.enable"] + METHODS[method] + list(extra)


def train_cmd(*args, **kwargs) -> list[str]:
    """torchrun (one process) of torchtitan.train with :func:`run_args`."""
    return ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
             "-m", "torchtitan.train"] + run_args(*args, **kwargs))


_MEMORY = re.compile(r"mxmoe-bench step memory: peak active ([\d.]+) GiB, at backward start ([\d.]+) GiB")
_STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([\d.]+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)"
                   r"(?:.*?mfu:\s*([\d.]+)%)?")


def parse_log(text: str, warmup: int) -> dict:
    """torchtitan's metric lines -> steps, loss, tokens/s (median after ``warmup`` steps), mfu, peak GiB
    (reserved, the largest of the logged intervals), ``peak_active_gib``, the allocator's peak active memory
    of a step, and ``backward_start_gib``, the most memory allocated as a backward began, both after the warm-up
    (``torchtitan_job.report_step_memory``'s line at exit; None without it)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    steps, loss, tps, mfu, mem = [], [], [], [], []
    for m in _STEP.finditer(text):
        steps.append(int(m.group(1)))
        loss.append(float(m.group(2)))
        mem.append(float(m.group(3)))
        tps.append(int(m.group(4).replace(",", "")))
        mfu.append(float(m.group(5)) / 100 if m.group(5) else None)
    after = [i for i, s in enumerate(steps) if s > warmup]
    med = lambda v: statistics.median(v) if v else None  # noqa: E731
    memory = _MEMORY.findall(text)
    return {"steps": steps, "loss": loss, "tps_intervals": tps,
            "tokens_per_s": med([tps[i] for i in after]),
            "mfu": med([mfu[i] for i in after if mfu[i] is not None]),
            "peak_gib": max(mem) if mem else None, "peak_active_gib": float(memory[-1][0]) if memory else None,
            "backward_start_gib": float(memory[-1][1]) if memory else None,
            "timed_steps": (steps[-1] - warmup) if after else 0}


# torch.profiler's GPU kernels of one step -> what they do, by name (first match wins). Grouped GEMMs:
# torchtitan's and torchao's are CUTLASS kernels over a GroupProblemShape, mxmoe's its Gluon
# sm90_mxfp8_grouped_gemm_kernel. The experts' other work: mxmoe's quantizers, permutations and SwiGLU, torchao's
# FP8 casts, the weights' copies for torch's grouped mm, and the token permutation's sorts, gathers and scatters
# (the router's top-k sort among them). Attention: SDPA's flash / cuDNN kernels. Optimizer: AdamW's and the
# gradient clipping's multi-tensor kernels. Dense GEMMs: every other GEMM (projections, shared experts, router
# gate, LM head). The rest (norms, elementwise fusions, the loss, memory copies) is "other".
PROFILE_CLASSES = (
    ("optimizer", r"multi_tensor_apply|adam|lpnorm"),
    ("attention", r"flash|fmha|sdpa|attention"),
    ("communication", r"nccl"),
    ("experts_gemm", r"GroupProblemShape|sm90_mxfp8_grouped_gemm"),
    ("experts_other", r"^(mx_|gather_rows|gather_sum|swiglu|router_|combine_|_transpose|to_float32|_fill_indices)"
                      r"|grouped|quantize|permute|fp8|float8|index|gather|scatter|sort"),
    ("dense_gemm", r"gemm|nvjet|xmma|cutlass|cublas|triton_tem_fused_(add)?mm|splitKreduce"),
)


def profile_class(name: str) -> str:
    """One GPU kernel's class in :data:`PROFILE_CLASSES` by its name; ``"other"`` (elementwise, norms, the
    compiled fusions) when none matches."""
    for cls, pat in PROFILE_CLASSES:
        if re.search(pat, name, re.IGNORECASE):
            return cls
    return "other"


def profile_summary(trace: dict, top: int = 8) -> dict:
    """A chrome trace of torch.profiler (torchtitan's ``--profiling.enable_profiling``, one active step) ->
    milliseconds of GPU kernel time per :func:`profile_class`, each class's share of the kernel total, the
    step's wall time (its ``ProfilerStep#N`` span), the largest kernels left in ``"other"`` by name, and the
    experts' kernels (both experts classes) by name with their launch counts (``experts_kernels``: name ->
    [launches, ms]; e.g. how many weight quantizations a step runs). Memory copies and sets count as ``"other"``."""
    ms: dict[str, float] = {}
    others: dict[str, float] = {}
    experts: dict[str, list] = {}
    step_ms = None
    for ev in trace.get("traceEvents", []):
        cat, name, dur = ev.get("cat", ""), ev.get("name", ""), ev.get("dur")
        if dur is None:
            continue
        if cat == "kernel" or cat in ("gpu_memcpy", "gpu_memset"):
            cls = profile_class(name) if cat == "kernel" else "other"
            ms[cls] = ms.get(cls, 0.0) + dur / 1e3
            if cls == "other":
                others[name[:80]] = others.get(name[:80], 0.0) + dur / 1e3
            elif cls.startswith("experts"):
                e = experts.setdefault(name[:80], [0, 0.0])
                e[0], e[1] = e[0] + 1, e[1] + dur / 1e3
        elif name.startswith("ProfilerStep#"):
            step_ms = max(step_ms or 0.0, dur / 1e3)
    total = sum(ms.values())
    out = {"kernel_ms": {k: round(v, 3) for k, v in sorted(ms.items())}, "kernel_total_ms": round(total, 3),
           "step_ms": round(step_ms, 3) if step_ms else None,
           "share": {k: round(v / total, 4) for k, v in sorted(ms.items())} if total else {},
           "top_other": {k: round(v, 3) for k, v in sorted(others.items(), key=lambda kv: -kv[1])[:top]},
           "experts_kernels": {k: [n, round(v, 3)] for k, (n, v) in sorted(experts.items(), key=lambda kv: -kv[1][1])}}
    return out


def profile_flags(step: int) -> list[str]:
    """torchtitan's profiler flags for one active step, ``step`` (3 warm-up steps before it)."""
    return ["--profiling.enable_profiling", "--profiling.profile_freq", str(step),
            "--profiling.profiler_warmup", "3", "--profiling.profiler_active", "1"]


def read_profile(dump: Path) -> dict | None:
    """The summary of the first trace under ``dump``'s ``profile_traces`` (the trace itself is deleted: a
    compiled step's trace is tens of MB)."""
    traces = sorted(Path(dump).glob("profile_traces/iteration_*/rank0_trace.json"))
    if not traces:
        return None
    summary = {"trace": f"{traces[0].parent.name}", **profile_summary(json.loads(traces[0].read_text()))}
    shutil.rmtree(Path(dump) / "profile_traces", ignore_errors=True)
    return summary


def _env(**extra: str) -> dict:
    env = dict(os.environ, **extra, PYTHONUNBUFFERED="1", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               HF_DATASETS_CACHE="/tmp/tt_hf", WANDB_MODE="disabled", NCCL_NVLS_ENABLE="0",
               TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(C.REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def ensure_assets() -> None:
    if not (ASSETS / "tokenizer" / "tokenizer.json").exists():
        subprocess.run([sys.executable, str(C.REPO / "benchmarks" / "torchtitan_assets.py"), str(ASSETS),
                        "--vocab", str(VOCAB)], check=True, env=_env())


def dry_run(model: str, method: str) -> dict:
    """Parse the run's config and build its model on meta with its converters (no GPU, no trainer)."""
    code = (
        "import sys, torch, json\n"
        "from torchtitan.config import ConfigManager\n"
        "from torchtitan.protocols.model_converter import build_model_converters\n"
        "from torchtitan.protocols.train_spec import get_train_spec\n"
        "c = ConfigManager().parse_args(sys.argv[1:]); spec = get_train_spec(c.model.name)\n"
        "args = spec.model_args[c.model.flavor]; args.update_from_config(c)\n"
        "with torch.device('meta'):\n    model = spec.model_cls(args)\n"
        "build_model_converters(c, None).convert(model)\n"
        "kinds = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith('Experts')})\n"
        "n = sum(p.numel() for p in model.parameters())\n"
        "print(json.dumps({'experts': kinds, 'params': n, 'converters': c.model.converters}))\n")
    p = subprocess.run([sys.executable, "-c", code] + run_args(model, method, 10, "/tmp/tt_dry"),
                       capture_output=True, text=True, env=_env())
    if p.returncode:
        return {"rc": p.returncode, "error": p.stderr[-2000:]}
    return {"rc": 0, **json.loads(p.stdout.strip().splitlines()[-1])}


def expert_shape(model: str) -> dict:
    """The run's routed experts as torchtitan builds them (the cut model on the meta device): experts E, FFN
    hidden, dim, top-k, the number of MoE layers."""
    import torch
    from torchtitan.config import ConfigManager
    from torchtitan.models.moe import moe as tt_moe
    from torchtitan.protocols.train_spec import get_train_spec

    cfg = ConfigManager().parse_args(run_args(model, "bf16", 10, "/tmp/tt_dry"))
    spec = get_train_spec(cfg.model.name)
    args = spec.model_args[cfg.model.flavor]
    args.update_from_config(cfg)
    with torch.device("meta"):
        net = spec.model_cls(args)
    layers = [m for m in net.modules() if isinstance(m, tt_moe.MoE)]
    E, hidden, dim = layers[0].experts.w1.shape
    return dict(experts=E, hidden=hidden, dim=dim, top_k=layers[0].router.top_k, moe_layers=len(layers))


@contextlib.contextmanager
def experts_step(model: str, variant: str, param_dtype: str = "float32"):
    """One routed-experts forward + backward at the run's shape as a callable (balanced rows per expert, BF16
    rows; parameters in ``param_dtype``, float32 as the one-GPU run holds them; their gradients set to None
    before each call, as a training step's zero_grad leaves them). ``variant``: ``"bf16"``, torchtitan's
    GroupedExperts through its grouped-mm function compiled (as --compile.enable runs it), or an mxmoe recipe
    (``RECIPE/unfused``: ``fused_swiglu=False``), converted and compiled as the converter does. Yields
    ``(step, shape)``: :func:`expert_shape`'s dict with ``rows``; torchtitan's function is restored on exit."""
    import torch
    from torchtitan.models.moe import moe as tt_moe

    from mxmoe.integrations.torchtitan import MXMoEGroupedExperts

    sh = expert_shape(model)
    m = MODELS[model]
    E, rows = sh["experts"], m["seq_len"] * m["batch"] * sh["top_k"]
    counts = torch.full((E,), rows // E, dtype=torch.int64, device="cuda")
    counts[: rows - int(counts.sum())] += 1
    x = torch.randn(rows, sh["dim"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    torch.manual_seed(0)
    e = tt_moe.GroupedExperts(sh["dim"], sh["hidden"], E, use_grouped_mm=True)
    e = e.cuda().to(getattr(torch, param_dtype))
    with torch.no_grad():
        e.init_weights(0.02)
    saved = tt_moe._run_experts_grouped_mm
    if variant == "bf16":
        tt_moe._run_experts_grouped_mm = torch.compile(saved, fullgraph=True)
    else:
        recipe, _, unfused = variant.partition("/")
        MXMoEGroupedExperts.convert(e, recipe, fused_swiglu=not unfused).compile_backend = "inductor"

    def step():
        x.grad = None
        for p in e.parameters():
            p.grad = None
        e(x, counts).backward(dy)

    try:
        yield step, {**sh, "rows": rows}
    finally:
        tt_moe._run_experts_grouped_mm = saved


def expert_timings(model: str, methods: list[str]) -> tuple[dict[str, float], dict]:
    """Milliseconds of one routed-experts forward + backward (:func:`experts_step`, triton's do_bench):
    torchtitan's BF16 experts and each mxmoe recipe of ``methods``, keyed ``"bf16"`` and by recipe. Returns
    them with the shape."""
    import triton.testing

    out, sh = {}, None
    recipes = list(dict.fromkeys(MX_RECIPE[mm] for mm in methods if mm in MX_RECIPE))
    for method in ["bf16"] + recipes:  # keyed by recipe: "+linear_fp8" runs share their recipe's experts
        with experts_step(model, method) as (step, sh):
            out[method] = triton.testing.do_bench(step, warmup=10, rep=60)
    return out, sh


def row_key(r: dict) -> tuple:
    """Rows merge by (model, method, kind, seed): kind "speed" (the default plan's rows), "parity", "resume" or
    "launch_counts"."""
    return r.get("model"), r.get("method"), r.get("kind", "speed"), r.get("seed", 0)


def _merge(path: Path) -> tuple[dict, list[dict]]:
    if path.exists():
        d = json.loads(path.read_text())
        if d.get("header", {}).get("suite") == SUITE:
            return d["header"], d["rows"]
    return {}, []


# a replaced row is kept in the header without these (its curves are in the git history)
_BULKY = ("loss", "steps", "tps_intervals", "loss_by_step", "compared_steps")  # (a profile stays: docs quote it)


def stamp(row: dict, head: dict) -> dict:
    """``row`` with the commit and date of the call that measured it (``head``'s git commit and date), where it
    has none yet: rows of several calls live in one file."""
    row.setdefault("commit", (head.get("git") or {}).get("commit"))
    row.setdefault("date", head.get("date"))
    return row


def put(head: dict, rows: list[dict], row: dict) -> list[dict]:
    """``rows`` with ``row`` in place of the row of its :func:`row_key`; the row it replaces, if any, goes to
    ``head["replaced_rows"]`` without its curves (:data:`_BULKY`; its profile summary stays)."""
    old = [r for r in rows if row_key(r) == row_key(row)]
    for r in old:
        if r is not row:
            head.setdefault("replaced_rows", []).append({k: v for k, v in r.items() if k not in _BULKY})
    return [r for r in rows if row_key(r) != row_key(row)] + [row]


def fold_header(head: dict, inc: dict, rows: list[dict], source: str | None = None) -> dict:
    """The canonical header ``head`` after a call whose header is ``inc`` and whose rows are ``rows``: the
    machine, versions, date and commit become the call's (the newer of the two dates), its models join
    ``models``, its command line is appended to ``argv`` (a list of command lines) and a line for it to ``runs``
    (date, commit, models, steps, ``source``); the rest of ``head`` (``not_run``, ``replaced_rows``, notes ...)
    stays. The call's ``parity`` summary is recomputed by the caller over the merged rows."""
    head = dict(head) if head else {**{k: v for k, v in inc.items() if k != "parity"}, "argv": [], "runs": []}
    argv = head.get("argv") or []
    if argv and not isinstance(argv[0], list):
        argv = [argv]
    head["argv"] = argv + [inc.get("argv", [])]
    head["runs"] = list(head.get("runs") or []) + [_run_line(inc, rows, source)]
    newer = str(inc.get("date") or "") >= str(head.get("date") or "")
    for k in ("suite", "gpu", "driver", "cuda", "torch", "triton", "python", "peers", "vocab"):
        if k in inc and (newer or k not in head):
            head[k] = inc[k]
    if newer:
        head["date"] = inc.get("date")
        head["git"] = {**(head.get("git") or {}), **{k: v for k, v in (inc.get("git") or {}).items() if k != "note"}}
    head["models"] = {**(head.get("models") or {}), **(inc.get("models") or {})}
    return head


def _run_line(inc: dict, rows: list[dict], source: str | None) -> dict:
    line = {"date": inc.get("date"), "commit": (inc.get("git") or {}).get("commit"),
            "models": sorted({r.get("model") for r in rows}),
            "kinds": sorted({r.get("kind", "speed") for r in rows}), "steps": inc.get("steps")}
    return {**line, **({"source": source} if source else {})}


def commit_note(rows: list[dict]) -> str:
    """The header's ``git.note``: which rows each commit measured, from the rows' own commit and date."""
    by: dict[tuple, list[str]] = {}
    for r in rows:
        kind = r.get("kind", "speed")
        by.setdefault((r.get("commit"), str(r.get("date", ""))[:10]), []).append(
            f"{r.get('model')} {r.get('method')}" + ("" if kind == "speed" else f" {kind}")
            + (f" seed {r['seed']}" if "seed" in r else ""))
    parts = [f"{c} ({d}): {', '.join(dict.fromkeys(v))}" for (c, d), v in sorted(by.items(), key=lambda kv: kv[0][1],
                                                                                    reverse=True)]
    return "rows carry their own commit and date (row fields commit, date): " + "; ".join(parts)


def merge_files(canonical: Path, incoming: list[Path]) -> tuple[dict, list[dict]]:
    """Fold device result files into the canonical one (written back): each incoming row stamped with its
    file's commit and date where it has none, put in place of the row of its :func:`row_key` (the replaced
    row into ``replaced_rows``), the file's header folded in (:func:`fold_header`), the parity summary
    recomputed over the merged parity rows, ``git.note`` regenerated (:func:`commit_note`)."""
    head, rows = _merge(Path(canonical))
    for path in incoming:
        d = json.loads(Path(path).read_text())
        inc, new = d.get("header") or {}, d.get("rows") or []
        if inc.get("suite", SUITE) != SUITE:
            raise SystemExit(f"{path}: not a {SUITE} result file (suite {inc.get('suite')!r})")
        for row in new:
            rows = put(head, rows, stamp(dict(row), inc))
        head = fold_header(head, inc, new, Path(path).name)
        if inc.get("parity") or head.get("parity"):
            par = inc.get("parity") or head["parity"]
            head["parity"] = parity_summary(rows, par["model"], par.get("tail_logged_steps", 20))
    head.setdefault("git", {})["note"] = commit_note(rows)
    C.write_result(canonical, head, rows)
    return head, rows


def _launch(cmd: list[str], log: Path, **env: str) -> subprocess.Popen:
    """Start a torchtitan run in its own process group (so a kill reaches torchrun's worker), output in ``log``,
    with ``env`` added to the environment."""
    f = open(log, "w")
    f.write(" ".join(cmd) + "\n")
    f.flush()
    p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(**env), start_new_session=True)
    p.log_file = f
    return p


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc): torchrun starts its workers in sessions of their own, which a
    kill of torchrun's process group does not reach."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _kill(p: subprocess.Popen) -> None:
    """SIGKILL a run: torchrun, its process group and every process below it (collected before any dies, so
    that none is handed to init first)."""
    pids = [p.pid] + _descendants(p.pid)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGKILL)


def _finish(p: subprocess.Popen, deadline: float) -> int:
    """Wait for ``p`` until ``deadline`` (time.time()); past it the run is killed (:func:`_kill`): rc 124."""
    try:
        rc = p.wait(timeout=max(deadline - time.time(), 1))
    except subprocess.TimeoutExpired:
        _kill(p)
        p.wait()
        rc = 124
    p.log_file.close()
    return rc


def tail_mean(loss: list[float], n: int) -> float | None:
    """Mean of the last ``n`` logged losses (None without any)."""
    return statistics.fmean(loss[-n:]) if loss else None


def parity_summary(rows: list[dict], model: str, tail: int) -> dict:
    """The 1000-step loss parity: each method's final loss (mean of its last ``tail`` logged losses) per seed,
    bf16's seed spread (max - min over seeds) and each method's gap to bf16 (mean over seeds), ``within``
    when the gap is no larger than the spread."""
    final: dict[str, dict[int, float]] = {}
    for r in rows:
        if r.get("kind") == "parity" and r.get("model") == model and r.get("loss"):
            final.setdefault(r["method"], {})[r["seed"]] = tail_mean(r["loss"], tail)
    out = {"model": model, "tail_logged_steps": tail, "final_loss": final}
    bf = list(final.get("bf16", {}).values())
    if len(bf) >= 2:
        spread = max(bf) - min(bf)
        out["bf16_seed_spread"] = spread
        for m, v in final.items():
            if m != "bf16":
                gap = statistics.fmean(v.values()) - statistics.fmean(bf)
                out[f"gap_{m}"] = gap
                out[f"within_{m}"] = abs(gap) <= spread
    return out


def parity(a, head: dict, rows: list[dict], out: Path, logdir: Path) -> list[dict]:
    """Loss parity on ``a.parity_model``: ``a.parity_methods`` x seeds 0 and 1, ``a.steps`` steps each at
    ``a.parity_batch`` sequences a step, ``a.parallel`` runs at a time on the one GPU (their tokens/s is
    not a speed figure). Rows of kind "parity" (the loss curve), the summary in the header."""
    model = a.parity_model
    todo = [(m, seed) for m in a.parity_methods.split(",") for seed in (0, 1)]
    deadline = time.time() + a.run_s
    while todo:
        batch, todo = todo[:a.parallel], todo[a.parallel:]
        procs = []
        for method, seed in batch:
            log = logdir / f"parity_{model}_{method.replace('+', '_')}_seed{seed}.txt"
            cmd = train_cmd(model, method, a.steps, f"/tmp/tt_parity/{model}_{method}_{seed}", seed, a.parity_batch)
            procs.append((method, seed, log, time.time(), _launch(cmd, log)))
        for method, seed, log, t0, p in procs:
            rc = _finish(p, deadline)
            parsed = parse_log(log.read_text(errors="replace"), a.warmup)
            row = {"model": model, "method": method, "seed": seed, "kind": "parity", "rc": rc,
                   "batch": a.parity_batch, "wall_s": round(time.time() - t0, 1), "steps": parsed["steps"],
                   "loss": parsed["loss"], "peak_gib": parsed["peak_gib"],
                   "peak_active_gib": parsed["peak_active_gib"],
                   "backward_start_gib": parsed["backward_start_gib"]}
            rows = put(head, rows, stamp(row, head))
            print(f"parity {model} {method} seed {seed}: rc {rc}, {len(row['steps'])} logged steps, last loss "
                  f"{row['loss'][-1] if row['loss'] else None}", flush=True)
        head["parity"] = parity_summary(rows, model, a.parity_tail)
        C.write_result(out, head, rows)
    print("parity:", json.dumps(head["parity"]), flush=True)
    return rows


def resume_row(curves: dict[str, dict[int, float]], rcs: dict, interval: int, kill: int) -> dict:
    """The kill-and-resume row's figures from the three runs' losses by step (``curves``: "uninterrupted",
    "killed", "resumed") and return codes: the first resumed step; ``max_abs_loss_diff_resumed_vs_killed``
    over the steps both logged in (``interval``, ``kill``], which the resumed run re-runs from the checkpoint
    of step ``interval`` (the same data, the restored state: what the resume itself changes);
    ``max_abs_loss_diff_after_resume``, |resumed - uninterrupted| over the steps both logged after
    ``interval``; and ``run_to_run_noise``, |killed - uninterrupted| over the steps up to ``interval``, before
    any checkpoint (the two runs' difference without a resume: nondeterministic kernels), the scale of the
    former."""
    full, killed, resumed = (curves.get(k, {}) for k in ("uninterrupted", "killed", "resumed"))
    mx = lambda a, b, steps: max((abs(a[st] - b[st]) for st in steps), default=None)  # noqa: E731
    after = sorted(st for st in resumed if st > interval and st in full)
    rerun = sorted(st for st in resumed if interval < st <= kill and st in killed)
    before = sorted(st for st in killed if st <= interval and st in full)
    return {"kind": "resume", "rc": rcs, "interval": interval, "killed_after_step": kill,
            "first_resumed_step": min(resumed, default=None), "loss_by_step": curves,
            "max_abs_loss_diff_after_resume": mx(resumed, full, after), "compared_steps": after,
            "max_abs_loss_diff_resumed_vs_killed": mx(resumed, killed, rerun), "rerun_steps": rerun,
            "run_to_run_noise": mx(killed, full, before), "noise_steps": before}


def resume_curves(logdir: Path, model: str, method: str) -> dict[str, dict[int, float]]:
    """The kill-and-resume runs' losses by step from their logs in ``logdir`` (:func:`parse_log`)."""
    out = {}
    for name in ("uninterrupted", "killed", "resumed"):
        log = Path(logdir) / f"resume_{model}_{method}_{name}.txt"
        if log.exists():
            parsed = parse_log(log.read_text(errors="replace"), 0)
            out[name] = dict(zip(parsed["steps"], parsed["loss"]))
    return out


def resume_check(a, head: dict, rows: list[dict], out: Path, logdir: Path) -> list[dict]:
    """Kill-and-resume through torchtitan's distributed checkpoints (``--checkpoint.enable``) with the converter:
    an uninterrupted run of ``a.resume_steps`` steps; the same run with checkpoints every ``a.resume_interval``
    steps, SIGKILLed once its log shows step ``a.resume_kill``; then that command again, which loads the
    newest checkpoint and runs to the end. Row of kind "resume" (:func:`resume_row`): the three loss curves by
    step, the resumed run against the killed one on the steps it re-ran and against the uninterrupted one after
    the checkpoint, and the run-to-run noise before it."""
    model, method, steps = a.resume_model, a.resume_method, a.resume_steps
    base = Path("/tmp/tt_resume")
    shutil.rmtree(base, ignore_errors=True)
    ckpt = ("--checkpoint.enable", "--checkpoint.interval", str(a.resume_interval))
    deadline = time.time() + a.run_s
    rcs = {}
    for name in ("uninterrupted", "killed", "resumed"):
        extra = () if name == "uninterrupted" else ckpt
        dump = base / ("full" if name == "uninterrupted" else "run")
        log = logdir / f"resume_{model}_{method}_{name}.txt"
        p = _launch(train_cmd(model, method, steps, str(dump), 0, None, extra), log)
        if name == "killed":  # wait for the kill step's log line (or the run's end)
            while p.poll() is None and time.time() < deadline and a.resume_kill not in parse_log(
                    log.read_text(errors="replace"), 0)["steps"]:
                time.sleep(0.1)
            if p.poll() is None:
                _kill(p)
        rcs[name] = _finish(p, deadline)
        print(f"resume {name}: rc {rcs[name]}, logged steps {parse_log(log.read_text(errors='replace'), 0)['steps']}",
              flush=True)
    row = stamp({"model": model, "method": method, **resume_row(resume_curves(logdir, model, method), rcs,
                                                                 a.resume_interval, a.resume_kill)}, head)
    rows = put(head, rows, row)
    C.write_result(out, head, rows)
    print(f"resume: first resumed step {row['first_resumed_step']}; max |resumed - killed| "
          f"{row['max_abs_loss_diff_resumed_vs_killed']} over steps {row['rerun_steps']}; max |resumed - "
          f"uninterrupted| {row['max_abs_loss_diff_after_resume']} over steps {row['compared_steps']}; run-to-run "
          f"noise {row['run_to_run_noise']}", flush=True)
    return rows


def copy_logs(files: list[Path], logdir: Path) -> list[Path]:
    """The run logs beside each merged file (its ``torchtitan_logs/``) copied into ``logdir`` (same names
    replaced)."""
    logdir.mkdir(parents=True, exist_ok=True)
    out = []
    for f in files:
        for log in sorted((Path(f).parent / "torchtitan_logs").glob("*.txt")):
            if log.resolve() != (logdir / log.name).resolve():
                shutil.copyfile(log, logdir / log.name)
                out.append(logdir / log.name)
    return out


def build_parser():
    ap = C.parser(SUITE, __doc__)
    ap.add_argument("--models", default=None, help=f"comma-separated, of {', '.join(MODELS)} (default: the plan's)")
    ap.add_argument("--methods", default=None, help=f"comma-separated, of {', '.join(METHODS)}")
    ap.add_argument("--steps", type=int, default=None, help="training steps a run (default 110; --quick 30)")
    ap.add_argument("--warmup", type=int, default=10, help="steps left out of the tokens/s median (compilation)")
    ap.add_argument("--run-s", type=int, default=170, help="time limit of one run, seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile-step", type=int, default=0,
                    help="profile this step of each speed run (torch.profiler through torchtitan's flags): the "
                         "row's 'profile', GPU kernel time by class (0: off)")
    ap.add_argument("--no-experts-timing", action="store_true", help="skip the experts' timing (expert_share ...)")
    ap.add_argument("--launch-counts", action="store_true",
                    help="short profiled runs (default 30 steps, step 25 profiled, no experts timing) as rows of kind "
                         "launch_counts, beside the speed rows, for the experts kernels' launches a step (e.g. "
                         "mxfp8_128+keep against mxfp8_128: does the recompute quantize the weights again?)")
    ap.add_argument("--timing-only", action="store_true",
                    help="only the experts' timing, for the (model, method) rows already in --out")
    ap.add_argument("--dry-run", action="store_true", help="parse each run's config and build it on meta (CPU)")
    ap.add_argument("--parity", action="store_true",
                    help="loss parity instead of speed: --parity-methods x seeds 0, 1 on --parity-model (default "
                         "1000 steps)")
    ap.add_argument("--parity-model", default="dsv3-16b")
    ap.add_argument("--parity-methods", default="bf16,mxfp8_128")
    ap.add_argument("--parity-batch", type=int, default=1, help="sequences a step in the parity runs")
    ap.add_argument("--parity-tail", type=int, default=20, help="logged steps averaged for the final loss")
    ap.add_argument("--parallel", type=int, default=2, help="parity runs at a time on the GPU")
    ap.add_argument("--resume-check", action="store_true",
                    help="kill-and-resume through torchtitan's DCP checkpoints instead of speed")
    ap.add_argument("--resume-model", default="dsv3-debug")
    ap.add_argument("--resume-method", default="mxfp8_128")
    ap.add_argument("--resume-steps", type=int, default=200)
    ap.add_argument("--resume-interval", type=int, default=100)
    ap.add_argument("--resume-kill", type=int, default=150, help="the step after whose log line the run is killed")
    ap.add_argument("--merge", nargs="+", metavar="FILE", default=None,
                    help="no runs: fold these result files of device calls into --out (default the canonical "
                         "benchmarks/results/<their gpu>/torchtitan.json) by (model, method, kind, seed), the rows "
                         "stamped with their file's commit and date, replaced rows kept in the header's "
                         "replaced_rows, the logs beside each file copied into torchtitan_logs/ (CPU is enough)")
    return ap


def plan(models: str | None, methods: str | None, quick: bool) -> list[tuple[str, str]]:
    for name, table in (("model", MODELS), ("method", METHODS)):
        arg = models if name == "model" else methods
        bad = [v for v in (arg or "").split(",") if v and v not in table]
        if bad:
            raise SystemExit(f"unknown {name}(s) {bad}; choose from {', '.join(table)}")
    if quick:
        return [("dsv3-16b", "bf16"), ("dsv3-16b", "mxfp8_128")]
    base = DEFAULT_PLAN
    if models:
        base = [(mo, me) for mo in models.split(",") for me in (methods.split(",") if methods else METHODS)
                if methods or (mo, me) in DEFAULT_PLAN]
    elif methods:
        base = [(mo, me) for mo, me in DEFAULT_PLAN if me in methods.split(",")]
    return base


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    if a.merge:
        files = [Path(f) for f in a.merge]
        out = Path(a.out) if a.out else (C.RESULTS / C.gpu_slug(json.loads(files[0].read_text())["header"].get("gpu"))
                                         / f"{SUITE}.json")
        head, rows = merge_files(out, files)
        copied = copy_logs(files, out.parent / "torchtitan_logs")
        print(f"merged {len(files)} file(s) into {out}: {len(rows)} rows, {len(head.get('replaced_rows', []))} "
              f"replaced rows kept in the header, {len(copied)} logs copied", flush=True)
        return
    runs = plan(a.models, a.methods, a.quick)
    if a.parity:
        runs = [(a.parity_model, m) for m in a.parity_methods.split(",")]
    elif a.resume_check:
        runs = [(a.resume_model, a.resume_method)]
    bad = [mo for mo, me in runs if mo not in MODELS] + [me for mo, me in runs if me not in METHODS]
    if bad:
        raise SystemExit(f"unknown model(s) or method(s) {bad}; models: {', '.join(MODELS)}; "
                         f"methods: {', '.join(METHODS)}")
    if a.launch_counts:
        a.profile_step, a.no_experts_timing = a.profile_step or 25, True
    steps = a.steps = a.steps or (30 if a.quick or a.launch_counts else 1000 if a.parity else 110)
    out = Path(a.out or C.default_out(SUITE))
    if a.dry_run:
        ensure_assets()
        for model, method in runs:
            print(model, method, json.dumps(dry_run(model, method)), flush=True)
        return
    C.require_cuda(SUITE)
    ensure_assets()
    head, rows = _merge(out)
    new = C.header(SUITE, a.quick, steps=steps, warmup=a.warmup, vocab=VOCAB,
                   models={k: MODELS[k] for k in {m for m, _ in runs}})
    kind = "parity" if a.parity else "resume" if a.resume_check else "launch_counts" if a.launch_counts else "speed"
    # into a file of earlier calls: their history stays, this call's line is appended (fold_header)
    head = fold_header(head, new, [{"model": mo, "kind": kind} for mo, _ in runs]) if head else new
    logdir = out.parent / "torchtitan_logs"
    logdir.mkdir(parents=True, exist_ok=True)
    if a.parity:
        parity(a, head, rows, out, logdir)
        return
    if a.resume_check:
        resume_check(a, head, rows, out, logdir)
        return
    for model, method in ([] if a.timing_only else runs):
        log = logdir / f"{'' if kind == 'speed' else kind + '_'}{model}_{method.replace('+', '_')}.txt"
        dump = Path(f"/tmp/tt_out/{model}_{method}")
        shutil.rmtree(dump / "profile_traces", ignore_errors=True)
        extra = tuple(profile_flags(a.profile_step)) if a.profile_step else ()
        cmd = train_cmd(model, method, steps, str(dump), a.seed, None, extra)
        t0 = time.time()
        # launch counts: the trainer waits for the GPU at each step's end (torchtitan_job.synchronize_step), so the
        # profiled window holds exactly one step's kernels
        sync = {SYNC_STEPS_ENV: "1"} if a.launch_counts else {}
        rc = _finish(_launch(cmd, log, **sync), t0 + a.run_s)
        row = {"model": model, "method": method, "rc": rc, "wall_s": round(time.time() - t0, 1),
               **({} if kind == "speed" else {"kind": kind}),
               **parse_log(log.read_text(errors="replace"), a.warmup)}
        if a.profile_step:
            row["profile"] = read_profile(dump)
        row["graph_breaks"] = len(re.findall(r"Graph break", log.read_text(errors="replace")))
        rows = put(head, rows, stamp(row, head))
        C.write_result(out, head, rows)
        print(f"{model} {method}: rc {rc} tokens/s {row['tokens_per_s']} mfu {row['mfu']} "
              f"peak {row['peak_gib']} GiB, {row['wall_s']} s", flush=True)
    if a.no_experts_timing:
        return
    for model in sorted({m for m, _ in runs}):
        methods = [me for mo, me in runs if mo == model]
        try:
            ms, shape = expert_timings(model, methods)
        except Exception as e:  # noqa: BLE001  (the timing is extra: the rows stand without it)
            print(f"{model}: experts timing failed: {e!r}", flush=True)
            continue
        bf16 = next((r for r in rows if row_key(r) == (model, "bf16", "speed", 0)), None)
        step_ms = (MODELS[model]["seq_len"] * MODELS[model]["batch"] / bf16["tokens_per_s"] * 1e3
                   if bf16 and bf16.get("tokens_per_s") else None)
        s = shape["moe_layers"] * ms["bf16"] / step_ms if step_ms else None
        for r in rows:
            key = "bf16" if r["method"] == "bf16" else MX_RECIPE.get(r["method"])
            if r["model"] != model or key not in ms or r.get("kind", "speed") != "speed":
                continue
            r["experts_ms"] = round(ms[key], 3)
            r["experts_ms_bf16"] = round(ms["bf16"], 3)
            if r["method"] in MX_RECIPE and s is not None:
                rr = ms["bf16"] / ms[key]
                r.update(expert_share=round(s, 4), layer_ratio=round(rr, 4),
                         ideal_speedup=round(1 / (1 - s + s / rr), 4))
        C.write_result(out, head, rows)
        print(f"{model}: experts fwd+bwd ms {ms}, expert share {s}", flush=True)


if __name__ == "__main__":
    main()
