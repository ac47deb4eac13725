"""The FP32 scale layouts the Hopper grouped GEMMs read, made from E8M0 scales on the device.

Hopper's FP8 tensor cores take no scales, so :mod:`mxmoe.kernels.sm90_gemm_kernel` applies them
on the CUDA cores and reads them as FP32 values ``2^(b-127)`` (byte 0xFF -> NaN, 0x00 -> the subnormal
2^-127), transposed so that one K step's scales for a tile's rows are contiguous (one TMA box):

* :func:`sm90_scale_layout`: ``[..., R, C]`` -> ``[..., C, R_pad]`` (``R_pad`` = R rounded up to 4: TMA
  needs 16-byte row strides; pad columns 0). Weights (M-grouped) and both wgrad operands.
* :func:`sm90_m_grouped_scales`: the activations of an M-grouped product, ``[M, C]`` -> ``[C, W]`` with
  each expert's rows starting at a multiple of 4 columns (a TMA box must start 16-byte aligned), and the
  kernel's schedule ``[2, E]`` (cumulative tile counts; each group's first column).
* :func:`sm90_k_grouped_schedule`: the K-grouped (wgrad) kernel's schedule ``[E + 1]``: the experts by row
  count, most first, and the tile counter its CTAs draw tiles from.

Each is one Triton launch on CUDA (the layer calls them for every product, so the count of launches is
host time on the step's critical path: the torch compositions they replace were ~20 small kernels per
product); :func:`sm90_scale_layout_reference` and :func:`sm90_grouped_scale_layout` are the pure-torch
definitions, on any device, that tests hold the kernels to byte for byte. No function here syncs the host.
"""

from __future__ import annotations

import torch

from mxmoe.backend import interpreting
from mxmoe.formats import e8m0_to_float
from mxmoe.layouts import padded_groups, padded_rows

try:  # Triton is optional: `import mxmoe` must work without it.
    import triton
    import triton.language as tl
    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the installed triton
    HAS_TRITON = False

__all__ = ["sm90_scale_layout", "sm90_scale_layout_reference", "sm90_grouped_scale_layout", "sm90_m_grouped_scales",
           "sm90_k_grouped_schedule", "sm90_k_grouped_schedule_reference"]

ALIGN = 4  # columns: a group's first scale starts 16 bytes into an FP32 row
MAX_GROUPS_ONE_BLOCK = 1024  # sm90_m_grouped_scales keeps every group's offset in registers up to here


# ----------------------------------------------------------------------------------------------
# Pure-torch definitions
# ----------------------------------------------------------------------------------------------

def sm90_scale_layout_reference(scale: torch.Tensor, col_pad: int = ALIGN) -> torch.Tensor:
    """Pure-torch :func:`sm90_scale_layout` (same arguments, same bytes)."""
    vals = e8m0_to_float(scale).transpose(-2, -1)  # [..., C, R]
    r = vals.shape[-1]
    r_pad = -(-r // col_pad) * col_pad
    out = torch.zeros(*vals.shape[:-1], r_pad, dtype=torch.float32, device=scale.device)
    out[..., :r] = vals
    return out


def sm90_grouped_scale_layout(scale: torch.Tensor, offs: torch.Tensor, align: int = ALIGN):
    """Pure-torch definition of the M-grouped activation layout (:func:`sm90_m_grouped_scales`'s values).

    Args:
        scale: ``[M, C]`` E8M0, rows grouped by ``offs``.
        offs: ``[E]`` int32 cumulative group end offsets.
    Returns:
        ``(values, starts)``: ``values[k, starts[e] + i]`` is the scale of row ``offs[e-1] + i``,
        block ``k`` (FP32 ``2^(b-127)``); other columns are 0; width ``W = round_up(M + 3E, 4)``, known
        without a sync. ``starts``: ``[E]`` int32.
    """
    M, kb = scale.shape
    E = offs.shape[0]
    offs64 = offs.to(torch.int64)
    counts = torch.diff(offs64, prepend=offs64.new_zeros(1))
    starts, ends = padded_groups(counts, align)
    width = padded_rows(M, E, align)  # >= ends[-1], known without a sync
    # Gather (deterministic): column c belongs to group g with starts[g] <= c < ends[g].
    cols = torch.arange(width, device=scale.device)
    g = torch.searchsorted(ends, cols, right=True)
    gc = g.clamp(max=E - 1)
    i = cols - starts[gc]
    valid = (g < E) & (i < counts[gc])
    src = (offs64[gc] - counts[gc] + i).clamp(0, max(M - 1, 0))
    vals = e8m0_to_float(scale).T  # [K/32, M]
    out = torch.where(valid, vals.index_select(1, src), torch.zeros((), device=scale.device))
    return out, starts.to(torch.int32)


def _schedule_reference(offs: torch.Tensor, starts: torch.Tensor, block_m: int, n_tiles: int) -> torch.Tensor:
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    tile_end = torch.cumsum((counts + block_m - 1) // block_m * n_tiles, 0, dtype=torch.int32)
    return torch.stack([tile_end, starts])


def sm90_k_grouped_schedule_reference(offs: torch.Tensor) -> torch.Tensor:
    """Pure-torch :func:`sm90_k_grouped_schedule` (same values)."""
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    order = torch.sort(counts.long() * -1, stable=True).indices  # most rows first; ties by expert id
    return torch.cat([order.to(torch.int32), offs.new_zeros(1)])


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _e8m0_value(b):
        """E8M0 byte (int32) -> FP32 2^(b-127) (formats.e8m0_to_float's bits): 0 -> 2^-127 (the subnormal
        0x00400000), 255 -> NaN (0x7FC00000)."""
        bits = b << 23
        bits = tl.where(b == 0, 0x00400000, bits)
        bits = tl.where(b == 255, 0x7FC00000, bits)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _transpose_kernel(src, dst, R, C, R_pad, s_b, s_r, s_c,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """dst[b, c, r] = value(src[b, r, c]) for r < R, 0 for R <= r < R_pad."""
        pb = tl.program_id(2).to(tl.int64)
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        inside = (r[:, None] < R) & (c[None, :] < C)
        b = tl.load(src + pb * s_b + r[:, None].to(tl.int64) * s_r + c[None, :] * s_c, mask=inside, other=0)
        v = tl.where(inside, _e8m0_value(b.to(tl.int32)), 0.0)
        out = dst + pb * C * R_pad + c[None, :].to(tl.int64) * R_pad + r[:, None]
        tl.store(out, v, mask=(r[:, None] < R_pad) & (c[None, :] < C))

    @triton.jit
    def _m_grouped_kernel(src, offs_ptr, dst, sched_ptr, M, C, W, E, s_r, s_c, BLOCK_M, N_TILES,
                          BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, EP2: tl.constexpr):
        """dst[k, col] for a block of BLOCK_K x BLOCK_W; program (0, 0) also writes sched."""
        e = tl.arange(0, EP2)
        in_e = e < E
        ends = tl.load(offs_ptr + e, mask=in_e, other=0)
        prev = tl.load(offs_ptr + e - 1, mask=in_e & (e > 0), other=0)
        counts = tl.where(in_e, ends - prev, 0)
        padded = (counts + 3) // 4 * 4
        starts_incl = tl.cumsum(padded, 0)
        cols = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)
        # Group of each column: the number of groups whose padded range ends at or before it (one
        # [BLOCK_W, EP2] reduction; its start column, first row and count are then gathered by it).
        before = (starts_incl[None, :] <= cols[:, None]) & in_e[None, :]
        g = tl.sum(before.to(tl.int32), 1)
        gi = tl.minimum(g, EP2 - 1)  # g == E (columns past every group) is masked off below
        g_start_col = tl.gather(starts_incl - padded, gi, 0)
        g_first_row = tl.gather(prev, gi, 0)
        g_count = tl.gather(counts, gi, 0)
        i = cols - g_start_col
        valid = (g < E) & (i < g_count) & (cols < W)
        k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        row = (g_first_row + i).to(tl.int64)
        take = valid[None, :] & (k[:, None] < C)
        b = tl.load(src + row[None, :] * s_r + k[:, None].to(tl.int64) * s_c, mask=take, other=0)
        v = tl.where(take, _e8m0_value(b.to(tl.int32)), 0.0)
        tl.store(dst + k[:, None].to(tl.int64) * W + cols[None, :], v, mask=(k[:, None] < C) & (cols[None, :] < W))
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tiles = tl.cumsum((counts + BLOCK_M - 1) // BLOCK_M * N_TILES, 0)
            tl.store(sched_ptr + e, tiles, mask=in_e)
            tl.store(sched_ptr + E + e, starts_incl - padded, mask=in_e)


    @triton.jit
    def _k_grouped_schedule_kernel(offs_ptr, sched_ptr, E, EP2: tl.constexpr):
        """sched[:E] = the experts sorted by row count, most first (ties: lower id first); sched[E] = 0."""
        e = tl.arange(0, EP2)
        in_e = e < E
        ends = tl.load(offs_ptr + e, mask=in_e, other=0)
        prev = tl.load(offs_ptr + e - 1, mask=in_e & (e > 0), other=0)
        rows = tl.where(in_e, ends - prev, -1).to(tl.int64)  # the pad lanes sort last
        key = tl.sort(rows * EP2 + (EP2 - 1 - e), descending=True)
        tl.store(sched_ptr + e, (EP2 - 1 - (key & (EP2 - 1))).to(tl.int32), mask=in_e)
        tl.store(sched_ptr + E, 0)


def _fast(t: torch.Tensor) -> bool:
    """The Triton kernels serve CUDA tensors (and CPU ones under Triton's interpreter, for tests)."""
    return HAS_TRITON and (t.is_cuda or interpreting())


def sm90_scale_layout(scale: torch.Tensor, col_pad: int = ALIGN) -> torch.Tensor:
    """E8M0 scales ``[..., R, C]`` (any strides) -> FP32 ``2^(b-127)`` values, transposed ``[..., C, R_pad]``.

    ``R_pad`` is ``R`` rounded up to ``col_pad`` (TMA needs 16-byte row strides); pad columns are
    0. Byte 0xFF becomes NaN, byte 0x00 the subnormal 2^-127. The values are exact powers of two,
    so the kernel's scale product ``sa * sb`` is exact unless it leaves FP32's range (below
    2^-149 it flushes to 0, as a block that small cannot move an FP32 sum of normal blocks).
    One Triton launch on CUDA (strided views such as ``s[:, ::4]`` read in place); the pure-torch
    :func:`sm90_scale_layout_reference` elsewhere.

    Raises:
        TypeError: ``scale`` not ``float8_e8m0fnu``. ValueError: fewer than 2 dims.
    """
    if scale.dtype != torch.float8_e8m0fnu:
        raise TypeError(f"scale must be torch.float8_e8m0fnu, got {scale.dtype}")
    if scale.dim() < 2:
        raise ValueError(f"scale must have at least 2 dims, got shape {tuple(scale.shape)}")
    if not _fast(scale) or scale.numel() == 0:
        return sm90_scale_layout_reference(scale, col_pad)
    lead = scale.shape[:-2]
    R, C = scale.shape[-2:]
    s3 = scale.view(torch.uint8).reshape(-1, R, C)  # a view for the layouts the GEMMs pass
    r_pad = -(-R // col_pad) * col_pad
    out = torch.empty(s3.shape[0], C, r_pad, dtype=torch.float32, device=scale.device)
    BR, BC = 64, 32
    grid = (triton.cdiv(r_pad, BR), triton.cdiv(C, BC), s3.shape[0])
    _transpose_kernel[grid](s3, out, R, C, r_pad, s3.stride(0), s3.stride(1), s3.stride(2), BLOCK_R=BR, BLOCK_C=BC)
    return out.view(*lead, C, r_pad)


def sm90_m_grouped_scales(scale: torch.Tensor, offs: torch.Tensor, block_m: int, n_tiles: int):
    """Activation scales of an M-grouped product -> the kernel's FP32 layout and its tile schedule.

    Args:
        scale: ``[M, C]`` E8M0 (any strides, e.g. every 4th column of 1x128 scales stored per 32),
            rows grouped by ``offs``.
        offs: ``[E]`` int32 cumulative END offsets (non-decreasing, ``offs[-1] <= M``).
        block_m: rows per output tile; n_tiles: output tiles along N.
    Returns:
        ``(values, sched)``: ``values`` FP32 ``[C, W]`` as :func:`sm90_grouped_scale_layout` (each
        group's rows start at a multiple of 4 columns, other columns 0); ``sched`` int32 ``[2, E]``:
        row 0 the cumulative tile counts (``ceil(count_e / block_m) * n_tiles``), row 1 each group's
        first column in ``values``. One Triton launch on CUDA (up to 1024 groups), no host sync.
    Raises:
        TypeError: ``scale`` not ``float8_e8m0fnu`` or ``offs`` not int32.
    """
    if scale.dtype != torch.float8_e8m0fnu:
        raise TypeError(f"scale must be torch.float8_e8m0fnu, got {scale.dtype}")
    if offs.dtype != torch.int32:
        raise TypeError(f"offs must be torch.int32, got {offs.dtype}")
    M, C = scale.shape
    E = offs.shape[0]
    if not _fast(scale) or E > MAX_GROUPS_ONE_BLOCK or M == 0 or E == 0:
        values, starts = sm90_grouped_scale_layout(scale, offs)
        return values, _schedule_reference(offs, starts, block_m, n_tiles)
    W = padded_rows(M, E, ALIGN)
    values = torch.empty(C, W, dtype=torch.float32, device=scale.device)
    sched = torch.empty(2, E, dtype=torch.int32, device=scale.device)
    u8 = scale.view(torch.uint8)
    BW, BK = 128, 16
    _m_grouped_kernel[(triton.cdiv(W, BW), triton.cdiv(C, BK))](
        u8, offs, values, sched, M, C, W, E, u8.stride(0), u8.stride(1), block_m, n_tiles,
        BLOCK_W=BW, BLOCK_K=BK, EP2=max(16, triton.next_power_of_2(E)))
    return values, sched


def sm90_k_grouped_schedule(offs: torch.Tensor) -> torch.Tensor:
    """The K-grouped (wgrad) kernel's schedule: int32 ``[E + 1]``, the experts in order of row count, most
    first (ties: lower id first), then the kernel's tile counter, 0.

    The kernel hands its tiles out longest first, each to the next CTA that frees up (greedy list
    scheduling): a wgrad tile's work is its expert's rows, so under skewed routing one expert's tiles can
    cost 40x a balanced one's, and the static round-robin order left CTAs idle behind them.

    Args:
        offs: ``[E]`` int32 cumulative END offsets (non-decreasing), on the GEMM's device.
    Returns:
        int32 ``[E + 1]``, fresh (the counter is the launch's own). One Triton launch on CUDA (up to 1024
        groups; the pure-torch :func:`sm90_k_grouped_schedule_reference` past that), no host sync.
    Raises:
        TypeError: ``offs`` not int32.
    """
    if offs.dtype != torch.int32:
        raise TypeError(f"offs must be torch.int32, got {offs.dtype}")
    E = offs.shape[0]
    if not _fast(offs) or E > MAX_GROUPS_ONE_BLOCK or E == 0:
        return sm90_k_grouped_schedule_reference(offs)
    sched = torch.empty(E + 1, dtype=torch.int32, device=offs.device)
    _k_grouped_schedule_kernel[(1, )](offs, sched, E, EP2=max(16, triton.next_power_of_2(E)))
    return sched
