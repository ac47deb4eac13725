"""The expert linear layer ``y = x W_e^T`` per expert group and its three products: fprop
(contraction K), dgrad (N), wgrad (tokens), each operand quantized along its product's contraction dim
under an MXFP8 recipe (docs/DESIGN.md §4)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from mxmoe.backend import Backend, resolve
from mxmoe.formats import BLOCK, MXTensor
from mxmoe.kernels.dispatch import layer_ops_for
from mxmoe.layouts import check_offsets
from mxmoe.ops.grouped import grouped_mm, is_mx
from mxmoe.ops.quantization import quantize, quantize_dual, quantize_grouped, quantize_weight, quantize_weight_both
from mxmoe.ops.saved import pack, unpack
from mxmoe.recipes import Recipe, get_recipe


def _pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-x.shape[0]) % multiple
    return torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x


def _expansion(x: torch.Tensor, w: torch.Tensor, recipe: Recipe, be: Backend):
    """The dispatch module where the layer's products take the Hopper expansion route, else None.

    On that route every MX operand is multiplied as its BF16 value (exact), so the quantize-
    dequantize (QDQ) kernels write those values straight from the source, one read, where
    quantize + expand would write FP8 and read it back; FP8 is written only for what is kept for
    backward.
    """
    if not x.is_cuda:
        return None
    from mxmoe.kernels import dispatch

    return dispatch if dispatch.expansion_route(recipe, x, w, be) else None


def _product(a, b, offs: torch.Tensor, out_dtype: torch.dtype, be: Backend) -> torch.Tensor:
    """MX grouped product of two MXTensors (any route), or on the expansion route of operands of
    which at least one is already its BF16 value: the other is expanded, and the product is
    computed exactly as :func:`mxmoe.kernels.dispatch.mx_grouped_mm_cuda` does on that route."""
    if is_mx(a) and is_mx(b):
        return grouped_mm(a, b, offs, out_dtype=out_dtype, _validate=False, backend=be)
    from mxmoe.kernels import dispatch

    return dispatch.bf16_grouped_mm(a, b, offs, out_dtype, be)


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element for element, NaN matching NaN (synchronizes with the GPU)."""
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _check_prequantized(x, x_mx, x_wgrad, recipe: Recipe) -> None:
    """grouped_linear's ``x_mx`` / ``x_wgrad`` contract (see there); raises TypeError / ValueError."""
    for name, t in (("x_mx", x_mx), ("x_wgrad", x_wgrad)):
        if t is None:
            continue
        if not is_mx(t):
            raise TypeError(f"{name} must be an MXTensor, got {type(t).__name__}")
        if not recipe.mxfp8:
            raise ValueError(f"{name} is for MXFP8 recipes; the {recipe.name} recipe does not quantize")
        if t.shape != x.shape or t.block != (1, recipe.act_block) or t.scale_rule != recipe.scale_rule:
            raise ValueError(f"{name} must be x {tuple(x.shape)} in 1x{recipe.act_block} blocks with the recipe's "
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
        xq = quantize(x.detach(), -1, recipe.scale_rule, recipe.act_block).dequantize(torch.float32).to(x.dtype)
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


def weight_operands_apply(recipe: "str | Recipe", x: torch.Tensor, w: torch.Tensor,
                          backend: Backend | None = None) -> bool:
    """Whether the MX product of ``x`` with the weight ``w`` quantizes the weight once for both its products
    (fprop along K, dgrad along N): square weight tiles off the Hopper expansion route, e.g. ``mxfp8_128``. There
    :func:`grouped_linear` takes the weight already quantized (``w_mx``, :func:`quantize_weight_both`'s pair)."""
    recipe = get_recipe(recipe)
    return (recipe.mxfp8 and recipe.weight_block > 1
            and _expansion(x, w, recipe, backend or resolve(x.device)) is None)


def check_weight_operands(x: torch.Tensor, ws: tuple, w_mx, recipe: Recipe, be: Backend, values: bool) -> None:
    """grouped_linear's ``w_mx`` contract (see there), its values against a fresh quantization of ``ws`` when
    ``values`` (synchronizes with the GPU); raises TypeError / ValueError."""
    if not (isinstance(w_mx, (tuple, list)) and len(w_mx) == 2 and all(is_mx(t) for t in w_mx)):
        raise TypeError(f"w_mx must be a pair of MXTensors (the weight along K, along N), got {type(w_mx).__name__}")
    if not ws or any(p.dim() != 3 for p in ws):
        raise ValueError(f"grouped_linear expects w [E, N, K] (or its parts) with w_mx, got "
                         f"{[tuple(p.shape) for p in ws]}")
    if not weight_operands_apply(recipe, x, ws[0], be):
        raise ValueError(f"w_mx is for products that quantize their weight once for both orientations (square tiles "
                         f"off the Hopper expansion route, e.g. mxfp8_128); the {recipe.name} recipe here does not")
    shape = (ws[0].shape[0], sum(p.shape[1] for p in ws), ws[0].shape[2])
    tile = (recipe.weight_block, recipe.weight_block)
    for name, t, axis in (("w_mx[0]", w_mx[0], 2), ("w_mx[1]", w_mx[1], 1)):
        if tuple(t.shape) != shape or t.axis != axis or t.block != tile or t.scale_rule != recipe.scale_rule:
            raise ValueError(f"{name} must be the weight {shape} quantized along axis {axis} in {tile} tiles with the "
                             f"recipe's {recipe.scale_rule!r} rule, got {t!r}")
        scale_shape = tuple(n // BLOCK if d == axis else n for d, n in enumerate(shape))
        if (t.data.dtype != torch.float8_e4m3fn or t.scale.dtype != torch.float8_e8m0fnu
                or tuple(t.scale.shape) != scale_shape or t.data.device != x.device or t.scale.device != x.device):
            raise ValueError(f"{name} must hold float8_e4m3fn data and float8_e8m0fnu scales {scale_shape} on "
                             f"{x.device}, got {t.data.dtype} data and {t.scale.dtype} scales "
                             f"{tuple(t.scale.shape)} on {t.data.device} / {t.scale.device}")
    if values:
        ref = quantize_weight_both(ws if len(ws) > 1 else ws[0], recipe, be)
        for t, r in zip(w_mx, ref):
            if not (torch.equal(t.data.view(torch.uint8), r.data.view(torch.uint8))
                    and torch.equal(t.scale.view(torch.uint8), r.scale.view(torch.uint8))):
                raise ValueError("w_mx must be quantize_weight_both of the weight w; its bytes differ (w changed "
                                 "since w_mx was made?)")


def _weight_along_n(w: "torch.Tensor | tuple[torch.Tensor, ...]", recipe: Recipe, expansion: bool, be: Backend):
    """dgrad's weight operand ``[E, N, K]`` quantized along N, from the parameter: its BF16 values on
    the Hopper expansion route (1x32: a transposed view; 32x32: the tile values, row-major), else an
    MXTensor. ``w``: a tuple of square-tile weight parts along N (not on the expansion route) is quantized
    without concatenating it (:func:`quantize_weight_both`)."""
    if isinstance(w, tuple):
        return quantize_weight_both(w, recipe, be)[1]
    if expansion:
        from mxmoe.kernels import dispatch

        if recipe.weight_block == BLOCK:  # 32x32 tiles: the values along K are those along N
            return dispatch.qdq_rowwise(w.detach(), recipe.scale_rule, True)
        return dispatch.qdq_columnwise(w.detach(), recipe.scale_rule).mT
    return quantize_weight(w, recipe, -2, be, blocked=be.blocked_weight_scales(recipe))


class _MXGroupedLinear(torch.autograd.Function):
    """MXFP8 expert linear layer. Saved for backward: FP8 x (columnwise) and the FP8 weights
    (or, for 1x32 weights off the expansion route or under ``requantize_weights``, the parameter
    itself, or its parts, requantized along N).

    On the Hopper expansion route (:func:`_expansion`) operands are BF16 MX values from the QDQ
    kernels, bit-identical to expanding the quantized operands; what is saved stays FP8.
    """

    @staticmethod
    def forward(ctx, x, offs, recipe: Recipe, x_mx: MXTensor | None, x_wgrad: MXTensor | None, w_mx, be: Backend,
                *ws):
        # ws: the weight, or its parts along N (their concatenation is the weight; each gets its own dW)
        y, saved = linear_forward(ctx, x, offs, recipe, x_mx, x_wgrad, be, ws, w_mx)
        ctx.save_for_backward(*saved)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        dx, dws = linear_backward(ctx, ctx.saved_tensors, dy, ctx.needs_input_grad[0], any(ctx.needs_input_grad[7:]))
        return dx, None, None, None, None, None, None, *dws


def linear_forward(ctx, x, offs, recipe: Recipe, x_mx, x_wgrad, be: Backend, ws: tuple,
                   w_mx: "tuple[MXTensor, MXTensor] | None" = None) -> tuple[torch.Tensor, list]:
    """The MX expert product's forward inside an autograd Function's ``forward`` (:class:`_MXGroupedLinear`, and
    the down projection fused with the combine, :mod:`mxmoe.ops.tokens`): ``(y, tensors to save)``; the
    Function saves those first (with its own after them) and passes them to :func:`linear_backward`. ``w_mx``:
    the weight's FP8 operands made upstream (:func:`grouped_linear`'s contract), used instead of quantizing."""
    ctx.splits = [p.shape[1] for p in ws]
    rule, g = recipe.scale_rule, recipe.act_block
    exp = _expansion(x, ws[0], recipe, be)
    tiles = exp is None and recipe.weight_block > 1  # square tiles: one quantization gives both orientations
    # the weight: its parts' concatenation, except with square tiles, where quantize_weight_both takes the parts
    # (the 128x128 kernel quantizes them without writing the concatenation; under requantize_weights the parts,
    # not an FP32 concatenation, are what backward keeps)
    w = ws[0] if len(ws) == 1 else tuple(ws) if tiles else torch.cat(ws, dim=1)
    grouped = exp is None and be.grouped_scales(recipe)
    x_saved = x_wgrad
    if x_mx is not None:  # (with x_wgrad too: x is only the autograd handle, see MXOperands)
        xq = x_mx
    elif grouped:  # scales in the sm_100 product's per-group blocked layout; wgrad's operand made below
        xq = quantize_grouped(x.detach(), offs, rule, backend=be)
    elif x_wgrad is not None:  # x: its own BF16 MX values along K already (see swiglu)
        xq = x.detach() if exp else quantize(x, -1, rule, g, backend=be)  # requantizing MX values: lossless
    elif recipe.wgrad_mxfp8 and x.shape[0] % g == 0:  # fprop (along K) + wgrad (along tokens) operands
        xq, x_saved = exp.qdq_dual(x.detach(), rule) if exp else quantize_dual(x.detach(), rule, g, be)
    else:
        xq = exp.qdq_rowwise(x.detach(), rule) if exp else quantize(x, -1, rule, g, backend=be)
    tile32 = recipe.weight_block == BLOCK
    if w_mx is not None:  # quantized upstream (e.g. kept from the first forward for a checkpoint's recompute)
        wq, w_dgrad = w_mx
    elif exp is not None and recipe.requantize_weights:  # BF16 values along K only; dgrad requantizes
        wq, w_dgrad = exp.qdq_rowwise(w.detach(), rule, tile32), None
    elif exp is not None:
        # Weights along K as BF16 values (fprop) + FP8 along N kept for dgrad (for 32x32 tiles the
        # same values; the transposed copy keeps dgrad's operand layout). Bytes per weight element
        # (estimate; fp32 parameters): saving FP8 moves 1 (extra write) + 1 + 2 (expansion in
        # backward) = 4 B; requantizing from the parameter in backward moves 4 + 2 = 6 B. Cost:
        # ~1 B per weight element held until backward (recipe.requantize_weights trades the other way).
        wq, w_dgrad = exp.qdq_dual(w.detach(), rule, tile32=tile32)
    elif tiles and not recipe.requantize_weights:  # one quantization serves fprop and dgrad
        wq, w_dgrad = quantize_weight_both(w, recipe, be)
    elif isinstance(w, tuple):  # parts under requantize_weights: along K now (the copy along N dropped)
        wq, w_dgrad = quantize_weight_both(w, recipe, be)[0], None
    else:
        wq = quantize_weight(w, recipe, -1, be, blocked=be.blocked_weight_scales(recipe))  # [E, N, K] along K
        w_dgrad = None
    y = _product(xq, wq.mT, offs, x.dtype, be)
    # backward operands, quantized now so FP8 (not BF16) is what is kept
    if x_saved is None:
        x_saved = (quantize(_pad_rows(x.detach(), g), 0, rule, g, backend=be) if recipe.wgrad_mxfp8
                   else x.detach().to(getattr(torch, recipe.compute_dtype)))  # along tokens
    ctx.recipe, ctx.expansion, ctx.grouped, ctx.be = recipe, exp is not None, grouped, be
    ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, ws[0].dtype
    # saved tensors, not ctx attributes: freed after backward, visible to saved_tensors_hooks
    xs, ctx.x_meta = pack(x_saved)
    wds, ctx.w_meta = pack(w_dgrad)
    ctx.n_x = len(xs)
    w_saved = () if w_dgrad is not None else w if isinstance(w, tuple) else (w,)  # for dgrad to requantize
    ctx.n_w = len(w_saved)
    return y, [offs, *w_saved, *xs, *wds]


def linear_backward(ctx, saved, dy, need_dx: bool, need_dw: bool, dyq: MXTensor | None = None,
                    dyq_t: MXTensor | None = None) -> tuple:
    """dgrad and wgrad of :func:`linear_forward`'s product from ``saved`` (the tensors it returned): ``(dx, [dW
    of each weight part])``. dy ``[M, N]``, or None with ``dyq`` (dy along N, ``[M, N]``) and ``dyq_t`` (dy along
    tokens, ``[N, M]``) already quantized upstream (the combine's fused backward)."""
    recipe, rule, g, be = ctx.recipe, ctx.recipe.scale_rule, ctx.recipe.act_block, ctx.be
    offs, w, rest = saved[0], tuple(saved[1:1 + ctx.n_w]), saved[1 + ctx.n_w:]
    w = w[0] if len(w) == 1 else w or None  # the parameter, its parts, or None (w_dgrad kept)
    x_saved, w_dgrad = unpack(rest[:ctx.n_x], ctx.x_meta), unpack(rest[ctx.n_x:], ctx.w_meta)
    dx, dws = None, [None] * len(ctx.splits)
    if dy is None:
        pass  # dyq / dyq_t given
    elif ctx.expansion:
        from mxmoe.kernels import dispatch

        if need_dx and need_dw and recipe.wgrad_mxfp8 and dy.shape[0] % BLOCK == 0:
            dyq, dyq_t = dispatch.qdq_dual_bf16(dy, rule)  # one read of dy
        elif need_dx:
            dyq = dispatch.qdq_rowwise(dy, rule)
    elif need_dx and need_dw and recipe.wgrad_mxfp8 and dy.shape[0] % g == 0 and not ctx.grouped:
        dyq, dyq_t = quantize_dual(dy, rule, g, be)  # FP8 along N (dgrad) and along tokens (wgrad): one read
        dyq_t = dyq_t.mT
    if need_dx:  # dgrad: dx[M,K] = dy[M,N] W[N,K], contraction over N
        if dyq is None:
            dyq = (quantize_grouped(dy, offs, rule, backend=be) if ctx.grouped
                   else quantize(dy, -1, rule, g, backend=be))
        wq_n = w_dgrad if w_dgrad is not None else _weight_along_n(w, recipe, ctx.expansion, be)
        dx = _product(dyq, wq_n, offs, ctx.x_dtype, be)
        dyq = wq_n = None  # dgrad's operands freed before wgrad's are made (peak memory)
    if need_dw:  # wgrad: dW[e] = dy_e^T x_e, contraction over tokens
        if recipe.wgrad_mxfp8:
            if dyq_t is None:
                dyq_t = quantize(_pad_rows(dy, g), 0, rule, g, backend=be).mT  # [N, M] along tokens
            # the expansion route's torch._grouped_mm writes BF16: dW is that BF16 product (as the bf16
            # recipe's), cast once its operands are freed (peak memory)
            if ctx.expansion or (is_mx(x_saved) and be.gemm_route(True, dyq_t.block, x_saved.block) == "expansion"):
                from mxmoe.kernels import dispatch
                dw = _product(dyq_t, x_saved, offs, torch.bfloat16, be)
                dyq_t = None
                dws = [dispatch.bf16_to(d, ctx.w_dtype, be) for d in _parts(dw, ctx.splits, 1)]
            elif is_mx(dyq_t) and dyq_t.grouped is None:  # one FP32 product per part: dW written in place
                dws = [_product(d, x_saved, offs, torch.float32, be) for d in _parts(dyq_t, ctx.splits, 0)]
            else:
                dws = _parts(_product(dyq_t, x_saved, offs, torch.float32, be), ctx.splits, 1)
        else:
            dws = _parts(grouped_mm(dy.to(x_saved.dtype).t(), x_saved, offs, _validate=False, backend=be),
                         ctx.splits, 1)
        dws = [d.to(ctx.w_dtype) for d in dws]
    return dx, dws


def _parts(t, splits: list[int], dim: int) -> list:
    """``t`` (a tensor or an MXTensor, not quantized along ``dim``) cut along ``dim`` into pieces of
    ``splits`` sizes (views; :class:`_MXGroupedLinear`'s weight parts)."""
    if len(splits) == 1:
        return [t]
    out, a = [], 0
    for n in splits:
        if isinstance(t, MXTensor):
            out.append(MXTensor(t.data.narrow(dim, a, n), t.scale.narrow(dim, a, n), t.axis, t.scale_rule, t.block))
        else:
            out.append(t.narrow(dim, a, n))
        a += n
    return out


def check_high_precision(op: str, **tensors: torch.Tensor) -> None:
    """Raise TypeError unless every tensor is float16, bfloat16, float32 or float64, naming ``op``, the tensor
    and its dtype: integers are no activations, and a bare FP8 tensor (``float8_e4m3fn``, ...) holds no MX
    scales (mxmoe quantizes the high-precision values itself; prequantized operands travel as MXTensors)."""
    for name, t in tensors.items():
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            fp8 = " (an FP8 tensor has no MX scales: pass the values it was cast from)" if t.is_floating_point() else ""
            raise TypeError(f"{op} expects a floating-point input {name} in float16, bfloat16, float32 or float64, "
                            f"got {t.dtype}{fp8}")


def _check_args(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, recipe: Recipe, x_mx: MXTensor | None,
                x_wgrad: MXTensor | None) -> None:
    """:func:`grouped_linear`'s ``validate`` checks (its Raises); synchronizes with the GPU once."""
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(f"grouped_linear expects x [M, K] and w [E, N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    check_high_precision("grouped_linear", x=x, w=w)
    if x.shape[1] != w.shape[2]:
        raise ValueError(f"grouped_linear: x has K={x.shape[1]} but w has K={w.shape[2]}")
    if x.device != w.device:
        raise ValueError(f"grouped_linear: x and w must be on one device, got {x.device} and {w.device}")
    sg = recipe.scale_groups
    if recipe.mxfp8 and (w.shape[1] % sg or w.shape[2] % sg):
        raise ValueError(f"the {recipe.name} recipe needs N and K divisible by {sg} (its MX scale groups), "
                         f"got w of shape {tuple(w.shape)}")
    check_offsets(offs, w.shape[0], x.shape[0])
    g = recipe.act_block
    if recipe.mxfp8 and recipe.wgrad_mxfp8 and bool((offs % g != 0).any()):
        raise ValueError(
            f"under the {recipe.name} recipe wgrad quantizes along tokens in blocks of {g}: every "
            f"expert group must end on a multiple of {g} rows (pad the groups, as mxmoe.MoE does), "
            f"got offs {offs.tolist()}")
    _check_prequantized(x, x_mx, x_wgrad, recipe)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, recipe: "str | Recipe" = "mxfp8",
                   validate: bool = True, x_mx: MXTensor | None = None,
                   x_wgrad: MXTensor | None = None, *, w_mx: "tuple[MXTensor, MXTensor] | None" = None,
                   backend: Backend | None = None) -> torch.Tensor:
    """Expert linear layer ``y[rows of e] = x[rows of e] @ w[e]^T`` with autograd.

    The three GEMMs (docs/DESIGN.md §4): fprop contracts K (x and W quantized along K), dgrad contracts N
    (dy along N, W along N), wgrad contracts tokens (dy and x along tokens); each operand is
    quantized along its GEMM's contraction dim under an MXFP8 recipe.

    Args:
        x: ``[M, K]`` float activations, rows grouped by expert (group ends in ``offs``).
        w: ``[E, N, K]`` float expert weights, or a tuple of parts ``[E, N_i, K]`` (one dtype; each N_i
            a whole number of the recipe's scale groups) taken as their concatenation along N, e.g. the
            gate and up projections as one product. Under MXFP8 recipes each part's gradient is its own
            product's output (no copy of a concatenated gradient; on the expansion route its cast).
        offs: int32 ``[E]`` cumulative end rows; under MXFP8 recipes with MX wgrad every group must
            end on a multiple of 32 rows (wgrad's 32-token blocks must not mix experts). With
            ``validate``, rows past ``offs[-1]`` give zero output and zero gradient; without it they
            are the caller's business (mxmoe.MoE ends the last group at M).
        recipe: name (``"bf16"``, ``"mxfp8"``, ``"mxfp8_2d"``, ``"mxfp8_lowmem"`` (here: ``"mxfp8"`` with
            the weights requantized in backward),
            ``"mxfp8_bf16_wgrad"``, ``"mxfp8_128"`` (1x128 / 128x128 groups: groups end on multiples of 128 rows),
            ``"mxfp8_128_lowmem"`` (here: ``"mxfp8_128"`` with the weights requantized in backward), ``"fp32"``)
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
        w_mx: optional, the weight already quantized for both products, ``(along K, along N)`` as
            :func:`~mxmoe.ops.quantization.quantize_weight_both` returns them for ``w`` (its parts'
            concatenation), where :func:`weight_operands_apply` (square tiles, e.g. ``mxfp8_128``): fprop and
            dgrad use them without quantizing w; ``w`` stays the autograd handle of dW. E.g. the first
            forward's operands kept for an activation checkpoint's recompute. ``validate`` checks their bytes.
        backend: the kernels (:func:`mxmoe.backend.resolve` of ``x.device`` by default); the backward
            uses the forward's.
    Returns:
        ``[M, N]`` in ``x.dtype``.
    Raises:
        ValueError: shape mismatch, x and w on two devices, K or N not divisible by 32 under MXFP8, bad offsets, MX-wgrad
            groups not on 32-row boundaries, ``x_mx`` / ``x_wgrad`` not matching x and the recipe.
        TypeError: x or w not float16 / bfloat16 / float32 / float64 (integer or FP8 tensors), ``x_mx`` /
            ``x_wgrad`` not MXTensors, x not bfloat16 with ``x_wgrad``, ``w_mx`` not a pair of MXTensors.
        ValueError (``w_mx``): a recipe or route that quantizes the weight per product, shapes, tiles or rule not
            the weight's; with ``validate``, bytes not quantize_weight_both's of w.

    Under ``mxfp8_bf16_wgrad`` dW comes from a plain product in ``recipe.compute_dtype``: BF16
    ``torch._grouped_mm`` by default, which writes BF16, so dW is rounded to BF16 as in the ``bf16``
    recipe. First-order gradients only (no double backward).
    """
    recipe = get_recipe(recipe)
    be = backend or resolve(x.device)
    ws = tuple(w) if isinstance(w, (tuple, list)) else (w,)
    if w_mx is not None:  # (an empty ws fails here too, with validate or without)
        check_weight_operands(x, ws, w_mx, recipe, be, values=validate)
    if validate:
        if not ws:
            raise ValueError("grouped_linear: w is an empty tuple of weight parts")
        for part in ws:  # each part a weight of its own (its N a whole number of scale groups)
            _check_args(x, part, offs, recipe, x_mx, x_wgrad)
        if len(ws) > 1 and len({(p.shape[0], p.shape[2], p.dtype) for p in ws}) > 1:
            raise ValueError(f"grouped_linear: the weight parts must share E, K and dtype, got "
                             f"{[(tuple(p.shape), p.dtype) for p in ws]}")
        if x.shape[0] == 0:  # no rows: an empty result that still connects x and w to autograd
            return x.new_zeros(0, sum(p.shape[1] for p in ws)) + (x.sum() + sum(p.sum() for p in ws)).to(x.dtype) * 0
        end = int(offs[-1]) if offs.numel() else 0
        if end < x.shape[0]:  # rows outside every group: zero in, zero out, zero gradient (no garbage)
            keep = (torch.arange(x.shape[0], device=x.device) < end).unsqueeze(1)
            x = torch.where(keep, x, 0)
            return torch.where(keep, grouped_linear(x, w, offs, recipe, validate=False, x_mx=x_mx,
                                                    x_wgrad=x_wgrad, w_mx=w_mx, backend=be), 0)
    if recipe.mxfp8:
        return _MXGroupedLinear.apply(x, offs, recipe, x_mx, x_wgrad, w_mx, be, *ws)
    w = ws[0] if len(ws) == 1 else torch.cat(ws, dim=1)  # (autograd splits the gradient)
    dt = getattr(torch, recipe.compute_dtype)
    if dt == torch.bfloat16 and w.dtype == torch.float32 and layer_ops_for(w, be) is not None:
        w16 = _ToBF16.apply(w, be)  # the same cast, its backward through the layer's cast kernel
    else:
        w16 = w.to(dt)
    y = grouped_mm(x.to(dt), w16.mT, offs, _validate=False, backend=be)
    return y.to(x.dtype)


class _ToBF16(torch.autograd.Function):
    """``w.to(torch.bfloat16)`` of an FP32 CUDA tensor whose backward casts the BF16 gradient to
    FP32 with the layer's cast kernel, not torch's dtype-converting copy (about twice the kernel's time in
    the bf16 layer's step: docs/moe-layer.md). Same values."""

    @staticmethod
    def forward(ctx, w, be: Backend):
        ctx.ops = layer_ops_for(w, be)
        return w.to(torch.bfloat16)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        return (ctx.ops.to_float32(g) if ctx.ops is not None else g.float()), None


class MXOperands(NamedTuple):
    """Both MXFP8 copies of an expert product's input, made upstream by a fused kernel (the permutation
    or the SwiGLU) from one read: ``fprop`` along the features (the fprop operand, ``[M, K]``, axis 1) and
    ``wgrad`` along tokens (``[M, K]``, axis 0). The BF16 input itself is never written: the tensor that
    travels beside them is a zero-stride autograd handle of its shape (its gradient flows back through
    the fused kernel's backward)."""

    fprop: MXTensor
    wgrad: MXTensor


def grad_handle(like: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A ``[rows, cols]`` zero-stride tensor in ``like``'s dtype and device: the autograd handle of an
    operand that exists only as :class:`MXOperands` (one element of storage)."""
    return like.new_zeros(()).expand(rows, cols)


def fused_fp8(x: torch.Tensor, rows: int, cols: int, recipe: Recipe, w_next: torch.Tensor | None,
              be: Backend) -> bool:
    """Whether a fused kernel may hand the product with ``w_next`` its ``[rows, cols]`` operand as
    :class:`MXOperands` (FP8 both ways, 1x128 groups): that product takes the Hopper promote-per-128
    route (``mxfp8_128`` with MX wgrad), x is 2D bfloat16 on CUDA, and both sizes are whole 128-groups."""
    return (w_next is not None and x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and recipe.mxfp8
            and recipe.act_block == 128 and recipe.wgrad_mxfp8 and rows % 128 == 0 and cols % 128 == 0
            and be.kernels and be.recipe_routes(recipe)["fprop"] == "sm90_128")


def fused_qdq(x: torch.Tensor, rows: int, cols: int, recipe: Recipe, w_next: torch.Tensor | None,
               be: Backend) -> bool:
    """Whether a fused kernel may hand the product with ``w_next`` its ``[rows, cols]`` operand
    directly as BF16 MX values plus the FP8 copy along rows (``x_wgrad``): that product runs on the
    Hopper expansion route under an MXFP8 recipe with MX wgrad, x is 2D bfloat16, and both sizes
    are multiples of 32."""
    return (w_next is not None and x.dtype == torch.bfloat16 and x.dim() == 2 and recipe.mxfp8
            and recipe.wgrad_mxfp8 and rows % BLOCK == 0 and cols % BLOCK == 0
            and _expansion(x, w_next, recipe, be) is not None)


def prequantized_operands(x_mx: "MXTensor | MXOperands | None") -> dict:
    """grouped_linear's ``x_mx`` / ``x_wgrad`` for an operand's upstream MXFP8 copies: an MXTensor along
    the features (axis 1, e.g. tokens received in MXFP8) is fprop's, one along rows (axis 0, beside the
    BF16 MX values) wgrad's, and :class:`~mxmoe.ops.linear.MXOperands` give both."""
    if isinstance(x_mx, MXOperands):
        return {"x_mx": x_mx.fprop, "x_wgrad": x_mx.wgrad}
    if x_mx is not None and x_mx.axis == 0:
        return {"x_mx": None, "x_wgrad": x_mx}
    return {"x_mx": x_mx, "x_wgrad": None}
