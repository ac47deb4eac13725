"""Token movement around the experts: the permutation into the expert-ordered buffer (with its
fused quantization for the first product) and the weighted top-k combine back to token order (with, for the
last product, its backward fused with that product's dy quantization)."""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from mxmoe.backend import Backend, resolve
from mxmoe.formats import MXTensor
from mxmoe.kernels.dispatch import layer_ops_for
from mxmoe.ops.linear import (MXOperands, fused_fp8, fused_qdq, grad_handle, grouped_linear, linear_backward,
                              linear_forward)
from mxmoe.recipes import Recipe, get_recipe


class _PermuteQDQ(torch.autograd.Function):
    """Tokens ``x2 [T, D]`` bf16 gathered into the expert-ordered buffer fused with its dual QDQ
    (forward: one read of x2, the BF16 buffer never written); backward: the gradient of the
    gather (the ops autograd runs for ``repeat_interleave`` + ``index_copy``, so the same bits):
    each token sums the gradient rows of its top_k slots. Quantization is straight-through."""

    @staticmethod
    def forward(ctx, x2, slot_rows, rows: int, top_k: int, scale_rule: str, be: Backend):
        from mxmoe.kernels import dispatch

        src = row_tokens(slot_rows, rows, top_k)
        xp16, data_t, scale_t = dispatch.permute_qdq(x2, src, scale_rule)  # columnwise storage [D, M], [D, M/32]
        ctx.save_for_backward(slot_rows)
        ctx.top_k, ctx.be = top_k, be
        ctx.mark_non_differentiable(data_t, scale_t)
        ctx.set_materialize_grads(False)  # no zero FP8 gradients made for the non-differentiable outputs
        return xp16, data_t, scale_t

    @staticmethod
    @once_differentiable
    def backward(ctx, dxp, *_):
        (slot_rows,) = ctx.saved_tensors
        return _permute_backward(dxp, slot_rows, ctx.top_k, ctx.be), None, None, None, None, None


class _PermuteQuantize128(_PermuteQDQ):
    """Tokens ``x2 [T, D]`` gathered into the expert-ordered buffer fused with its dual FP8 quantization
    in 1x128 / 128x1 groups (forward: one read of x2, the buffer never written; returns the zero-stride
    handle of the buffer and the four FP8 outputs); backward: the gather's gradient (each token sums its
    top_k slots' rows, :class:`_PermuteQDQ`'s), quantization straight-through."""

    @staticmethod
    def forward(ctx, x2, slot_rows, rows: int, top_k: int, scale_rule: str, be: Backend):
        from mxmoe.kernels import dispatch

        src = row_tokens(slot_rows, rows, top_k)
        data, scale, data_t, scale_t = dispatch.permute_quantize_128(x2, src, scale_rule)
        ctx.save_for_backward(slot_rows)
        ctx.top_k, ctx.be = top_k, be
        ctx.mark_non_differentiable(data, scale, data_t, scale_t)
        ctx.set_materialize_grads(False)
        return grad_handle(x2, rows, x2.shape[1]), data, scale, data_t, scale_t


def row_slots(slot_rows: torch.Tensor, rows: int) -> torch.Tensor:
    """Inverse of ``slot_rows``: int32 ``[rows]``, the slot each row holds, -1 on padding rows."""
    slot = torch.full((rows,), -1, dtype=torch.int32, device=slot_rows.device)
    return slot.index_copy_(0, slot_rows, torch.arange(slot_rows.numel(), device=slot_rows.device, dtype=torch.int32))


def row_tokens(slot_rows: torch.Tensor, rows: int, top_k: int) -> torch.Tensor:
    """int32 ``[rows]``: the token each row holds (slot // top_k), -1 on padding rows."""
    slot = row_slots(slot_rows, rows)
    return torch.where(slot >= 0, slot // top_k, -1)


def _permute_backward(dxp: torch.Tensor, slot_rows: torch.Tensor, top_k: int, be: Backend) -> torch.Tensor:
    """Each token's gradient: the sum of its top_k slots' rows of ``dxp`` (FP32 sums, one rounding;
    the ops autograd runs for ``repeat_interleave`` + ``index_copy``, so the same values)."""
    ops = layer_ops_for(dxp, be)
    if ops is not None:
        return ops.gather_sum(dxp, slot_rows, top_k, None)
    g = dxp.index_select(0, slot_rows)  # [T*top_k, D], slot t*top_k + j
    return g.view(-1, top_k, g.shape[1]).sum(1)


class _Permute(torch.autograd.Function):
    """Tokens gathered into the expert-ordered buffer on CUDA: one gather kernel (padding rows zero),
    backward one gather-sum kernel; the same values as ``repeat_interleave`` + ``index_copy``."""

    @staticmethod
    def forward(ctx, x2, slot_rows, rows: int, top_k: int, be: Backend):
        ctx.save_for_backward(slot_rows)
        ctx.top_k, ctx.be = top_k, be
        return layer_ops_for(x2, be).gather_rows(x2, row_tokens(slot_rows, rows, top_k), rows)

    @staticmethod
    @once_differentiable
    def backward(ctx, dxp):
        (slot_rows,) = ctx.saved_tensors
        return _permute_backward(dxp, slot_rows, ctx.top_k, ctx.be), None, None, None, None


class _GatherRows(torch.autograd.Function):
    """``src.index_select(0, index)`` for an ``index`` without repeats (each expert row feeds at most
    one slot). The backward writes each gradient row to its source row (``index_copy``) instead of
    autograd's ``index_add``, which accumulates with atomics; same values (rows no slot reads get
    zero)."""

    @staticmethod
    def forward(ctx, src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.rows = src.shape[0]
        return src.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        return grad.new_zeros(ctx.rows, *grad.shape[1:]).index_copy_(0, index, grad), None


class _Unpermute(torch.autograd.Function):
    """``yp[slot_rows]`` on CUDA: the rows back in slot order, one gather kernel (a one-term gather-sum:
    the same bits); backward one gather kernel writing each slot's gradient to its row, zero on padding
    rows (autograd's ``index_select`` backward, ``index_add`` with atomics, gives the same values)."""

    @staticmethod
    def forward(ctx, yp, slot_rows, be: Backend):
        ctx.save_for_backward(slot_rows)
        ctx.rows, ctx.ops = yp.shape[0], layer_ops_for(yp, be)
        return ctx.ops.gather_sum(yp, slot_rows, 1, None)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        (slot_rows,) = ctx.saved_tensors
        return ctx.ops.gather_rows(dy, row_tokens(slot_rows, ctx.rows, 1), ctx.rows), None, None


def unpermute(yp: torch.Tensor, slot_rows: torch.Tensor, *, backend: Backend | None = None) -> torch.Tensor:
    """Expert-ordered rows back in slot order, unweighted: ``yp[slot_rows]`` ``[S, D]`` in yp's dtype, the
    adjoint of :func:`permute_tokens` with ``top_k=1`` (its gradient ``dyp`` is the slots' gradient rows
    at their rows, zero on padding rows). For callers that combine outside (torchtitan's experts); the
    top-k weighted combine is :func:`combine`.

    Args:
        yp: ``[M, D]`` float, rows grouped by expert (padding rows ignored).
        slot_rows: ``[S]`` int64, distinct rows of yp (from :func:`mxmoe.moe.permute_plan`; unchecked: an
            out-of-range row reads zero on CUDA and raises on the CPU).
    Raises:
        ValueError: yp not 2-D or slot_rows not 1-D. TypeError: non-float yp, slot_rows not int64.
    """
    if yp.dim() != 2 or slot_rows.dim() != 1:
        raise ValueError(f"unpermute expects yp [M, D] and slot_rows [S]; got {tuple(yp.shape)}, {tuple(slot_rows.shape)}")
    if not yp.is_floating_point() or slot_rows.dtype != torch.int64:
        raise TypeError(f"unpermute expects float yp and int64 slot_rows, got {yp.dtype}, {slot_rows.dtype}")
    be = backend or resolve(yp.device)
    if layer_ops_for(yp, be) is not None:
        return _Unpermute.apply(yp, slot_rows, be)
    return _GatherRows.apply(yp, slot_rows)


class _Combine(torch.autograd.Function):
    """The top-k combine on CUDA: one gather-sum kernel forward; backward one pass over the expert
    rows writing their gradient and the router weights' gradient (see :func:`combine`)."""

    @staticmethod
    def forward(ctx, yp, slot_rows, weights, top_k: int, be: Backend):
        w = weights.reshape(-1).to(torch.float32).contiguous()
        ctx.save_for_backward(yp, slot_rows, w)
        ctx.top_k, ctx.w_dtype, ctx.ops = top_k, weights.dtype, layer_ops_for(yp, be)
        return ctx.ops.gather_sum(yp, slot_rows, top_k, w)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        yp, slot_rows, w = ctx.saved_tensors
        dyp, dw = ctx.ops.combine_backward(dy, w, yp, row_slots(slot_rows, yp.shape[0]), ctx.top_k)
        return dyp, None, dw.view(-1, ctx.top_k).to(ctx.w_dtype), None, None


class _MXLinearCombine(torch.autograd.Function):
    """The last expert product and the top-k combine as one Function (``mxfp8_128`` on sm_90): forward the MX
    product (:func:`~mxmoe.ops.linear.linear_forward`), then the combine's gather-sum kernel; backward one kernel
    for the combine's backward and dy's dual FP8 quantization (the BF16 expert-row gradient is never written),
    then the product's dgrad and wgrad on those operands (:func:`~mxmoe.ops.linear.linear_backward`). Saved: the
    product's tensors, and yp, slot_rows, the FP32 weights (the combine's)."""

    @staticmethod
    def forward(ctx, x, offs, recipe: Recipe, x_mx, x_wgrad, be: Backend, slot_rows, weights, top_k: int, w):
        yp, saved = linear_forward(ctx, x, offs, recipe, x_mx, x_wgrad, be, (w,))
        wf = weights.reshape(-1).to(torch.float32).contiguous()
        ctx.n_linear, ctx.top_k, ctx.weights_dtype = len(saved), top_k, weights.dtype
        ctx.save_for_backward(*saved, yp, slot_rows, wf)
        ops = layer_ops_for(yp, be)
        if ops is not None:
            return ops.gather_sum(yp, slot_rows, top_k, wf)
        return (yp[slot_rows].view(-1, top_k, yp.shape[1]).float() * wf.view(-1, top_k, 1)).sum(1).to(yp.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        from mxmoe.kernels import dispatch

        saved = ctx.saved_tensors
        yp, slot_rows, wf = saved[ctx.n_linear:]
        dyq, dyq_rows, dw_rows = dispatch.combine_backward_quantize_128(
            dy.contiguous(), wf, yp, row_slots(slot_rows, yp.shape[0]), ctx.top_k, ctx.recipe.scale_rule)
        dx, (dw,) = linear_backward(ctx, saved[:ctx.n_linear], None, ctx.needs_input_grad[0],
                                    ctx.needs_input_grad[9], dyq, dyq_rows.mT)
        dweights = dw_rows[slot_rows].view(-1, ctx.top_k).to(ctx.weights_dtype)
        return dx, None, None, None, None, None, None, dweights, None, dw


def linear_combine(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, slot_rows: torch.Tensor,
                   weights: torch.Tensor, recipe: "str | Recipe" = "bf16", x_mx: MXTensor | None = None,
                   x_wgrad: MXTensor | None = None, *, backend: Backend | None = None) -> torch.Tensor:
    """The experts' last product and the top-k combine: ``combine(grouped_linear(x, w, offs, recipe,
    validate=False, x_mx=x_mx, x_wgrad=x_wgrad), slot_rows, weights, validate=False)``, ``[T, D]``, the same
    values and gradients. Where the product takes the Hopper promote-per-128 route with the layer kernels on
    (``mxfp8_128``, bf16 x, ``M % 128 == D % 128 == 0``) the backward runs the combine's backward fused with the
    dual FP8 quantization of the product's dy (:func:`mxmoe.kernels.quantize_fused.combine_backward_quantize_128`),
    so that BF16 ``[M, D]`` gradient is never written; ``MXMOE_FUSED_COMBINE=0`` (``backend.fused_combine`` off)
    keeps the two apart.

    Args:
        x: ``[M, K]`` rows grouped by expert (offs), e.g. the SwiGLU output; ``x_mx`` / ``x_wgrad``: its MXFP8
            copies (:func:`~mxmoe.ops.linear.grouped_linear`'s contract).
        w: ``[E, D, K]``. offs: int32 ``[E]`` group ends. slot_rows: ``[T*top_k]`` int64, distinct rows of the
            product's output. weights: ``[T, top_k]`` float router weights.
    Unchecked (the layer's own call, as :func:`combine` with ``validate=False``): validate inputs through
    :func:`~mxmoe.ops.linear.grouped_linear` and :func:`combine` where they come from elsewhere.
    """
    recipe = get_recipe(recipe)
    be = backend or resolve(x.device)
    D = w.shape[1]
    if be.fused_combine and slot_rows.numel() and fused_fp8(x, x.shape[0], D, recipe, w, be):
        return _MXLinearCombine.apply(x, offs, recipe, x_mx, x_wgrad, be, slot_rows, weights, weights.shape[1], w)
    yp = grouped_linear(x, w, offs, recipe, validate=False, x_mx=x_mx, x_wgrad=x_wgrad, backend=be)
    return combine(yp, slot_rows, weights, validate=False, backend=be)


def combine(yp: torch.Tensor, slot_rows: torch.Tensor, weights: torch.Tensor, validate: bool = True, *,
            backend: Backend | None = None) -> torch.Tensor:
    """Expert outputs back in token order, weighted over each token's top_k experts:
    ``y[t] = sum_j weights[t, j] * yp[slot_rows[t*top_k + j]]``.

    Args:
        yp: ``[M, D]`` float expert outputs (rows grouped by expert, padding rows ignored).
        slot_rows: ``[T*top_k]`` int64, distinct rows of yp (from :func:`mxmoe.moe.permute_plan`).
        weights: ``[T, top_k]`` float router weights (gradients flow to them and to yp).
        validate: check that slot_rows are distinct rows of yp (synchronizes with the GPU once;
            :class:`mxmoe.MoE` passes False: its rows come from :func:`mxmoe.moe.permute_plan`).
            Unchecked, an out-of-range row is an error or undefined (the CPU path raises; on CUDA the
            forward adds zero and the backward's row map fails a device-side check).
    Returns:
        ``[T, D]`` in yp's dtype; products and sums in FP32 (FP64 for FP64 inputs), rounded once (on CUDA one kernel; the
        backward one pass over yp's rows: ``dyp = weights * dy`` rounded to yp's dtype, zero on
        padding rows, and ``dweights[t, j] = <dy[t], yp[row]>`` in FP32).
    Raises:
        ValueError: shapes that do not match; with ``validate``, rows out of range or repeated.
        TypeError: non-float yp or weights, slot_rows not int64.
    """
    if yp.dim() != 2 or weights.dim() != 2 or slot_rows.shape != (weights.numel(),):
        raise ValueError(f"combine expects yp [M, D], weights [T, top_k] and slot_rows [T*top_k]; got "
                         f"{tuple(yp.shape)}, {tuple(weights.shape)}, {tuple(slot_rows.shape)}")
    if not (yp.is_floating_point() and weights.is_floating_point()) or slot_rows.dtype != torch.int64:
        raise TypeError(f"combine expects float yp and weights and int64 slot_rows, got {yp.dtype}, "
                        f"{weights.dtype}, {slot_rows.dtype}")
    if validate and slot_rows.numel():
        lo, hi = int(slot_rows.min()), int(slot_rows.max())
        if lo < 0 or hi >= yp.shape[0]:
            raise ValueError(f"combine: slot_rows must be rows of yp (0..{yp.shape[0] - 1}), got values in [{lo}, {hi}]")
        if slot_rows.unique().numel() != slot_rows.numel():
            raise ValueError("combine: slot_rows repeats a row (each expert row feeds one slot)")
    T, top_k = weights.shape
    be = backend or resolve(yp.device)
    if layer_ops_for(yp, be) is not None:
        return _Combine.apply(yp, slot_rows, weights, top_k, be)
    acc = torch.promote_types(yp.dtype, torch.float32)  # FP32, or FP64 for FP64 inputs
    y = _GatherRows.apply(yp, slot_rows).view(T, top_k, yp.shape[1])
    return (y.to(acc) * weights.to(acc).unsqueeze(-1)).sum(1).to(yp.dtype)


def permute_tokens(x2: torch.Tensor, slot_rows: torch.Tensor, rows: int, top_k: int,
                   recipe: "str | Recipe" = "bf16", w_next: torch.Tensor | None = None, *,
                   backend: Backend | None = None):
    """Tokens ``x2 [T, D]`` -> the expert-ordered buffer ``xp [rows, D]`` feeding the expert
    product with ``w_next`` (``[E, N, D]``): slot ``t*top_k + j`` (token t's j-th expert) goes to row
    ``slot_rows[t*top_k + j]`` (``slot_rows`` ``[T*top_k]`` int64, distinct rows); other rows are zero.

    Returns ``(xp, xp_wgrad)``. Where that product takes the Hopper expansion route (CUDA, bf16 x2,
    an MXFP8 recipe with MX wgrad, ``rows % 32 == D % 32 == 0``) one fused kernel returns ``xp`` as
    its BF16 MX values along D (``qdq_dual(xp)[0]`` bit for bit) and ``xp_wgrad`` its FP8 copy along
    rows: pass both to :func:`grouped_linear` (``x_wgrad=xp_wgrad``). Where it takes the Hopper
    promote-per-128 route (``mxfp8_128``, bf16 x2, ``rows % 128 == D % 128 == 0``) one fused kernel
    writes only FP8: ``xp`` is then a zero-stride autograd handle and the second item an
    :class:`~mxmoe.ops.linear.MXOperands` (xp along D and along rows; pass them as ``x_mx`` and
    ``x_wgrad`` with ``validate=False``). Elsewhere ``(xp, None)``, xp
    gathered by the layer's gather kernel on CUDA, by ``repeat_interleave`` + ``index_copy`` on the CPU
    (the same values). Gradients flow to x2 either way, the same bits.

    ``MXMOE_FUSED_PERMUTE=0`` (``backend.fused_permute`` off) disables the fused kernel (e.g. to time
    the layer with and without it in one run). ``backend``: :func:`mxmoe.backend.resolve` of the
    device by default.
    """
    recipe = get_recipe(recipe)
    if x2.dim() != 2 or slot_rows.dim() != 1 or slot_rows.numel() != x2.shape[0] * top_k:
        raise ValueError(f"permute_tokens expects x2 [T, D] and slot_rows [T*top_k]; got {tuple(x2.shape)}, "
                         f"{tuple(slot_rows.shape)} with top_k={top_k}")
    D = x2.shape[-1]
    be = backend or resolve(x2.device)
    if be.fused_permute and fused_fp8(x2, rows, D, recipe, w_next, be):
        from mxmoe.kernels.quantize import columnwise_mxtensor, rowwise_mxtensor

        g, rule = (1, 128), recipe.scale_rule
        handle, data, scale, data_t, scale_t = _PermuteQuantize128.apply(x2, slot_rows, rows, top_k, rule, be)
        return handle, MXOperands(rowwise_mxtensor(data, scale, rule, g), columnwise_mxtensor(data_t, scale_t, rule, g))
    if be.fused_permute and fused_qdq(x2, rows, D, recipe, w_next, be):
        from mxmoe.kernels.quantize import columnwise_mxtensor

        xp16, data_t, scale_t = _PermuteQDQ.apply(x2, slot_rows, rows, top_k, recipe.scale_rule, be)
        return xp16, columnwise_mxtensor(data_t, scale_t, recipe.scale_rule)
    if layer_ops_for(x2, be) is not None:
        return _Permute.apply(x2, slot_rows, rows, top_k, be), None
    src = x2.repeat_interleave(top_k, dim=0)  # [T*top_k, D], slot t*top_k + j
    return x2.new_zeros(rows, D).index_copy(0, slot_rows, src), None
