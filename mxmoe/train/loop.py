"""The training loop: one recipe's steps (:func:`train_recipe`), one optimizer step's gradients
(:func:`forward_backward`), validation (:func:`evaluate`) and the learning-rate schedule."""

import contextlib
import dataclasses
import importlib
import json
import math
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn as nn
from tqdm import tqdm

from mxmoe import parallel
from mxmoe.train.checkpoint import CHECKPOINT_FORMAT, save_training_state
from mxmoe.train.config import GRAPH_BACKENDS, TrainConfig, compile_backend
from mxmoe.train.data import get_batch, tokens_per_step
from mxmoe.train.distributed import SINGLE_PROCESS, ExpertParallel, clip_gradients, mean_over_ranks
from mxmoe.train.model import MoELM, autocast

# the training loop synchronizes with the GPU (and times the steps since the last synchronization)
# every this many steps
TIMING_EVERY = 10


def compiled(model: nn.Module, backend: str) -> nn.Module:
    """``model`` under ``torch.compile`` with the resolved ``backend`` (:func:`compile_backend`); eager for ``""``."""
    if not backend:
        return model
    if backend == "inductor-cudagraphs":
        return torch.compile(model, backend="inductor", mode="reduce-overhead")
    return torch.compile(model, backend=backend)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``cfg.lr``, then cosine decay to ``cfg.lr * cfg.min_lr_frac`` at ``cfg.steps``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))



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
            with autocast(device):
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
        with autocast(device):
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


class StopRequest:
    """A flag the loop polls after every update: ``signum`` is set (by a signal handler) to ask it to stop."""

    def __init__(self):
        self.signum: int | None = None


@contextlib.contextmanager
def stop_on_signals(stop: StopRequest, enabled: bool = True):
    """Inside the block, the first SIGINT or SIGTERM sets ``stop.signum`` (the loop then saves its state and
    raises :class:`Interrupted`); a second one raises KeyboardInterrupt at once. The previous handlers come
    back on exit. Nothing is installed when not ``enabled`` or outside the main thread (signals go there)."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield stop
        return
    signums = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.getsignal(s) for s in signums}

    def handler(signum, frame):
        if stop.signum is not None:
            raise KeyboardInterrupt
        stop.signum = signum
        print(f"\n{signal.Signals(signum).name}: stopping after this step and saving a checkpoint "
              "(again: stop at once, unsaved)", file=sys.stderr, flush=True)

    for s in signums:
        signal.signal(s, handler)
    try:
        yield stop
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


class Interrupted(Exception):
    """Raised by :func:`train_recipe` when a :class:`StopRequest` was set: ``recipe`` stopped after ``step``
    updates, its state saved to ``checkpoint`` (None: no state written) because of signal ``signum``."""

    def __init__(self, recipe: str, step: int, signum: int, checkpoint: Path | None):
        super().__init__(f"{recipe} interrupted at step {step}")
        self.recipe, self.step, self.signum, self.checkpoint = recipe, step, signum, checkpoint


def train_recipe(cfg: TrainConfig, recipe: str, init_state: dict, train_data: torch.Tensor,
                 val_data: torch.Tensor, device: torch.device,
                 ep: ExpertParallel = SINGLE_PROCESS, resume: dict | None = None,
                 ckpt_path: Path | None = None, stop_after: int | None = None,
                 stop: "StopRequest | None" = None) -> tuple[MoELM, dict]:
    """Train one recipe from ``init_state`` on the seeded batch order; return (model, metrics).

    Metrics: ``train_loss`` / ``aux_loss`` (one per step), ``final_train_loss`` (mean of the last
    10), ``val_step`` and ``val_loss`` (parallel lists; val at step s is measured after s
    updates), ``tokens_per_s`` and ``ms_per_step``
    (training steps only, first steps excluded as warm-up; timed between the loop's synchronizations with
    the GPU, every :data:`TIMING_EVERY` steps, so the host's launch work overlaps the GPU's), ``peak_mem_gib`` (CUDA, else None),
    ``wall_s`` (this recipe's time in this function: model build, steps, evaluations, checkpoint writes and
    compilation; summed over a resumed run's parts; not data loading, process start-up or the one-off
    imports of :func:`_warm_up_process`), ``compile`` (the backend the steps ran under, "" eager).

    Checkpoints: with ``ckpt_path``, after every ``cfg.checkpoint_every`` updates short of the last (none for 0), :func:`save_training_state` writes the state there; ``resume`` (such a
    state, from :func:`load_training_state`) continues from its step, as if never stopped (the speed
    numbers then time the resumed steps only; ``resumed_at_step`` says where it went on).

    Stopping early: with ``stop_after``, the loop leaves after that many updates (the schedule is still
    ``cfg.steps``'s; no final validation): the first steps of a long run, for tests. ``stop`` (a
    :class:`StopRequest`, set by a signal handler) is checked after every update: once set, the state is
    written to ``ckpt_path`` (when given) and :class:`Interrupted` is raised.

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
        stopping = stop is not None and stop.signum is not None
        if ckpt_path is not None and ((cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < cfg.steps)
                                      or (stopping and done < cfg.steps)):
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
        if stopping and done < cfg.steps:
            bar.close()
            raise Interrupted(recipe, done, stop.signum, ckpt_path)
        if stop_after is not None and done >= stop_after:
            break
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


def final_train_loss(m: dict, last: int = 10) -> float:
    """Mean train loss of the last ``last`` steps (one batch alone is noisy)."""
    tail = m["train_loss"][-last:]
    return sum(tail) / len(tail)

