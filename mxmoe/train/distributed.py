"""Expert parallelism under torchrun: this process's place in the group and the collectives the loop uses
(:mod:`mxmoe.parallel` does the layer's work)."""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from mxmoe import parallel
from mxmoe.train.config import RunInputError, TrainConfig


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

