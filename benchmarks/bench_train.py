"""Train suite: the main job's tokens/s and MFU per recipe (``mxmoe train --preset gpu-throughput``), one process.

    python -m benchmarks train [--quick] [--out benchmarks/results/<gpu>/train.json] [--recipes bf16,mxfp8,mxfp8_128]

Runs ``python -m mxmoe train --preset gpu-throughput --device cuda`` with the recipes one after the other in one
process (2 layers, dim 2048, 8 experts top-2, expert FFN 4096; MFU against the H200's dense BF16 peak for every
recipe), by default with 8 micro-batches per optimizer step (131,072 tokens, 40 steps: the optimizer paid once per
8 micro-batches, as at scale). Rows (``kind: "throughput"``): ``recipe``, ``tokens_per_s``, ``mfu``,
``ms_per_step``, ``tokens_per_step``, ``peak_mem_gib``, ``vs_bf16`` (mxmoe.train.throughput_rows) and the run's
``grad_accum`` / ``compile``. ``--quick``: bf16 and mxfp8_128, 12 eager steps of one micro-batch (a smoke test of
the suite: no compile, so its tokens/s are not the job's).

Convergence (the ``gpu`` preset, 2000 steps per recipe and seed, one device call each:
``benchmarks/run_device_convergence.sh``) is not rerun by a throughput run: rows of ``kind: "convergence"`` already
in the output file (final train / validation loss per recipe and seed) are carried over unchanged, their sources
in the header's ``carried_over``. ``--convergence METRICS.json...`` (no GPU needed) replaces those rows with the
given runs' (``mxmoe.train.compare_runs``) and keeps the throughput rows and header.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import common as C

SUITE = "train"


def build_parser():
    ap = C.parser(SUITE, __doc__)
    ap.add_argument("--recipes", default=None, help="default bf16,mxfp8,mxfp8_128 (--quick: bf16,mxfp8_128)")
    ap.add_argument("--grad-accum", type=int, default=None, help="micro-batches per step (default 8, --quick 1)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default 40, --quick 12)")
    ap.add_argument("--compile", default=None,
                    help="mxmoe train --compile (default auto: inductor-cudagraphs; --quick: none, eager)")
    ap.add_argument("--run-dir", default=None, help="mxmoe train's --out (default a temporary folder)")
    ap.add_argument("--convergence", nargs="+", default=None, metavar="METRICS",
                    help="no run: put these gpu-preset runs' metrics (train_gpu_<recipe>_seed<N>.json) into --out "
                         "as its convergence rows")
    return ap


def convergence_rows(paths: list[str]) -> list[dict]:
    """Rows of ``kind: "convergence"``, one per recipe and seed of the runs' metrics files."""
    from mxmoe.train import compare_runs

    runs = [json.loads(Path(p).read_text()) for p in paths]
    cfg = runs[0]["config"]
    preset = "gpu" if cfg.get("steps") == 2000 and cfg.get("dim") == 640 else "custom"
    rows = []
    for recipe, v in compare_runs(runs).items():
        for seed in v["seeds"]:
            rows.append({"kind": "convergence", "recipe": recipe, "seed": seed, "val_loss": v["val"][seed],
                         "train_loss": v["train"][seed], "gap_pct": v.get("gap_pct", {}).get(seed),
                         "val_minus_train_pct": v["val_minus_train_pct"][seed], "preset": preset,
                         "compile": runs[0]["recipes"][next(iter(runs[0]["recipes"]))].get("compile")})
    return rows


def add_convergence(out: Path, paths: list[str]) -> None:
    """Replace the convergence rows of ``out`` (kept: its header and throughput rows) with ``paths``' runs."""
    doc = json.loads(out.read_text()) if out.exists() else {"header": C.header(SUITE, False), "rows": []}
    rows = [r for r in doc["rows"] if r.get("kind") != "convergence"] + convergence_rows(paths)
    doc["header"]["convergence_from"] = [str(p) for p in paths]
    C.write_result(out, doc["header"], rows)
    print(f"{out}: {len(rows)} rows, convergence from {len(paths)} runs")


def train_command(args, run_dir: str) -> list[str]:
    """The ``mxmoe train`` command line of a run of this suite."""
    recipes = args.recipes or ("bf16,mxfp8_128" if args.quick else "bf16,mxfp8,mxfp8_128")
    accum = args.grad_accum or (1 if args.quick else 8)
    steps = args.steps or (12 if args.quick else 40)
    warmup = max(2, steps // 10)
    return [sys.executable, "-m", "mxmoe", "train", "--preset", "gpu-throughput", "--device", "cuda",
            "--recipes", recipes, "--grad-accum", str(accum), "--steps", str(steps), "--warmup", str(warmup),
            "--eval-every", str(steps), "--compile", args.compile or ("none" if args.quick else "auto"),
            "--out", run_dir]


def carried_convergence(out: Path) -> tuple[list[dict], list[str]]:
    """Convergence rows of an existing result file, and where they came from."""
    if not out.exists():
        return [], []
    doc = json.loads(out.read_text())
    rows = [r for r in doc.get("rows", []) if r.get("kind") == "convergence"]
    head = doc.get("header", {})
    return rows, head.get("convergence_from", head.get("converted_from", [])) if rows else []


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.convergence:
        return add_convergence(Path(args.out or C.default_out(SUITE)), args.convergence)
    C.require_cuda(SUITE)
    from mxmoe.train import throughput_rows

    out = Path(args.out or C.default_out(SUITE))
    run_dir = args.run_dir or tempfile.mkdtemp(prefix="mxmoe_bench_train_")
    cmd = train_command(args, run_dir)
    print("$", " ".join(cmd), flush=True)
    env = dict(os.environ, PYTHONPATH=str(C.REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rc = subprocess.run(cmd, env=env).returncode
    metrics_path = Path(run_dir) / "metrics.json"
    if rc != 0 or not metrics_path.exists():
        raise SystemExit(f"mxmoe train failed (exit status {rc}); no {metrics_path}")
    metrics = json.loads(metrics_path.read_text())
    cfg = metrics["config"]
    backend = cfg.get("compile")
    if backend == "auto":  # what mxmoe.train.compile_backend resolves it to on one GPU
        backend = "auto (inductor-cudagraphs)"
    rows = [dict(r, kind="throughput", grad_accum=cfg.get("grad_accum", 1), compile=backend,
                 steps=cfg.get("steps")) for r in throughput_rows(metrics)]
    kept, sources = carried_convergence(out)
    head = C.header(SUITE, args.quick, command=" ".join(cmd[1:]), train_env=metrics["env"], train_config=cfg,
                    params=metrics.get("params"), model_flops_per_token=metrics.get("model_flops_per_token"),
                    peak_flops=metrics.get("peak_flops"), carried_over=sources)
    C.write_result(out, head, rows + kept)
    for r in rows:
        print(f"{r['recipe']:12s} {r['tokens_per_s']:10,.0f} tokens/s  MFU {100 * (r['mfu'] or 0):5.1f}%  "
              f"{r['ms_per_step']:7.1f} ms/step  x{r['vs_bf16'] or 0:.2f} bf16  peak {r['peak_mem_gib']:.1f} GiB")
    print(f"wrote {len(rows)} rows (+{len(kept)} convergence rows kept) to {out}")


if __name__ == "__main__":
    main()
