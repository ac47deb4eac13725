"""Render ``benchmarks/RESULTS.md`` (and its plots) from the suites' result files; never edit it by hand.

    python -m benchmarks report            # write benchmarks/RESULTS.md and results/<gpu>/<suite>.png
    python -m benchmarks report --check    # exit status 1 if RESULTS.md differs from what the files give

Reads every ``benchmarks/results/<gpu>/<suite>.json`` of the suites of ``benchmarks.__main__.SUITES`` (files with
a ``header`` and ``rows``); one section per suite and GPU folder: the header's GPU, date, versions and commit, a
table of ours against the peers measured in the same run, and a link to the plot.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from benchmarks import common as C

OUT_MD = C.REPO / "benchmarks" / "RESULTS.md"
ORDER = ("quantize", "gemm", "linear", "layer", "train", "torchtitan")
SHAPE_ORDER = {name: i for i, name in enumerate(C.SHAPES)}


def fmt(v, nd: int = 2, suffix: str = "") -> str:
    """A number with ``nd`` decimals (thousands separated when nd is 0), '–' for None or NaN."""
    if v is None or (isinstance(v, float) and v != v):
        return "–"
    return f"{v:,.0f}{suffix}" if nd == 0 else f"{v:.{nd}f}{suffix}"


def pct(v, nd: int = 0) -> str:
    return "–" if v is None else f"{100 * v:.{nd}f}%"


def ratio(a, b):
    return a / b if a is not None and b else None


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"] + [
        "| " + " | ".join(r) + " |" for r in rows]


def shape_key(name: str):
    return SHAPE_ORDER.get(name, len(SHAPE_ORDER)), name


def header_lines(h: dict) -> list[str]:
    """Where and with what a file's rows were measured."""
    peers = ", ".join(f"{k} {v}" for k, v in sorted((h.get("peers") or {}).items())) or "none importable"
    git = h.get("git") or {}
    commit = git.get("commit") or "unknown"
    if git.get("dirty"):
        commit += " (uncommitted changes)"
    out = [f"{h.get('gpu') or 'no GPU'}, driver {h.get('driver') or '?'}, CUDA {h.get('cuda') or '?'}, torch "
           f"{h.get('torch')}, Triton {h.get('triton')}; peers: {peers}; {h.get('date')}; mxmoe commit {commit}"
           + ("; --quick run" if h.get("quick") else "") + "."]
    if h.get("converted_from"):
        out.append("Converted from earlier result files (run numbers below index them): " + "; ".join(
            f"{i}: `{r['source']}` ({r.get('date', '?')})" for i, r in enumerate(h.get("runs", []))) + ".")
    for n in h.get("notes") or []:
        out.append(f"Note: {n}.")
    for r in h.get("lost_runs") or []:
        out.append(f"Lost run ({r.get('commit', '?')}, {r.get('date', '?')}; {', '.join(r.get('models', []))}): "
                   f"{r.get('note', '')}.")
    return out


# --- per-suite tables -------------------------------------------------------------------------------------------

def quantize_section(rows: list[dict]) -> list[str]:
    shapes, cols, cells, kernels = [], [], {}, []
    for r in rows:
        if r["shape"] not in shapes:
            shapes.append(r["shape"])
    for timing in ("do_bench", "cudagraph"):
        cols += [(timing, s) for s in shapes if any(r["shape"] == s and r.get("timing", "do_bench") == timing
                                                   for r in rows)]
    for r in rows:
        key = (r["kernel"], r.get("timing", "do_bench"), r["shape"])
        if key in cells:  # the first run's figure (converted files may hold a kernel twice)
            continue
        cells[key] = f"{r['tbps']:.2f} ({100 * r['ratio']:.0f}%)"
        if r["kernel"] not in kernels:
            kernels.append(r["kernel"])
    head = ["kernel"] + [s + (", CUDA graph" if t == "cudagraph" else "") for t, s in cols]
    body = [[k] + [cells.get((k, t, s), "") for t, s in cols] for k in kernels]
    return ["TB/s (bytes read + written, scales included) and % of a device-to-device copy of the same bytes "
            "timed in the same run; `do_bench` columns unless marked CUDA graph (replays: no host time, no L2 "
            "flush). `ceiling_*`: the data movement alone; `torch_*` / `torchao_*`: peers.", ""] + table(head, body)


def gemm_section(rows: list[dict]) -> list[str]:
    head = ["shape", "proj", "balance", "pass", "recipe (weights)", "timing", "ours TFLOP/s", "BF16", "FP8 rowwise",
            "cuBLAS block loop", "BF16 expansion", "vs BF16", "vs cuBLAS loop", "rel. error"]
    body = []
    for r in sorted(rows, key=lambda r: (r.get("run", 0), shape_key(r["shape"]), r["proj"] != "up",
                                         r["balance"] != "balanced", ("fprop", "dgrad", "wgrad").index(r["pass"]),
                                         r.get("weights", ""))):
        if "error" in r:
            body.append([r["shape"], r["proj"], r["balance"], r["pass"], r["recipe"], "", "error: " + r["error"][:80]]
                        + [""] * 7)
            continue
        body.append([r["shape"], r["proj"], r["balance"], r["pass"], f"{r['recipe']} ({r.get('weights', '')})",
                     r.get("timing", ""), fmt(r["tflops"], 0), fmt(r.get("bf16_tflops"), 0),
                     fmt(r.get("fp8_rowwise_tflops"), 0), fmt(r.get("cublas_block_loop_tflops"), 0),
                     fmt(r.get("bf16x_tflops"), 0), fmt(r.get("vs_bf16"), 2, "x"),
                     fmt(r.get("vs_cublas_block_loop"), 2, "x"), f"{r['rel_err']:.1e}" if "rel_err" in r else "–"])
    return ["TFLOP/s = 2 M N K / time, quantization excluded; peers on the same operands in the same run: BF16 "
            "`torch._grouped_mm`, FP8 rowwise `torch._scaled_grouped_mm`, a per-expert loop of cuBLAS block-scaled "
            "`torch._scaled_mm` (1x128 x 128x128 scales), and the exact recipe's expansion to BF16.", ""] + table(head,
                                                                                                          body)


LINEAR_METHODS = ("bf16", "mxfp8_128", "mxfp8", "torchao_fp8")


def linear_section(rows: list[dict]) -> list[str]:
    head = ["shape", "proj", "balance"] + [f"{m} ms" for m in LINEAR_METHODS] + [
        "mxfp8_128 vs bf16", "mxfp8_128 vs torchao", "torchao vs bf16", "mxfp8_128 vs bf16, eager"]
    body = []
    for r in sorted(rows, key=lambda r: (shape_key(r["shape"]), r["proj"] != "up", r["balance"] != "balanced")):
        m = r["methods"]
        g = {k: m.get(k, {}).get("graph_ms") for k in LINEAR_METHODS}
        e = {k: m.get(k, {}).get("eager_ms") for k in LINEAR_METHODS}
        body.append([r["shape"], r["proj"], r["balance"]] + [fmt(g[k], 2) for k in LINEAR_METHODS] + [
            fmt(ratio(g["bf16"], g["mxfp8_128"]), 2, "x"), fmt(ratio(g["torchao_fp8"], g["mxfp8_128"]), 2, "x"),
            fmt(ratio(g["bf16"], g["torchao_fp8"]), 2, "x"), fmt(ratio(e["bf16"], e["mxfp8_128"]), 2, "x")])
    return ["One expert linear, forward + `autograd.grad` of x and w, quantization included; ms of the step "
            "replayed from a CUDA graph (the last column: eager, host launch work included). Ratios > 1: ours "
            "faster.", ""] + table(head, body)


def layer_cells(r: dict) -> list[str]:
    route = "" if r.get("route", "auto") == "auto" else f" ({r['route']})"
    mem = [ratio(r.get("saved_for_bwd_gib"), r.get("bf16_saved_for_bwd_gib")),
           ratio(r.get("peak_mem_gib"), r.get("bf16_peak_mem_gib"))]
    return [r["shape"], r["balance"], r["recipe"] + route, str(r.get("run", "")), fmt(r["ms"]), fmt(r.get("bf16_ms")),
            fmt(ratio(r.get("bf16_ms"), r["ms"]), 2, "x"), pct(r.get("quant_share"))] + [fmt(m, 2, "x") for m in mem]


def layer_section(rows: list[dict]) -> list[str]:
    out = ["MoE layer forward + backward, 16384 tokens; `vs bf16`: our bf16 recipe's ms over the row's, same run "
           "and timing. Saved for backward and peak memory (eager only) against bf16's.", ""]
    head = ["shape", "balance", "recipe", "run", "ms", "bf16 ms", "vs bf16", "quant. share", "saved vs bf16",
            "peak vs bf16"]
    notes = {"inductor-cudagraphs": " (inductor, the step replayed from CUDA graphs, as `mxmoe train` runs it by default)",
             "cudagraphs": " (torch.compile's plain cudagraphs backend, as `mxmoe train --compile cudagraphs`: it also "
                           "copies the parameters into the graphs' inputs at every replay)",
             "eager": " (every kernel launched from Python)"}
    from benchmarks.bench_layer import TIMINGS  # the suite's own list, in its order

    for timing in TIMINGS:
        sel = [r for r in rows if r.get("timing", "eager") == timing]
        if not sel:
            continue
        body = [layer_cells(r) for r in sorted(sel, key=lambda r: (r.get("run", 0), shape_key(r["shape"]),
                                                                  r["balance"] != "balanced", r["recipe"]))]
        out += [f"Timing `{timing}`{notes.get(timing, '')}:", ""]
        out += table(head, body) + [""]
    return out[:-1]


def train_section(rows: list[dict]) -> list[str]:
    out = []
    tp = [r for r in rows if r.get("kind", "throughput") == "throughput"]
    if tp:
        head = ["run", "compile", "micro-batches", "steps", "recipe", "tokens/s", "ms/step", "MFU", "vs bf16",
                "peak GiB"]
        body = [[str(r.get("run", "")), str(r.get("compile")), str(r.get("grad_accum")), str(r.get("steps")),
                 r["recipe"], fmt(r["tokens_per_s"], 0), fmt(r["ms_per_step"], 1), pct(r.get("mfu"), 1),
                 fmt(r.get("vs_bf16"), 2, "x"), fmt(r.get("peak_mem_gib"), 1)]
                for r in sorted(tp, key=lambda r: (r.get("run", 0), r["recipe"] != "bf16", r["recipe"]))]
        out += ["Throughput, `mxmoe train --preset gpu-throughput` (2 layers, dim 2048, 8 experts top-2, FFN 4096; "
                "MFU against the GPU's dense BF16 peak for every recipe), the recipes one after the other in one "
                "process:", ""] + table(head, body) + [""]
    cv = [r for r in rows if r.get("kind") == "convergence"]
    if cv:
        head = ["recipe", "seeds", "final val loss, mean", "seed spread", "gap to bf16, mean (per seed)",
                "val - train, worst"]
        body = []
        for rec in dict.fromkeys(r["recipe"] for r in cv):
            sel = sorted((r for r in cv if r["recipe"] == rec), key=lambda r: r["seed"])
            vals = [r["val_loss"] for r in sel]
            gaps = [r.get("gap_pct") for r in sel]
            gap = "" if rec == "bf16" or None in gaps else (f"{statistics.mean(gaps):+.2f}% (" + " / ".join(
                f"{g:+.2f}" for g in gaps) + "%)")
            body.append([rec, ", ".join(str(r["seed"]) for r in sel), f"{statistics.mean(vals):.4f}",
                         f"{max(vals) - min(vals):.4f}", gap, f"{max(r['val_minus_train_pct'] for r in sel):+.2f}%"])
        out += ["Convergence, `mxmoe train --preset gpu` (2000 steps of 16,384 tokens), final validation loss "
                "(nats/byte) per recipe over seeds:", ""] + table(head, body) + [""]
    return out[:-1]


PROFILE_ORDER = ("experts_gemm", "experts_other", "attention", "dense_gemm", "optimizer", "communication", "other")


def torchtitan_profiles(rows: list[dict]) -> list[str]:
    """Per model, the profiled step's GPU kernel milliseconds by class for each method (share of the kernel
    total in brackets), the kernel total and the step's wall span."""
    out = []
    prof = [r for r in rows if r.get("kind", "speed") == "speed" and r.get("profile")]
    for model in dict.fromkeys(r["model"] for r in prof):
        sel = [r for r in prof if r["model"] == model]
        classes = [c for c in PROFILE_ORDER if any(c in r["profile"].get("kernel_ms", {}) for r in sel)]
        body = []
        for r in sel:
            p = r["profile"]
            body.append([str(r["method"])] + [f"{fmt(p['kernel_ms'].get(c), 1)} ({pct(p.get('share', {}).get(c))})"
                                              for c in classes]
                        + [fmt(p.get("kernel_total_ms"), 1), fmt(p.get("step_ms"), 1), str(r.get("commit", "–"))])
        out += ["", f"Where the time goes, {model} (`--profile-step`, torch.profiler over one step, "
                f"{sel[0]['profile'].get('trace', '?')}): GPU kernel ms by class (share of the kernel total); "
                "classes as `bench_torchtitan.PROFILE_CLASSES` (the experts' grouped GEMMs, their other kernels: "
                "quantizers, permutations, casts, sorts; dense GEMMs: projections, shared experts, LM head).", ""]
        out += table(["method"] + classes + ["kernel total", "step span", "commit"], body)
    return out


def torchtitan_checks(rows: list[dict]) -> list[str]:
    """The parity rows (final loss: mean of the last 20 logged losses) with their summary, and the
    kill-and-resume rows."""
    from benchmarks.bench_torchtitan import parity_summary

    out = []
    par = [r for r in rows if r.get("kind") == "parity"]
    if par:
        body = [[str(r["model"]), str(r["method"]), str(r.get("seed")), str((r.get("steps") or [None])[-1]),
                 str(r.get("batch")), fmt(statistics.fmean(r["loss"][-20:]) if r.get("loss") else None, 4),
                 str(r.get("commit", "–"))] for r in par]
        out += ["", "Loss parity (`--parity`; runs two at a time on the GPU, so no speed figure): final loss = mean of "
                "the last 20 logged steps.", ""] + table(
            ["model", "method", "seed", "steps", "sequences a step", "final loss", "commit"], body)
        for model in dict.fromkeys(r["model"] for r in par):
            s = parity_summary(rows, model, 20)
            if "bf16_seed_spread" not in s:
                continue
            gaps = "; ".join(f"{k[4:]} {s[k]:+.4f} ({'within' if s['within_' + k[4:]] else 'outside'} the spread)"
                             for k in s if k.startswith("gap_"))
            out += ["", f"Parity, {model}: bf16's seed spread (max - min final loss over seeds) "
                    f"{s['bf16_seed_spread']:.4f}; gap to bf16 (mean over seeds): {gaps}."]
    counts = [r for r in rows if r.get("kind") == "launch_counts" and (r.get("profile") or {}).get("experts_kernels")]
    if counts:
        names = list(dict.fromkeys(k for r in counts for k in r["profile"]["experts_kernels"]
                                   if re.search(r"mx_|gemm|quantize|swiglu", k)))
        body = [[str(r["model"]), str(r["method"]), str(r.get("commit", "–"))]
                + [str((r["profile"]["experts_kernels"].get(k) or ["–"])[0]) for k in names]
                + [fmt(r.get(k), 2) for k in ("peak_gib", "peak_active_gib", "backward_start_gib")] for r in counts]
        out += ["", "Launches a step of the experts' GEMM and quantization kernels (`--launch-counts`: 30-step runs, "
                "step 25 profiled; on Hopper the weights' quantizations are `mx_quantize_cols_kernel` launches). Since "
                "54faa36 the trainer waits for the GPU at each step's end, so the window holds step 25 alone; before, "
                "it could take in launches of the steps beside it: compare rows of one commit (one call). Memory: "
                "torchtitan's reserved peak over the run; after 10 warm-up steps, the allocator's peak active memory "
                "of a step and the most allocated as a backward began:",
                ""] + table(["model", "method", "commit"] + [f"`{k[:48]}`" for k in names]
                            + ["reserved GiB", "active GiB", "at bwd start GiB"], body)
    for r in (r for r in rows if r.get("kind") == "resume"):
        out += ["", f"Kill-and-resume (`--resume-check`, {r['model']} {r['method']}, commit {r.get('commit', '–')}): "
                f"checkpoints every {r.get('interval')} steps, killed after step {r.get('killed_after_step')}, resumed "
                f"from the step-{r.get('interval')} checkpoint (first logged step {r.get('first_resumed_step')})."]
        if "max_abs_loss_diff_resumed_vs_killed" in r:
            out[-1] += (f" Largest |loss difference|: resumed - killed on the re-run steps {_span(r.get('rerun_steps'))} "
                        f"{fmt(r.get('max_abs_loss_diff_resumed_vs_killed'), 5)} (what the resume changes); killed - "
                        f"uninterrupted on steps {_span(r.get('noise_steps'))} {fmt(r.get('run_to_run_noise'), 4)} "
                        f"(run-to-run noise, before any checkpoint); resumed - uninterrupted on steps "
                        f"{_span(r.get('compared_steps'))} {fmt(r.get('max_abs_loss_diff_after_resume'), 4)}.")
        else:
            out[-1] += (f" Largest |resumed - uninterrupted| loss over steps {r.get('compared_steps')}: "
                        f"{fmt(r.get('max_abs_loss_diff_after_resume'), 4)}.")
    return out


def _span(steps) -> str:
    return f"{steps[0]}-{steps[-1]}" if steps else "–"


SCOPES = ("linear_fp8", "shared")  # method suffixes that widen what runs in FP8 (others, e.g. "+keep", do not)


def _scope(method) -> frozenset:
    return frozenset(str(method).split("+")[1:]) & frozenset(SCOPES)


def _torchao_of(rows: list[dict]):
    """row -> tokens/s of torchao FP8 rowwise's row of the same model and scope (:data:`SCOPES`: ``+linear_fp8``,
    ``+shared``, or the routed experts alone)."""
    ao = {(r.get("model"), _scope(r["method"])): r.get("tokens_per_s")
          for r in rows if str(r.get("method", "")).startswith("torchao_fp8")}
    return lambda r: ao.get((r.get("model"), _scope(r.get("method", ""))))


def torchtitan_section(rows: list[dict]) -> list[str]:
    checks = torchtitan_checks(rows)
    rows = [r for r in rows if r.get("kind", "speed") == "speed"]
    head = ["model", "method", "tokens/s", "vs bf16", "vs torchao FP8", "MFU", "peak GiB", "active GiB",
            "at bwd start GiB", "loss at the last step", "timed steps", "expert share", "experts ratio",
            "ideal speed-up", "commit"]
    ref = {r.get("model"): r.get("tokens_per_s") for r in rows if r.get("method") == "bf16"}
    ao = _torchao_of(rows)
    body = [[str(r.get("model")), str(r.get("method")), fmt(r.get("tokens_per_s"), 0),
             fmt(ratio(r.get("tokens_per_s"), ref.get(r.get("model"))), 3, "x"),
             fmt(ratio(r.get("tokens_per_s"), ao(r)), 3, "x"), pct(r.get("mfu"), 1),
             fmt(r.get("peak_gib"), 1), fmt(r.get("peak_active_gib"), 1), fmt(r.get("backward_start_gib"), 1),
             fmt((r.get("loss") or [None])[-1], 3),
             str(r.get("timed_steps", "–")),
             pct(r.get("expert_share")), fmt(r.get("layer_ratio"), 2, "x"), fmt(r.get("ideal_speedup"), 2, "x"),
             str(r.get("commit", "–"))]  # rows merged from several calls carry their own commit
            for r in rows]
    return ["torchtitan 0.2.2's own training entry point (`python -m benchmarks torchtitan`), cut flavors of the "
            "published models, `--compile.enable`, selective activation checkpointing; `bf16`: torchtitan's "
            "experts, `torchao_fp8`: torchao's FP8 rowwise MoE on the routed experts (mxmoe's scope), the others "
            "mxmoe's converter; `+shared`: torchao on the shared experts' linears too; `+linear_fp8`: torchtitan's "
            "FP8 rowwise dense linears as well (a row compares with torchao's of the same scope). "
            "tokens/s: median of "
            "the logged 5-step intervals after 10 warm-up steps. peak GiB: torchtitan's max reserved over the run; "
            "active GiB: the allocator's peak active memory of a step; at bwd start GiB: the most memory allocated "
            "as a backward began (the weights, AdamW's moments and what the forward saved); both after the warm-up, "
            "in rows from 2026-12-06 on (the file's notes). Rows from several calls (their commit column; the "
            "header's git note): ratios across commits compare calls on different machines.", ""] + (
                table(head, body) + torchtitan_profiles(rows) + checks)


SECTIONS = {"quantize": ("Quantization kernels", quantize_section), "gemm": ("Grouped GEMMs", gemm_section),
            "linear": ("One expert linear layer", linear_section), "layer": ("MoE layer", layer_section),
            "train": ("Training (`mxmoe train`)", train_section), "torchtitan": ("torchtitan", torchtitan_section)}


def result_files(results: Path) -> list[tuple[str, str, Path]]:
    """(gpu folder, suite, path) of every suite result file under ``results``, in report order."""
    out = []
    for folder in sorted(p for p in results.iterdir() if p.is_dir()):
        for suite in ORDER:
            if (folder / f"{suite}.json").exists():
                out.append((folder.name, suite, folder / f"{suite}.json"))
    return out


EXTRA_PLOTS = {"torchtitan": ("loss", "parity")}  # <suite>_<name>.png beside a suite's own plot, shown where present


def render(results: Path = C.RESULTS) -> str:
    """RESULTS.md's text from the result files under ``results`` (pure: writes nothing)."""
    lines = ["# mxmoe benchmark results", "",
             "Generated by `python -m benchmarks report` from `benchmarks/results/<gpu>/<suite>.json` (each written "
             "by `python -m benchmarks <suite>`); do not edit by hand: `tests/test_benchmarks.py` fails when this "
             "file is stale. Every ratio is against a peer measured in the same run on the same GPU.", ""]
    files = result_files(results)
    lines += ["| suite | GPU folder | date | rows |", "| --- | --- | --- | --- |"]
    docs = []
    for gpu, suite, path in files:
        doc = json.loads(path.read_text())
        docs.append((gpu, suite, doc))
        ok = isinstance(doc.get("header"), dict) and isinstance(doc.get("rows"), list)
        n = len(doc["rows"]) if ok else "not in the suite format"
        lines.append(f"| [{suite}](#{suite}-{gpu}) | {gpu} | {doc['header'].get('date', '?') if ok else '?'} | {n} |")
    for gpu, suite, doc in docs:
        title, section = SECTIONS[suite]
        lines += ["", f"## {suite} ({gpu})", "", f"**{title}**, `python -m benchmarks {suite}` -> "
                  f"`benchmarks/results/{gpu}/{suite}.json`.", ""]
        if not (isinstance(doc.get("header"), dict) and isinstance(doc.get("rows"), list)):
            lines.append(f"This file is not in the suite format (no header and rows): rerun `python -m benchmarks "
                         f"{suite}`.")
            continue
        lines += header_lines(doc["header"]) + [""]
        lines += [f"![{suite} {extra}](results/{gpu}/{suite}_{extra}.png)\n" for extra in EXTRA_PLOTS.get(suite, ())
                  if (results / gpu / f"{suite}_{extra}.png").exists()]
        lines += section(doc["rows"])
        if suite in PLOTS:
            lines += ["", f"![{suite}](results/{gpu}/{suite}.png)"]
    return "\n".join(lines) + "\n"


# --- plots ------------------------------------------------------------------------------------------------------

def _bars(path: Path, title: str, labels: list[str], series: dict[str, list], ylabel: str, ref: float | None = 1.0):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(labels) * max(1, len(series))), 4.0))
    width = 0.8 / max(1, len(series))
    for i, (name, vals) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(labels))]
        ax.bar(xs, [v if v is not None else 0 for v in vals], width, label=name)
    if ref is not None:
        ax.axhline(ref, color="black", lw=0.8)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_layer(rows, path):
    newest = max(r.get("run", 0) for r in rows)
    sel = [r for r in rows if r["balance"] == "balanced" and r.get("run", 0) == newest]
    shapes = sorted({r["shape"] for r in sel}, key=shape_key)
    series = {}
    for r in sel:
        key = f"{r['recipe']}, {r.get('timing', 'eager')}"
        series.setdefault(key, {})[r["shape"]] = ratio(r.get("bf16_ms"), r["ms"])
    _bars(path, f"MoE layer fwd+bwd, speed-up over bf16 (balanced, run {newest})", shapes,
          {k: [v.get(s) for s in shapes] for k, v in series.items()}, "x bf16")


def plot_linear(rows, path):
    rows = sorted(rows, key=lambda r: (shape_key(r["shape"]), r["proj"], r["balance"]))
    labels = [f"{r['shape']} {r['proj']}" + ("" if r["balance"] == "balanced" else " skew") for r in rows]
    series = {m: [ratio(r["methods"].get("bf16", {}).get("graph_ms"), r["methods"].get(m, {}).get("graph_ms"))
                  for r in rows] for m in ("mxfp8_128", "mxfp8", "torchao_fp8")}
    _bars(path, "One expert linear fwd+bwd (CUDA graph), speed-up over bf16", labels, series, "x bf16")


def plot_gemm(rows, path):
    sel = [r for r in rows if r["recipe"] == "mxfp8_128" and r["balance"] == "balanced" and "error" not in r]
    sel.sort(key=lambda r: (shape_key(r["shape"]), r["proj"]))
    labels = list(dict.fromkeys(f"{r['shape']} {r['proj']}" for r in sel))
    series = {p: [next((r["vs_bf16"] for r in sel if f"{r['shape']} {r['proj']}" == lab and r["pass"] == p), None)
                  for lab in labels] for p in ("fprop", "dgrad", "wgrad")}
    _bars(path, "mxfp8_128 grouped GEMM, speed-up over BF16 torch._grouped_mm (balanced)", labels, series, "x bf16")


def plot_quantize(rows, path):
    shape = rows[0]["shape"]
    sel = [r for r in rows if r["shape"] == shape and r.get("timing", "do_bench") == "do_bench"]
    kernels = list(dict.fromkeys(r["kernel"] for r in sel))
    vals = [next(r["ratio"] for r in sel if r["kernel"] == k) for k in kernels]
    _bars(path, f"Quantization kernels on {shape}, fraction of a device copy's bandwidth", kernels,
          {"of copy": vals}, "fraction of copy", ref=0.9)


def plot_train(rows, path):
    sel = [r for r in rows if r.get("kind", "throughput") == "throughput"]
    runs = list(dict.fromkeys((r.get("run", 0), r.get("compile"), r.get("grad_accum")) for r in sel))
    recipes = list(dict.fromkeys(r["recipe"] for r in sel))
    labels = [f"run {run}: {c}, accum {a}" for run, c, a in runs]
    series = {rec: [next((r.get("vs_bf16") for r in sel if (r.get("run", 0), r.get("compile"), r.get("grad_accum"))
                          == key and r["recipe"] == rec), None) for key in runs] for rec in recipes}
    _bars(path, "mxmoe train gpu-throughput: tokens/s over bf16's", labels, series, "x bf16")


def plot_torchtitan(rows, path):
    """Speed-up over bf16 and over torchao FP8 rowwise per (model, method) in ``path``; beside it
    (``torchtitan_loss.png``) each speed run's logged training loss and (``torchtitan_parity.png``) the parity
    runs' loss curves."""
    plot_torchtitan_parity(rows, Path(path).with_name("torchtitan_parity.png"))
    curves = [r for r in rows if r.get("steps") and r.get("loss") and r.get("kind", "speed") == "speed"]
    rows = [r for r in rows if r.get("kind", "speed") == "speed"]
    ref = {r.get("model"): r.get("tokens_per_s") for r in rows if r.get("method") == "bf16"}
    ao = _torchao_of(rows)
    labels = [f"{r.get('model')} {r.get('method')}" for r in rows]
    _bars(path, "torchtitan: tokens/s over bf16's and over torchao FP8 rowwise's (same scope)", labels,
          {"x bf16": [ratio(r.get("tokens_per_s"), ref.get(r.get("model"))) for r in rows],
           "x torchao_fp8": [ratio(r.get("tokens_per_s"), ao(r)) for r in rows]}, "speed-up")
    if not curves:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in curves})
    fig, axes = plt.subplots(1, len(models), figsize=(5.0 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        for r in curves:
            if r["model"] == model:
                label = r["method"] + (f" seed {r.get('seed')} (parity)" if r.get("kind") == "parity" else "")
                ax.plot(r["steps"], r["loss"], lw=1.0, label=label)
        ax.set_title(f"torchtitan {model}: training loss", fontsize=10)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(Path(path).with_name("torchtitan_loss.png"), dpi=110)
    plt.close(fig)


def plot_torchtitan_parity(rows, path):
    """The parity runs' loss per method and seed (a moving mean over 5 logged steps: each logged loss is one
    step's), one panel per model; nothing without parity rows."""
    par = [r for r in rows if r.get("kind") == "parity" and r.get("steps") and r.get("loss")]
    if not par:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in par))
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.0), squeeze=False)
    colors = {}
    for ax, model in zip(axes[0], models):
        for r in (r for r in par if r["model"] == model):
            loss, n = r["loss"], 5
            smooth = [statistics.fmean(loss[max(0, i - n + 1):i + 1]) for i in range(len(loss))]
            color = colors.setdefault(r["method"], f"C{len(colors)}")
            ax.plot(r["steps"], smooth, lw=1.0, color=color, ls="-" if r.get("seed", 0) == 0 else "--",
                    label=f"{r['method']} seed {r.get('seed')}")
        ax.set_title(f"torchtitan {model}: loss parity (moving mean of 5 logged steps)", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_ylim(top=min(ax.get_ylim()[1], 8.0))
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PLOTS = {"quantize": plot_quantize, "gemm": plot_gemm, "linear": plot_linear, "layer": plot_layer,
         "train": plot_train, "torchtitan": plot_torchtitan}


def write_plots(results: Path = C.RESULTS) -> list[Path]:
    """One PNG per suite file (``results/<gpu>/<suite>.png``); returns the paths written."""
    written = []
    for gpu, suite, path in result_files(results):
        doc = json.loads(path.read_text())
        if isinstance(doc.get("header"), dict) and doc.get("rows") and suite in PLOTS:
            out = path.with_suffix(".png")
            PLOTS[suite](doc["rows"], out)
            written.append(out)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only compare RESULTS.md with the result files")
    ap.add_argument("--no-plots", action="store_true", help="write RESULTS.md only")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if OUT_MD.exists() and OUT_MD.read_text() == text:
            print("RESULTS.md is up to date")
            return 0
        print("RESULTS.md is stale: run python -m benchmarks report", file=sys.stderr)
        return 1
    OUT_MD.write_text(text)
    print(f"wrote {OUT_MD}")
    if not args.no_plots:
        for p in write_plots():
            print(f"wrote {p}")
    return 0
