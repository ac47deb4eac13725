"""The router's product: FP32 logits of the tokens against the router weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from mxmoe.backend import AUTOCAST_DEVICE_TYPES, Backend, resolve
from mxmoe.kernels.dispatch import layer_ops_for


class _RouterLogits(torch.autograd.Function):
    """FP32 ``x @ w^T`` for BF16 x from BF16 tensor cores: x is exact in BF16 and w is split into three
    BF16 pieces (``split_bf16`` of :mod:`mxmoe.kernels.layer`), so every product is exact and the sums are
    FP32. Backward: dx from the logits' FP32 gradient (split in the kernel), rounded once to BF16; dw from that
    gradient's pieces, in FP32 (w's dtype). Saves x itself and the pieces, not an FP32 copy of x."""

    @staticmethod
    def forward(ctx, x, w, be: Backend):
        ops = layer_ops_for(x, be)
        w3 = ops.split_bf16(w.detach())
        ctx.save_for_backward(x, w3)
        ctx.be, ctx.w_dtype = be, w.dtype
        return ops.router_logits(x, w3)

    @staticmethod
    @once_differentiable
    def backward(ctx, dl):
        x, w3 = ctx.saved_tensors
        ops = layer_ops_for(x, ctx.be)
        dl = dl.float().contiguous()
        dx = ops.router_dx(dl, w3) if ctx.needs_input_grad[0] else None
        dw = ops.router_dw(ops.split_bf16(dl), x).to(ctx.w_dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def router_logits(x: torch.Tensor, w: torch.Tensor, backend: Backend | None = None) -> torch.Tensor:
    """Router logits ``[T, E]`` FP32 of tokens ``x [T, D]`` and the router weight ``w [E, D]`` (floating
    tensors of any float dtype, on one device): the FP32 product ``x.float() @ w.float().T`` (what
    ``F.linear`` of FP32 copies computes; autocast does not apply; FP64 inputs are rounded to FP32).

    For BF16 x on CUDA with the layer kernels on and E <= 128 the same product comes from BF16 tensor
    cores (:class:`_RouterLogits`: FP32 sums, not bit for bit cuBLAS's SGEMM; ``tests/test_router.py``);
    otherwise ``F.linear`` of FP32 operands.

    Raises:
        TypeError: x or w not a floating-point tensor, or ``backend`` not a :class:`~mxmoe.backend.Backend`.
        ValueError: x not 2-D, w not ``[E, D]`` with x's D, or x and w on two devices.
    """
    from mxmoe.kernels.layer import ROUTER_MAX_EXPERTS

    for name, t in (("x", x), ("w", w)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"router_logits: {name} must be a floating-point tensor, got "
                            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
    if x.dim() != 2 or w.dim() != 2 or w.shape[1] != x.shape[1]:
        raise ValueError(f"router_logits expects x [T, D] and w [E, D], got x {tuple(x.shape)} and w {tuple(w.shape)}")
    if x.device != w.device:
        raise ValueError(f"router_logits: x and w must be on one device, got {x.device} and {w.device}")
    if backend is not None and not isinstance(backend, Backend):
        raise TypeError(f"router_logits: backend must be a mxmoe.backend.Backend or None, got {type(backend).__name__}")
    be = backend or resolve(x.device)
    ops = layer_ops_for(x, be)
    if (ops is not None and x.dtype == torch.bfloat16 and 0 < w.shape[0] <= ROUTER_MAX_EXPERTS
            and w.dtype in (torch.float32, torch.bfloat16)):
        return _RouterLogits.apply(x, w, be)
    if x.device.type not in AUTOCAST_DEVICE_TYPES:  # e.g. meta tensors (shape tracing)
        return F.linear(x.float(), w.float())
    with torch.autocast(x.device.type, enabled=False):
        return F.linear(x.float(), w.float())
