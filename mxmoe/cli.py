"""The ``mxmoe`` command line.

    mxmoe train [--preset tiny|default|gpu|gpu-throughput] [--steps N] [--out DIR] ...   # see mxmoe.train
    mxmoe train --resume DIR   # continue an interrupted run (Ctrl-C, SIGTERM, a crash after a checkpoint)
    mxmoe sample --ckpt out/model_mxfp8.safetensors --prompt "def " --tokens 200   # mxmoe.train.sample
    mxmoe info [--device cuda:0]   # which kernels serve each recipe on this machine (mxmoe.backend)
    python -m mxmoe train --help
"""

import argparse
import dataclasses
import inspect
import re


def _field_comments(cls) -> dict[str, str]:
    """``{field: comment}`` from the ``name: type = default  # comment`` lines of a dataclass."""
    try:
        src = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    return dict(re.findall(r"^\s+(\w+): [^#\n]*#\s*(.+)$", src, re.M))


TRAIN_DESCRIPTION = """\
Train a small byte-level MoE language model on this machine's Python sources, once per recipe (bf16, mxfp8,
...), from one initialization on one batch order, and compare their losses. Writes metrics.json, loss.png and
model_<recipe>.safetensors into --out; a folder holding an earlier run is refused (--resume, --overwrite).
Checkpoints every --checkpoint-every steps and on Ctrl-C / SIGTERM; `mxmoe train --resume DIR` continues.

  mxmoe train                                   # default preset, CPU: minutes
  mxmoe train --preset tiny --out /tmp/tiny     # seconds
  mxmoe train --preset gpu --device cuda --recipes bf16 --seed 0
  torchrun --standalone --nproc-per-node 2 -m mxmoe train --preset tiny --out /tmp/ep2   # expert parallel

More: python -c "import mxmoe.train; help(mxmoe.train)" and the README."""


def _add_train_parser(sub) -> argparse.ArgumentParser:
    import mxmoe.train as train

    p = sub.add_parser("train", help="train bf16 and mxfp8 MoE LMs on stdlib bytes, compare losses",
                       description=TRAIN_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default=None, choices=sorted(train.PRESETS),
                   help="starting values for every setting below (default: default)")
    comments = _field_comments(train.TrainConfig)
    for f in dataclasses.fields(train.TrainConfig):
        if isinstance(f.default, bool):  # a switch: --overwrite
            p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, action="store_const", const=True,
                           default=None, help=comments.get(f.name, "").replace("%", "%%"))
            continue
        p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=type(f.default), default=None,
                       metavar=type(f.default).__name__.upper(),
                       help=comments.get(f.name, "").replace("%", "%%")
                       + f" (default preset: {train.PRESETS['default'].get(f.name, f.default)!r})")
    return p


def _add_sample_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("sample", help="load a checkpoint of mxmoe train and sample text from it",
                       description="Continue a prompt with bytes sampled from a model written by mxmoe train "
                                   "(mxmoe.train.sample). Deterministic for a given checkpoint, device and seed.")
    p.add_argument("--ckpt", required=True, help="a model_<recipe>.safetensors written by mxmoe train")
    p.add_argument("--prompt", default="\n", help="text to continue, UTF-8 (default: a newline)")
    p.add_argument("--tokens", type=int, default=200, help="bytes to sample (default: 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0: greedy (default: 0.8)")
    p.add_argument("--top-k", type=int, default=200, help="sample among the k likeliest bytes; 0: all (default: 200)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    p.add_argument("--recipe", default=None, help="run the experts in this recipe instead of the checkpoint's")
    return p


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with one subcommand per job (``train``, ``sample``, ``info``)."""
    parser = argparse.ArgumentParser(prog="mxmoe", description="MoE training with MXFP8 expert matrix products")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="print which kernels serve each recipe's products on this machine")
    info.add_argument("--device", default=None, help="a torch device (default: the first GPU, else the CPU)")
    # for usage errors that print the subcommand's usage
    parser.subcommands = {"train": _add_train_parser(sub), "sample": _add_sample_parser(sub), "info": info}
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mxmoe`` console script; ``argv`` defaults to ``sys.argv[1:]``."""
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    command = args.pop("command")
    if command == "train":
        from mxmoe.train import load_run_config, make_config, run

        preset = args.pop("preset")
        given = {k: v for k, v in args.items() if v is not None}
        try:
            if given.get("resume"):
                others = ["--preset"] * (preset is not None)
                others += ["--" + k.replace("_", "-") for k in given if k != "resume"]
                if others:
                    raise ValueError(f"--resume DIR continues the run with its own settings (DIR/run_config.json): "
                                     f"give no other flags (got {' '.join(others)})")
                cfg = load_run_config(given["resume"])
            else:
                cfg = make_config(preset or "default", **given)
        except ValueError as e:  # a bad flag combination: a usage error (exit 2), not a traceback
            parser.subcommands["train"].error(str(e))
        from mxmoe.train import Interrupted, RunInputError

        try:
            run(cfg)
        except RunInputError as e:  # the run's data, checkpoints, saved settings or --out: a usage error too
            parser.subcommands["train"].error(str(e))
        except Interrupted as e:  # SIGINT / SIGTERM: the state is saved, no traceback
            import shlex
            import sys

            where = (f"; resume with: mxmoe train --resume {shlex.quote(cfg.out)}" if e.checkpoint is not None
                     else " (no checkpoint: single-process only)")
            print(f"{e.recipe}: interrupted at step {e.step}{where}", file=sys.stderr)
            return 128 + e.signum  # 130 for SIGINT, 143 for SIGTERM, as a shell reports a killed job
    elif command == "sample":
        from mxmoe.train import check_device, sample

        try:
            check_device(args["device"])
            text = sample(args["ckpt"], args["prompt"], args["tokens"], args["temperature"], args["top_k"],
                          args["seed"], args["device"], args["recipe"])
        except (ValueError, FileNotFoundError, RuntimeError) as e:
            parser.subcommands["sample"].error(str(e))
        print(text)
    elif command == "info":
        from mxmoe.backend import describe

        try:
            print(describe(args["device"]))
        except (ValueError, RuntimeError) as e:
            parser.subcommands["info"].error(str(e))
    return 0
