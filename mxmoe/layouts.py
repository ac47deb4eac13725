"""Scale layouts: row-major ``[rows, K/32]`` and the 128x4 "blocked" layout the block-scaled
tensor cores read.

The blocked layout is the one cuBLAS documents for block-scaled GEMMs ("1D Block Scaling Factors
Layout", cuBLAS docs, section on ``CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0``) and that tcgen05
(sm_100) and ``torch._scaled_mm`` / ``torch._scaled_grouped_mm`` with MXFP8 consume:

* the scale matrix ``[rows, cols]`` is padded with zeros to ``[ceil(rows/128)*128, ceil(cols/4)*4]``;
* it is cut into 128x4 tiles, stored tile after tile in row-major tile order
  (tile ``(rb, cb)`` starts at ``(rb * ceil(cols/4) + cb) * 512``);
* inside a tile, entry ``(r, c)`` with ``r = 32*i + j`` (``i < 4``, ``j < 32``) sits at
  ``16*j + 4*i + c``: the four 32-row chunks are interleaved, so 32 lines of 16 bytes.

For grouped (per-expert) activations each group's rows start on a 128-row boundary of the
blocked scale tensor: group ``g`` occupies ``ceil(n_g/128)*128`` padded rows.

Group padding (:func:`padded_groups`, :func:`padded_rows`) is the one planner of grouped buffers: the MoE
layer's expert-ordered buffer (``moe.permute_plan``, groups padded to ``recipe.align``), the expert-parallel
local buffer (``parallel.ExpertParallelMoE.dispatch_plan``) and the grouped blocked scales (128 rows).
"""

from __future__ import annotations

import math

import torch

ROW_TILE = 128
COL_TILE = 4


def round_up(a: int, b: int) -> int:
    """``a`` rounded up to a multiple of ``b`` (positive ints)."""
    return -(-a // b) * b


def padded_groups(counts: torch.Tensor, align: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups of ``counts[g]`` rows laid out one after the other, each padded to a multiple of ``align`` rows.

    Args:
        counts: ``[E]`` integer tensor (int64 in the layers), rows of each group, any device.
        align: positive int, the row multiple every group starts on.
    Returns:
        ``(starts, ends)``, both ``[E]`` of ``counts``' dtype and device: ``starts[g]`` the first padded row
        of group g, ``ends[g] = starts[g] + ceil(counts[g] / align) * align`` (cumulative: ``ends[-1]`` is the
        padded total). Device ops only, no host synchronization.
    """
    padded = (counts + align - 1) // align * align
    ends = torch.cumsum(padded, 0)
    return ends - padded, ends


def padded_rows(num_rows: int, num_groups: int, align: int) -> int:
    """Static bound on ``padded_groups(counts, align)``'s total for any ``num_groups`` counts summing to
    ``num_rows``: ``ceil((num_rows + num_groups * (align - 1)) / align) * align`` (host ints, no sync)."""
    return math.ceil((num_rows + num_groups * (align - 1)) / align) * align


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


def blocked_numel(rows: int, cols: int) -> int:
    """Number of entries of the blocked layout of a ``[rows, cols]`` scale matrix."""
    return round_up(rows, ROW_TILE) * round_up(cols, COL_TILE)


def _check_scale(scale, fn: str) -> None:
    if not isinstance(scale, torch.Tensor) or scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise TypeError(f"{fn} expects a float8_e8m0fnu (or uint8) scale tensor, got "
                        f"{getattr(scale, 'dtype', type(scale).__name__)}")
    if scale.dim() != 2:
        raise ValueError(f"{fn} expects a 2D scale matrix, got shape {tuple(scale.shape)}")


def to_blocked(scale: torch.Tensor) -> torch.Tensor:
    """Row-major ``[rows, cols]`` scales -> flat 128x4 blocked layout (cuBLAS block-scaling layout).

    Args:
        scale: 2D ``torch.float8_e8m0fnu`` (or uint8) tensor ``[rows, cols]``.
    Returns:
        1D tensor of the same dtype with ``ceil(rows/128)*128 * ceil(cols/4)*4`` entries; padding
        entries are zero.
    Raises:
        TypeError: not an E8M0/uint8 tensor. ValueError: not 2D.
    """
    _check_scale(scale, "to_blocked")
    rows, cols = scale.shape
    R, C = round_up(rows, ROW_TILE), round_up(cols, COL_TILE)
    b = scale.view(torch.uint8)
    padded = torch.zeros(R, C, dtype=torch.uint8, device=scale.device)
    padded[:rows, :cols] = b
    # [R/128, 128, C/4, 4] -> tiles [R/128, C/4, 4(i), 32(j), 4(c)] -> [.., 32(j), 4(i), 4(c)]
    t = padded.view(R // ROW_TILE, 4, 32, C // COL_TILE, COL_TILE).permute(0, 3, 2, 1, 4)
    return t.reshape(-1).view(scale.dtype)


def from_blocked(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`to_blocked`: flat blocked scales -> row-major ``[rows, cols]``.

    Raises:
        ValueError: ``blocked`` does not have ``blocked_numel(rows, cols)`` entries.
    """
    R, C = round_up(rows, ROW_TILE), round_up(cols, COL_TILE)
    if blocked.numel() != R * C:
        raise ValueError(f"blocked scale has {blocked.numel()} entries, expected {R * C} for [{rows}, {cols}]")
    t = blocked.reshape(-1).view(torch.uint8).view(R // ROW_TILE, C // COL_TILE, 32, 4, COL_TILE)
    full = t.permute(0, 3, 2, 1, 4).reshape(R, C)
    return full[:rows, :cols].contiguous().view(blocked.dtype)


def group_sizes_from_offsets(offs: torch.Tensor) -> torch.Tensor:
    """Group sizes from int32 cumulative end offsets (``offs[g]`` = end row of group ``g``)."""
    return torch.diff(offs.to(torch.int64), prepend=offs.new_zeros(1, dtype=torch.int64))


def blocked_group_offsets(offs: torch.Tensor) -> torch.Tensor:
    """Cumulative end offsets, in padded rows, of each group in the grouped blocked layout.

    Args:
        offs: int32 ``[E]`` cumulative end offsets of the groups' rows.
    Returns:
        int32 ``[E]``: ``cumsum(ceil(n_g / 128) * 128)``.
    """
    return padded_groups(group_sizes_from_offsets(offs), ROW_TILE)[1].to(torch.int32)


def to_blocked_grouped(scale: torch.Tensor, offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert-group blocked layout of activation scales.

    Args:
        scale: ``[M, cols]`` row-major scales of grouped rows (``float8_e8m0fnu``).
        offs: int32 ``[E]`` cumulative end offsets of the row groups (``offs[-1] <= M``).
    Returns:
        ``(blocked, blocked_offs)``: the flat blocked scales, group after group, each group
        starting on a 128-row boundary (``blocked_offs[-1] * ceil(cols/4)*4`` entries), and the
        padded-row end offsets from :func:`blocked_group_offsets`.
    Raises:
        TypeError / ValueError: bad scale tensor, or offsets not int32, not non-decreasing, or past ``M``.
    """
    _check_scale(scale, "to_blocked_grouped")
    check_offsets(offs, None, scale.shape[0], "rows")
    ends = offs.tolist()
    parts, start = [], 0
    for end in ends:
        if end > start:
            parts.append(to_blocked(scale[start:end]))
        start = end
    out = torch.cat(parts) if parts else scale.new_zeros(0)
    return out, blocked_group_offsets(offs)
