"""Blackwell (sm_100) path: PyTorch's block-scaled grouped product, fed our MX tensors.

On sm_100 the tensor cores apply 1x32 E8M0 scales natively (tcgen05.mma block-scaled), so
``torch._scaled_grouped_mm`` (cuBLAS/CUTLASS) with MXFP8 operands and scales in the 128x4
blocked layout (:mod:`mxmoe.layouts`, cuBLAS "1D Block Scaling Factors Layout") is the fast path.

UNTESTED ON HARDWARE: we have no sm_100 GPU. The arguments built here follow the contract of
PyTorch's own MXFP8 grouped tests (2D x 3D: activation scales blocked per group, each group
starting on a 128-row boundary; weight scales blocked per expert and stacked) and are checked on
CPU in ``tests/test_sm100_args.py``.
"""

from __future__ import annotations

import torch

from mxmoe.formats import MXTensor
from mxmoe.layouts import COL_TILE, round_up, to_blocked, to_blocked_grouped


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


def sm100_scaled_grouped_mm_args(a: MXTensor, b: MXTensor, offs: torch.Tensor, out_dtype: torch.dtype) -> dict:
    """Keyword arguments of ``torch._scaled_grouped_mm`` for our grouped forms.

    2D x 3D: ``a [M, K]`` (along K), ``b [E, K, N]`` (along K) -> ``mat_a [M, K]`` row-major,
    ``mat_b [E, K, N]`` with K contiguous, ``scale_a`` = per-group blocked scales reshaped to
    ``[rows, ceil(K/32/4)*4]``, ``scale_b`` = ``[E, blocked_numel(N, K/32)]``.
    2D x 2D: ``a [N, T]`` (along T), ``b [T, K]`` (along T), token groups multiples of 32 ->
    ``mat_a [N, T]`` row-major, ``mat_b [T, K]`` column-major, scales blocked per token group.
    """
    if b.dim() == 3:
        mat_a = a.data.contiguous()
        mat_b = b.data.mT.contiguous().mT  # [E, K, N] with K contiguous
        sa, _ = to_blocked_grouped(a.scale.contiguous(), offs)
        scale_a = sa.view(-1, round_up(a.scale.shape[1], COL_TILE))
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
