"""The model ``mxmoe train`` trains: a byte-level decoder-only transformer whose FFNs are :class:`mxmoe.MoE`."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from mxmoe.moe import MoE
from mxmoe.train.config import VOCAB, TrainConfig


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


def autocast(device: torch.device):
    """BF16 autocast on CUDA (the model's dense layers in BF16); off elsewhere (FP32 on the CPU)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

