"""Torch-level ops: quantization dispatch, grouped matrix products, and the expert linear layer.

Shape letters: M routed rows (tokens x top_k, grouped by expert), K contraction, N output
features, E experts, T tokens of a K-grouped (wgrad) product.

Every op has a pure-torch path that runs anywhere and is the reference the fast CUDA kernels
(:mod:`mxmoe.kernels`) are tested against; the fast path is taken on CUDA when it supports the
case, and the result agrees with the reference (bit for bit for quantization, to FP32
summation order for products).
"""

from __future__ import annotations

import os

import torch
from torch.autograd.function import once_differentiable

from mxmoe import formats
from mxmoe.formats import BLOCK, MXTensor
from mxmoe.recipes import Recipe, get_recipe

Operand = "torch.Tensor | MXTensor"


# --------------------------------------------------------------------------------------------
# Quantization
# --------------------------------------------------------------------------------------------
def quantize(x: torch.Tensor, axis: int = -1, scale_rule: str = "rceil", block=BLOCK) -> MXTensor:
    """Quantize ``x`` to MXFP8 along ``axis``; same contract as :func:`mxmoe.formats.quantize`.

    On CUDA the Triton kernels of :mod:`mxmoe.kernels.quantize` are used where they cover the
    case (bit-identical to the reference); everywhere else the pure-torch reference runs.

    Args:
        x: float16/bfloat16/float32/float64 tensor with ``x.shape[axis] % 32 == 0``.
        axis: quantized (contraction) axis.
        scale_rule: ``"rceil"`` (default) or ``"floor"``.
        block: ``32`` (1x32) or ``(32, 32)`` (one scale per 32x32 tile of the last two dims).
    Returns:
        :class:`~mxmoe.formats.MXTensor` (E4M3 data, row-major E8M0 scales).
    Raises:
        TypeError, ValueError: as :func:`mxmoe.formats.quantize`.
    """
    if isinstance(x, torch.Tensor) and x.is_cuda:
        from mxmoe.kernels import dispatch

        out = dispatch.quantize_cuda(x, axis, scale_rule, block)
        if out is not None:
            return out
    return formats.quantize(x, axis, scale_rule, block)


# --------------------------------------------------------------------------------------------
# Grouped matrix products (torch._grouped_mm contract)
# --------------------------------------------------------------------------------------------
def check_offsets(offs: torch.Tensor, num_groups: int | None, extent: int, what: str = "rows") -> None:
    """Validate int32 cumulative end offsets of groups.

    Raises:
        TypeError: ``offs`` is not an int32 tensor.
        ValueError: not 1D, wrong group count, decreasing, negative, or past ``extent``.
    """
    if not isinstance(offs, torch.Tensor) or offs.dtype != torch.int32:
        raise TypeError(f"offs must be an int32 tensor, got {getattr(offs, 'dtype', type(offs).__name__)}")
    if offs.dim() != 1:
        raise ValueError(f"offs must be 1D [num_groups], got shape {tuple(offs.shape)}")
    if num_groups is not None and offs.numel() != num_groups:
        raise ValueError(f"offs has {offs.numel()} groups but the operand has {num_groups}")
    if offs.numel() == 0:
        return
    o = offs.cpu()
    if (o[0] < 0) or bool((o[1:] < o[:-1]).any()):
        raise ValueError(f"offs must be non-decreasing and non-negative, got {o.tolist()}")
    if int(o[-1]) > extent:
        raise ValueError(f"offs[-1] = {int(o[-1])} is past the {extent} {what} of the grouped operand")


def _is_mx(t) -> bool:
    return isinstance(t, MXTensor)


def _reference_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, out_dtype) -> torch.Tensor:
    """Plain per-group products, FP32 (or FP64) accumulate; rows/groups outside offs are zero."""
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    if b.dim() == 3:  # [M,K] x [E,K,N] -> [M,N]
        out = torch.zeros(a.shape[0], b.shape[2], dtype=out_dtype, device=a.device)
        for e, (s, t) in enumerate(zip(starts, ends)):
            if t > s:
                out[s:t] = (a[s:t] @ b[e]).to(out_dtype)
    else:  # [N,T] x [T,K] -> [E,N,K]
        out = torch.zeros(len(ends), a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
        for e, (s, t) in enumerate(zip(starts, ends)):
            if t > s:
                out[e] = (a[:, s:t] @ b[s:t]).to(out_dtype)
    if not any(t > s for s, t in zip(starts, ends)):  # no rows: keep a and b in the graph (zero gradients)
        out = out + (a.flatten()[:0].sum() + b.flatten()[:0].sum()).to(out_dtype)
    return out


def _check_grouped_operands(a, b, offs) -> None:
    if _is_mx(a) != _is_mx(b):
        raise TypeError("grouped_mm: both operands must be MXTensors or both plain tensors")
    if a.dim() != 2 or b.dim() not in (2, 3):
        raise ValueError(f"grouped_mm supports 2D x 3D (fprop/dgrad) and 2D x 2D (wgrad); got {a.dim()}D x {b.dim()}D")
    if _is_mx(a):
        if a.axis != 1 or b.axis != b.dim() - 2:
            raise ValueError(
                f"grouped_mm: MX operands must be quantized along the contraction dim "
                f"(a along dim 1, b along dim {b.dim() - 2}); got a.axis={a.axis}, b.axis={b.axis}")
    else:
        if not (a.is_floating_point() and b.is_floating_point()):
            raise TypeError(f"grouped_mm expects floating tensors, got {a.dtype} and {b.dtype}")
        if a.dtype != b.dtype:
            raise TypeError(f"grouped_mm: operand dtypes differ ({a.dtype} vs {b.dtype})")
    k_a, k_b = a.shape[1], b.shape[-2]
    if k_a != k_b:
        raise ValueError(f"grouped_mm: contraction sizes differ: a {tuple(a.shape)} vs b {tuple(b.shape)}")
    if b.dim() == 3:
        check_offsets(offs, b.shape[0], a.shape[0], "rows")
    else:
        check_offsets(offs, None, a.shape[1], "contraction elements")
        if _is_mx(a) and bool((offs % BLOCK != 0).any()):  # a 32-element block would mix two experts
            raise ValueError(f"grouped_mm: MX operands contracted per group (wgrad) need every group to end on a "
                             f"multiple of {BLOCK}, got offs {offs.tolist()}")


def grouped_mm(a: Operand, b: Operand, offs: torch.Tensor, out_dtype: torch.dtype | None = None,
               _validate: bool = True) -> torch.Tensor:
    """Grouped matrix product with the contract of ``torch._grouped_mm``.

    Forms:
        * 2D x 3D (fprop, dgrad): ``a [M, K]``, ``b [E, K, N]``, ``offs`` int32 ``[E]`` cumulative
          end rows of ``a``; returns ``[M, N]`` with rows of group ``e`` multiplied by ``b[e]``.
          Rows past ``offs[-1]`` are unspecified (the reference writes zeros there).
        * 2D x 2D (wgrad): ``a [N, T]``, ``b [T, K]``, ``offs`` int32 ``[E]`` cumulative end along
          T; returns ``[E, N, K]``, ``out[e] = a[:, group e] @ b[group e]``; empty groups give zero.

    Operands are both plain float tensors (bf16/fp16/fp32) or both :class:`MXTensor` quantized
    along the contraction dim (``a.axis == 1``; ``b.axis`` = its K dim). MX products equal the
    FP64 product of the dequantized operands up to FP32 summation order, rounded once to ``out_dtype``
    (the CPU reference, the Gluon route, sm_100) -- except on Hopper's expansion route (sm_90 with
    ``MXMOE_SM90_GEMM`` unset, ``auto`` or ``bf16``, the default; and the 2D x 2D form under ``mixed``):
    there the operands are expanded exactly to BF16 and multiplied by BF16 ``torch._grouped_mm``, which
    sums in FP32 but writes BF16, so ``out_dtype=torch.float32`` returns that BF16-rounded product cast
    to FP32 (every element a BF16 value, up to 2^-9 relative error against the exact product; not FP32
    accuracy). The layer's MX weight gradients come from this form, so on that route they reach FP32
    parameters BF16-rounded (``tests/test_out_dtype.py``).

    Args:
        out_dtype: result dtype; default ``a.dtype`` for plain tensors, ``bfloat16`` for MX.
    Raises:
        TypeError: mixed operand kinds, non-float dtypes, mismatched dtypes, offs not int32.
        TypeError: also a non-float ``out_dtype``.
        ValueError: wrong ranks, contraction mismatch, wrong quantized axis, offsets not
            non-decreasing, past the tensor, or a group count different from ``b.shape[0]``; 2D x 2D MX
            operands with a group not ending on a multiple of 32.
    """
    if _validate:
        _check_grouped_operands(a, b, offs)
        if out_dtype is not None and not (isinstance(out_dtype, torch.dtype) and out_dtype.is_floating_point):
            raise TypeError(f"grouped_mm: out_dtype must be a floating dtype, got {out_dtype}")
    if _is_mx(a):
        out_dtype = out_dtype or torch.bfloat16
        if a.device.type == "cuda":
            from mxmoe.kernels import dispatch

            out = dispatch.mx_grouped_mm_cuda(a, b, offs, out_dtype, trusted=not _validate)
            if out is not None:
                return out
        acc = torch.float64 if out_dtype == torch.float64 else torch.float32
        return _reference_grouped_mm(a.dequantize(acc), b.dequantize(acc), offs, out_dtype)
    out_dtype = out_dtype or a.dtype
    if (a.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm") and offs.numel() > 0 and _aligned_16b(a)
            and _aligned_16b(b)):  # (no groups: the reference's zeros; torch._grouped_mm leaves memory unset)
        return torch._grouped_mm(a, b, offs, out_dtype=out_dtype)
    return _reference_grouped_mm(a, b, offs, out_dtype)


def _aligned_16b(t: torch.Tensor) -> bool:
    """torch._grouped_mm needs one unit-stride dim, other strides and the base on 16 bytes.

    Under torch.compile the base address cannot be traced (data_ptr / storage_offset break the
    graph), so only the strides are checked there: a view starting off a 16-byte boundary is then
    not routed to the reference product (the layer's own operands are fresh casts or views at
    multiples of 16 bytes)."""
    size = t.element_size()
    strides_ok = 1 in t.stride()[-2:] and all((s * size) % 16 == 0 for s in t.stride() if s != 1)
    if torch.compiler.is_compiling():
        return strides_ok
    return strides_ok and t.data_ptr() % 16 == 0


# --------------------------------------------------------------------------------------------
# Expert linear layer: y = x W_e^T per group, with its three GEMMs
# --------------------------------------------------------------------------------------------
def _pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-x.shape[0]) % multiple
    return torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x


def quantize_weight(w: torch.Tensor, recipe: Recipe, axis: int) -> MXTensor:
    """Expert weights ``[E, N, K]`` quantized along ``axis`` (-1: K for fprop, -2: N for dgrad)."""
    block = (BLOCK, BLOCK) if recipe.weight_block == BLOCK else (1, BLOCK)
    return quantize(w, axis=axis, scale_rule=recipe.scale_rule, block=block)


def quantize_dual(x: torch.Tensor, scale_rule: str = "rceil") -> tuple[MXTensor, MXTensor]:
    """``x [M, K]`` quantized along K and along M (``M % 32 == 0``): one read on CUDA."""
    if x.is_cuda:
        from mxmoe.kernels import dispatch

        out = dispatch.quantize_dual_cuda(x, scale_rule)
        if out is not None:
            return out
    return quantize(x, -1, scale_rule), quantize(x, 0, scale_rule)


def quantize_weight_both(w: torch.Tensor, recipe: Recipe) -> tuple[MXTensor, MXTensor]:
    """32x32-block weights ``[E, N, K]`` along K (fprop) and along N (dgrad): one quantization."""
    if w.is_cuda:
        from mxmoe.kernels import dispatch

        out = dispatch.quantize_weight_both_cuda(w, recipe.scale_rule)
        if out is not None:
            return out
    wq = quantize_weight(w, recipe, axis=-1)
    return wq, wq.requantize_free_swap()


def _expansion(x: torch.Tensor, w: torch.Tensor, recipe: Recipe):
    """The dispatch module where the layer's products take the Hopper expansion route, else None.

    On that route every MX operand is multiplied as its BF16 value (exact), so the quantize-
    dequantize (QDQ) kernels write those values straight from the source, one read, where
    quantize + expand would write FP8 and read it back; FP8 is written only for what is kept for
    backward.
    """
    if not x.is_cuda:
        return None
    from mxmoe.kernels import dispatch

    return dispatch if dispatch.expansion_route(recipe.weight_block, x, w) else None


def _product(a, b, offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """MX grouped product of two MXTensors (any route), or on the expansion route of operands of
    which at least one is already its BF16 value: the other is expanded, and the product is
    computed exactly as :func:`mxmoe.kernels.dispatch.mx_grouped_mm_cuda` does on that route."""
    if _is_mx(a) and _is_mx(b):
        return grouped_mm(a, b, offs, out_dtype=out_dtype, _validate=False)
    from mxmoe.kernels import dispatch

    return dispatch.bf16_grouped_mm(a, b, offs, out_dtype)


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element for element, NaN matching NaN (synchronizes with the GPU)."""
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _check_prequantized(x, x_mx, x_wgrad, recipe: Recipe) -> None:
    """grouped_linear's ``x_mx`` / ``x_wgrad`` contract (see there); raises TypeError / ValueError."""
    for name, t in (("x_mx", x_mx), ("x_wgrad", x_wgrad)):
        if t is None:
            continue
        if not _is_mx(t):
            raise TypeError(f"{name} must be an MXTensor, got {type(t).__name__}")
        if not recipe.mxfp8:
            raise ValueError(f"{name} is for MXFP8 recipes; the {recipe.name} recipe does not quantize")
        if t.shape != x.shape or t.block != (1, BLOCK) or t.scale_rule != recipe.scale_rule:
            raise ValueError(f"{name} must be x {tuple(x.shape)} in 1x32 blocks with the recipe's "
                             f"{recipe.scale_rule!r} rule, got {t!r}")
    if x_mx is not None and x_mx.axis != 1:
        raise ValueError(f"x_mx must be x quantized along K (axis 1), got axis {x_mx.axis}")
    if x_mx is not None:
        if not _same_values(x_mx.dequantize(x.dtype), x):
            raise ValueError("x_mx must be x quantized along K, with x its dequantized value; they differ")
    if x_wgrad is not None:
        if x_wgrad.axis != 0 or x_mx is not None or not recipe.wgrad_mxfp8:
            raise ValueError(f"x_wgrad must be x quantized along tokens (axis 0), without x_mx, under a recipe "
                             f"with MX wgrad; got axis {x_wgrad.axis} under {recipe.name}")
        if x.dtype != torch.bfloat16:
            raise TypeError(f"with x_wgrad, x must be bfloat16 (its own BF16 MX values), got {x.dtype}")
        xq = quantize(x.detach(), axis=-1, scale_rule=recipe.scale_rule).dequantize(torch.float32).to(x.dtype)
        if not _same_values(xq, x):
            raise ValueError("with x_wgrad, x must hold its own MX values along K (e.g. from ops.swiglu or "
                             "ops.permute_tokens); quantizing x changes it")
        # x_wgrad comes from the tensor x was rounded from (not from x), so only closeness can be
        # checked: two MX roundings stay within a few % (Frobenius); another tensor does not
        xd = x.detach()
        fin = torch.isfinite(xd)
        diff = torch.where(fin, x_wgrad.dequantize(x.dtype) - xd, 0).nan_to_num(0.0, 0.0, 0.0)
        far = torch.linalg.vector_norm(diff, dtype=torch.float32) > \
            0.25 * torch.linalg.vector_norm(torch.where(fin, xd, 0), dtype=torch.float32) + 1e-30
        if bool(far):
            raise ValueError("x_wgrad must be x's tensor quantized along tokens (axis 0); it is far from x")


def _pack(t) -> tuple[tuple, tuple | None]:
    """An MXTensor, tensor or None as (tensors for ``ctx.save_for_backward``, metadata)."""
    if t is None:
        return (), None
    if _is_mx(t):
        return (t.data, t.scale), (t.axis, t.scale_rule, t.block)
    return (t,), ()


def _unpack(tensors: tuple, meta: tuple | None):
    """Inverse of :func:`_pack`."""
    if meta is None:
        return None
    return MXTensor(*tensors, *meta) if meta else tensors[0]


def _weight_along_n(w: torch.Tensor, recipe: Recipe, expansion: bool):
    """dgrad's weight operand ``[E, N, K]`` quantized along N, from the parameter: its BF16 values on
    the Hopper expansion route (1x32: a transposed view; 32x32: the tile values, row-major), else an
    MXTensor."""
    if expansion:
        from mxmoe.kernels import dispatch

        if recipe.weight_block == BLOCK:  # 32x32 tiles: the values along K are those along N
            return dispatch.qdq_rowwise(w.detach(), recipe.scale_rule, True)
        return dispatch.qdq_columnwise(w.detach(), recipe.scale_rule).mT
    return quantize_weight(w, recipe, axis=-2)


class _MXGroupedLinear(torch.autograd.Function):
    """MXFP8 expert linear layer. Saved for backward: FP8 x (columnwise) and the FP8 weights
    (or, for 1x32 weights off the expansion route or under ``requantize_weights``, the parameter
    itself, requantized along N).

    On the Hopper expansion route (:func:`_expansion`) operands are BF16 MX values from the QDQ
    kernels, bit-identical to expanding the quantized operands; what is saved stays FP8.
    """

    @staticmethod
    def forward(ctx, x, w, offs, recipe: Recipe, x_mx: MXTensor | None, x_wgrad: MXTensor | None):
        rule = recipe.scale_rule
        exp = _expansion(x, w, recipe)
        x_saved = None
        if x_wgrad is not None:  # x: its own BF16 MX values along K already (see swiglu)
            xq = x.detach() if exp else quantize(x, axis=-1, scale_rule=rule)  # requantizing MX values: lossless
            x_saved = x_wgrad
        elif x_mx is not None:
            xq = x_mx
        elif recipe.wgrad_mxfp8 and x.shape[0] % BLOCK == 0:  # fprop (along K) + wgrad (along tokens) operands
            xq, x_saved = exp.qdq_dual(x.detach(), rule) if exp else quantize_dual(x.detach(), rule)
        else:
            xq = exp.qdq_rowwise(x.detach(), rule) if exp else quantize(x, axis=-1, scale_rule=rule)
        tile32 = recipe.weight_block == BLOCK
        if exp is not None and recipe.requantize_weights:  # BF16 values along K only; dgrad requantizes
            wq, w_dgrad = exp.qdq_rowwise(w.detach(), rule, tile32), None
        elif exp is not None:
            # Weights along K as BF16 values (fprop) + FP8 along N kept for dgrad (for 32x32 tiles the
            # same values; the transposed copy keeps dgrad's operand layout). Bytes per weight element
            # (estimate; fp32 parameters): saving FP8 moves 1 (extra write) + 1 + 2 (expansion in
            # backward) = 4 B; requantizing from the parameter in backward moves 4 + 2 = 6 B. Cost:
            # ~1 B per weight element held until backward (recipe.requantize_weights trades the other way).
            wq, w_dgrad = exp.qdq_dual(w.detach(), rule, tile32=tile32)
        elif tile32 and not recipe.requantize_weights:  # one quantization serves fprop and dgrad
            wq, w_dgrad = quantize_weight_both(w, recipe)
        else:
            wq, w_dgrad = quantize_weight(w, recipe, axis=-1), None  # [E, N, K] along K
        y = _product(xq, wq.mT, offs, x.dtype)
        # backward operands, quantized now so FP8 (not BF16) is what is kept
        if x_saved is None:
            x_saved = (quantize(_pad_rows(x.detach(), BLOCK), axis=0, scale_rule=rule) if recipe.wgrad_mxfp8
                       else x.detach().to(getattr(torch, recipe.compute_dtype)))  # along tokens
        ctx.recipe, ctx.expansion = recipe, exp is not None
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, w.dtype
        # saved tensors, not ctx attributes: freed after backward, visible to saved_tensors_hooks
        xs, ctx.x_meta = _pack(x_saved)
        ws, ctx.w_meta = _pack(w_dgrad)
        ctx.n_x = len(xs)
        ctx.save_for_backward(offs, w if w_dgrad is None else None, *xs, *ws)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        recipe, rule = ctx.recipe, ctx.recipe.scale_rule
        offs, w, *rest = ctx.saved_tensors
        x_saved, w_dgrad = _unpack(rest[:ctx.n_x], ctx.x_meta), _unpack(rest[ctx.n_x:], ctx.w_meta)
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = dw = None
        dyq = dyq_t = None  # dy along N (dgrad), along tokens as [N, M] (wgrad)
        if ctx.expansion:
            from mxmoe.kernels import dispatch

            if need_dx and need_dw and recipe.wgrad_mxfp8 and dy.shape[0] % BLOCK == 0:
                dyq, dyq_t = dispatch.qdq_dual_bf16(dy, rule)  # one read of dy
            elif need_dx:
                dyq = dispatch.qdq_rowwise(dy, rule)
        elif need_dx and need_dw and recipe.wgrad_mxfp8 and dy.shape[0] % BLOCK == 0:
            dyq, dyq_t = quantize_dual(dy, rule)  # FP8 along N (dgrad) and along tokens (wgrad): one read
            dyq_t = dyq_t.mT
        if need_dx:  # dgrad: dx[M,K] = dy[M,N] W[N,K], contraction over N
            if dyq is None:
                dyq = quantize(dy, axis=-1, scale_rule=rule)
            wq_n = w_dgrad if w_dgrad is not None else _weight_along_n(w, recipe, ctx.expansion)
            dx = _product(dyq, wq_n, offs, ctx.x_dtype)
            dyq = wq_n = None  # dgrad's operands freed before wgrad's are made (peak memory)
        if need_dw:  # wgrad: dW[e] = dy_e^T x_e, contraction over tokens
            if recipe.wgrad_mxfp8:
                if dyq_t is None:
                    dyq_t = quantize(_pad_rows(dy, BLOCK), axis=0, scale_rule=rule).mT  # [N, M] along tokens
                if ctx.expansion:  # torch._grouped_mm writes BF16: cast once its operands are freed (peak memory)
                    dw = _product(dyq_t, x_saved, offs, torch.bfloat16)
                    dyq_t = None
                    dw = dispatch.bf16_to(dw, ctx.w_dtype)
                else:
                    dw = _product(dyq_t, x_saved, offs, torch.float32)
            else:
                dw = grouped_mm(dy.to(x_saved.dtype).t(), x_saved, offs, _validate=False)
            dw = dw.to(ctx.w_dtype)
        return dx, dw, None, None, None, None


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, recipe: "str | Recipe" = "mxfp8",
                   validate: bool = True, x_mx: MXTensor | None = None,
                   x_wgrad: MXTensor | None = None) -> torch.Tensor:
    """Expert linear layer ``y[rows of e] = x[rows of e] @ w[e]^T`` with autograd.

    The three GEMMs (DESIGN §4): fprop contracts K (x and W quantized along K), dgrad contracts N
    (dy along N, W along N), wgrad contracts tokens (dy and x along tokens); each operand is
    quantized along its GEMM's contraction dim under an MXFP8 recipe.

    Args:
        x: ``[M, K]`` float activations, rows grouped by expert (group ends in ``offs``).
        w: ``[E, N, K]`` float expert weights.
        offs: int32 ``[E]`` cumulative end rows; under MXFP8 recipes with MX wgrad every group must
            end on a multiple of 32 rows (wgrad's 32-token blocks must not mix experts). With
            ``validate``, rows past ``offs[-1]`` give zero output and zero gradient; without it they
            are the caller's business (mxmoe.MoE ends the last group at M).
        recipe: name (``"bf16"``, ``"mxfp8"``, ``"mxfp8_2d"``, ``"mxfp8_lowmem"`` (here: ``"mxfp8"`` with
            the weights requantized in backward),
            ``"mxfp8_bf16_wgrad"``, ``"fp32"``)
            or a :class:`~mxmoe.recipes.Recipe`.
        validate: check shapes and offsets (synchronizes with the GPU once).
        x_mx: optional, ``x`` already quantized along K (e.g. tokens received in MXFP8 from an
            expert-parallel dispatch; ``x`` is then its dequantized value, the autograd handle):
            fprop uses it as is, with no second quantization.
        x_wgrad: optional (MXFP8 recipes with MX wgrad): ``x`` is bfloat16 holding its own MX values
            along K (exact, e.g. from :func:`swiglu` or :func:`permute_tokens`) and ``x_wgrad`` its
            FP8 copy along tokens (``[M, K]``, axis 0, ``M % 32 == 0``): fprop uses ``x`` and wgrad
            ``x_wgrad`` without quantizing again. ``validate`` checks that x is unchanged by
            quantization (so every route computes the same product).
    Returns:
        ``[M, N]`` in ``x.dtype``.
    Raises:
        ValueError: shape mismatch, K or N not divisible by 32 under MXFP8, bad offsets, MX-wgrad
            groups not on 32-row boundaries, ``x_mx`` / ``x_wgrad`` not matching x and the recipe.
        TypeError: non-float inputs, ``x_mx`` / ``x_wgrad`` not MXTensors, x not bfloat16 with ``x_wgrad``.

    Under ``mxfp8_bf16_wgrad`` dW comes from a plain product in ``recipe.compute_dtype``: BF16
    ``torch._grouped_mm`` by default, which writes BF16, so dW is rounded to BF16 as in the ``bf16``
    recipe. First-order gradients only (no double backward).
    """
    recipe = get_recipe(recipe)
    if validate:
        if x.dim() != 2 or w.dim() != 3:
            raise ValueError(f"grouped_linear expects x [M, K] and w [E, N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
        if not (x.is_floating_point() and w.is_floating_point()):
            raise TypeError(f"grouped_linear expects floating tensors, got {x.dtype} and {w.dtype}")
        if x.shape[1] != w.shape[2]:
            raise ValueError(f"grouped_linear: x has K={x.shape[1]} but w has K={w.shape[2]}")
        if recipe.mxfp8 and (w.shape[1] % BLOCK or w.shape[2] % BLOCK):
            raise ValueError(f"MXFP8 needs N and K divisible by {BLOCK}, got w of shape {tuple(w.shape)}")
        check_offsets(offs, w.shape[0], x.shape[0])
        if recipe.mxfp8 and recipe.wgrad_mxfp8 and bool((offs % BLOCK != 0).any()):
            raise ValueError(
                f"under the {recipe.name} recipe wgrad quantizes along tokens in blocks of {BLOCK}: every "
                f"expert group must end on a multiple of {BLOCK} rows (pad the groups, as mxmoe.MoE does), "
                f"got offs {offs.tolist()}")
        _check_prequantized(x, x_mx, x_wgrad, recipe)
        if x.shape[0] == 0:  # no rows: an empty result that still connects x and w to autograd
            return x.new_zeros(0, w.shape[1]) + (x.sum() + w.sum()).to(x.dtype) * 0
        end = int(offs[-1]) if offs.numel() else 0
        if end < x.shape[0]:  # rows outside every group: zero in, zero out, zero gradient (no garbage)
            keep = (torch.arange(x.shape[0], device=x.device) < end).unsqueeze(1)
            x = torch.where(keep, x, 0)
            return torch.where(keep, grouped_linear(x, w, offs, recipe, validate=False, x_mx=x_mx,
                                                    x_wgrad=x_wgrad), 0)
    if recipe.mxfp8:
        return _MXGroupedLinear.apply(x, w, offs, recipe, x_mx, x_wgrad)
    dt = getattr(torch, recipe.compute_dtype)
    if dt == torch.bfloat16 and w.dtype == torch.float32 and _layer_ops(w) is not None:
        w16 = _ToBF16.apply(w)  # the same cast, its backward through the layer's cast kernel
    else:
        w16 = w.to(dt)
    y = grouped_mm(x.to(dt), w16.mT, offs, _validate=False)
    return y.to(x.dtype)


class _ToBF16(torch.autograd.Function):
    """``w.to(torch.bfloat16)`` of an FP32 CUDA tensor whose backward casts the BF16 gradient to
    FP32 with the layer's cast kernel, not torch's dtype-converting copy (that copy was 8-21% of the
    bf16 layer's step on an H200, benchmarks/NOTES_moe_layer.md). Same values."""

    @staticmethod
    def forward(ctx, w):
        ctx.ops = _layer_ops(w)  # the backward uses what the forward chose (MXMOE_LAYER_KERNELS may change)
        return w.to(torch.bfloat16)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        return ctx.ops.to_float32(g) if ctx.ops is not None else g.float()


# --------------------------------------------------------------------------------------------
# SwiGLU between the expert products
# --------------------------------------------------------------------------------------------
def _layer_ops(t: torch.Tensor):
    """The layer kernels (:mod:`mxmoe.kernels.layer`, via :func:`mxmoe.kernels.dispatch.layer_ops`)
    for a CUDA BF16/FP16/FP32 tensor, else None (the torch ops run). ``MXMOE_LAYER_KERNELS=0`` turns
    them off (e.g. to time the layer with and without them in one run)."""
    if not t.is_cuda or t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return None  # (FP64 keeps the torch ops: the kernels sum in FP32)
    from mxmoe.kernels import dispatch

    return dispatch.layer_ops()


def _fused_qdq(x: torch.Tensor, rows: int, cols: int, recipe: Recipe, w_next: torch.Tensor | None) -> bool:
    """Whether a fused kernel may hand the product with ``w_next`` its ``[rows, cols]`` operand
    directly as BF16 MX values plus the FP8 copy along rows (``x_wgrad``): that product runs on the
    Hopper expansion route under an MXFP8 recipe with MX wgrad, x is 2D bfloat16, and both sizes
    are multiples of 32."""
    return (w_next is not None and x.dtype == torch.bfloat16 and x.dim() == 2 and recipe.mxfp8
            and recipe.wgrad_mxfp8 and rows % BLOCK == 0 and cols % BLOCK == 0
            and _expansion(x, w_next, recipe) is not None)


class _SwiGLUQDQ(torch.autograd.Function):
    """``a = silu(gate) * up`` of ``h [M, 2F]`` bf16 fused with a's dual QDQ (forward, one read of
    h, a never written); backward: the torch SwiGLU gradient (the ops autograd runs for
    ``F.silu(gate) * up``, so the same bits), from h alone (silu recomputed, not saved). With
    ``save_h_fp8`` the same read also writes h as MXFP8 along 2F, which is what is kept (see
    :func:`swiglu`)."""

    @staticmethod
    def forward(ctx, h, scale_rule: str, save_h_fp8: bool):
        from mxmoe.kernels import dispatch

        # a's columnwise storage [F, M], [F, M/32]; then h along 2F, or two empty tensors
        a16, data_t, scale_t, qh, sh = dispatch.swiglu_qdq(h, scale_rule, save_h_fp8)
        hs, ctx.h_meta = _pack(MXTensor(qh, sh, 1, scale_rule) if save_h_fp8 else h)
        ctx.save_for_backward(*hs)
        ctx.mark_non_differentiable(data_t, scale_t)
        return a16, data_t, scale_t

    @staticmethod
    @once_differentiable
    def backward(ctx, da, *_):
        return _swiglu_backward(da, _unpack(ctx.saved_tensors, ctx.h_meta)), None, None


def _swiglu_backward(da: torch.Tensor, h: "torch.Tensor | MXTensor") -> torch.Tensor:
    """dh ``[M, 2F]`` of ``a = F.silu(gate) * up`` from ``da [M, F]``: torch's autograd arithmetic,
    from one pass of the layer kernel on CUDA for bf16 (bit for bit the same). h may be an
    MXTensor along its last dim: the gradient is then taken at its MX values in da's dtype (the
    CUDA kernel expands them itself, for a 2D bf16 da and F % 32 == 0)."""
    ops = _layer_ops(da)
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
    ``save_rule`` as MXFP8 along 2F (``quantize(h, -1, save_rule)``), SwiGLU's gradient then taken
    at h's MX values (the ``swiglu_input_fp8`` recipes off the fused path: the same numbers)."""

    @staticmethod
    def forward(ctx, h, save_rule: str | None):
        ops = _layer_ops(h)
        if ops is not None and h.dim() == 2 and h.dtype == torch.bfloat16:
            a = ops.swiglu(h)
        else:
            gate, up = h.split(h.shape[-1] // 2, dim=-1)
            a = torch.nn.functional.silu(gate) * up
        hs, ctx.h_meta = _pack(h if save_rule is None else quantize(h.detach(), -1, save_rule))
        ctx.save_for_backward(*hs)  # (saved tensors, not ctx attributes: freed after backward)
        return a

    @staticmethod
    @once_differentiable
    def backward(ctx, da):
        return _swiglu_backward(da, _unpack(ctx.saved_tensors, ctx.h_meta)), None


class _PermuteQDQ(torch.autograd.Function):
    """Tokens ``x2 [T, D]`` bf16 gathered into the expert-ordered buffer fused with its dual QDQ
    (forward: one read of x2, the BF16 buffer never written); backward: the gradient of the
    gather (the ops autograd runs for ``repeat_interleave`` + ``index_copy``, so the same bits):
    each token sums the gradient rows of its top_k slots. Quantization is straight-through."""

    @staticmethod
    def forward(ctx, x2, slot_rows, rows: int, top_k: int, scale_rule: str):
        from mxmoe.kernels import dispatch

        src = _row_tokens(slot_rows, rows, top_k)
        xp16, data_t, scale_t = dispatch.permute_qdq(x2, src, scale_rule)  # columnwise storage [D, M], [D, M/32]
        ctx.save_for_backward(slot_rows)
        ctx.top_k = top_k
        ctx.mark_non_differentiable(data_t, scale_t)
        return xp16, data_t, scale_t

    @staticmethod
    @once_differentiable
    def backward(ctx, dxp, *_):
        (slot_rows,) = ctx.saved_tensors
        return _permute_backward(dxp, slot_rows, ctx.top_k), None, None, None, None


def _row_slots(slot_rows: torch.Tensor, rows: int) -> torch.Tensor:
    """Inverse of ``slot_rows``: int32 ``[rows]``, the slot each row holds, -1 on padding rows."""
    slot = torch.full((rows,), -1, dtype=torch.int32, device=slot_rows.device)
    return slot.index_copy_(0, slot_rows, torch.arange(slot_rows.numel(), device=slot_rows.device, dtype=torch.int32))


def _row_tokens(slot_rows: torch.Tensor, rows: int, top_k: int) -> torch.Tensor:
    """int32 ``[rows]``: the token each row holds (slot // top_k), -1 on padding rows."""
    slot = _row_slots(slot_rows, rows)
    return torch.where(slot >= 0, slot // top_k, -1)


def _permute_backward(dxp: torch.Tensor, slot_rows: torch.Tensor, top_k: int) -> torch.Tensor:
    """Each token's gradient: the sum of its top_k slots' rows of ``dxp`` (FP32 sums, one rounding;
    the ops autograd runs for ``repeat_interleave`` + ``index_copy``, so the same values)."""
    ops = _layer_ops(dxp)
    if ops is not None:
        return ops.gather_sum(dxp, slot_rows, top_k, None)
    g = dxp.index_select(0, slot_rows)  # [T*top_k, D], slot t*top_k + j
    return g.view(-1, top_k, g.shape[1]).sum(1)


class _Permute(torch.autograd.Function):
    """Tokens gathered into the expert-ordered buffer on CUDA: one gather kernel (padding rows zero),
    backward one gather-sum kernel; the same values as ``repeat_interleave`` + ``index_copy``."""

    @staticmethod
    def forward(ctx, x2, slot_rows, rows: int, top_k: int):
        ctx.save_for_backward(slot_rows)
        ctx.top_k = top_k
        return _layer_ops(x2).gather_rows(x2, _row_tokens(slot_rows, rows, top_k), rows)

    @staticmethod
    @once_differentiable
    def backward(ctx, dxp):
        (slot_rows,) = ctx.saved_tensors
        return _permute_backward(dxp, slot_rows, ctx.top_k), None, None, None


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


class _Combine(torch.autograd.Function):
    """The top-k combine on CUDA: one gather-sum kernel forward; backward one pass over the expert
    rows writing their gradient and the router weights' gradient (see :func:`combine`)."""

    @staticmethod
    def forward(ctx, yp, slot_rows, weights, top_k: int):
        w = weights.reshape(-1).to(torch.float32).contiguous()
        ctx.save_for_backward(yp, slot_rows, w)
        ctx.top_k, ctx.w_dtype, ctx.ops = top_k, weights.dtype, _layer_ops(yp)
        return ctx.ops.gather_sum(yp, slot_rows, top_k, w)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        yp, slot_rows, w = ctx.saved_tensors
        dyp, dw = ctx.ops.combine_backward(dy, w, yp, _row_slots(slot_rows, yp.shape[0]), ctx.top_k)
        return dyp, None, dw.view(-1, ctx.top_k).to(ctx.w_dtype), None


def combine(yp: torch.Tensor, slot_rows: torch.Tensor, weights: torch.Tensor, validate: bool = True) -> torch.Tensor:
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
    if _layer_ops(yp) is not None:
        return _Combine.apply(yp, slot_rows, weights, top_k)
    acc = torch.promote_types(yp.dtype, torch.float32)  # FP32, or FP64 for FP64 inputs
    y = _GatherRows.apply(yp, slot_rows).view(T, top_k, yp.shape[1])
    return (y.to(acc) * weights.to(acc).unsqueeze(-1)).sum(1).to(yp.dtype)


def permute_tokens(x2: torch.Tensor, slot_rows: torch.Tensor, rows: int, top_k: int,
                   recipe: "str | Recipe" = "bf16", w_next: torch.Tensor | None = None):
    """Tokens ``x2 [T, D]`` -> the expert-ordered buffer ``xp [rows, D]`` feeding the expert
    product with ``w_next`` (``[E, N, D]``): slot ``t*top_k + j`` (token t's j-th expert) goes to row
    ``slot_rows[t*top_k + j]`` (``slot_rows`` ``[T*top_k]`` int64, distinct rows); other rows are zero.

    Returns ``(xp, xp_wgrad)``. Where that product takes the Hopper expansion route (CUDA, bf16 x2,
    an MXFP8 recipe with MX wgrad, ``rows % 32 == D % 32 == 0``) one fused kernel returns ``xp`` as
    its BF16 MX values along D (``qdq_dual(xp)[0]`` bit for bit) and ``xp_wgrad`` its FP8 copy along
    rows: pass both to :func:`grouped_linear` (``x_wgrad=xp_wgrad``). Elsewhere ``(xp, None)``, xp
    gathered by the layer's gather kernel on CUDA, by ``repeat_interleave`` + ``index_copy`` on the CPU
    (the same values). Gradients flow to x2 either way, the same bits.

    The environment variable ``MXMOE_FUSED_PERMUTE`` (read at every call; default ``"1"``) set to
    ``"0"`` disables the fused kernel (e.g. to time the layer with and without it in one run).
    """
    recipe = get_recipe(recipe)
    if x2.dim() != 2 or slot_rows.dim() != 1 or slot_rows.numel() != x2.shape[0] * top_k:
        raise ValueError(f"permute_tokens expects x2 [T, D] and slot_rows [T*top_k]; got {tuple(x2.shape)}, "
                         f"{tuple(slot_rows.shape)} with top_k={top_k}")
    D = x2.shape[-1]
    if os.environ.get("MXMOE_FUSED_PERMUTE", "1") != "0" and _fused_qdq(x2, rows, D, recipe, w_next):
        from mxmoe.kernels.quantize import columnwise_mxtensor

        xp16, data_t, scale_t = _PermuteQDQ.apply(x2, slot_rows, rows, top_k, recipe.scale_rule)
        return xp16, columnwise_mxtensor(data_t, scale_t, recipe.scale_rule)
    if _layer_ops(x2) is not None:
        return _Permute.apply(x2, slot_rows, rows, top_k), None
    src = x2.repeat_interleave(top_k, dim=0)  # [T*top_k, D], slot t*top_k + j
    return x2.new_zeros(rows, D).index_copy(0, slot_rows, src), None


def swiglu(h: torch.Tensor, recipe: "str | Recipe" = "bf16", w_next: torch.Tensor | None = None):
    """SwiGLU of ``h [M, 2F]`` (gate ``h[:, :F]``, up ``h[:, F:]``) feeding the expert product with ``w_next``.

    Returns ``(a, a_wgrad)``. Where that product takes the Hopper expansion route (CUDA, bf16 h,
    an MXFP8 recipe with MX wgrad, ``M % 32 == F % 32 == 0``) one fused kernel returns ``a`` as its
    BF16 MX values along F (``qdq_rowwise(F.silu(gate) * up)`` bit for bit) and ``a_wgrad`` its FP8
    copy along tokens: pass both to :func:`grouped_linear` (``x_wgrad=a_wgrad``). Elsewhere
    ``(F.silu(gate) * up, None)``. Gradients flow to h either way.

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
    save_fp8 = recipe.swiglu_input_fp8 and f % BLOCK == 0 and h.requires_grad and torch.is_grad_enabled()
    if _fused_qdq(h, h.shape[0], f, recipe, w_next):
        from mxmoe.kernels.quantize import columnwise_mxtensor

        a16, data_t, scale_t = _SwiGLUQDQ.apply(h, recipe.scale_rule, save_fp8)
        return a16, columnwise_mxtensor(data_t, scale_t, recipe.scale_rule)
    if save_fp8 or (h.dim() == 2 and h.dtype == torch.bfloat16 and _layer_ops(h) is not None):
        return _SwiGLU.apply(h, recipe.scale_rule if save_fp8 else None), None
    gate, up = h.split(f, dim=-1)
    return torch.nn.functional.silu(gate) * up, None
