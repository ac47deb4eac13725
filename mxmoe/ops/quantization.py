"""Quantization front end: MXFP8 copies of activations and expert weights on the kernels the
backend names (bit-identical to :mod:`mxmoe.formats`, the pure-torch twin, which runs elsewhere)."""

from __future__ import annotations

import torch

from mxmoe import formats
from mxmoe.backend import Backend, resolve
from mxmoe.formats import BLOCK, MXTensor
from mxmoe.recipes import Recipe


def quantize(x: torch.Tensor, axis: int = -1, scale_rule: str = "rceil", block=BLOCK, *,
             backend: Backend | None = None) -> MXTensor:
    """Quantize ``x`` to MXFP8 along ``axis``; same contract as :func:`mxmoe.formats.quantize`.

    On CUDA the Triton kernels of :mod:`mxmoe.kernels.quantize` are used where they cover the
    case (bit-identical to the reference); everywhere else the pure-torch reference runs.

    Args:
        x: float16/bfloat16/float32/float64 tensor with ``x.shape[axis] % 32 == 0``.
        axis: quantized (contraction) axis.
        scale_rule: ``"rceil"`` (default) or ``"floor"``.
        block: the scale group, one of :data:`mxmoe.formats.BLOCKS`: ``32`` (1x32), ``128`` (1x128),
            ``(32, 32)`` or ``(128, 128)`` (one scale per square tile of the last two dims).
        backend: the kernels to use (:func:`mxmoe.backend.resolve` of ``x.device`` by default).
    Returns:
        :class:`~mxmoe.formats.MXTensor` (E4M3 data, row-major E8M0 scales).
    Raises:
        TypeError, ValueError: as :func:`mxmoe.formats.quantize`.
    """
    if isinstance(x, torch.Tensor) and x.is_cuda:
        from mxmoe.kernels import dispatch

        out = dispatch.quantize_cuda(x, axis, scale_rule, block, backend or resolve(x.device))
        if out is not None:
            return out
    return formats.quantize(x, axis, scale_rule, block)


def quantize_grouped(x: torch.Tensor, offs: torch.Tensor, scale_rule: str = "rceil", *,
                     backend: Backend | None = None) -> MXTensor:
    """``x [M, K]`` (rows grouped by expert) quantized along K in 1x32 blocks, for an M-grouped product.

    Where the grouped kernel runs (:func:`mxmoe.kernels.dispatch.quantize_grouped_cuda`: the backend's
    kernels on, so CUDA, or CPU tensors under Triton's interpreter in tests) the result also carries its
    scales in the per-group blocked layout (:class:`~mxmoe.formats.GroupedScale`), which the sm_100
    product takes as they are; elsewhere it is ``formats.quantize(x, -1, scale_rule)``. Data and
    row-major scales are that either way, bit for bit. :func:`~mxmoe.ops.linear.grouped_linear` calls
    it where :meth:`~mxmoe.backend.Backend.grouped_scales` says so.

    Args:
        x: ``[M, K]`` float tensor, ``K % 32 == 0``.
        offs: int32 ``[E]`` cumulative end rows of the groups (non-decreasing, ``offs[-1] <= M``), on x's device.
        scale_rule: ``"rceil"`` (default) or ``"floor"``.
        backend: the kernels to use (:func:`mxmoe.backend.resolve` of ``x.device`` by default).
    Raises:
        TypeError, ValueError: as :func:`mxmoe.formats.quantize`; ValueError for bad ``offs`` on the kernel.
    """
    be = backend or resolve(x.device)
    if isinstance(x, torch.Tensor) and isinstance(offs, torch.Tensor):
        from mxmoe.kernels import dispatch

        out = dispatch.quantize_grouped_cuda(x, offs, scale_rule, be)
        if out is not None:
            return out
    return quantize(x, -1, scale_rule, BLOCK, backend=be)


def weight_block(recipe: Recipe) -> tuple[int, int]:
    """The scale group of a recipe's expert weights: ``(1, 32)``, ``(32, 32)`` or ``(128, 128)``
    (:attr:`~mxmoe.recipes.Recipe.weight_group`)."""
    return recipe.weight_group


def quantize_weight(w: torch.Tensor, recipe: Recipe, axis: int, be: Backend | None = None, *,
                    blocked: bool = False) -> MXTensor:
    """Expert weights quantized along ``axis`` in the recipe's scale groups (:func:`weight_block`).

    Args:
        w: ``[E, N, K]`` float16/bfloat16/float32/float64 weights, the quantized dim a multiple of the group.
        recipe: an MXFP8 :class:`~mxmoe.recipes.Recipe` (its ``scale_rule`` and ``weight_block``).
        axis: -1 (K, fprop's operand) or -2 (N, dgrad's).
        be: the kernels (:func:`mxmoe.backend.resolve` of ``w.device`` by default).
        blocked: where :meth:`~mxmoe.backend.Backend.blocked_weight_scales` says so (1x32 weights): where the
            kernel runs (:func:`mxmoe.kernels.dispatch.quantize_weight_blocked_cuda`: the backend's kernels,
            so CUDA, or CPU tensors under Triton's interpreter in tests) the result also carries each
            expert's scales in the blocked layout the sm_100 product reads (:attr:`~mxmoe.formats.MXTensor.grouped`
            per expert, ``float8_e8m0fnu`` ``[E, blocked_numel(r, c)]`` of the ``[r, c]`` scale matrix with
            the quantized axis last), written in the same pass. Data and row-major scales are the same bit
            for bit either way.
    Returns:
        :class:`~mxmoe.formats.MXTensor` ``[E, N, K]`` (E4M3 data, E8M0 scales).
    Raises:
        TypeError, ValueError: as :func:`mxmoe.formats.quantize`.
    """
    be = be or resolve(w.device)
    if blocked and isinstance(w, torch.Tensor) and weight_block(recipe) == (1, BLOCK):
        from mxmoe.kernels import dispatch

        out = dispatch.quantize_weight_blocked_cuda(w, axis, recipe.scale_rule, be)
        if out is not None:
            return out
    return quantize(w, axis, recipe.scale_rule, weight_block(recipe), backend=be)


def quantize_dual(x: torch.Tensor, scale_rule: str = "rceil", group: int = BLOCK,
                  be: Backend | None = None) -> tuple[MXTensor, MXTensor]:
    """``x [M, K]`` quantized along K and along M in 1 x ``group`` blocks (``M % group == 0``): one read
    on CUDA."""
    if x.is_cuda:
        from mxmoe.kernels import dispatch

        out = dispatch.quantize_dual_cuda(x, scale_rule, group, be or resolve(x.device))
        if out is not None:
            return out
    return quantize(x, -1, scale_rule, group, backend=be), quantize(x, 0, scale_rule, group, backend=be)


def quantize_weight_both(w: "torch.Tensor | tuple[torch.Tensor, ...]", recipe: Recipe,
                         be: Backend | None = None) -> tuple[MXTensor, MXTensor]:
    """Square-tile weights ``[E, N, K]`` (32x32 or 128x128) along K (fprop) and along N (dgrad): one
    quantization. ``w`` may be a tuple of parts ``[E, N_i, K]`` along N: the weight is their concatenation,
    which the 128x128 CUDA kernel never writes (elsewhere it is concatenated first)."""
    first = w[0] if isinstance(w, tuple) else w
    if first.is_cuda:
        from mxmoe.kernels import dispatch

        out = dispatch.quantize_weight_both_cuda(w, recipe.scale_rule, recipe.weight_block,
                                                 be or resolve(first.device))
        if out is not None:
            return out
    if isinstance(w, tuple):
        w = w[0] if len(w) == 1 else torch.cat(w, dim=-2)
    wq = quantize_weight(w, recipe, -1, be)
    return wq, wq.requantize_free_swap()
