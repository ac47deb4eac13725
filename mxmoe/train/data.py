"""The training windows: random ``seq_len + 1``-byte slices of a corpus split, as inputs and targets."""

import torch

from mxmoe.train.config import TrainConfig


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

