"""The ``mxmoe`` command line.

    mxmoe train [--preset tiny|default|gpu] [--steps N] [--out DIR] ...   # see mxmoe.train
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


def _add_train_parser(sub) -> argparse.ArgumentParser:
    import mxmoe.train as train

    p = sub.add_parser("train", help="train bf16 and mxfp8 MoE LMs on stdlib bytes, compare losses",
                       description=train.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="default", choices=sorted(train.PRESETS),
                   help="starting values for every setting below (default: default)")
    comments = _field_comments(train.TrainConfig)
    for f in dataclasses.fields(train.TrainConfig):
        p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=type(f.default), default=None,
                       metavar=type(f.default).__name__.upper(),
                       help=comments.get(f.name, "").replace("%", "%%") + f" (default preset: {f.default!r})")
    return p


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with one subcommand per job (``train``)."""
    parser = argparse.ArgumentParser(prog="mxmoe", description="MoE training with MXFP8 expert matrix products")
    sub = parser.add_subparsers(dest="command", required=True)
    parser.subcommands = {"train": _add_train_parser(sub)}  # for usage errors that print the subcommand's usage
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mxmoe`` console script; ``argv`` defaults to ``sys.argv[1:]``."""
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    command = args.pop("command")
    if command == "train":
        from mxmoe.train import make_config, run

        preset = args.pop("preset")
        try:
            cfg = make_config(preset, **{k: v for k, v in args.items() if v is not None})
            if cfg.device:
                import torch

                try:
                    torch.device(cfg.device)
                except RuntimeError as e:
                    raise ValueError(f"--device {cfg.device!r}: {e}") from None
            if cfg.out:
                from pathlib import Path

                try:
                    Path(cfg.out).mkdir(parents=True, exist_ok=True)
                except OSError as e:
                    raise ValueError(f"--out {cfg.out!r} cannot be created: {e.strerror}") from None
        except ValueError as e:  # a bad flag combination: a usage error (exit 2), not a traceback
            parser.subcommands["train"].error(str(e))
        run(cfg)
    return 0
