"""Train a small byte-level MoE language model on Python source code: bf16 vs mxfp8.

Every recipe starts from the same initial weights and sees the same batches in the same order,
so the difference between their loss curves is the cost of the MXFP8 expert matrix products.
The data is this machine's own Python sources (:mod:`mxmoe.corpus`; nothing is downloaded): on the
CPU by default the standard library (``sysconfig.get_paths()["stdlib"]``, all ``.py`` files,
site-packages excluded, every 20th file in sorted order held out for validation); on CUDA by default
every ``.py`` file of the interpreter's stdlib and site-packages, deduplicated, a file held out when a
hash of its content says so (``--data python-all``; hundreds of MB, cached under ``--data-cache``).
The log says how many files and bytes the run uses and how many epochs of the train split it consumes.
Launch:

    mxmoe train                                    # default preset: 2.5-4.5 minutes on 2 CPU cores
    mxmoe train --preset tiny --out /tmp/tiny      # seconds; what the tests run
    mxmoe train --preset gpu --device cuda --recipes bf16 --seed 0     # convergence: 171M parameters, 2000 steps
    mxmoe train --preset gpu-throughput --device cuda --recipes bf16,mxfp8,mxfp8_128   # tokens/s and MFU
    python -m mxmoe train --steps 500 --lr 2e-3 --recipes bf16,mxfp8
    mxmoe train --batch-size 8 --grad-accum 4      # 32 windows per optimizer step, 8 per forward/backward

On CUDA the steps run compiled and replayed from CUDA graphs by default (``--compile auto``:
``inductor-cudagraphs``, torch.compile's inductor with ``mode="reduce-overhead"``, which fuses torch's
elementwise work around our kernels; on the gpu-throughput preset 1.13x (bf16) and 1.16x (mxfp8_128) the
tokens/s of the ``cudagraphs`` backend, which replays the unfused kernels and was the default before; the
old 110M preset ran 2.8-3.8x eager's tokens/s under it). ``--compile cudagraphs`` keeps that one,
``--compile ""`` runs eager; the log says which.

MFU (the ``mfu`` of each recipe's metrics, CUDA only) is model FLOPs per second over a stated peak:
model FLOPs per token = 6 x the matrix-multiply parameters a token uses (attention projections, router,
its top_k experts, LM head; embedding lookups excluded) + 12 x layers x seq_len x dim (attention scores
and values, forward and backward, counted without the causal mask's half, as PaLM's MFU does), times
tokens/s, divided by :data:`PEAK_FLOPS`, the H200's dense BF16 peak of 989.4 TFLOP/s, for every recipe
(the MXFP8 recipes too: the same yardstick, so MFU ratios are tokens/s ratios).

Runs survive interruption: with ``--checkpoint-every N`` (the GPU presets: on) every N steps the
recipe's model, optimizer, step, data-order and RNG states and metrics so far go to
``<out>/checkpoint_<recipe>.pt``, written atomically; ``mxmoe train --resume DIR`` continues a killed
run from them with its own settings (``DIR/run_config.json``) and ends with the numbers of an
uninterrupted run (bit for bit on the CPU).

Expert parallelism: launched by ``torchrun`` with more than one process, every rank holds
``experts / world`` experts of each MoE layer (``mxmoe.parallel``: gloo on CPUs, NCCL and one GPU
per rank on CUDA) and trains on its own batches; the rest of the model is replicated and its
gradients are averaged. ``--batch-size`` and ``--eval-batches`` count per rank; ``--experts`` must
be divisible by the number of processes. Rank 0 prints and writes the outputs; the saved models hold
the full (single-process) state dict. Training states (``--checkpoint-every``, ``--resume``) are
single-process only.

    torchrun --standalone --nproc-per-node 2 -m mxmoe train --preset tiny --out /tmp/tiny_ep2
    torchrun --standalone --nproc-per-node 2 -m mxmoe train --preset gpu --device cuda --checkpoint-every 0

Writes into ``--out``: ``metrics.json`` (config, environment, data, per-recipe losses and speed),
``loss.png`` (train and val curves, and each recipe's val loss minus bf16's against the stored
seed-to-seed spread) and ``model_<recipe>.safetensors``. Runs of one recipe and seed each (the ``gpu``
preset) are compared by :func:`compare_runs` / :func:`plot_compare` (``benchmarks/compare_train_runs.py``);
:func:`throughput_rows` gives the ``train_gpu_throughput.json`` rows. On the CPU every recipe runs the
pure-torch reference (the speed column reads ``ref tok/s``), whose BF16 grouped products are FP32
products of the BF16 values (:func:`mxmoe.ops.grouped.reference_grouped_mm`). A model is
loaded by :func:`load_checkpoint` and sampled by :func:`sample` / ``mxmoe sample``:

    mxmoe sample --ckpt out/model_mxfp8.safetensors --prompt "def " --tokens 200
"""

import dataclasses
import importlib
import json
import math
import os
import platform
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm

from mxmoe import parallel
from mxmoe.corpus import load_corpus, python_roots, resolve_source
from mxmoe.moe import MoE

VOCAB = 256  # byte-level: one token per byte


@dataclass
class TrainConfig:
    """Settings of one ``mxmoe train`` run; a preset fills them, flags override."""

    # I/O and run
    out: str = "out"  # output folder: metrics.json, loss.png, model_<recipe>.safetensors
    device: str = ""  # "cuda" or "cpu"; empty = cuda if available, else cpu
    recipes: str = "bf16,mxfp8"  # comma-separated MoE recipes, trained one after the other
    seed: int = 0  # one seed -> one init and one batch order, shared by every recipe
    # torch.compile backend, not under torchrun (expert parallelism); inductor-cudagraphs: inductor's fused
    # kernels replayed from CUDA graphs
    compile: str = "auto"  # auto (inductor-cudagraphs on CUDA in one process, else eager), "" or none (eager), inductor, inductor-cudagraphs, cudagraphs, aot_eager, eager
    checkpoint_every: int = 0  # steps between checkpoints (<out>/checkpoint_<recipe>.pt); 0: none (one process only)
    resume: str = ""  # continue the killed run in this folder, with its own settings (give no other flags)
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
        if (self.checkpoint_every or self.resume) and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ValueError("checkpoints and --resume are single-process only: leave --checkpoint-every at 0 "
                             "under torchrun (expert parallelism)")
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
        if self.device and self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device {self.device} asked for, but torch sees no CUDA GPU here")
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

# the training loop synchronizes with the GPU (and times the steps since the last synchronization)
# every this many steps
TIMING_EVERY = 10


def compile_backend(cfg: "TrainConfig", device: torch.device, world_size: int = 1) -> str:
    """The torch.compile backend the steps use: ``cfg.compile`` resolved (``auto``: ``inductor-cudagraphs`` on
    CUDA in one process, the fastest of the backends on the GPU presets; else eager); ``""`` means eager."""
    if cfg.compile == "auto":
        return "inductor-cudagraphs" if device.type == "cuda" and world_size == 1 else ""
    return "" if cfg.compile == "none" else cfg.compile


def compiled(model: nn.Module, backend: str) -> nn.Module:
    """``model`` under ``torch.compile`` with the resolved ``backend`` (:func:`compile_backend`); eager for ``""``."""
    if not backend:
        return model
    if backend == "inductor-cudagraphs":
        return torch.compile(model, backend="inductor", mode="reduce-overhead")
    return torch.compile(model, backend=backend)


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
                           batch_size=16, steps=300, lr=3e-4, warmup=30, eval_every=300, eval_batches=4),
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


# ----------------------------------------------------------------------------- data

def tokens_per_step(cfg: "TrainConfig") -> int:
    """Training tokens one rank reads per optimizer step: ``batch_size * seq_len * grad_accum``."""
    return cfg.batch_size * cfg.seq_len * cfg.grad_accum


def get_batch(data: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of ``data``: inputs and next-byte targets, both int64 ``[B, T]`` on ``device``."""
    start = torch.randint(len(data) - seq_len - 1, (batch_size, 1), generator=gen)  # [B, 1]
    window = data[start + torch.arange(seq_len + 1)].long()  # [B, T+1]
    if device.type == "cuda":  # from pinned memory, so the copy does not wait for the GPU's queued work
        window = window.pin_memory().to(device, non_blocking=True)
        return window[:, :-1], window[:, 1:]
    return window[:, :-1].to(device), window[:, 1:].to(device)


# ----------------------------------------------------------------------------- model

class Attention(nn.Module):
    """Causal multi-head self-attention (``F.scaled_dot_product_attention``)."""

    def __init__(self, cfg: TrainConfig):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.heads, D // self.heads)  # [B, T, 3, H, D/H]
        q, k, v = qkv.transpose(1, 3).unbind(2)  # each [B, H, T, D/H]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, D/H]
        return self.proj(y.transpose(1, 2).reshape(B, T, D))  # [B, T, D]


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + moe(norm(x))."""

    def __init__(self, cfg: TrainConfig, recipe: str):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.norm2 = nn.RMSNorm(cfg.dim)
        self.moe = MoE(cfg.dim, cfg.ffn_dim, cfg.experts, cfg.top_k, recipe=recipe,
                       aux_loss_coef=cfg.aux_loss_coef)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


class MoELM(nn.Module):
    """Byte-level decoder-only MoE LM: token + learned position embedding, blocks, norm, LM head."""

    def __init__(self, cfg: TrainConfig, recipe: str):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, cfg.dim)
        self.pos = nn.Embedding(cfg.seq_len, cfg.dim)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(cfg, recipe) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, VOCAB, bias=False)

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        """Next-byte logits: idx int64 ``[B, T]`` with ``T <= seq_len`` -> FP32 ``[B, T, 256]``."""
        T = idx.shape[1]
        if T > self.pos.num_embeddings:
            raise ValueError(f"{T} tokens are more than the model's context of {self.pos.num_embeddings}")
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))  # [B, T, D]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)).float()  # [B, T, V]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """idx, targets: int64 ``[B, T]``. Returns (cross-entropy, MoE aux loss summed over layers);
        :meth:`logits` gives the predictions."""
        logits = self.logits(idx)  # [B, T, V]
        ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        aux = sum(block.moe.aux_loss for block in self.blocks)
        return ce, aux


def count_params(model: MoELM, cfg: TrainConfig) -> dict:
    """Total parameters, those inside the MoE layers, and those active per token (top_k of experts)."""
    total = sum(p.numel() for p in model.parameters())
    moe = sum(p.numel() for b in model.blocks for p in b.moe.parameters())
    experts = sum(p.numel() for b in model.blocks for p in (b.moe.w13, b.moe.w2))  # [E, 2F, D], [E, D, F]
    active = total - experts + experts * cfg.top_k // cfg.experts
    return {"total": total, "moe": moe, "experts": experts, "active_per_token": active}


# ----------------------------------------------------------------------------- expert parallelism (torchrun)

@dataclass(frozen=True)
class ExpertParallel:
    """This process's place in a torchrun launch; the default is a single process."""

    group: object = None  # the default process group, None when single-process
    rank: int = 0
    size: int = 1  # number of processes (ranks); each holds experts / size experts per MoE layer


SINGLE_PROCESS = ExpertParallel()


def init_expert_parallel(cfg: TrainConfig, device: torch.device) -> tuple[ExpertParallel, torch.device]:
    """Join the process group when launched by torchrun with WORLD_SIZE > 1 (gloo for a CPU run,
    NCCL for CUDA, where the device becomes ``cuda:LOCAL_RANK``); else ``(SINGLE_PROCESS, device)``.

    Raises RunInputError (a ValueError; on every rank, before any collective) if ``cfg.experts`` is not
    divisible by the number of processes.
    """
    group = parallel.maybe_init_distributed("nccl" if device.type == "cuda" else "gloo")
    if group is None:
        return SINGLE_PROCESS, device
    ep = ExpertParallel(group, dist.get_rank(group), dist.get_world_size(group))
    if cfg.experts % ep.size:
        raise RunInputError(f"--experts {cfg.experts} is not divisible by the {ep.size} torchrun processes "
                         "(expert parallelism: each rank holds experts / processes of every MoE layer's experts)")
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    return ep, device


def mean_over_ranks(t: torch.Tensor, ep: ExpertParallel) -> torch.Tensor:
    """Element-wise mean of ``t`` over the ranks (FP32); ``t`` itself when single-process. Collective."""
    if ep.group is None:
        return t
    t = t.detach().float().clone()
    dist.all_reduce(t, group=ep.group)
    return t / ep.size


def clip_gradients(model: nn.Module, params: list[nn.Parameter], max_norm: float, ep: ExpertParallel) -> None:
    """Single process: ``clip_grad_norm_``. Expert parallel: average the replicated gradients over
    the ranks (expert gradients already hold every rank's tokens), then clip the global norm."""
    if ep.group is None:
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        return
    parallel.allreduce_gradients(model, ep.group)
    parallel.clip_grad_norm_(model, max_norm, ep.group)


def full_state_dict(model: nn.Module, ep: ExpertParallel) -> dict[str, torch.Tensor]:
    """The single-process state dict on the CPU; expert slices all-gathered under torchrun (collective)."""
    state = parallel.full_state_dict(model, ep.group) if ep.group is not None else model.state_dict()
    return {k: v.detach().cpu().contiguous() for k, v in state.items()}


# ----------------------------------------------------------------------------- training

def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``cfg.lr``, then cosine decay to ``cfg.lr * cfg.min_lr_frac`` at ``cfg.steps``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def _autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def evaluate(model: MoELM, data: torch.Tensor, cfg: TrainConfig, device: torch.device,
             ep: ExpertParallel = SINGLE_PROCESS) -> float:
    """Mean validation cross-entropy over ``cfg.eval_batches`` batches per rank (the same ones every
    call): rank r of W takes batches r, r + W, ... of one seeded stream, so the W ranks together see
    its first ``W * eval_batches`` batches. Collective under torchrun; every rank gets the mean."""
    model.eval()
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    losses = []
    for i in range(cfg.eval_batches * ep.size):
        x, y = get_batch(data, cfg.batch_size, cfg.seq_len, gen, device)  # [B, T] each
        if i % ep.size == ep.rank:
            with _autocast(device):
                losses.append(model(x, y)[0].clone())  # clone: a CUDA graph's output is reused by its next replay
    model.train()
    return mean_over_ranks(torch.stack(losses).mean(), ep).item()


def forward_backward(step_fn, batches, n: int, backend: str, device: torch.device,
                     params: list[nn.Parameter]) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step's gradients: ``step_fn(x, y) -> (ce, aux)`` and backward on each of the ``n``
    micro-batches ``(x, y)`` of ``batches``, gradients accumulated into the ``.grad`` of ``params`` as the
    mean over the micro-batches (``n`` = 1: the plain loss). Returns the micro-batches' mean ``ce`` and
    ``aux`` (scalar tensors, not graph outputs: safe after the next CUDA-graph replay)."""
    ce_sum = aux_sum = None
    for i, (x, y) in enumerate(batches):
        if backend in GRAPH_BACKENDS:
            torch.compiler.cudagraph_mark_step_begin()  # the previous micro-batch's graph outputs are dead
        with _autocast(device):
            ce, aux = step_fn(x, y)
        loss = ce + aux
        (loss if n == 1 else loss / n).backward()
        if i == 0 and n > 1 and backend in GRAPH_BACKENDS:
            # the first backward's gradients are outputs of its CUDA graph, in the graphs' memory pool, which
            # the next replay overwrites: copy them out once; later micro-batches add into the copies in place
            for p in params:
                if p.grad is not None:
                    p.grad = p.grad.clone()
        if ce_sum is None:  # clone: see evaluate
            ce_sum, aux_sum = ce.detach().clone(), aux.detach().clone()
        else:
            ce_sum, aux_sum = ce_sum + ce.detach(), aux_sum + aux.detach()
    return (ce_sum, aux_sum) if n == 1 else (ce_sum / n, aux_sum / n)


def _warm_up_process(device: torch.device) -> None:
    """Pay a process's one-off costs that would otherwise land in the first recipe's ``wall_s``: the
    import of ``torch._dynamo`` (seconds; the first optimizer or torch.compile triggers it) and, on CUDA,
    the context's creation."""
    importlib.import_module("torch._dynamo")

    if device.type == "cuda":
        torch.zeros(1, device=device)
        _sync(device)


def train_recipe(cfg: TrainConfig, recipe: str, init_state: dict, train_data: torch.Tensor,
                 val_data: torch.Tensor, device: torch.device,
                 ep: ExpertParallel = SINGLE_PROCESS, resume: dict | None = None,
                 ckpt_path: Path | None = None) -> tuple[MoELM, dict]:
    """Train one recipe from ``init_state`` on the seeded batch order; return (model, metrics).

    Metrics: ``train_loss`` / ``aux_loss`` (one per step), ``final_train_loss`` (mean of the last
    10), ``val_step`` and ``val_loss`` (parallel lists; val at step s is measured after s
    updates), ``tokens_per_s`` and ``ms_per_step``
    (training steps only, first steps excluded as warm-up; timed between the loop's synchronizations with
    the GPU, every :data:`TIMING_EVERY` steps, so the host's launch work overlaps the GPU's), ``peak_mem_gib`` (CUDA, else None),
    ``wall_s`` (this recipe's time in this function: model build, steps, evaluations, checkpoint writes and
    compilation; summed over a resumed run's parts; not data loading, process start-up or the one-off
    imports of :func:`_warm_up_process`), ``compile`` (the backend the steps ran under, "" eager).

    Checkpoints: with ``ckpt_path`` and ``cfg.checkpoint_every > 0``, after every ``checkpoint_every``
    updates short of the last, :func:`save_training_state` writes the state there; ``resume`` (such a
    state, from :func:`load_training_state`) continues from its step, as if never stopped (the speed
    numbers then time the resumed steps only; ``resumed_at_step`` says where it went on).

    Under torchrun (``ep.group`` set) every MoE becomes expert-parallel, rank r draws its batches
    from seed ``cfg.seed + r``, losses are means over the ranks, tokens/s counts all ranks' tokens
    and the times are this rank's. Collective: every rank must call it with the same arguments.
    """
    _warm_up_process(device)  # outside every recipe's wall_s, the first's too (costs nothing after the first call)
    t_start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    model = MoELM(cfg, recipe)
    model.load_state_dict(init_state if resume is None else resume["model"])
    if ep.group is not None:
        model = parallel.convert_to_expert_parallel(model, ep.group)  # this rank's experts of every MoE
        parallel.sync_replicated_parameters(model, ep.group)
    model.to(device).train()
    backend = compile_backend(cfg, device, ep.size)
    if backend:  # a fresh compile cache per recipe: the recipes' guards would add up to dynamo's recompile limit
        torch._dynamo.reset()
    step_fn = compiled(model, backend)  # same parameters
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(cfg.seed + ep.rank)  # same batch order for every recipe
    ce_hist, aux_hist = [], []
    m = {"train_loss": [], "aux_loss": [], "val_step": [], "val_loss": []}
    start, wall_before = 0, 0.0
    if resume is not None:
        opt.load_state_dict(resume["optimizer"])
        gen.set_state(resume["data_rng"])
        torch.set_rng_state(resume["torch_rng"])
        if device.type == "cuda" and resume.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(resume["cuda_rng"], device)
        ce_hist, aux_hist = list(resume["ce_hist"].to(device)), list(resume["aux_hist"].to(device))
        m["val_step"], m["val_loss"] = list(resume["val_step"]), list(resume["val_loss"])
        start, wall_before = resume["step"], resume["wall_s"]
    postfix = {}
    bar = tqdm(total=cfg.steps, initial=start, desc=f"{recipe:>8}", dynamic_ncols=True, disable=ep.rank != 0)
    # Steps are timed between host synchronizations (every TIMING_EVERY steps, before evaluations and
    # checkpoints), not one by one: the host queues the next step's launches while the GPU runs this one,
    # as a training loop that logs every few steps does. segments: (first step, end step, seconds).
    segments, seg = [], [start, time.perf_counter()]
    skip = start + min(10, (cfg.steps - start) // 5)  # warm-up steps (allocator, compilation) are not timed

    def close_segment(end: int) -> None:
        _sync(device)
        now = time.perf_counter()
        if end > seg[0]:
            segments.append((seg[0], end, now - seg[1]))
        seg[:] = [end, now]

    for step in range(start, cfg.steps + 1):
        if step % cfg.eval_every == 0 or step == cfg.steps:
            close_segment(step)
            m["val_step"].append(step)
            m["val_loss"].append(evaluate(step_fn, val_data, cfg, device, ep))
            postfix["val"] = f"{m['val_loss'][-1]:.3f}"
            bar.set_postfix(postfix, refresh=False)
            seg[1] = time.perf_counter()  # the evaluation is not step time
        if step == cfg.steps:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        batches = (get_batch(train_data, cfg.batch_size, cfg.seq_len, gen, device) for _ in range(cfg.grad_accum))
        ce, aux = forward_backward(step_fn, batches, cfg.grad_accum, backend, device, params)
        clip_gradients(model, params, cfg.grad_clip, ep)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ce_hist.append(ce)
        aux_hist.append(aux)
        bar.update()
        done = step + 1
        if done == skip:
            close_segment(done)
        if done % TIMING_EVERY == 0:
            close_segment(done)
            postfix["loss"] = f"{ce_hist[-1].item():.3f}"
            bar.set_postfix(postfix)
        if ckpt_path is not None and cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < cfg.steps:
            close_segment(done)
            save_training_state(ckpt_path, {
                "format": CHECKPOINT_FORMAT, "recipe": recipe, "config": json.dumps(dataclasses.asdict(cfg)),
                "done": False, "step": done, "model": model.state_dict(), "optimizer": opt.state_dict(),
                "data_rng": gen.get_state(), "torch_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
                "ce_hist": torch.stack(ce_hist).cpu(), "aux_hist": torch.stack(aux_hist).cpu(),
                "val_step": list(m["val_step"]), "val_loss": list(m["val_loss"]),
                "wall_s": wall_before + time.perf_counter() - t_start})
            seg[1] = time.perf_counter()  # nor is writing the checkpoint
    bar.close()
    m["train_loss"] = mean_over_ranks(torch.stack(ce_hist), ep).tolist()  # [steps]
    m["aux_loss"] = mean_over_ranks(torch.stack(aux_hist).float(), ep).tolist()
    m["final_train_loss"] = final_train_loss(m)
    timed = [(b - a, sec) for a, b, sec in segments if a >= skip] or [(1, float("nan"))]
    n_timed, sec_timed = sum(n for n, _ in timed), sum(sec for _, sec in timed)
    m["ms_per_step"] = 1e3 * sec_timed / n_timed
    m["tokens_per_s"] = ep.size * tokens_per_step(cfg) * n_timed / sec_timed  # all ranks
    m["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    m["wall_s"] = wall_before + time.perf_counter() - t_start
    m["compile"] = backend
    if resume is not None:
        m["resumed_at_step"] = start
    return model, m


# ----------------------------------------------------------------------------- resumable runs

CHECKPOINT_FORMAT = "mxmoe-train-state-1"


def save_training_state(path: str | os.PathLike, state: dict) -> None:
    """``torch.save(state)`` to ``path`` atomically: written to a temp file in the same folder, flushed
    to disk, then ``os.replace``d over ``path``; a crash mid-write leaves the previous file as it was
    (and the temp file is removed on any error). ``state`` must hold only tensors, numbers, strings,
    None and lists / dicts of them (what ``torch.load(weights_only=True)`` reads back)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_training_state(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict:
    """A state written by :func:`save_training_state` (``torch.load(weights_only=True)``: no code is
    unpickled), tensors on ``device`` (generator states stay on the CPU).

    Raises:
        FileNotFoundError: no such file. RunInputError (a ValueError): a damaged file, or not a
            ``mxmoe train`` training state.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no training state at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch.load raises several kinds for a damaged file
        raise RunInputError(f"{path} cannot be read as a training state ({type(e).__name__}: {str(e)[:120]}): "
                            "the file is damaged or incomplete; delete it to train that recipe from the start") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise RunInputError(f"{path} is not a mxmoe train checkpoint (format {CHECKPOINT_FORMAT})")
    if "model" in state:
        state["model"] = {k: v.to(device) for k, v in state["model"].items()}
    return state


def load_run_config(folder: str | os.PathLike) -> TrainConfig:
    """The settings of the checkpointed run in ``folder`` (its ``run_config.json``), with ``out`` and
    ``resume`` set to ``folder``: what ``mxmoe train --resume DIR`` runs.

    Raises:
        ValueError: ``folder`` is not a folder, or holds no ``run_config.json`` (not a run with
            ``--checkpoint-every``).
    """
    path = Path(folder) / "run_config.json"
    if not Path(folder).is_dir():
        raise ValueError(f"--resume {str(folder)!r} is not a folder")
    if not path.is_file():
        raise ValueError(f"--resume {str(folder)!r}: no run_config.json there (it is written by a run with "
                         "--checkpoint-every N > 0 into its --out folder)")
    try:
        saved = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RunInputError(f"--resume: {path} is not valid JSON ({e}); it is written by mxmoe train") from None
    if not isinstance(saved, dict):
        raise RunInputError(f"--resume: {path} does not hold a run's settings (a JSON object)")
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{**{k: v for k, v in saved.items() if k in known}, "out": str(folder), "resume": str(folder)})


def _same_run(a: dict, b: dict) -> bool:
    """Whether two config dicts describe the same computation (``out`` and ``resume`` aside)."""
    return all(a.get(k) == b.get(k) for k in set(a) | set(b) if k not in ("out", "resume"))


def final_train_loss(m: dict, last: int = 10) -> float:
    """Mean train loss of the last ``last`` steps (one batch alone is noisy)."""
    tail = m["train_loss"][-last:]
    return sum(tail) / len(tail)


# ----------------------------------------------------------------------------- checkpoints and sampling

def load_checkpoint(path: str | os.PathLike, device: str | torch.device = "cpu",
                    recipe: str | None = None) -> tuple[MoELM, TrainConfig, str]:
    """A model written by ``mxmoe train`` (``model_<recipe>.safetensors``), in eval mode on ``device``.

    The file's metadata holds the run's config and recipe; ``recipe`` overrides the latter (e.g. run
    a bf16-trained model's experts in MXFP8). Returns ``(model, config, recipe)``; in the config of a
    file written before those checks, a warmup longer than the steps is cut to them and a negative
    aux_loss_coef is 0.

    Raises:
        FileNotFoundError: no such file. ValueError: a safetensors file without ``mxmoe train``'s
            metadata, or whose tensors do not match its config.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # noqa: BLE001 - safetensors' own error type for a file that is not one
        raise ValueError(f"{path} is not a safetensors model file ({str(e)[:100]}): give a "
                         "model_<recipe>.safetensors written by mxmoe train") from None
    if "config" not in meta or "recipe" not in meta:
        raise ValueError(f"{path} has no mxmoe train metadata (config, recipe): not written by mxmoe train")
    saved = json.loads(meta["config"])
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    fields = {k: v for k, v in saved.items() if k in known}
    # files of runs from before warmup <= steps and aux_loss_coef >= 0 were checked: training settings, not the model's
    if isinstance(fields.get("warmup"), int) and isinstance(fields.get("steps"), int):
        fields["warmup"] = min(fields["warmup"], fields["steps"])
    if isinstance(fields.get("aux_loss_coef"), (int, float)) and fields["aux_loss_coef"] < 0:
        fields["aux_loss_coef"] = 0.0
    cfg = TrainConfig(**fields)
    recipe = recipe or meta["recipe"]
    model = MoELM(cfg, recipe)
    try:
        model.load_state_dict(load_file(str(path)))
    except RuntimeError as e:
        raise ValueError(f"{path}: tensors do not match its config: {e}") from None
    return model.to(device).eval(), cfg, recipe


@torch.no_grad()
def generate(model: MoELM, prompt: bytes, tokens: int, temperature: float = 0.8, top_k: int | None = 200,
             seed: int = 0) -> bytes:
    """``tokens`` bytes sampled after ``prompt`` (the prompt itself not included).

    Each step feeds the last ``seq_len`` bytes (the model's context) and draws the next byte from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely bytes (None or 0: all
    256), with a CPU generator seeded by ``seed``, so a call is deterministic for a given model,
    device and seed. ``temperature == 0`` takes the most likely byte (greedy).

    Raises:
        ValueError: an empty prompt, ``tokens < 0``, a negative or non-finite ``temperature``, ``top_k < 0``.
    """
    if not prompt:
        raise ValueError("the prompt is empty: give at least one byte (e.g. b'\\n')")
    bad = ([f"tokens must be >= 0, got {tokens}"] * (tokens < 0)
           + [f"temperature must be finite and >= 0, got {temperature}"] * (not 0 <= temperature < math.inf)
           + [f"top_k must be >= 0, got {top_k}"] * (top_k is not None and top_k < 0))
    if bad:  # NaN and inf temperatures would sample from NaN or uniform probabilities
        raise ValueError("; ".join(bad))
    was_training = model.training
    model.eval()
    device = model.head.weight.device
    context = model.pos.num_embeddings
    gen = torch.Generator().manual_seed(seed)
    idx = torch.tensor(list(prompt), dtype=torch.long)  # [P]
    out = []
    with _autocast(device):
        for _ in range(tokens):
            logits = model.logits(idx[-context:].unsqueeze(0).to(device))[0, -1].cpu()  # [V] FP32
            if temperature == 0:
                nxt = int(logits.argmax())
            else:
                logits = logits / temperature
                if top_k:
                    kth = torch.topk(logits, min(top_k, VOCAB)).values[-1]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
            out.append(nxt)
            idx = torch.cat([idx, torch.tensor([nxt])])
    model.train(was_training)
    return bytes(out)


def sample(ckpt: str | os.PathLike, prompt: str = "\n", tokens: int = 200, temperature: float = 0.8,
           top_k: int | None = 200, seed: int = 0, device: str = "cpu", recipe: str | None = None) -> str:
    """Load a ``mxmoe train`` checkpoint and continue ``prompt`` (UTF-8) by ``tokens`` sampled bytes.

    Returns the prompt followed by the sample, decoded as UTF-8 (a byte sequence that is not valid
    UTF-8 shows as U+FFFD). Raises as :func:`load_checkpoint` and :func:`generate`.
    """
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
    model, _, _ = load_checkpoint(ckpt, device, recipe)
    data = prompt.encode()
    return (data + generate(model, data, tokens, temperature, top_k, seed)).decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------- reporting

# Seed-to-seed spread, measured per preset: the same run with seeds 0, 1, 2 (other init, other batch
# order), each recipe's validation loss at every validation step. `mxmoe train --seed S --device cpu` on
# 2 pinned CPU cores (the H200 host's, torch 2.11.0 CPU ops), 2026-12-01, on Python 3.11.7's standard
# library (benchmarks/NOTES_train.md). A stored spread applies to runs on that Python's stdlib.
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
_SPREAD_FREE = ("out", "device", "recipes", "seed", "compile", "eval_every", "data", "data_cache",
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
    free = ("seed", "recipes", "out", "resume", "device", "data_cache", "checkpoint_every", "compile")

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


def run(cfg: TrainConfig) -> dict:
    """Train every recipe of ``cfg.recipes`` from one init on one batch order; write the outputs.

    Under torchrun with more than one process: joins the process group, trains expert-parallel,
    has rank 0 print and write, and destroys the group at the end.
    A fresh run (no ``cfg.resume``) first removes an earlier run's training states from ``cfg.out``
    (``run_config.json``, ``checkpoint_*.pt``), so no later ``--resume`` continues that run over this one's
    outputs. With ``cfg.checkpoint_every``: writes ``run_config.json``, then training states
    (:func:`train_recipe`); a finished recipe's state keeps only its metrics. With ``cfg.resume``:
    finished recipes are taken from their states, an unfinished one continues from its state.
    Returns the metrics dict that is also written to ``<cfg.out>/metrics.json``.

    Raises:
        RunInputError (a ValueError): ``cfg.resume`` with a damaged state or one of other settings than
            ``cfg``'s; data that cannot feed the run (too few files, a split shorter than a window).
    """
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    ep, device = init_expert_parallel(cfg, device)
    main_rank = ep.rank == 0  # prints and writes
    recipes = parse_recipes(cfg.recipes)
    out = Path(cfg.out)
    config = dataclasses.asdict(cfg)
    states = {}
    if cfg.resume:
        for recipe in recipes:
            if (out / f"checkpoint_{recipe}.pt").is_file():
                states[recipe] = load_training_state(out / f"checkpoint_{recipe}.pt", device)
                if not _same_run(json.loads(states[recipe]["config"]), config):
                    theirs = json.loads(states[recipe]["config"])
                    differ = sorted(k for k in config if k not in ("out", "resume") and theirs.get(k) != config[k])
                    raise RunInputError(f"{out / f'checkpoint_{recipe}.pt'} was written by a run of other settings "
                                        f"than {out / 'run_config.json'} (differ: {', '.join(differ) or 'unknown'})")
    if main_rank:
        out.mkdir(parents=True, exist_ok=True)
        if not cfg.resume:  # a fresh run: an earlier run's states in this folder are not this run's
            stale = [p for p in [out / "run_config.json", *sorted(out.glob("checkpoint_*.pt"))] if p.is_file()]
            for p in stale:  # else a later --resume would continue that run and overwrite this one's outputs
                p.unlink()
            if stale:
                print(f"removed an earlier run's training states from {out}: {', '.join(p.name for p in stale)}")
            if cfg.checkpoint_every:
                _write_json_atomic(out / "run_config.json", config)
    try:
        corpus = load_corpus(cfg.data, device.type, cfg.val_every_file, cfg.data_cache)
    except ValueError as e:
        raise RunInputError(f"--data {cfg.data!r}: {e} (one file in --val-every-file goes to validation)") from None
    train_data, val_data = corpus.train, corpus.val
    for split, d in (("train", train_data), ("validation", val_data)):
        if len(d) <= cfg.seq_len + 1:
            raise RunInputError(f"--data {cfg.data!r}: the {split} split has {len(d):,} bytes, fewer than a window of "
                                f"--seq-len {cfg.seq_len} + 2: give more data or a shorter --seq-len")
    torch.manual_seed(cfg.seed)
    init_model = MoELM(cfg, recipes[0])
    init_state = {k: v.detach().clone() for k, v in init_model.state_dict().items()}
    params = count_params(init_model, cfg)
    del init_model
    tokens = cfg.steps * tokens_per_step(cfg) * ep.size
    data = {**corpus.info(), "tokens_per_recipe": tokens, "epochs_per_recipe": tokens / len(train_data)}
    backend = compile_backend(cfg, device, ep.size)
    if main_rank:
        ranks = f" x {ep.size} ranks, expert parallel" if ep.group is not None else ""
        cached = f", from the cache {corpus.cache}" if corpus.from_cache else (f", cached to {corpus.cache}"
                                                                               if corpus.cache else "")
        dups = f", {corpus.duplicates:,} duplicate files skipped" if corpus.duplicates else ""
        read = f"{tokens / 1e6:.1f}M" if tokens >= 1e6 else f"{tokens:,}"
        print(f"data: {corpus.source}: {corpus.files['train']:,} train / {corpus.files['val']:,} val files, "
              f"{len(train_data) / 1e6:.1f}M / {len(val_data) / 1e6:.1f}M bytes{dups}{cached}; "
              f"a recipe's run reads {read} tokens = {data['epochs_per_recipe']:.3g} epochs of the "
              f"train split" + (" (more than one pass: the model can memorize it)" if data["epochs_per_recipe"] >= 1
                                else ""))
        print(f"params: {params['total'] / 1e6:.2f}M total, {params['active_per_token'] / 1e6:.2f}M active "
              f"per token | device: {device}{ranks} | recipes: {', '.join(recipes)} | steps: "
              + (f"torch.compile backend {backend}" + (" (CUDA graphs)" if backend in GRAPH_BACKENDS else "")
                 if backend else "eager")
              + (f" | checkpoints every {cfg.checkpoint_every} steps in {out}" if cfg.checkpoint_every else "")
              + (" | resumed: " + ", ".join(f"{r} at step {s.get('step', cfg.steps)}" for r, s in states.items())
                 if states else ""))
    where = {"stdlib": sysconfig.get_paths()["stdlib"], "python-all": "python-all: " + ", ".join(python_roots())}
    env = {"device": str(device), "world_size": ep.size, "torch": torch.__version__, "cuda": torch.version.cuda,
           "python": platform.python_version(), "data": where.get(corpus.source, str(Path(corpus.source))),
           "platform": platform.platform(), "threads": torch.get_num_threads(),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    flops = model_flops_per_token(cfg)
    metrics = {"config": config, "env": env, "params": params,
               "data_bytes": {"train": len(train_data), "val": len(val_data)}, "data": data,
               "model_flops_per_token": flops, "peak_flops": PEAK_FLOPS, "recipes": {}}
    for recipe in recipes:
        state = states.get(recipe)
        if state is not None and state["done"]:
            metrics["recipes"][recipe] = state["metrics"]
            continue
        ckpt = out / f"checkpoint_{recipe}.pt" if cfg.checkpoint_every and ep.group is None else None
        model, m = train_recipe(cfg, recipe, init_state, train_data, val_data, device, ep, state, ckpt)
        m["mfu"] = m["tokens_per_s"] * flops / PEAK_FLOPS if device.type == "cuda" else None
        metrics["recipes"][recipe] = m
        weights = full_state_dict(model, ep)  # every rank takes part; rank 0 writes
        if main_rank:
            save_model(weights, out / f"model_{recipe}.safetensors",
                       metadata={"recipe": recipe, "config": json.dumps(config)})
            if ckpt is not None:  # finished: the metrics alone (the weights are in the safetensors file)
                save_training_state(ckpt, {"format": CHECKPOINT_FORMAT, "recipe": recipe, "done": True,
                                           "config": json.dumps(config), "metrics": m})
        del model, weights
    if "bf16" in metrics["recipes"]:
        ref = metrics["recipes"]["bf16"]["val_loss"][-1]
        metrics["val_gap_vs_bf16_pct"] = {r: 100 * (m["val_loss"][-1] - ref) / ref
                                          for r, m in metrics["recipes"].items() if r != "bf16"}
        spread = seed_spread(metrics["config"])
        if spread is not None:
            metrics["seed_spread"] = {k: spread[k] for k in ("preset", "seeds", "bf16_val", "spread", "gaps",
                                                             "data", "python")}
    if main_rank:
        (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
        plot_losses(metrics, out / "loss.png")
        print(summarize(metrics))
        print(f"wrote {out / 'metrics.json'}, {out / 'loss.png'}, "
              + ", ".join(str(out / f"model_{r}.safetensors") for r in recipes))
    if ep.group is not None:
        parallel.shutdown_distributed()
    return metrics


def _umask() -> int:
    """The process's umask: from ``/proc/self/status`` where Linux has it (reading it changes nothing), else
    by setting it and putting it back at once (not safe against another thread creating files meanwhile)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def _umask_mode(path: Path) -> None:
    """Give ``path`` the mode a plain ``open(path, "w")`` would: ``0o666`` less the umask (temp files,
    safetensors' among them, are created ``0o600``)."""
    os.chmod(path, 0o666 & ~_umask())


def save_model(weights: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str]) -> None:
    """``safetensors.torch.save_file`` (a temp file renamed over ``path``), with the permissions of a
    plain file (``0o666`` less the umask) instead of the temp file's ``0o600``."""
    save_file(weights, path, metadata=metadata)
    _umask_mode(Path(path))


def _write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=1))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
