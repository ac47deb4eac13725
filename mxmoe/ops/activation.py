"""SwiGLU between the expert products, with its fused forms (quantization of its output for the
next product, its input kept in MXFP8 for backward)."""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from mxmoe.backend import Backend, resolve
from mxmoe.formats import BLOCK, MXTensor
from mxmoe.kernels.dispatch import layer_ops_for
from mxmoe.ops.linear import (MXOperands, check_weight_operands, fused_fp8, fused_qdq, grad_handle, grouped_linear,
                              linear_backward, linear_forward)
from mxmoe.ops.quantization import quantize
from mxmoe.ops.saved import pack, unpack
from mxmoe.recipes import Recipe, get_recipe


class _SwiGLUQDQ(torch.autograd.Function):
    """``a = silu(gate) * up`` of ``h [M, 2F]`` bf16 fused with a's dual QDQ (forward, one read of
    h, a never written); backward: the torch SwiGLU gradient (the ops autograd runs for
    ``F.silu(gate) * up``, so the same bits), from h alone (silu recomputed, not saved). With
    ``save_h_fp8`` the same read also writes h as MXFP8 along 2F, which is what is kept (see
    :func:`swiglu`)."""

    @staticmethod
    def forward(ctx, h, scale_rule: str, save_h_fp8: bool, be: Backend):
        from mxmoe.kernels import dispatch

        # a's columnwise storage [F, M], [F, M/32]; then h along 2F, or two empty tensors
        a16, data_t, scale_t, qh, sh = dispatch.swiglu_qdq(h, scale_rule, save_h_fp8)
        hs, ctx.h_meta = pack(MXTensor(qh, sh, 1, scale_rule) if save_h_fp8 else h)
        ctx.save_for_backward(*hs)
        ctx.be = be
        ctx.mark_non_differentiable(data_t, scale_t)
        ctx.set_materialize_grads(False)  # no zero FP8 gradients made for the non-differentiable outputs
        return a16, data_t, scale_t

    @staticmethod
    @once_differentiable
    def backward(ctx, da, *_):
        return _swiglu_backward(da, unpack(ctx.saved_tensors, ctx.h_meta), ctx.be), None, None, None


class _SwiGLUQuantize128(_SwiGLUQDQ):
    """``a = silu(gate) * up`` of ``h [M, 2F]`` bf16 fused with a's dual FP8 quantization in 1x128 /
    128x1 groups (forward: one read of h, a never written; returns a's zero-stride autograd handle and
    the four FP8 outputs); backward: the torch SwiGLU gradient from h (kept as is, or with ``save_h_fp8``
    as MXFP8 along 2F in 1x128 groups written by the same read)."""

    @staticmethod
    def forward(ctx, h, scale_rule: str, save_h_fp8: bool, be: Backend):
        from mxmoe.kernels import dispatch

        data, scale, data_t, scale_t, qh, sh = dispatch.swiglu_quantize_128(h, scale_rule, save_h_fp8)
        hs, ctx.h_meta = pack(MXTensor(qh, sh, 1, scale_rule, (1, 128)) if save_h_fp8 else h)
        ctx.save_for_backward(*hs)
        ctx.be = be
        ctx.mark_non_differentiable(data, scale, data_t, scale_t)
        ctx.set_materialize_grads(False)
        return grad_handle(h, h.shape[0], h.shape[1] // 2), data, scale, data_t, scale_t


def _swiglu_backward(da: torch.Tensor, h: "torch.Tensor | MXTensor", be: Backend) -> torch.Tensor:
    """dh ``[M, 2F]`` of ``a = F.silu(gate) * up`` from ``da [M, F]``: torch's autograd arithmetic,
    from one pass of the layer kernel on CUDA for bf16 (bit for bit the same). h may be an
    MXTensor along its last dim: the gradient is then taken at its MX values in da's dtype (the
    CUDA kernel expands them itself, for a 2D bf16 da and F % 32 == 0)."""
    ops = layer_ops_for(da, be)
    if isinstance(h, MXTensor):
        if (ops is not None and da.dtype == torch.bfloat16 and da.dim() == 2 and h.axis == 1
                and da.shape[1] % BLOCK == 0):
            return ops.swiglu_backward(da, h.data, h.scale)
        h = h.dequantize(da.dtype)
    if ops is not None and h.dtype == da.dtype == torch.bfloat16:
        return ops.swiglu_backward(da, h)
    gate, up = h.split(h.shape[-1] // 2, dim=-1)
    dgate = torch.ops.aten.silu_backward(da * up, gate)
    return torch.cat([dgate, da * torch.nn.functional.silu(gate)], dim=-1)


class _SwiGLU(torch.autograd.Function):
    """``a = F.silu(gate) * up`` of ``h [..., 2F]``: one kernel each way for 2D bf16 h on CUDA, the
    torch ops elsewhere (the same bits); silu recomputed in backward. h is kept as is, or with
    ``save_rule`` as MXFP8 along 2F (``quantize(h, -1, save_rule, group)``), SwiGLU's gradient then taken
    at h's MX values (the ``swiglu_input_fp8`` recipes off the fused path: the same numbers)."""

    @staticmethod
    def forward(ctx, h, save_rule: str | None, be: Backend, group: int = BLOCK):
        ops = layer_ops_for(h, be)
        if ops is not None and h.dim() == 2 and h.dtype == torch.bfloat16:
            a = ops.swiglu(h)
        else:
            gate, up = h.split(h.shape[-1] // 2, dim=-1)
            a = torch.nn.functional.silu(gate) * up
        hs, ctx.h_meta = pack(h if save_rule is None else quantize(h.detach(), -1, save_rule, group, backend=be))
        ctx.save_for_backward(*hs)  # (saved tensors, not ctx attributes: freed after backward)
        ctx.be = be
        return a

    @staticmethod
    @once_differentiable
    def backward(ctx, da):
        return _swiglu_backward(da, unpack(ctx.saved_tensors, ctx.h_meta), ctx.be), None, None, None


def swiglu(h: torch.Tensor, recipe: "str | Recipe" = "bf16", w_next: torch.Tensor | None = None, *,
           backend: Backend | None = None):
    """SwiGLU of ``h [M, 2F]`` (gate ``h[:, :F]``, up ``h[:, F:]``) feeding the expert product with ``w_next``.

    Returns ``(a, a_wgrad)``. Where that product takes the Hopper expansion route (CUDA, bf16 h,
    an MXFP8 recipe with MX wgrad, ``M % 32 == F % 32 == 0``) one fused kernel returns ``a`` as its
    BF16 MX values along F (``qdq_rowwise(F.silu(gate) * up)`` bit for bit) and ``a_wgrad`` its FP8
    copy along tokens: pass both to :func:`grouped_linear` (``x_wgrad=a_wgrad``). Where it takes the
    Hopper promote-per-128 route (``mxfp8_128``, bf16 h, ``M % 128 == F % 128 == 0``) one fused kernel
    writes only FP8: ``a`` is a zero-stride autograd handle and the second item an
    :class:`~mxmoe.ops.linear.MXOperands` (a along F and along tokens; pass them as ``x_mx`` and
    ``x_wgrad`` with ``validate=False``). Elsewhere ``(F.silu(gate) * up, None)``. Gradients flow to h
    either way.

    Under a recipe with ``swiglu_input_fp8`` (and ``F % 32 == 0``) h is kept for backward as MXFP8
    along 2F, not BF16 (on the fused path written by the same kernel, from the same read of h), and
    the SwiGLU gradient is taken at h's MX values: an approximation of the exact gradient. h is
    rounded to E4M3 at its 32-element block's scale (relative error <= 2^-4 inside E4M3's normal
    range, coarser for elements far below their block's maximum, which may flush to zero); the
    gradient's per-element error is not bounded (silu's derivative crosses zero), and a NaN/Inf in
    h makes its whole block (and the matching block of the other half) non-finite in dh. Only where
    a backward can follow (h requires grad, grad mode on); otherwise nothing extra is quantized.
    """
    recipe = get_recipe(recipe)
    if h.dim() < 1 or h.shape[-1] % 2:
        raise ValueError(f"swiglu expects h [..., 2F] (gate and up halves), got shape {tuple(h.shape)}")
    f = h.shape[-1] // 2
    # (only when a backward will need h: no extra quantization under no_grad / for inference)
    save_fp8 = (recipe.swiglu_input_fp8 and f % recipe.act_block == 0 and h.requires_grad
                and torch.is_grad_enabled())
    be = backend or resolve(h.device)
    if fused_fp8(h, h.shape[0], f, recipe, w_next, be):
        from mxmoe.kernels.quantize import columnwise_mxtensor, rowwise_mxtensor

        g, rule = (1, 128), recipe.scale_rule
        handle, data, scale, data_t, scale_t = _SwiGLUQuantize128.apply(h, rule, save_fp8, be)
        return handle, MXOperands(rowwise_mxtensor(data, scale, rule, g), columnwise_mxtensor(data_t, scale_t, rule, g))
    if fused_qdq(h, h.shape[0], f, recipe, w_next, be):
        from mxmoe.kernels.quantize import columnwise_mxtensor

        a16, data_t, scale_t = _SwiGLUQDQ.apply(h, recipe.scale_rule, save_fp8, be)
        return a16, columnwise_mxtensor(data_t, scale_t, recipe.scale_rule)
    if save_fp8 or (h.dim() == 2 and h.dtype == torch.bfloat16 and layer_ops_for(h, be) is not None):
        return _SwiGLU.apply(h, recipe.scale_rule if save_fp8 else None, be, recipe.act_block), None
    gate, up = h.split(f, dim=-1)
    return torch.nn.functional.silu(gate) * up, None


class _MXLinearSwiGLU(torch.autograd.Function):
    """The up projection and SwiGLU as one Function (``mxfp8_128`` on sm_90): forward the MX product
    (:func:`~mxmoe.ops.linear.linear_forward`) to h ``[M, 2F]``, then SwiGLU fused with a's dual FP8 quantization
    (a's zero-stride handle and its four FP8 outputs, as :class:`_SwiGLUQuantize128`); backward one kernel for
    SwiGLU's gradient and dh's dual FP8 quantization (the BF16 dh is never written), then the product's dgrad and
    wgrad on those operands (:func:`~mxmoe.ops.linear.linear_backward`). Saved: the product's tensors, and h (or,
    with ``save_h_fp8``, its MXFP8 copy along 2F in 1x128 groups, written by the SwiGLU kernel's read of h)."""

    @staticmethod
    def forward(ctx, x, offs, recipe: Recipe, x_mx, x_wgrad, w_mx, be: Backend, save_h_fp8: bool, *ws):
        from mxmoe.kernels import dispatch

        h, saved = linear_forward(ctx, x, offs, recipe, x_mx, x_wgrad, be, ws, w_mx)
        rule = recipe.scale_rule
        data, scale, data_t, scale_t, qh, sh = dispatch.swiglu_quantize_128(h, rule, save_h_fp8)
        hs, ctx.h_meta = pack(MXTensor(qh, sh, 1, rule, (1, 128)) if save_h_fp8 else h)
        ctx.n_linear = len(saved)
        ctx.save_for_backward(*saved, *hs)
        ctx.mark_non_differentiable(data, scale, data_t, scale_t)
        ctx.set_materialize_grads(False)
        return grad_handle(h, h.shape[0], h.shape[1] // 2), data, scale, data_t, scale_t

    @staticmethod
    @once_differentiable
    def backward(ctx, da, *_):
        if da is None:  # a took no part in the loss
            return (None,) * (8 + len(ctx.splits))
        from mxmoe.kernels import dispatch

        saved = ctx.saved_tensors
        h = unpack(saved[ctx.n_linear:], ctx.h_meta)
        dhq, dhq_rows = dispatch.swiglu_backward_quantize_128(da.contiguous(), h, ctx.recipe.scale_rule)
        dx, dws = linear_backward(ctx, saved[:ctx.n_linear], None, ctx.needs_input_grad[0],
                                  any(ctx.needs_input_grad[8:]), dhq, dhq_rows.mT)
        return dx, None, None, None, None, None, None, None, *dws


def linear_swiglu(x: torch.Tensor, w: "torch.Tensor | tuple[torch.Tensor, ...]", offs: torch.Tensor,
                  recipe: "str | Recipe" = "bf16", w_next: torch.Tensor | None = None, x_mx: MXTensor | None = None,
                  x_wgrad: MXTensor | None = None, validate: bool = False, *,
                  w_mx: "tuple[MXTensor, MXTensor] | None" = None, backend: Backend | None = None):
    """The experts' up projection and SwiGLU: ``swiglu(grouped_linear(x, w, offs, recipe, validate, x_mx, x_wgrad),
    recipe, w_next)``, the same ``(a, a_wgrad)`` (:func:`swiglu`'s contract), values and gradients. With
    ``MXMOE_FUSED_SWIGLU_BWD=1`` (``backend.fused_swiglu_bwd``), where both products take the Hopper promote-per-128
    route (``mxfp8_128``, bf16 x, ``M % 128 == F % 128 == 0``) and ``validate`` is off, one Function whose backward
    runs SwiGLU's gradient fused with the dual FP8 quantization of dh, the product's dy
    (:func:`mxmoe.kernels.quantize_fused.swiglu_backward_quantize_128`), so that BF16 ``[M, 2F]`` gradient is
    never written.

    Args:
        x: ``[M, K]`` rows grouped by expert (offs), e.g. the permuted tokens; ``x_mx`` / ``x_wgrad``: its MXFP8
            copies (:func:`~mxmoe.ops.linear.grouped_linear`'s contract).
        w: ``[E, 2F, K]``, the gate and up projections stacked (gate first), or its parts along 2F (e.g. the
            gate and up weights ``[E, F, K]``: :func:`~mxmoe.ops.linear.grouped_linear`'s weight parts).
        offs: int32 ``[E]`` group ends. w_next: the down projection's weight ``[E, D, F]``, which takes a.
        w_mx: w already quantized for both its products (:func:`~mxmoe.ops.linear.grouped_linear`'s contract).
        validate: :func:`~mxmoe.ops.linear.grouped_linear`'s checks (and its raises), on the unfused path.
    """
    recipe = get_recipe(recipe)
    be = backend or resolve(x.device)
    ws = tuple(w) if isinstance(w, (tuple, list)) else (w,)
    f = sum(p.shape[1] for p in ws) // 2
    if not validate and be.fused_swiglu_bwd and fused_fp8(x, x.shape[0], f, recipe, w_next, be):
        if w_mx is not None:  # (the unfused path's grouped_linear checks it)
            check_weight_operands(x, ws, w_mx, recipe, be, values=False)
        from mxmoe.kernels.quantize import columnwise_mxtensor, rowwise_mxtensor

        save_fp8 = (recipe.swiglu_input_fp8 and torch.is_grad_enabled()
                    and (x.requires_grad or any(p.requires_grad for p in ws)))
        g, rule = (1, 128), recipe.scale_rule
        handle, data, scale, data_t, scale_t = _MXLinearSwiGLU.apply(x, offs, recipe, x_mx, x_wgrad, w_mx, be,
                                                                     save_fp8, *ws)
        return handle, MXOperands(rowwise_mxtensor(data, scale, rule, g), columnwise_mxtensor(data_t, scale_t, rule, g))
    h = grouped_linear(x, w, offs, recipe, validate=validate, x_mx=x_mx, x_wgrad=x_wgrad, w_mx=w_mx,
                       backend=be)  # [M, 2F]
    return swiglu(h, recipe, w_next, backend=be)
