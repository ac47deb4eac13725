"""What a run reports: the stored seed-to-seed spread and the verdict on a recipe's gap to bf16, the
summary table, ``loss.png``, throughput rows, comparisons of runs over seeds, model FLOPs per token."""

import dataclasses
import json
import os
import platform
import time
from pathlib import Path

import torch

from mxmoe.train.config import PEAK_FLOPS, VOCAB, TrainConfig, make_config

# Seed-to-seed spread, measured per preset: the same run with seeds 0, 1, 2 (other init, other batch
# order), each recipe's validation loss at every validation step. `mxmoe train --seed S --device cpu` on
# 2 pinned CPU cores (the H200 host's, torch 2.11.0 CPU ops), 2026-12-01, on Python 3.11.7's standard
# library (docs/training.md). A stored spread applies to runs on that Python's stdlib.
SEED_SPREAD: dict[str, dict] = {
    "default": {
        "data": "Python 3.11.7 standard library", "python": "3.11",
        "val_step": list(range(0, 301, 25)),
        "runs": {
            0: {"bf16": [5.7929, 2.9714, 2.6878, 2.5955, 2.4907, 2.4276, 2.3731, 2.3178, 2.2648, 2.2305, 2.1863,
                         2.1545, 2.1293],
                "mxfp8": [5.792, 2.9691, 2.6822, 2.5767, 2.5151, 2.4451, 2.391, 2.3385, 2.2943, 2.2496, 2.2166,
                          2.188, 2.1636]},
            1: {"bf16": [5.5761, 2.8962, 2.6459, 2.4904, 2.444, 2.3588, 2.2952, 2.2407, 2.1892, 2.1635, 2.1159,
                         2.0854, 2.0717],
                "mxfp8": [5.5745, 2.9014, 2.6612, 2.516, 2.4263, 2.3783, 2.3171, 2.2735, 2.2028, 2.1744, 2.1307,
                          2.1012, 2.0854]},
            2: {"bf16": [5.6458, 2.9767, 2.675, 2.5279, 2.4569, 2.3787, 2.3325, 2.266, 2.2121, 2.1803, 2.1374,
                         2.0977, 2.0731],
                "mxfp8": [5.6475, 2.9607, 2.682, 2.5335, 2.4842, 2.4291, 2.3702, 2.3161, 2.2783, 2.2308, 2.2007,
                          2.1694, 2.1442]},
        },
    },
}

# fields that do not change what a run computes (or not beyond summation order): a stored spread applies
# to a run whose other fields equal the preset's
# (stored runs' configs may hold fields of older versions, e.g. cpu_bf16_gemm: only today's fields are compared)
_SPREAD_FREE = ("out", "overwrite", "device", "recipes", "seed", "compile", "eval_every", "data", "data_cache",
                "checkpoint_every", "resume")

# fields added after runs were stored, with the value those runs ran with
_ADDED_LATER = {"grad_accum": 1}


def _data_source(cfg: dict) -> str:
    """``stdlib``, ``python-all`` or the folder a run of config dict ``cfg`` reads (:func:`resolve_source`)."""
    device = cfg.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    data = cfg.get("data") or ""
    return data or ("python-all" if device.startswith("cuda") else "stdlib")


def seed_spread(cfg: dict) -> dict | None:
    """The stored seed-to-seed spread (:data:`SEED_SPREAD`) for a run of config ``cfg`` (a dict of
    :class:`TrainConfig` fields), or None when none was measured for its settings.

    Returns ``{"preset", "seeds", "bf16_val": {seed: final val}, "spread": max - min of bf16's final val
    losses, "gaps": {recipe: [final val - bf16's, per seed]}, "val_step", "bf16_curves": {seed: [...]},
    "data", "python"}``.
    """
    source = _data_source(cfg)
    if source == "python-all":
        return None  # every spread was measured on a standard library
    for preset, spread in SEED_SPREAD.items():
        if source == "stdlib" and not platform.python_version().startswith(spread["python"] + "."):
            continue  # this Python's stdlib is other data
        want = dataclasses.asdict(make_config(preset))
        if all(cfg.get(k, _ADDED_LATER.get(k)) == v for k, v in want.items() if k not in _SPREAD_FREE):
            runs = spread["runs"]  # {seed: {recipe: [val losses at val_step]}}
            finals = {seed: r["bf16"][-1] for seed, r in runs.items()}
            gaps = {rec: [r[rec][-1] - r["bf16"][-1] for r in runs.values()]
                    for rec in next(iter(runs.values())) if rec != "bf16"}
            return {"preset": preset, "seeds": sorted(runs), "bf16_val": finals,
                    "spread": max(finals.values()) - min(finals.values()), "gaps": gaps,
                    "val_step": spread["val_step"], "bf16_curves": {seed: r["bf16"] for seed, r in runs.items()},
                    "data": spread["data"], "python": spread["python"]}
    return None


def verdict(gap: float, spread: dict | None, recipe: str | None = None) -> str:
    """One sentence: is a final val-loss gap (``recipe`` minus bf16, nats) inside the seed-to-seed spread
    of bf16's final val loss (``spread`` from :func:`seed_spread`; None: not measured, said so)? With
    ``recipe``, the gaps the stored seeds gave for it are quoted too."""
    if spread is None:
        return ("no seed-to-seed spread is stored for these settings (mxmoe.train.SEED_SPREAD): run bf16 with "
                "two --seed values to measure one before reading the gap")
    n, sp = len(spread["seeds"]), spread["spread"]
    where = "inside" if abs(gap) <= sp else "outside"
    reading = ("not distinguishable from seed noise" if where == "inside"
               else ("lower than bf16 beyond" if gap < 0 else "higher than bf16 beyond") + " seed noise")
    text = (f"|gap| {abs(gap):.4f} is {where} the seed-to-seed spread of bf16's final val loss on the "
            f"{spread['preset']} preset, {sp:.4f} nats ({n} seeds, {spread['data']}): {reading}")
    gaps = spread["gaps"].get(recipe) if recipe else None
    if gaps:
        text += f"; the stored seeds' own gaps for {recipe}: {', '.join(f'{g:+.4f}' for g in gaps)}"
    return text


def plot_losses(metrics: dict, path: Path) -> None:
    """``loss.png`` (Agg backend): top, every recipe's train loss (raw, faint, and a 10-step moving
    average) and validation loss (markers at every validation step; distinct colour, line style and
    marker per recipe; the y range starts below the step-0 loss so the curves are readable, step 0
    noted); bottom, each recipe's validation loss minus bf16's at every validation step, with the
    stored seed-to-seed spread of bf16 (:func:`seed_spread`) as a band where it is known."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    styles = [("C0", "-", "o"), ("C3", "--", "s"), ("C2", ":", "^"), ("C1", "-.", "D"), ("C4", "-", "v")]
    recs = metrics["recipes"]
    fig = Figure(figsize=(9, 7.5))
    FigureCanvasAgg(fig)
    ax, dax = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    lows, highs = [], []
    for i, (recipe, m) in enumerate(recs.items()):
        color, ls, marker = styles[i % len(styles)]
        tl = torch.tensor(m["train_loss"])
        steps = torch.arange(1, len(tl) + 1)
        ax.plot(steps, tl, color=color, lw=0.5, alpha=0.25)
        w = min(10, len(tl))
        smooth = tl.unfold(0, w, 1).mean(1)
        ax.plot(steps[w - 1:], smooth, color=color, ls=ls, lw=1.2, alpha=0.8, label=f"{recipe} train ({w}-step mean)")
        ax.plot(m["val_step"], m["val_loss"], color=color, ls=ls, lw=2, marker=marker, ms=6 + 2 * (i == 0),
                mfc="white" if i else color, mew=1.5, label=f"{recipe} val", zorder=3 + i)
        lows.append(min(m["val_loss"] + smooth.tolist()))
        highs.append(max(m["val_loss"][1:] + smooth[: max(1, len(smooth) // 10)].tolist()) if len(m["val_loss"]) > 1
                     else m["val_loss"][0])
    top = max(highs)
    ax.set_ylim(min(lows) - 0.05 * (top - min(lows)), top + 0.05 * (top - min(lows)))
    first = next(iter(recs.values()))
    if first["val_loss"][0] > top:
        ax.annotate(f"step 0 val: {first['val_loss'][0]:.2f} (off scale)", xy=(0.01, 0.97), xycoords="axes fraction",
                    va="top", fontsize=8)
    cfg = metrics["config"]
    ax.set(ylabel="cross-entropy (nats / byte)",
           title=f"MoE LM on {metrics.get('data', {}).get('source', 'stdlib')} bytes: {cfg['layers']}L d{cfg['dim']} "
                 f"{cfg['experts']}E top-{cfg['top_k']}, "
                 f"seed {cfg['seed']}, {metrics['env']['device']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    spread = seed_spread(cfg)
    if "bf16" in recs:
        ref = recs["bf16"]
        if spread is not None and spread["val_step"] == ref["val_step"]:
            curves = torch.tensor(list(spread["bf16_curves"].values()))  # [seeds, evals]
            band = (curves.max(0).values - curves.min(0).values).tolist()
            dax.fill_between(ref["val_step"], [-b for b in band], band, color="0.8", alpha=0.7,
                             label=f"± bf16 seed-to-seed spread ({len(curves)} seeds)")
        elif spread is not None:
            dax.axhspan(-spread["spread"], spread["spread"], color="0.8", alpha=0.7,
                        label=f"± final bf16 seed-to-seed spread ({len(spread['seeds'])} seeds)")
        for i, (recipe, m) in enumerate(recs.items()):
            if recipe == "bf16" or m["val_step"] != ref["val_step"]:
                continue
            color, ls, marker = styles[i % len(styles)]
            diff = [v - r for v, r in zip(m["val_loss"], ref["val_loss"])]
            dax.plot(m["val_step"], diff, color=color, ls=ls, marker=marker, mfc="white", mew=1.5,
                     label=f"{recipe} − bf16")
        dax.axhline(0, color="k", lw=0.8)
        dax.set_ylabel("val loss − bf16's (nats)")
        if dax.get_legend_handles_labels()[0]:  # a bf16-only run without a stored spread has none
            dax.legend(fontsize=8)
    else:
        dax.text(0.5, 0.5, "no bf16 run: no difference to show", ha="center", va="center", transform=dax.transAxes)
    dax.set_xlabel("step")
    dax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def summarize(metrics: dict) -> str:
    """A small table (recipe, final train loss (mean of the last 10 steps), final val loss,
    tokens/s, wall s; on CUDA also ms/step, MFU and peak memory), then each recipe's final val-loss gap
    to bf16 (nats and %) with a verdict against the stored seed-to-seed spread (:func:`verdict`). On the
    CPU the speed column is headed ``ref tok/s``: every recipe runs the pure-torch reference there, not
    the GPU kernels."""
    w = max([10] + [len(r) + 1 for r in metrics["recipes"]])  # recipe column: the longest name + 1
    cpu = metrics["env"]["device"].startswith("cpu")
    speed = "ref tok/s" if cpu else "tokens/s"
    gpu = "" if cpu else f"{'ms/step':>9}{'MFU':>7}{'peak GiB':>9}"
    rows = [f"{'recipe':<{w}}{'train loss':>12}{'val loss':>10}{speed:>11}{'wall s':>8}{gpu}"]
    for recipe, m in metrics["recipes"].items():
        rows.append(f"{recipe:<{w}}{m['final_train_loss']:>12.4f}{m['val_loss'][-1]:>10.4f}"
                    f"{m['tokens_per_s']:>11,.0f}{m['wall_s']:>8.1f}" + ("" if cpu else
                    f"{m['ms_per_step']:>9.1f}{100 * (m.get('mfu') or 0):>6.1f}%{m['peak_mem_gib'] or 0:>9.1f}"))
    if not cpu:
        rows.append(f"MFU: {metrics.get('model_flops_per_token', 0) / 1e9:.3f} GFLOP per token (6 x matmul params "
                    f"used + attention) x tokens/s over {metrics.get('peak_flops', PEAK_FLOPS) / 1e12:.1f} TFLOP/s "
                    "(H200 dense BF16, every recipe)")
    if cpu:
        rows.append(f"{speed}: the CPU runs every recipe's pure-torch reference (MX: quantize, dequantize, FP32 "
                    "products); it says nothing about the GPU kernels' speed")
    spread = seed_spread(metrics["config"])
    for recipe, gap in metrics.get("val_gap_vs_bf16_pct", {}).items():
        nats = metrics["recipes"][recipe]["val_loss"][-1] - metrics["recipes"]["bf16"]["val_loss"][-1]
        rows.append(f"{recipe} vs bf16 final val loss: {nats:+.4f} nats ({gap:+.2f}%); {verdict(nats, spread, recipe)}")
    return "\n".join(rows)


def throughput_rows(metrics: dict) -> list[dict]:
    """Rows of ``train_gpu_throughput.json``, one per recipe of a run's ``metrics``: ``recipe``,
    ``tokens_per_s`` (training steps, warm-up excluded), ``mfu`` (see the module docstring; None off
    CUDA), ``ms_per_step`` (one optimizer step), ``tokens_per_step`` (all ranks), ``peak_mem_gib`` (None off
    CUDA) and ``vs_bf16`` (tokens/s over bf16's; None without a bf16 run)."""
    recs, cfg = metrics["recipes"], metrics["config"]
    ref = recs.get("bf16", {}).get("tokens_per_s")
    per_step = cfg["batch_size"] * cfg["seq_len"] * cfg.get("grad_accum", 1) * metrics["env"].get("world_size", 1)
    return [{"recipe": r, "tokens_per_s": m["tokens_per_s"], "mfu": m.get("mfu"), "ms_per_step": m["ms_per_step"],
             "tokens_per_step": per_step, "peak_mem_gib": m["peak_mem_gib"],
             "vs_bf16": m["tokens_per_s"] / ref if ref else None}
            for r, m in recs.items()]


def write_throughput(metrics: dict | str | os.PathLike, path: str | os.PathLike) -> dict:
    """Write ``train_gpu_throughput.json`` to ``path`` from a run's metrics (a dict or its
    ``metrics.json``): ``rows`` (:func:`throughput_rows`), ``env``, ``config``, ``params``,
    ``model_flops_per_token``, ``peak_flops`` and the date. Returns what it wrote."""
    if not isinstance(metrics, dict):
        metrics = json.loads(Path(metrics).read_text())
    doc = {"rows": throughput_rows(metrics), "env": metrics["env"], "config": metrics["config"],
           "params": metrics["params"], "model_flops_per_token": metrics.get("model_flops_per_token"),
           "peak_flops": metrics.get("peak_flops"), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    Path(path).write_text(json.dumps(doc, indent=1))
    return doc


def compare_runs(runs: list[dict]) -> dict:
    """Recipes over seeds, from runs' metrics (e.g. ``train_gpu_<recipe>_seed<N>.json``, one recipe or
    more each; a (recipe, seed) given twice raises ValueError, as do runs of other settings than the
    first's, seed and recipes aside).

    Returns ``{recipe: {"seeds": [...], "val": {seed: final val loss}, "val_mean", "val_spread" (max - min),
    "train": {seed: final train loss}, "val_minus_train_pct": {seed: 100 (val - train) / train},
    "gap_pct": {seed: 100 (val - bf16's val of that seed) / bf16's} (seeds with a bf16 run), "gap_mean_pct"
    (None without any)}}``.
    """
    if not runs:
        raise ValueError("compare_runs: no runs given")
    # compile: compared as the backend the steps ran under (``auto`` resolves differently across versions)
    free = ("seed", "recipes", "out", "resume", "overwrite", "device", "data_cache", "checkpoint_every", "compile")

    def settings(metrics: dict) -> dict:
        backends = {m.get("compile") for m in metrics["recipes"].values()}
        config = {**_ADDED_LATER, **metrics["config"]}
        return {**{k: v for k, v in config.items() if k not in free}, "compile": sorted(map(str, backends))}

    first = settings(runs[0])
    by: dict[str, dict[int, dict]] = {}
    for metrics in runs:
        cfg = metrics["config"]
        if settings(metrics) != first:
            raise ValueError(f"compare_runs: run of seed {cfg['seed']} ({', '.join(metrics['recipes'])}) has other "
                             "settings than the first run's")
        for recipe, m in metrics["recipes"].items():
            if cfg["seed"] in by.setdefault(recipe, {}):
                raise ValueError(f"compare_runs: recipe {recipe} seed {cfg['seed']} given twice")
            by[recipe][cfg["seed"]] = m
    out = {}
    for recipe, seeds in by.items():
        val = {s: m["val_loss"][-1] for s, m in sorted(seeds.items())}
        train = {s: m["final_train_loss"] for s, m in sorted(seeds.items())}
        gap = {s: 100 * (v - by["bf16"][s]["val_loss"][-1]) / by["bf16"][s]["val_loss"][-1]
               for s, v in val.items() if s in by.get("bf16", {})}
        out[recipe] = {"seeds": sorted(seeds), "val": val, "val_mean": sum(val.values()) / len(val),
                       "val_spread": max(val.values()) - min(val.values()), "train": train,
                       "val_minus_train_pct": {s: 100 * (val[s] - train[s]) / train[s] for s in val},
                       "gap_pct": gap, "gap_mean_pct": sum(gap.values()) / len(gap) if gap else None}
    return out


def compare_table(cmp: dict) -> str:
    """A markdown table of :func:`compare_runs`: recipe, seeds, final val loss (mean and max - min over
    seeds), gap to bf16 (mean over seeds, %), worst val - train (%)."""
    rows = ["| recipe | seeds | val loss, mean | spread (max - min) | gap to bf16, mean | val - train, worst |",
            "| --- | --- | --- | --- | --- | --- |"]
    for recipe, c in cmp.items():
        gap = "" if recipe == "bf16" or c["gap_mean_pct"] is None else f"{c['gap_mean_pct']:+.2f}%"
        rows.append(f"| {recipe} | {', '.join(map(str, c['seeds']))} | {c['val_mean']:.4f} | {c['val_spread']:.4f} | "
                    f"{gap} | {max(c['val_minus_train_pct'].values()):+.2f}% |")
    return "\n".join(rows)


def plot_compare(runs: list[dict], path: str | os.PathLike) -> None:
    """Loss curves of runs over recipes and seeds (as :func:`compare_runs` takes them), PNG (Agg): top,
    every (recipe, seed)'s validation loss (colour per recipe, line style per seed) and 10-step mean
    train loss (faint); bottom, each recipe's validation loss minus bf16's of the same seed, with bf16's
    seed-to-seed spread (max - min over its seeds at every validation step) as a band around zero."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    compare_runs(runs)  # the same checks
    by: dict[str, dict[int, dict]] = {}
    for metrics in runs:
        for recipe, m in metrics["recipes"].items():
            by.setdefault(recipe, {})[metrics["config"]["seed"]] = m
    colors = {r: f"C{i}" for i, r in enumerate(by)}
    lines = ["-", "--", ":", "-."]
    fig = Figure(figsize=(9, 7.5))
    FigureCanvasAgg(fig)
    ax, dax = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    for recipe, seeds in by.items():
        for j, (seed, m) in enumerate(sorted(seeds.items())):
            tl = torch.tensor(m["train_loss"])
            w = min(10, len(tl))
            ax.plot(torch.arange(w, len(tl) + 1), tl.unfold(0, w, 1).mean(1), color=colors[recipe], lw=0.6, alpha=0.3)
            ax.plot(m["val_step"], m["val_loss"], color=colors[recipe], ls=lines[j % 4], marker=".",
                    label=f"{recipe} seed {seed} val")
    ax.set_ylim(top=min(max(m["val_loss"][1:] or m["val_loss"]) for s in by.values() for m in s.values()) * 1.15)
    cfg = runs[0]["config"]
    ax.set(ylabel="cross-entropy (nats / byte)",
           title=f"MoE LM: {cfg['layers']}L d{cfg['dim']} {cfg['experts']}E top-{cfg['top_k']} ffn {cfg['ffn_dim']}, "
                 f"{runs[0]['env'].get('gpu') or runs[0]['env']['device']} (train: faint, 10-step mean)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    bf16 = by.get("bf16", {})
    steps = next(iter(bf16.values()))["val_step"] if bf16 else None
    if len(bf16) >= 2 and all(m["val_step"] == steps for m in bf16.values()):
        curves = torch.tensor([m["val_loss"] for m in bf16.values()])  # [seeds, evals]
        band = (curves.max(0).values - curves.min(0).values).tolist()
        dax.fill_between(steps, [-b for b in band], band, color="0.8", alpha=0.7,
                         label=f"± bf16 seed-to-seed spread ({len(bf16)} seeds)")
    for recipe, seeds in by.items():
        for j, (seed, m) in enumerate(sorted(seeds.items())):
            if recipe != "bf16" and seed in bf16 and m["val_step"] == bf16[seed]["val_step"]:
                dax.plot(m["val_step"], [v - r for v, r in zip(m["val_loss"], bf16[seed]["val_loss"])],
                         color=colors[recipe], ls=lines[j % 4], marker=".", label=f"{recipe} − bf16, seed {seed}")
    dax.axhline(0, color="k", lw=0.8)
    dax.set(xlabel="step", ylabel="val loss − bf16's, same seed (nats)")
    dax.grid(alpha=0.3)
    if dax.get_legend_handles_labels()[0]:
        dax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def model_flops_per_token(cfg: TrainConfig) -> float:
    """Model FLOPs of one training token (forward and backward), as MFU counts them: 6 x the
    matrix-multiply parameters a token uses (per layer: QKV and output projections ``4 dim^2``, router
    ``dim x experts``, ``top_k`` SwiGLU experts ``3 dim ffn_dim`` each; the LM head ``dim x 256``;
    embedding lookups excluded) + attention scores and values, ``12 x layers x seq_len x dim`` (the
    causal mask's half not taken off)."""
    per_layer = 4 * cfg.dim ** 2 + cfg.dim * cfg.experts + cfg.top_k * 3 * cfg.dim * cfg.ffn_dim
    return 6.0 * (cfg.layers * per_layer + cfg.dim * VOCAB) + 12.0 * cfg.layers * cfg.seq_len * cfg.dim

