"""Blackwell (sm_100) path: PyTorch's block-scaled grouped product, fed our MX tensors.

On sm_100 the tensor cores apply 1x32 E8M0 scales natively (tcgen05.mma block-scaled), so
``torch._scaled_grouped_mm`` (cuBLAS/CUTLASS) with MXFP8 operands and scales in the 128x4
blocked layout (:mod:`mxmoe.layouts`, cuBLAS "1D Block Scaling Factors Layout") is the fast path.

UNTESTED ON HARDWARE: we have no sm_100 GPU. The arguments built here follow the contract of
PyTorch's own MXFP8 grouped tests (2D x 3D: activation scales blocked per group, each group
starting on a 128-row boundary; weight scales blocked per expert and stacked) and are checked on
CPU in ``tests/test_sm100_args.py``.

Activation scales arrive already blocked per group where the grouped quantization kernel made them
(:attr:`mxmoe.formats.MXTensor.grouped`, chosen by :meth:`mxmoe.backend.Backend.grouped_scales`), and 1x32
weight scales blocked per expert where the weight quantization wrote its blocked copy (the same attribute,
chosen by :meth:`mxmoe.backend.Backend.blocked_weight_scales`); only without them are the row-major scales
re-laid here (:func:`mxmoe.layouts.to_blocked_grouped`, :func:`mxmoe.layouts.to_blocked` per expert).
wgrad's 2D x 2D operands (along tokens, blocked per token group) are always re-laid here.
"""

from __future__ import annotations

import torch

from mxmoe.formats import MXTensor
from mxmoe.layouts import COL_TILE, blocked_numel, round_up, to_blocked, to_blocked_grouped


def _groups_along_cols(scale: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Blocked layout of ``scale [R, T/32]`` cut into column groups (token groups of 32-multiples)."""
    if any(e % 32 for e in offs.tolist()):
        raise ValueError(f"K-grouped MX products need token groups ending on multiples of 32, got {offs.tolist()}")
    ends = [e // 32 for e in offs.tolist()]
    parts, start = [], 0
    for end in ends:
        if end > start:
            parts.append(to_blocked(scale[:, start:end]))
        start = end
    return torch.cat(parts) if parts else scale.new_zeros(0)


def _grouped_scale(a: MXTensor, offs: torch.Tensor) -> torch.Tensor:
    """``a``'s carried per-group blocked scales, flat, after checking they were laid out for ``offs`` and
    ``a``'s shape (ValueError otherwise); no host sync when ``offs`` is the tensor they were made for."""
    gs = a.grouped
    if a.dim() != 2 or a.axis != 1 or gs.offs is None:
        raise ValueError(f"per-group blocked scales belong to a 2D tensor quantized along its last dim, got {a!r} "
                         f"carrying {'per-expert' if gs.offs is None else 'per-group'} blocked scales")
    if gs.offs is not offs and (gs.offs.shape != offs.shape or gs.offs.device != offs.device
                                or not torch.equal(gs.offs, offs)):
        raise ValueError(f"the MXTensor's blocked scales were laid out for groups ending at {gs.offs.tolist()}, "
                         f"not the product's {offs.tolist()}")
    rows = gs.rows
    want = rows * round_up(a.shape[1] // 32, COL_TILE)
    if gs.scale.dim() != 1 or gs.scale.numel() != want or gs.blocked_offs.shape != offs.shape:
        raise ValueError(f"the MXTensor's blocked scales ({tuple(gs.scale.shape)}, blocked_offs "
                         f"{tuple(gs.blocked_offs.shape)}) do not fit a {tuple(a.shape)} operand in {offs.numel()} "
                         f"groups padded to {rows} rows ({want} entries)")
    return gs.scale


def _expert_scale(b: MXTensor) -> torch.Tensor:
    """``b [E, K, N]``'s carried per-expert blocked scales ``[E, blocked_numel(N, K/32)]``, after checking
    their form and shape against ``b`` (ValueError otherwise)."""
    gs = b.grouped
    if b.dim() != 3 or b.axis != 1 or gs.offs is not None:
        raise ValueError(f"per-expert blocked scales belong to a 3D operand [E, K, N] quantized along K, got {b!r} "
                         f"carrying {'per-expert' if gs.offs is None else 'per-group'} blocked scales")
    E, K, N = b.shape
    want = (E, blocked_numel(N, K // 32))
    if tuple(gs.scale.shape) != want or gs.scale.dtype != b.scale.dtype:
        raise ValueError(f"the MXTensor's per-expert blocked scales ({tuple(gs.scale.shape)}, {gs.scale.dtype}) do "
                         f"not fit a {tuple(b.shape)} operand quantized along K ({want}, {b.scale.dtype})")
    return gs.scale


def sm100_scaled_grouped_mm_args(a: MXTensor, b: MXTensor, offs: torch.Tensor, out_dtype: torch.dtype) -> dict:
    """Keyword arguments of ``torch._scaled_grouped_mm`` for our grouped forms.

    Args:
        a, b: MXTensors quantized along the contraction dim (``float8_e4m3fn`` data, ``float8_e8m0fnu`` scales).
        offs: int32 ``[E]`` cumulative group ends (rows of ``a`` for 2D x 3D, tokens for 2D x 2D).
        out_dtype: the product's dtype.
    Returns:
        ``dict(mat_a, mat_b, scale_a, scale_b, offs, out_dtype)``.

    2D x 3D: ``a [M, K]`` (along K), ``b [E, K, N]`` (along K) -> ``mat_a [M, K]`` row-major,
    ``mat_b [E, K, N]`` with K contiguous, ``scale_a`` = per-group blocked scales
    (:func:`mxmoe.layouts.to_blocked_grouped` of ``a.scale``) reshaped to ``[rows, ceil(K/32/4)*4]``:
    ``a.grouped`` as it is where ``a`` carries it, else re-laid from ``a.scale``;
    ``scale_b`` = ``[E, blocked_numel(N, K/32)]``, each expert's ``to_blocked(b.scale[e].mT)``: ``b.grouped``
    (per expert) as it is where ``b`` carries it, else re-laid from ``b.scale``.
    2D x 2D: ``a [N, T]`` (along T), ``b [T, K]`` (along T), token groups multiples of 32 ->
    ``mat_a [N, T]`` row-major, ``mat_b [T, K]`` column-major, scales blocked per token group.

    Raises:
        ValueError: 2D x 2D token groups not ending on multiples of 32; ``a.grouped`` laid out for other
            offsets or not fitting ``a``'s shape; ``b.grouped`` not per expert or not fitting ``b``'s shape.
    """
    if b.dim() == 3:
        mat_a = a.data.contiguous()
        mat_b = b.data.mT.contiguous().mT  # [E, K, N] with K contiguous
        if a.grouped is not None:
            sa = _grouped_scale(a, offs)
        else:
            sa, _ = to_blocked_grouped(a.scale.contiguous(), offs)
        scale_a = sa.view(-1, round_up(a.scale.shape[1], COL_TILE))
        if b.grouped is not None:
            scale_b = _expert_scale(b)
        else:
            scale_b = torch.stack([to_blocked(b.scale[e].mT.contiguous()) for e in range(b.shape[0])])
    else:
        mat_a = a.data.contiguous()
        mat_b = b.data.mT.contiguous().mT  # [T, K] column-major
        scale_a = _groups_along_cols(a.scale.contiguous(), offs)
        scale_b = _groups_along_cols(b.scale.mT.contiguous(), offs)
    return dict(mat_a=mat_a, mat_b=mat_b, scale_a=scale_a, scale_b=scale_b, offs=offs, out_dtype=out_dtype)


def sm100_mxfp8_grouped_mm(a: MXTensor, b: MXTensor, offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """MX grouped product on sm_100 through ``torch._scaled_grouped_mm`` (untested on hardware)."""
    kw = sm100_scaled_grouped_mm_args(a, b, offs, out_dtype)
    return torch._scaled_grouped_mm(kw.pop("mat_a"), kw.pop("mat_b"), kw.pop("scale_a"), kw.pop("scale_b"), **kw)
