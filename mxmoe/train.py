"""Train a small byte-level MoE language model on the Python standard library: bf16 vs mxfp8.

Every recipe starts from the same initial weights and sees the same batches in the same order,
so the difference between their loss curves is the cost of the MXFP8 expert matrix products.
The data is this machine's own standard library (``sysconfig.get_paths()["stdlib"]``, all
``.py`` files, site-packages excluded); every 20th file, in sorted order, is held out for
validation. Nothing is downloaded. Launch:

    mxmoe train                                    # default preset: 2-3 minutes on 2 CPU cores
    mxmoe train --preset tiny --out /tmp/tiny      # seconds; what the tests run
    mxmoe train --preset gpu --device cuda         # ~110M parameters, bf16 autocast
    mxmoe train --preset gpu --device cuda --compile cudagraphs   # the same, 2.8-3.8x the tokens/s (H200)
    python -m mxmoe train --steps 500 --lr 2e-3 --recipes bf16,mxfp8

Expert parallelism: launched by ``torchrun`` with more than one process, every rank holds
``experts / world`` experts of each MoE layer (``mxmoe.parallel``: gloo on CPUs, NCCL and one GPU
per rank on CUDA) and trains on its own batches; the rest of the model is replicated and its
gradients are averaged. ``--batch-size`` and ``--eval-batches`` count per rank; ``--experts`` must
be divisible by the number of processes. Rank 0 prints and writes the outputs; checkpoints hold
the full (single-process) state dict.

    torchrun --standalone --nproc-per-node 2 -m mxmoe train --preset tiny --out /tmp/tiny_ep2
    torchrun --standalone --nproc-per-node 2 -m mxmoe train --preset gpu --device cuda   # 8 experts per GPU

Writes into ``--out``: ``metrics.json`` (config, environment, per-recipe losses and speed),
``loss.png`` (train and val curves, and each recipe's val loss minus bf16's against the stored
seed-to-seed spread) and ``model_<recipe>.safetensors``. On the CPU every recipe runs the pure-torch
reference (the speed column reads ``ref tok/s``), whose BF16 grouped products are FP32 products of the
BF16 values (:func:`mxmoe.ops.grouped.reference_grouped_mm`; :class:`CPUBF16GroupedMMAsFP32` does the same
for a direct ``torch._grouped_mm`` call, ``--cpu-bf16-gemm``). A checkpoint is
loaded by :func:`load_checkpoint` and sampled by :func:`sample` / ``mxmoe sample``:

    mxmoe sample --ckpt out/model_mxfp8.safetensors --prompt "def " --tokens 200
"""

import contextlib
import dataclasses
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
from torch.overrides import TorchFunctionMode
from tqdm import tqdm

from mxmoe import parallel
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
    compile: str = ""  # torch.compile: "cudagraphs" (CUDA, ~3x steps/s), "inductor", "aot_eager", "eager"; not under torchrun
    # CPU only: "fp32" runs the BF16 grouped products (torch._grouped_mm of BF16 operands, the bf16 recipe's
    # experts) as FP32 products of the same BF16 values, rounded to BF16 (the same numbers up to FP32
    # summation order, ~10x faster on CPUs without BF16 matrix units); "native": torch's CPU BF16 kernel
    cpu_bf16_gemm: str = "fp32"
    # data
    data: str = ""  # folder whose .py files are the data (site-packages skipped); empty: this Python's stdlib
    val_every_file: int = 20  # every N-th stdlib file (sorted) goes to the validation split
    seq_len: int = 128  # tokens (bytes) per training window = context length
    batch_size: int = 16  # windows per optimizer step (per rank under torchrun)
    # model
    dim: int = 128  # residual stream width (a multiple of the recipe's scale groups: 32 for MX, 128 for mxfp8_128)
    layers: int = 2  # transformer blocks, each attention + MoE
    heads: int = 4  # attention heads (dim % heads == 0)
    experts: int = 8  # experts per MoE layer (a multiple of the torchrun processes)
    top_k: int = 2  # experts each token is routed to
    ffn_dim: int = 256  # hidden width of one expert (a multiple of the recipe's scale groups, as dim)
    aux_loss_coef: float = 0.01  # weight of the MoE load-balancing loss
    # optimization
    steps: int = 300  # optimizer steps per recipe
    lr: float = 3e-3  # peak AdamW learning rate
    min_lr_frac: float = 0.1  # cosine decay ends at lr * min_lr_frac
    warmup: int = 30  # linear warmup steps
    weight_decay: float = 0.1  # AdamW decay on matrices and embeddings (not norms)
    grad_clip: float = 1.0  # clip the global gradient norm to this
    # evaluation
    eval_every: int = 50  # steps between validation passes (also at step 0 and at the end)
    eval_batches: int = 8  # batches per validation pass, per rank (the same batches every time)

    def __post_init__(self):
        if self.dim % self.heads:
            raise ValueError(f"dim {self.dim} is not divisible by heads {self.heads}")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k {self.top_k} must be in [1, experts={self.experts}]")
        if min(self.steps, self.eval_every, self.eval_batches, self.batch_size, self.seq_len, self.layers) < 1:
            raise ValueError("steps, eval_every, eval_batches, batch_size, seq_len and layers must be >= 1")
        if self.val_every_file < 2:
            raise ValueError(f"val_every_file must be >= 2 (every file would be validation), got {self.val_every_file}")
        from mxmoe.recipes import get_recipe

        names = parse_recipes(self.recipes)
        if self.data and not Path(self.data).is_dir():
            raise ValueError(f"--data {self.data!r} is not a folder")
        if self.cpu_bf16_gemm not in ("fp32", "native"):
            raise ValueError(f"cpu_bf16_gemm must be 'fp32' or 'native', got {self.cpu_bf16_gemm!r}")
        for name in names:
            get_recipe(name).check_dims(self.dim, self.ffn_dim)  # unknown names and bad dims fail before training
        if not (self.lr > 0 and 0 <= self.min_lr_frac <= 1 and self.weight_decay >= 0 and self.grad_clip > 0
                and self.warmup >= 0):
            raise ValueError(f"need lr > 0 (got {self.lr}), 0 <= min_lr_frac <= 1 ({self.min_lr_frac}), "
                             f"weight_decay >= 0 ({self.weight_decay}), grad_clip > 0 ({self.grad_clip}), "
                             f"warmup >= 0 ({self.warmup})")
        if self.device and self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device {self.device} asked for, but torch sees no CUDA GPU here")
        if self.compile:
            if self.compile not in COMPILE_BACKENDS:
                raise ValueError(f"compile backend {self.compile!r}: use one of {', '.join(COMPILE_BACKENDS)} "
                                 "(or nothing, for eager)")
            if int(os.environ.get("WORLD_SIZE", "1")) > 1:
                raise ValueError("--compile is not supported with expert parallelism (torchrun): leave it off there")
            on_cpu = (self.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cpu")
            if self.compile == "inductor" and on_cpu and any(n != "bf16" for n in names):
                raise ValueError("--compile inductor on the CPU cannot compile the MX recipes (torch's CPU "
                                 "codegen has no float8_e8m0fnu); use --compile aot_eager there, or a GPU")
            if self.compile == "cudagraphs" and on_cpu:
                raise ValueError("--compile cudagraphs records CUDA graphs: it needs --device cuda")


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
# torch's, unfused) from CUDA graphs, which takes the host's launch work out of the step
COMPILE_BACKENDS = ("inductor", "cudagraphs", "aot_eager", "eager")

PRESETS = {
    "tiny": dict(dim=64, layers=2, heads=2, experts=4, top_k=2, ffn_dim=64, seq_len=64, batch_size=8,
                 steps=40, warmup=5, eval_every=20, eval_batches=2),
    "default": dict(eval_every=25),
    # ~110M parameters (SwiGLU experts: 3 * dim * ffn_dim each), ~22M active per token. 1200 steps of
    # 8192 tokens = 9.8M tokens, under one pass over the 10.2M-byte training split: at 3000 steps of
    # 16384 tokens (4.8 epochs, H200 2026-11-30) the model memorized (train 0.45, val 0.89 and rising)
    "gpu": dict(dim=512, layers=8, heads=8, experts=16, top_k=2, ffn_dim=512, seq_len=512, batch_size=16,
                steps=1200, lr=1e-3, warmup=100, eval_every=100, eval_batches=40),
}


def make_config(preset: str = "default", **overrides) -> TrainConfig:
    """A ``TrainConfig`` from a named preset (``tiny``, ``default``, ``gpu``) plus field overrides."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    return TrainConfig(**{**PRESETS[preset], **overrides})


# ----------------------------------------------------------------------------- data

def load_stdlib(val_every_file: int = 20, root: str | os.PathLike = "") -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes of the standard library's ``.py`` files (or those under ``root``) as (train, val) uint8 tensors.

    Files are sorted by path; file ``i`` is validation when ``i % val_every_file == 0``.
    Files of a split are joined with ``b"\\n\\n"``.

    Raises:
        ValueError: ``root`` is not a folder, or it holds fewer than ``val_every_file`` ``.py`` files.
    """
    root = Path(root or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise ValueError(f"data folder {str(root)!r} is not a folder")
    files = sorted(p for p in root.rglob("*.py") if p.relative_to(root).parts[0] != "site-packages")
    if len(files) < val_every_file:
        raise ValueError(f"data folder {str(root)!r} has {len(files)} .py files: need at least {val_every_file}")
    splits: tuple[list[bytes], list[bytes]] = ([], [])
    for i, path in enumerate(files):
        splits[i % val_every_file == 0].append(path.read_bytes())
    train, val = (torch.frombuffer(bytearray(b"\n\n".join(s)), dtype=torch.uint8) for s in splits)
    return train, val


def get_batch(data: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of ``data``: inputs and next-byte targets, both int64 ``[B, T]`` on ``device``."""
    start = torch.randint(len(data) - seq_len - 1, (batch_size, 1), generator=gen)  # [B, 1]
    window = data[start + torch.arange(seq_len + 1)].long()  # [B, T+1]
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

    Raises ValueError (on every rank, before any collective) if ``cfg.experts`` is not divisible
    by the number of processes.
    """
    group = parallel.maybe_init_distributed("nccl" if device.type == "cuda" else "gloo")
    if group is None:
        return SINGLE_PROCESS, device
    ep = ExpertParallel(group, dist.get_rank(group), dist.get_world_size(group))
    if cfg.experts % ep.size:
        raise ValueError(f"--experts {cfg.experts} is not divisible by the {ep.size} torchrun processes "
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


class CPUBF16GroupedMMAsFP32(TorchFunctionMode):
    """Inside this mode, ``torch._grouped_mm`` of BF16 CPU tensors is computed as FP32 products of
    the same BF16 values, rounded once to the output dtype (BF16 unless ``out_dtype`` says otherwise).

    Why: on CPUs without BF16 matrix instructions (AVX2, and AVX-512 without BF16) torch's CPU BF16
    GEMM is about 10x slower than its FP32 GEMM, which made the ``bf16`` recipe's pure-torch reference
    3.7x slower than the ``mxfp8`` one (whose reference products run in FP32 on dequantized values).
    Same numbers: a product of two BF16 values is exact in FP32, the sums are FP32 as in
    ``torch._grouped_mm``, and the result is rounded to BF16 once; only the FP32 summation order may
    differ. The autograd graph is the FP32 one, so dgrad and wgrad run in FP32 too and are rounded to
    BF16 where the operands' BF16 casts are differentiated (as the BF16 kernel's outputs are).
    Rows past ``offs[-1]`` are zeros (``torch._grouped_mm`` leaves them unset).

    Any other call, or a ``torch._grouped_mm`` on another device or dtype, runs unchanged.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch._grouped_mm and len(args) == 3 and set(kwargs) <= {"out_dtype"}:
            a, b, offs = args
            if (a.device.type == "cpu" and a.dtype == b.dtype == torch.bfloat16 and offs is not None
                    and offs.numel() > 0):
                return _grouped_mm_fp32(a, b, offs, kwargs.get("out_dtype") or a.dtype)
        return func(*args, **kwargs)


def _grouped_mm_fp32(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs)`` as per-group FP32 products (differentiable), in ``out_dtype``.

    2D x 3D: ``a [M, K]``, ``b [E, K, N]`` -> ``[M, N]``; 2D x 2D: ``a [N, T]``, ``b [T, K]`` ->
    ``[E, N, K]``; ``offs`` int32 ``[E]`` cumulative group ends (rows of ``a``, or along ``T``).
    """
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    a32, b32 = a.float(), b.float()
    if b.dim() == 3:
        parts = [a32[s:t] @ b32[e] for e, (s, t) in enumerate(zip(starts, ends))]
        if ends[-1] < a.shape[0]:
            parts.append(a32.new_zeros(a.shape[0] - ends[-1], b.shape[2]))
        return torch.cat(parts).to(out_dtype)
    return torch.stack([a32[:, s:t] @ b32[s:t] for s, t in zip(starts, ends)]).to(out_dtype)


def _products(cfg: TrainConfig, device: torch.device):
    """The context the model's forward and backward run in: :class:`CPUBF16GroupedMMAsFP32` on the CPU
    with ``cfg.cpu_bf16_gemm == "fp32"`` and no ``--compile``; else nothing."""
    if device.type == "cpu" and cfg.cpu_bf16_gemm == "fp32" and not cfg.compile:
        return CPUBF16GroupedMMAsFP32()
    return contextlib.nullcontext()


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
            with _autocast(device), _products(cfg, device):
                losses.append(model(x, y)[0].clone())  # clone: a CUDA graph's output is reused by its next replay
    model.train()
    return mean_over_ranks(torch.stack(losses).mean(), ep).item()


def train_recipe(cfg: TrainConfig, recipe: str, init_state: dict, train_data: torch.Tensor,
                 val_data: torch.Tensor, device: torch.device,
                 ep: ExpertParallel = SINGLE_PROCESS) -> tuple[MoELM, dict]:
    """Train one recipe from ``init_state`` on the seeded batch order; return (model, metrics).

    Metrics: ``train_loss`` / ``aux_loss`` (one per step), ``final_train_loss`` (mean of the last
    10), ``val_step`` and ``val_loss`` (parallel lists; val at step s is measured after s
    updates), ``tokens_per_s`` and ``ms_per_step``
    (training steps only, first steps excluded as warm-up), ``peak_mem_gib`` (CUDA, else None),
    ``wall_s`` (everything, evaluation included).

    Under torchrun (``ep.group`` set) every MoE becomes expert-parallel, rank r draws its batches
    from seed ``cfg.seed + r``, losses are means over the ranks, tokens/s counts all ranks' tokens
    and the times are this rank's. Collective: every rank must call it with the same arguments.
    """
    t_start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    model = MoELM(cfg, recipe)
    model.load_state_dict(init_state)
    if ep.group is not None:
        model = parallel.convert_to_expert_parallel(model, ep.group)  # this rank's experts of every MoE
        parallel.sync_replicated_parameters(model, ep.group)
    model.to(device).train()
    step_fn = torch.compile(model, backend=cfg.compile) if cfg.compile else model  # same parameters
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(cfg.seed + ep.rank)  # same batch order for every recipe
    ce_hist, aux_hist, step_s = [], [], []
    m = {"train_loss": [], "aux_loss": [], "val_step": [], "val_loss": []}
    postfix = {}
    bar = tqdm(total=cfg.steps, desc=f"{recipe:>8}", dynamic_ncols=True, disable=ep.rank != 0)
    for step in range(cfg.steps + 1):
        if step % cfg.eval_every == 0 or step == cfg.steps:
            m["val_step"].append(step)
            m["val_loss"].append(evaluate(step_fn, val_data, cfg, device, ep))
            postfix["val"] = f"{m['val_loss'][-1]:.3f}"
            bar.set_postfix(postfix, refresh=False)
        if step == cfg.steps:
            break
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        x, y = get_batch(train_data, cfg.batch_size, cfg.seq_len, gen, device)  # [B, T] each
        if cfg.compile == "cudagraphs":
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's graph outputs are dead
        with _products(cfg, device):
            with _autocast(device):
                ce, aux = step_fn(x, y)
            (ce + aux).backward()
        clip_gradients(model, params, cfg.grad_clip, ep)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ce_hist.append(ce.detach().clone())  # clone: see evaluate
        aux_hist.append(aux.detach().clone())
        _sync(device)
        step_s.append(time.perf_counter() - t0)
        bar.update()
        if step % 10 == 0:
            postfix["loss"] = f"{ce.item():.3f}"
            bar.set_postfix(postfix)
    bar.close()
    m["train_loss"] = mean_over_ranks(torch.stack(ce_hist), ep).tolist()  # [steps]
    m["aux_loss"] = mean_over_ranks(torch.stack(aux_hist).float(), ep).tolist()
    m["final_train_loss"] = final_train_loss(m)
    timed = step_s[min(10, cfg.steps // 5):]  # skip warm-up steps (allocator, kernel compilation)
    m["ms_per_step"] = 1e3 * sum(timed) / len(timed)
    m["tokens_per_s"] = ep.size * cfg.batch_size * cfg.seq_len * len(timed) / sum(timed)  # all ranks
    m["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    m["wall_s"] = time.perf_counter() - t_start
    return model, m


def final_train_loss(m: dict, last: int = 10) -> float:
    """Mean train loss of the last ``last`` steps (one batch alone is noisy)."""
    tail = m["train_loss"][-last:]
    return sum(tail) / len(tail)


# ----------------------------------------------------------------------------- checkpoints and sampling

def load_checkpoint(path: str | os.PathLike, device: str | torch.device = "cpu",
                    recipe: str | None = None) -> tuple[MoELM, TrainConfig, str]:
    """A model written by ``mxmoe train`` (``model_<recipe>.safetensors``), in eval mode on ``device``.

    The file's metadata holds the run's config and recipe; ``recipe`` overrides the latter (e.g. run
    a bf16-trained model's experts in MXFP8). Returns ``(model, config, recipe)``.

    Raises:
        FileNotFoundError: no such file. ValueError: a safetensors file without ``mxmoe train``'s
            metadata, or whose tensors do not match its config.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if "config" not in meta or "recipe" not in meta:
        raise ValueError(f"{path} has no mxmoe train metadata (config, recipe): not written by mxmoe train")
    saved = json.loads(meta["config"])
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in saved.items() if k in known})
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
        ValueError: an empty prompt, ``tokens < 0``, ``temperature < 0``, ``top_k < 0``.
    """
    if not prompt:
        raise ValueError("the prompt is empty: give at least one byte (e.g. b'\\n')")
    if tokens < 0 or temperature < 0 or (top_k is not None and top_k < 0):
        raise ValueError(f"need tokens >= 0 (got {tokens}), temperature >= 0 ({temperature}), top_k >= 0 ({top_k})")
    was_training = model.training
    model.eval()
    device = model.head.weight.device
    context = model.pos.num_embeddings
    gen = torch.Generator().manual_seed(seed)
    idx = torch.tensor(list(prompt), dtype=torch.long)  # [P]
    out = []
    with (CPUBF16GroupedMMAsFP32() if device.type == "cpu" else contextlib.nullcontext()), _autocast(device):
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
_SPREAD_FREE = ("out", "device", "recipes", "seed", "compile", "cpu_bf16_gemm", "eval_every", "data")


def seed_spread(cfg: dict) -> dict | None:
    """The stored seed-to-seed spread (:data:`SEED_SPREAD`) for a run of config ``cfg`` (a dict of
    :class:`TrainConfig` fields), or None when none was measured for its settings.

    Returns ``{"preset", "seeds", "bf16_val": {seed: final val}, "spread": max - min of bf16's final val
    losses, "gaps": {recipe: [final val - bf16's, per seed]}, "val_step", "bf16_curves": {seed: [...]},
    "data", "python"}``.
    """
    if not cfg.get("data") and not platform.python_version().startswith(tuple(
            sp["python"] + "." for sp in SEED_SPREAD.values())):
        return None  # this Python's stdlib is other data
    for preset, spread in SEED_SPREAD.items():
        if not cfg.get("data") and not platform.python_version().startswith(spread["python"] + "."):
            continue
        want = dataclasses.asdict(make_config(preset))
        if all(cfg.get(k) == v for k, v in want.items() if k not in _SPREAD_FREE):
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
           title=f"MoE LM on stdlib bytes: {cfg['layers']}L d{cfg['dim']} {cfg['experts']}E top-{cfg['top_k']}, "
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
        dax.legend(fontsize=8)
    else:
        dax.text(0.5, 0.5, "no bf16 run: no difference to show", ha="center", va="center", transform=dax.transAxes)
    dax.set_xlabel("step")
    dax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def summarize(metrics: dict) -> str:
    """A small table (recipe, final train loss (mean of the last 10 steps), final val loss,
    tokens/s, wall s), then each recipe's final val-loss gap to bf16 (nats and %) with a verdict
    against the stored seed-to-seed spread (:func:`verdict`). On the CPU the speed column is headed
    ``ref tok/s``: every recipe runs the pure-torch reference there, not the GPU kernels."""
    w = max([10] + [len(r) + 1 for r in metrics["recipes"]])  # recipe column: the longest name + 1
    cpu = metrics["env"]["device"].startswith("cpu")
    speed = "ref tok/s" if cpu else "tokens/s"
    rows = [f"{'recipe':<{w}}{'train loss':>12}{'val loss':>10}{speed:>11}{'wall s':>8}"]
    for recipe, m in metrics["recipes"].items():
        rows.append(f"{recipe:<{w}}{m['final_train_loss']:>12.4f}{m['val_loss'][-1]:>10.4f}"
                    f"{m['tokens_per_s']:>11,.0f}{m['wall_s']:>8.1f}")
    if cpu:
        rows.append(f"{speed}: the CPU runs every recipe's pure-torch reference (MX: quantize, dequantize, FP32 "
                    "products); it says nothing about the GPU kernels' speed")
    spread = seed_spread(metrics["config"])
    for recipe, gap in metrics.get("val_gap_vs_bf16_pct", {}).items():
        nats = metrics["recipes"][recipe]["val_loss"][-1] - metrics["recipes"]["bf16"]["val_loss"][-1]
        rows.append(f"{recipe} vs bf16 final val loss: {nats:+.4f} nats ({gap:+.2f}%); {verdict(nats, spread, recipe)}")
    return "\n".join(rows)


def run(cfg: TrainConfig) -> dict:
    """Train every recipe of ``cfg.recipes`` from one init on one batch order; write the outputs.

    Under torchrun with more than one process: joins the process group, trains expert-parallel,
    has rank 0 print and write, and destroys the group at the end.
    Returns the metrics dict that is also written to ``<cfg.out>/metrics.json``.
    """
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    ep, device = init_expert_parallel(cfg, device)
    main_rank = ep.rank == 0  # prints and writes
    recipes = parse_recipes(cfg.recipes)
    out = Path(cfg.out)
    if main_rank:
        out.mkdir(parents=True, exist_ok=True)
    train_data, val_data = load_stdlib(cfg.val_every_file, cfg.data)
    torch.manual_seed(cfg.seed)
    init_model = MoELM(cfg, recipes[0])
    init_state = {k: v.detach().clone() for k, v in init_model.state_dict().items()}
    params = count_params(init_model, cfg)
    del init_model
    if main_rank:
        ranks = f" x {ep.size} ranks, expert parallel" if ep.group is not None else ""
        print(f"data: {len(train_data) / 1e6:.1f}M train / {len(val_data) / 1e6:.1f}M val bytes of stdlib .py | "
              f"params: {params['total'] / 1e6:.2f}M total, {params['active_per_token'] / 1e6:.2f}M active "
              f"per token | device: {device}{ranks} | recipes: {', '.join(recipes)}")
    env = {"device": str(device), "world_size": ep.size, "torch": torch.__version__, "cuda": torch.version.cuda,
           "python": platform.python_version(), "data": str(Path(cfg.data or sysconfig.get_paths()["stdlib"])),
           "platform": platform.platform(), "threads": torch.get_num_threads(),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    metrics = {"config": dataclasses.asdict(cfg), "env": env, "params": params,
               "data_bytes": {"train": len(train_data), "val": len(val_data)}, "recipes": {}}
    for recipe in recipes:
        model, metrics["recipes"][recipe] = train_recipe(cfg, recipe, init_state, train_data, val_data, device, ep)
        state = full_state_dict(model, ep)  # every rank takes part; rank 0 writes
        if main_rank:
            save_file(state, out / f"model_{recipe}.safetensors",
                      metadata={"recipe": recipe, "config": json.dumps(dataclasses.asdict(cfg))})
        del model, state
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
