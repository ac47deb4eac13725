"""Settings of ``mxmoe train``: :class:`TrainConfig` (one field per flag), the named presets, the
``--recipes`` and ``--compile`` values, and :class:`RunInputError` (a usage error of a run's inputs)."""

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from mxmoe.corpus import resolve_source

VOCAB = 256  # byte-level: one token per byte


@dataclass
class TrainConfig:
    """Settings of one ``mxmoe train`` run; a preset fills them, flags override."""

    # I/O and run
    out: str = "out"  # output folder: metrics.json, loss.png, model_<recipe>.safetensors; one holding a run is refused
    # (--overwrite deletes that run's files first; --resume continues it)
    overwrite: bool = False  # delete the earlier run's files in --out first (else such a folder is refused)
    device: str = ""  # "cuda", "cuda:N" or "cpu"; empty = cuda if available, else cpu
    recipes: str = "bf16,mxfp8"  # comma-separated MoE recipes, trained one after the other
    seed: int = 0  # one seed -> one init and one batch order, shared by every recipe
    # torch.compile backend, not under torchrun (expert parallelism); inductor-cudagraphs: inductor's fused
    # kernels replayed from CUDA graphs
    compile: str = "auto"  # auto (inductor-cudagraphs on CUDA in one process, else eager), "" or none (eager), inductor, inductor-cudagraphs, cudagraphs, aot_eager, eager
    # training states <out>/checkpoint_<recipe>.pt for --resume, also written on Ctrl-C / SIGTERM (none under torchrun)
    checkpoint_every: int = 50  # steps between checkpoints (under 0.5% of a default CPU run); 0: on a signal only
    resume: str = ""  # continue the interrupted run in this folder, with its own settings (give no other flags)
    # data (mxmoe.corpus)
    data: str = ""  # "stdlib", "python-all" (stdlib + site-packages) or a .py folder; empty: python-all on CUDA, else stdlib
    data_cache: str = "~/.cache/mxmoe"  # folder caching the python-all corpus (keyed by its file list); empty: none
    val_every_file: int = 20  # ~every N-th file is validation (stdlib/folder: N-th sorted; python-all: by content hash)
    seq_len: int = 128  # tokens (bytes) per training window = context length
    batch_size: int = 16  # windows per micro-batch, one forward and backward (per rank under torchrun)
    grad_accum: int = 1  # micro-batches per optimizer step, gradient their mean (tokens per step: batch_size * seq_len * grad_accum)
    # model
    dim: int = 128  # residual stream width (a multiple of the recipe's scale groups: 32 for MX, 128 for mxfp8_128)
    layers: int = 2  # transformer blocks, each attention + MoE
    heads: int = 4  # attention heads (dim % heads == 0)
    experts: int = 8  # experts per MoE layer (a multiple of the torchrun processes)
    top_k: int = 2  # experts each token is routed to
    ffn_dim: int = 256  # hidden width of one expert (a multiple of the recipe's scale groups, as dim)
    aux_loss_coef: float = 0.01  # weight of the MoE load-balancing loss (>= 0)
    # optimization
    steps: int = 300  # optimizer steps per recipe
    lr: float = 3e-3  # peak AdamW learning rate
    min_lr_frac: float = 0.1  # cosine decay ends at lr * min_lr_frac
    warmup: int = 30  # linear warmup steps, at most steps (a preset's is cut to --steps)
    weight_decay: float = 0.1  # AdamW decay on matrices and embeddings (not norms)
    grad_clip: float = 1.0  # clip the global gradient norm to this
    # evaluation
    eval_every: int = 50  # steps between validation passes (also at step 0 and at the end)
    eval_batches: int = 8  # batches per validation pass, per rank (the same batches every time)

    def __post_init__(self):
        for name in ("dim", "heads", "ffn_dim", "experts", "layers", "steps", "eval_every", "eval_batches",
                     "batch_size", "grad_accum", "seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name in ("warmup", "checkpoint_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{name} must be an int, got {v!r}")
        if self.dim % self.heads:
            raise ValueError(f"dim {self.dim} is not divisible by heads {self.heads}")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k {self.top_k} must be in [1, experts={self.experts}]")
        if self.val_every_file < 2:
            raise ValueError(f"val_every_file must be >= 2 (every file would be validation), got {self.val_every_file}")
        from mxmoe.recipes import get_recipe

        names = parse_recipes(self.recipes)
        resolve_source(self.data, "cpu")  # a folder that does not exist fails here
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0 (0: no checkpoints), got {self.checkpoint_every}")
        if self.resume and not Path(self.resume).is_dir():
            raise ValueError(f"--resume {self.resume!r} is not a folder")
        if self.resume and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ValueError("--resume is single-process only (training states are not written under torchrun)")
        if not isinstance(self.overwrite, bool):
            raise ValueError(f"overwrite must be True or False, got {self.overwrite!r}")
        if self.resume and self.overwrite:
            raise ValueError("--resume continues the run in its folder; --overwrite would delete it: give one")
        if not self.out:
            raise ValueError("--out is empty: give the folder the run writes into (default: out)")
        for name in names:
            get_recipe(name).check_dims(self.dim, self.ffn_dim)  # unknown names and bad dims fail before training
        bounds = {"lr": (0 < self.lr < math.inf, "a finite value > 0"),  # NaN fails every comparison
                  "min_lr_frac": (0 <= self.min_lr_frac <= 1, "in [0, 1]"),
                  "weight_decay": (0 <= self.weight_decay < math.inf, "a finite value >= 0"),
                  "grad_clip": (self.grad_clip > 0, "> 0"),
                  "aux_loss_coef": (0 <= self.aux_loss_coef < math.inf, "a finite value >= 0")}
        bad = [f"{name} must be {want}, got {getattr(self, name)}" for name, (ok, want) in bounds.items() if not ok]
        if bad:
            raise ValueError("; ".join(bad))
        if not 0 <= self.warmup <= self.steps:
            raise ValueError(f"warmup must be in [0, steps={self.steps}] (linear warmup steps, then cosine decay), "
                             f"got {self.warmup}")
        if self.device:
            check_device(self.device)
        if self.compile not in ("auto", "", "none"):
            if self.compile not in COMPILE_BACKENDS:
                raise ValueError(f"compile backend {self.compile!r}: use one of {', '.join(COMPILE_BACKENDS)} "
                                 "(or auto, or nothing / none, for eager)")
            if int(os.environ.get("WORLD_SIZE", "1")) > 1:
                raise ValueError("--compile is not supported with expert parallelism (torchrun): leave it off there")
            on_cpu = (self.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cpu")
            if self.compile in GRAPH_BACKENDS and on_cpu:
                raise ValueError(f"--compile {self.compile} records CUDA graphs: it needs --device cuda")
            if self.compile == "inductor" and on_cpu and any(n != "bf16" for n in names):
                raise ValueError("--compile inductor on the CPU cannot compile the MX recipes (torch's CPU "
                                 "codegen has no float8_e8m0fnu); use --compile aot_eager there, or a GPU")


def check_device(spec: str, flag: str = "--device") -> torch.device:
    """``spec`` as a torch device this job can run on: ``cpu`` (or ``cpu:0``), ``cuda`` or ``cuda:N`` with N below
    ``torch.cuda.device_count()``.

    Raises:
        ValueError: a string torch does not parse, another device type, a CPU index other than 0 (torch
            has one CPU device: ``cpu:7`` would run on the same CPU), CUDA without a GPU, or an index past
            the last GPU; the message names ``flag``.
    """
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{flag} {spec!r}: {e}") from None
    if device.type == "cpu":
        if device.index not in (None, 0):
            raise ValueError(f"{flag} {spec!r}: torch has a single CPU device; give cpu (or cpu:0)")
    elif device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{flag} {spec} asked for, but torch sees no CUDA GPU here")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{flag} {spec!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s), "
                             f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    else:
        raise ValueError(f"{flag} {spec!r}: mxmoe train runs on cpu or cuda, not {device.type}")
    return device


def parse_recipes(spec: str) -> list[str]:
    """The recipe names of a comma-separated ``--recipes`` value, in order, spaces stripped.

    Raises:
        ValueError: an empty list or an empty name (``"bf16,,mxfp8"``, a trailing comma) or a name given
            twice; unknown names are checked by :func:`mxmoe.recipes.get_recipe`.
    """
    names = [r.strip() for r in spec.split(",")]
    if not any(names):
        raise ValueError("recipes is empty; give e.g. --recipes bf16,mxfp8")
    if not all(names):
        raise ValueError(f"recipes {spec!r} has an empty name (two commas, or one at an end); give e.g. "
                         "--recipes bf16,mxfp8")
    if len(set(names)) != len(names):
        raise ValueError(f"recipes {spec!r} names a recipe twice")
    return names


# torch.compile backends this job was run with; "cudagraphs" replays the step's kernels (ours and
# torch's, unfused) from CUDA graphs, which takes the host's launch work out of the step;
# "inductor-cudagraphs" is inductor (torch's elementwise work fused, our kernels as they are) with
# mode="reduce-overhead", its kernels replayed from CUDA graphs too
COMPILE_BACKENDS = ("inductor", "inductor-cudagraphs", "cudagraphs", "aot_eager", "eager")
GRAPH_BACKENDS = ("cudagraphs", "inductor-cudagraphs")

# the yardstick of MFU for every recipe: one H200's dense BF16 tensor-core peak, FLOP/s (NVIDIA's H200
# SXM datasheet: 1979 TFLOP/s with sparsity, half of it dense)
PEAK_FLOPS = 989.4e12

def compile_backend(cfg: "TrainConfig", device: torch.device, world_size: int = 1) -> str:
    """The torch.compile backend the steps use: ``cfg.compile`` resolved (``auto``: ``inductor-cudagraphs`` on
    CUDA in one process, the fastest of the backends on the GPU presets; else eager); ``""`` means eager."""
    if cfg.compile == "auto":
        return "inductor-cudagraphs" if device.type == "cuda" and world_size == 1 else ""
    return "" if cfg.compile == "none" else cfg.compile


PRESETS = {
    "tiny": dict(dim=64, layers=2, heads=2, experts=4, top_k=2, ffn_dim=64, seq_len=64, batch_size=8,
                 steps=40, warmup=5, eval_every=20, eval_batches=2),
    "default": dict(eval_every=25),
    # convergence, one recipe and seed per call: 171M parameters (SwiGLU experts: 3 * dim * ffn_dim
    # each), 53M active per token, ~0.38 GFLOP per token (see MFU above). 2000 steps of 16384 tokens =
    # 33M tokens: ~0.1-0.15 epochs of a python-all corpus of 200-300 MB (the old 110M preset on the 10 MB
    # stdlib memorized at 4.8 epochs). 6.2 TFLOP per step: ~1 min of steps at 20% MFU, ~2 min at 10%
    "gpu": dict(dim=640, layers=8, heads=10, experts=8, top_k=2, ffn_dim=1280, seq_len=1024, batch_size=16,
                steps=2000, lr=6e-4, warmup=200, eval_every=100, eval_batches=16, checkpoint_every=500),
    # tokens/s and MFU: experts' products ~75% of the step's FLOPs. 439M parameters, 137M active per
    # token, ~0.86 GFLOP per token, 14.1 TFLOP per step of 16384 tokens; evaluated at the ends only
    "gpu-throughput": dict(dim=2048, layers=2, heads=16, experts=8, top_k=2, ffn_dim=4096, seq_len=1024,
                           batch_size=16, steps=300, lr=3e-4, warmup=30, eval_every=300, eval_batches=4,
                           checkpoint_every=0),  # a speed measurement: no 5 GB states mid-run (still on a signal)
}


def make_config(preset: str = "default", **overrides) -> TrainConfig:
    """A ``TrainConfig`` from a named preset (``tiny``, ``default``, ``gpu``, ``gpu-throughput``) plus
    field overrides. A preset's warmup longer than an overridden ``steps`` is cut to ``steps`` (e.g.
    ``--preset tiny --steps 2``); a ``warmup`` override longer than ``steps`` raises ValueError."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    fields = {**PRESETS[preset], **overrides}
    if "warmup" not in overrides and isinstance(fields.get("steps"), int):
        fields["warmup"] = min(fields.get("warmup", TrainConfig.warmup), fields["steps"])
    return TrainConfig(**fields)


class RunInputError(ValueError):
    """A problem with a run's inputs (its data, checkpoints or saved settings), not with the code: the
    ``mxmoe train`` command reports it as a usage error, one line, no traceback."""

