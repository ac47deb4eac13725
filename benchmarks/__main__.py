"""Run benchmark suites, or render RESULTS.md from their result files.

    python -m benchmarks SUITE... [--quick] [--out-dir DIR] [-- SUITE_ARGS...]
    python -m benchmarks --list
    python -m benchmarks --plan [--budget 540] [--quick] SUITE...   # fits one device call? (run_device.sh asks)
    python -m benchmarks report [--check]                          # benchmarks/RESULTS.md and its plots

Suite S is ``benchmarks/bench_<S>.py``, whose ``main(argv)`` takes at least ``--quick`` and ``--out PATH``; it is
called with ``--out DIR/<S>.json``, DIR = ``benchmarks/results/<gpu>`` (gpu: ``benchmarks.common.gpu_slug``,
e.g. ``h200``) unless ``--out-dir`` says otherwise. Arguments after ``--`` go to every suite named.

The session-by-session device scripts, logs, ablations and one-off diagnostics that preceded these suites were
removed from the tree; the last commit that has them is 29fb0d1 (``git show 29fb0d1:benchmarks/...``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback

# name: (what it measures, estimated seconds on one H200 for a full run, for --quick). Estimates from the device
# logs of the scripts these suites replace (29fb0d1: benchmarks/results/h200/log_session*.txt), scaled for the
# two shapes added since (dsv3-16b, dsv3-671b-ep8); a fresh machine compiles every kernel first (+20-40 s).
SUITES = {
    "quantize": ("quantization kernels, TB/s against a device copy (1x32 and 1x128 families)", 150, 30),
    "gemm": ("grouped GEMMs (mxfp8_128) vs BF16 / FP8 rowwise / cuBLAS block-scaled loop, CUDA-graph timing", 300, 30),
    "linear": ("one expert linear fwd+bwd, quantization included, vs bf16 and torchao FP8 rowwise", 420, 40),
    "layer": ("MoE layer fwd+bwd, MX recipes vs bf16, CUDA graphs and eager, memory", 240, 45),
    "train": ("mxmoe train gpu-throughput preset, tokens/s and MFU per recipe", 220, 50),
    "torchtitan": ("torchtitan's training entry point with mxmoe's experts vs its own", 480, 120),
}
DEVICE_BUDGET_S = 540  # of a device call's 600 s: the rest for the machine's start and copying results


def estimate(suites: list[str], quick: bool) -> int:
    """Estimated seconds of running ``suites`` one after the other on one H200."""
    return sum(SUITES[s][2 if quick else 1] for s in suites)


def plan(suites: list[str], quick: bool, budget: int) -> tuple[bool, str]:
    """(fits, message): whether ``suites`` fit in ``budget`` seconds, and if not, how to split them into calls
    that do (first fit, in the order given; a suite longer than the budget alone gets its own call)."""
    total = estimate(suites, quick)
    lines = [f"{s:11s} ~{SUITES[s][2 if quick else 1]:4d} s" for s in suites]
    if total <= budget:
        return True, "\n".join(lines + [f"total ~{total} s of {budget} s: fits one device call"])
    calls: list[list[str]] = []
    for s in suites:
        t = SUITES[s][2 if quick else 1]
        for c in calls:
            if estimate(c, quick) + t <= budget:
                c.append(s)
                break
        else:
            calls.append([s])
    q = " --quick" if quick else ""
    lines += [f"total ~{total} s > {budget} s: too long for one device call; split it:"]
    lines += [f"  bash benchmarks/run_device.sh {' '.join(c)}{q}   # ~{estimate(c, quick)} s" for c in calls]
    return False, "\n".join(lines)


def check_suites(names: list[str]) -> None:
    """Raise SystemExit naming the known suites if any of ``names`` is not one."""
    bad = [n for n in names if n not in SUITES]
    if bad:
        raise SystemExit(f"unknown suite(s): {', '.join(bad)}; known: {', '.join(SUITES)} (and 'report'); "
                         "see python -m benchmarks --list")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("suites", nargs="*", metavar="SUITE", help=f"one or more of {', '.join(SUITES)}")
    ap.add_argument("--quick", action="store_true", help="smoke run of each suite (one shape, few repetitions)")
    ap.add_argument("--out-dir", default=None, help="folder of the result files (default benchmarks/results/<gpu>)")
    ap.add_argument("--list", action="store_true", help="list the suites with their estimated seconds, then exit")
    ap.add_argument("--plan", action="store_true", help="say whether the suites fit one device call, then exit "
                    "(exit status 3 if not)")
    ap.add_argument("--budget", type=int, default=DEVICE_BUDGET_S, help="--plan: seconds available")
    return ap


def run_suites(suites: list[str], quick: bool, out_dir: str | None, extra: list[str]) -> int:
    """Run each suite's ``main`` in turn; a failing suite is reported and the next one still runs. Returns the
    number of suites that failed."""
    from benchmarks import common

    folder = out_dir or str(common.RESULTS / common.gpu_slug())
    failed = 0
    for s in suites:
        argv = (["--quick"] if quick else []) + ["--out", f"{folder}/{s}.json"] + extra
        print(f"=== benchmarks {s} {' '.join(argv)}", flush=True)
        t = time.time()
        try:
            importlib.import_module(f"benchmarks.bench_{s}").main(argv)
            status = "ok"
        except SystemExit as e:  # a suite's own clear error (no GPU, bad option): say it, go on
            status = "ok" if e.code in (None, 0) else f"exited: {e.code}"
        except Exception:  # noqa: BLE001  (one suite failing must not hide the others)
            traceback.print_exc()
            status = "failed"
        failed += status != "ok"
        print(f"=== {s}: {status} in {time.time() - t:.0f} s", flush=True)
    return failed


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    if argv[:1] == ["report"]:
        from benchmarks import report

        return report.main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.list:
        for name, (what, full, quick) in SUITES.items():
            print(f"{name:11s} ~{full:4d} s (--quick ~{quick:3d} s)  {what}")
        print("report      render benchmarks/RESULTS.md and its plots from the result files")
        return 0
    if not args.suites:
        raise SystemExit("name at least one suite (python -m benchmarks --list shows them)")
    check_suites(args.suites)
    if args.plan:
        fits, msg = plan(args.suites, args.quick, args.budget)
        print(msg)
        return 0 if fits else 3
    return 1 if run_suites(args.suites, args.quick, args.out_dir, extra) else 0


if __name__ == "__main__":
    sys.exit(main())
