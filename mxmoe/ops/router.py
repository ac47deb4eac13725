"""The router's product: FP32 logits of the tokens against the router weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from mxmoe.backend import Backend, resolve
from mxmoe.kernels.dispatch import layer_ops_for


def split_bf16(w: torch.Tensor) -> torch.Tensor:
    """FP32 ``w [...]`` as three BF16 pieces ``[3, ...]`` whose FP32 sum is ``w`` exactly (8 + 8 + 8
    significand bits; each piece the nearest BF16 of what the pieces before it leave)."""
    w = w.float()
    hi = w.to(torch.bfloat16)
    rest = w - hi.float()
    mid = rest.to(torch.bfloat16)
    return torch.stack([hi, mid, (rest - mid.float()).to(torch.bfloat16)])


class _RouterLogits(torch.autograd.Function):
    """FP32 ``x @ w^T`` for BF16 x from BF16 tensor cores: x is exact in BF16 and w is split into three
    BF16 pieces (:func:`split_bf16`), so every product is exact and the sums are FP32. Backward: dx
    rounded once to BF16, dw in FP32 (w's dtype). Saves x itself and the pieces, not an FP32 copy of x."""

    @staticmethod
    def forward(ctx, x, w, be: Backend):
        w3 = split_bf16(w.detach())
        ctx.save_for_backward(x, w3)
        ctx.be, ctx.w_dtype = be, w.dtype
        return layer_ops_for(x, be).router_logits(x, w3)

    @staticmethod
    @once_differentiable
    def backward(ctx, dl):
        x, w3 = ctx.saved_tensors
        ops = layer_ops_for(x, ctx.be)
        dl = dl.float().contiguous()
        dx = ops.router_dx(dl, w3) if ctx.needs_input_grad[0] else None
        dw = ops.router_dw(dl, x).to(ctx.w_dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def router_logits(x: torch.Tensor, w: torch.Tensor, backend: Backend | None = None) -> torch.Tensor:
    """Router logits ``[T, E]`` FP32 of tokens ``x [T, D]`` and the router weight ``w [E, D]``: the FP32
    product ``x.float() @ w.float().T`` (what ``F.linear`` of FP32 copies computes; autocast does not
    apply).

    For BF16 x on CUDA with the layer kernels on and E <= 128 the same product comes from BF16 tensor
    cores (:class:`_RouterLogits`: FP32 to summation order, not bit for bit cuBLAS's SGEMM); otherwise
    ``F.linear`` of FP32 operands.
    """
    from mxmoe.kernels.layer import ROUTER_MAX_EXPERTS

    be = backend or resolve(x.device)
    ops = layer_ops_for(x, be)
    if (ops is not None and x.dtype == torch.bfloat16 and x.dim() == 2 and w.dim() == 2
            and w.shape == (w.shape[0], x.shape[1]) and 0 < w.shape[0] <= ROUTER_MAX_EXPERTS
            and w.dtype in (torch.float32, torch.bfloat16) and w.device == x.device):
        return _RouterLogits.apply(x, w, be)
    with torch.autocast(x.device.type, enabled=False):
        return F.linear(x.float(), w.float())
