"""Gluon kernel of the column-family MXFP8 outputs (the body only; :mod:`mxmoe.kernels.quantize_launch`
launches it, and :mod:`mxmoe.kernels.quantize` / :mod:`mxmoe.kernels.qdq` pick it for ``quantize_columnwise``,
``quantize_dual``, ``qdq_dual`` and ``qdq_dual_bf16`` on sm_90 and fall back to the Triton kernels elsewhere).

Same contracts and numerics as :func:`mxmoe.kernels.quantize_triton.mx_quantize_kernel` with
``COL=True, TILE32=False`` (``ROW`` for dual) and ``mx_qdq_kernel`` with a column output (the rules are in that module's docstring: integer max of the
FP32 bits of |x|, E8M0 byte ``E - 8 (+1 rceil)`` clamped to [0, 254], 0xFF and data 0x7F for NaN/Inf
blocks, E4M3 by ``cvt.rn.satfinite``). Why Gluon: the 32x1 block max runs along M, across the rows
that a coalesced load spreads over lanes and warps; Triton picks that load layout for the reduction
too (shuffles and shared-memory rounds per block). Gluon lets us name the two
layouts and convert once, as a transpose does::

    x tile [MB, 32, BK] --coalesced 16-byte loads along K (L_IN)--> registers
        --one convert_layout (shared memory)--> L_COL: a thread holds RS (32 or 16) rows of one column
        of one block: the block max is in-thread (RS 16: plus one shuffle between the block's two
        lanes); TM lanes take TM neighbouring blocks of the same column, so a warp's transposed store
        writes TM * 32 contiguous bytes of qc[k, :] (RS 16: whole 32-byte sectors per instruction)

Its throughput against a device copy, and against the same design's data movement alone: docs/quantization.md.

Inputs: ``x`` [B, M, K] with unit stride along K, ``M % 32 == 0``; outputs qc [B, K, M] (uint8
E4M3 bytes) and sc [B, K, M/32] in the scale layout ``LAYOUT`` (0 row-major, 1 cuBLAS blocked, 2
the Hopper GEMM's FP32 layout; as ``quantize_triton._store_scales``). Tiles cover
``[M_cover, K_cover]`` so the blocked layout's zero padding is written.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

# Triton 3.6's names of a TMA load into shared memory and of a CTA-wide barrier; 3.9 renamed them (async_load,
# barrier) and removed the old ones
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

# The element math is shared with the Triton kernels (triton.jit helpers are callable from Gluon).
from mxmoe.kernels.layer_triton import _swiglu_grads_bf16
from mxmoe.kernels.quantize_fused_triton import _silu_mul_bf16
from mxmoe.kernels.quantize_triton import (_e8m0_from_amax_bits, _k_fastest, _max4, _quantize_elems, _store_scales,
                                           _tile_coords, _to_f32)


@gluon.jit
def _expand_bf16(q, byte):
    """BF16 of the E4M3 bytes q (uint8) times 2^(byte - 127): the values of dequantize.mx_expand_bf16
    (two normal FP32 powers of two, the second product rounds once; byte 255 -> NaN). Kept apart
    because it selects the NaN on the integer bits: calling mx_expand_bf16 here changes the SASS of
    the QDQ modes, and only this form's SASS is checked on the GPU."""
    e = byte - 127
    e1 = e >> 1
    s1 = ((e1 + 127) << 23).to(gl.float32, bitcast=True)
    s2 = gl.where(byte == 255, 0x7FC00000, (e - e1 + 127) << 23).to(gl.float32, bitcast=True)
    return ((q.to(gl.float8e4nv, bitcast=True).to(gl.float32) * s1) * s2).to(gl.bfloat16)


@gluon.jit
def _group_max(a, AXIS: gl.constexpr):
    """a [D0, D1] or [D0, D1, D2] maxed over groups of 4 neighbouring entries along AXIS and spread back,
    in a's layout: 32-block maxima -> those of 128-element groups (GROUP 128, docs/DESIGN.md §9)."""
    if len(a.shape) == 2:
        g = _max4(gl.reshape(a, [a.shape[0], a.shape[1], 1]), AXIS)
        return gl.convert_layout(gl.reshape(g, [a.shape[0], a.shape[1]]), a.type.layout)
    else:
        return gl.convert_layout(_max4(a, AXIS), a.type.layout)


@gluon.jit
def _tile_index(tm, tk, MB: gl.constexpr, BK: gl.constexpr, L: gl.constexpr):
    """Global rows m [MB, 32, 1] and columns k [1, 1, BK] of tile (tm, tk), in the 3D layout L."""
    i0 = gl.arange(0, MB, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
    i1 = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, L)))
    i2 = gl.arange(0, BK, layout=gl.SliceLayout(0, gl.SliceLayout(1, L)))
    m = tm * MB * 32 + gl.expand_dims(gl.expand_dims(i0 * 32, 1), 2) + gl.expand_dims(gl.expand_dims(i1, 0), 2)
    return m, tk * BK + gl.expand_dims(gl.expand_dims(i2, 0), 1)


@gluon.jit
def _rowwise(x, m, k, tm, tk, b, qr_ptr, sr_ptr, M, K, sr_stride_b, rceil, OUT: gl.constexpr, LAYOUT: gl.constexpr,
             MB: gl.constexpr, BK: gl.constexpr, WM: gl.constexpr, WK: gl.constexpr, L_IN: gl.constexpr,
             TILE32: gl.constexpr, GROUP: gl.constexpr = 32, M_OUT=None):
    """The rowwise half, on the tile x [MB, 32, BK] as loaded (L_IN, global indices m [MB, 32, 1],
    k [1, 1, BK]): a 1x32 block along K is VEC elements in each of 32/VEC neighbouring lanes, so its
    max is in-thread plus shuffles. OUT 1: E4M3 qr [B, M, K] and scales sr; OUT 2: the BF16 MX
    values (quantize, then expand) into qr [B, M, K] bf16. TILE32: one scale per 32x32 tile (the
    max of the tile's 32 row-block maxima). GROUP 128: 1x128 groups (BK % 128 == 0), with TILE32 128x128 tiles.
    M_OUT: the rows of each batch of the destination qr [B, M_OUT, K] (default M; qr_ptr may point at a row inside
    it), its batch stride M_OUT * K."""
    if M_OUT is None:
        M_OUT = M
    NB: gl.constexpr = BK // 32
    xf = gl.reshape(_to_f32(x), [MB, 32, NB, 32])
    amax = gl.max(xf.to(gl.int32, bitcast=True) & 0x7FFFFFFF, axis=3)  # [MB, 32, NB]
    if GROUP == 128 and not TILE32:
        amax = _group_max(amax, 2)
    if TILE32:
        tile = gl.max(amax, axis=1)  # [MB, NB]
        if GROUP == 128:
            tile = _group_max(_group_max(tile, 0), 1)
        amax, _ = gl.broadcast(gl.expand_dims(tile, 1), amax)
    byte = _e8m0_from_amax_bits(amax, rceil)
    q = _quantize_elems(xf, gl.expand_dims(byte, 3), False)
    if OUT == 2:
        v = gl.convert_layout(gl.reshape(_expand_bf16(q, gl.expand_dims(byte, 3)), [MB, 32, BK]), L_IN)
        gl.store(qr_ptr + b * M_OUT * K + m.to(gl.int64) * K + k, v, mask=(m < M) & (k < K))
    else:
        q = gl.convert_layout(gl.reshape(q, [MB, 32, BK]), L_IN)
        gl.store(qr_ptr + b * M_OUT * K + m.to(gl.int64) * K + k, q, mask=(m < M) & (k < K))
        if TILE32 and LAYOUT == 2:  # compact: one value per tile of the [M/32, K/32] tile grid
            _tile_scales(_e8m0_from_amax_bits(tile, rceil), tm, tk, sr_ptr + b * sr_stride_b, M // 32, K // 32,
                         MB, NB, False)
        else:
            _rowwise_scales(byte, tm, tk, b, sr_ptr, M, K, sr_stride_b, LAYOUT, MB, BK, WM, WK)


@gluon.jit
def _tile_scales(byte, tm, tk, s_ptr, n_rows, n_cols, MB: gl.constexpr, NB: gl.constexpr, TRANSPOSED: gl.constexpr):
    """Store the 32x32-tile scale bytes [MB, NB] of tile (tm, tk) in the compact Hopper layout of a
    [n_rows, n_cols] tile-scale matrix (rows: M/32 tiles; TRANSPOSED: rows are the K/32 tiles)."""
    L: gl.constexpr = byte.type.layout
    r = tm * MB + gl.expand_dims(gl.arange(0, MB, layout=gl.SliceLayout(1, L)), 1)  # [MB, 1] tile row along M
    c = tk * NB + gl.expand_dims(gl.arange(0, NB, layout=gl.SliceLayout(0, L)), 0)  # [1, NB] tile column along K
    if TRANSPOSED:
        _store_scales(s_ptr, c, r, byte, n_rows, n_cols, 0, 2)
    else:
        _store_scales(s_ptr, r, c, byte, n_rows, n_cols, 0, 2)


@gluon.jit
def _rowwise_scales(byte, tm, tk, b, sr_ptr, M, K, sr_stride_b, LAYOUT: gl.constexpr,
                    MB: gl.constexpr, BK: gl.constexpr, WM: gl.constexpr, WK: gl.constexpr):
    """Store the rowwise scale bytes [MB, 32, BK/32] of tile (tm, tk) (one byte per thread)."""
    NB: gl.constexpr = BK // 32
    L_S: gl.constexpr = gl.BlockedLayout([1, 1, 1], [1, 32 // NB, NB], [WM, WK, 1], [2, 1, 0])
    r0 = gl.arange(0, MB, layout=gl.SliceLayout(1, gl.SliceLayout(2, L_S)))
    r1 = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, L_S)))
    r2 = gl.arange(0, NB, layout=gl.SliceLayout(0, gl.SliceLayout(1, L_S)))
    sr = tm * MB * 32 + gl.expand_dims(gl.expand_dims(r0 * 32, 1), 2) + gl.expand_dims(gl.expand_dims(r1, 0), 2)
    sc = tk * NB + gl.expand_dims(gl.expand_dims(r2, 0), 1)
    _store_scales(sr_ptr + b * sr_stride_b, sr, sc, gl.convert_layout(byte, L_S), M, K // 32, (K // 32 + 3) // 4, LAYOUT)


@gluon.jit(do_not_specialize=["rceil"])
def mx_quantize_cols_kernel(
    x_ptr, qc_ptr, sc_ptr, qr_ptr, sr_ptr, M, K, M_cover, K_cover, stride_xb, stride_xm,
    sc_stride_b, sr_stride_b, rceil,
    ROW: gl.constexpr, COL: gl.constexpr, LAYOUT: gl.constexpr, MB: gl.constexpr, BK: gl.constexpr, VEC: gl.constexpr,
    WM: gl.constexpr, WK: gl.constexpr, TM: gl.constexpr, TILE32: gl.constexpr, K_FAST: gl.constexpr = False,
    RS: gl.constexpr = 32, GROUP: gl.constexpr = 32,
    src_ptr=None, T=0, qh_ptr=None, sh_ptr=None, IN_MODE: gl.constexpr = 0, SAVE_H: gl.constexpr = False,
    w_ptr=None, yp_ptr=None, dwp_ptr=None, TOP_K: gl.constexpr = 1, h_ptr=None, hs_ptr=None,
    H_FP8: gl.constexpr = False, M_OUT=None,
):
    """One program per [MB*32, BK] tile of x[b] (m-tiles fastest, K_FAST: k-tiles fastest; then b); WM*WK warps.

    L_IN: VEC elements per thread along K (16 bytes for 16-bit input), BK/VEC lanes along K, warps [WM, WK] over
    (block, row). L_COL: RS rows of one block per thread (32/RS lanes per block), TM lanes over blocks and the rest over
    columns, warps [WM, WK] over (block, column); needs TM <= RS, MB % (TM*WM) == 0 and BK % (RS/TM*WK) == 0.
    Outputs, by mode (1: E4M3 data + E8M0 scales, 2: BF16 MX values, i.e. quantize then expand):
    COL 1: qc [B, K, M] + sc (quantize_columnwise); COL 2: qc [B, K, M] bf16 (the transposed QDQ).
    ROW 0: none; 1: qr [B, M, K] + sr [B, M, K/32] (quantize_dual); 2: qr [B, M, K] bf16 (qdq_dual).
    ROW needs K % 32 == 0. The row outputs come from the same load. TILE32 (ROW 1 or 2 with COL 1): one
    scale per 32x32 tile, so both orientations hold the same bytes (quantize_32x32, qdq_dual tile32);
    the scales are stored replicated per row / column, or once per tile in the compact LAYOUT 2.
    GROUP 128 (docs/DESIGN.md §9): one scale per 128 elements along each output's axis (1x128 rows, 128x1 columns,
    TILE32: 128x128 tiles), the max of 4 neighbouring 32-blocks, stored per 32 as above; needs MB % 4 == 0
    and, with ROW, BK % 128 == 0.
    IN_MODE (B == 1) fuses the producer of the tile: 1, the rows gathered from x [T, K] by src [M] (int32/int64;
    outside [0, T): a zero row), i.e. the outputs of x[src]; 2, SwiGLU: x is h [M, 2K] bf16 and the tile is
    a = silu(h[:, :K]) * h[:, K:] (BF16 math as torch's, quantize_fused_triton._silu_mul_bf16), with SAVE_H also h's
    rows quantized (ROW mode 1, GROUP) into qh [M, 2K] + sh [M, 2K/32] row-major (K % BK == 0); 3, the top-k
    combine's backward: x is dy [T, K], src [M] int32 the slot s = t*TOP_K + j of each row (-1: padding), and the
    tile is dyp[m] = w[s] * dy[s // TOP_K] (w [T*TOP_K] FP32; the FP32 product rounded to BF16, zero on padding
    rows: layer_triton.combine_backward_kernel's dyp), with each row's partial router-weight gradient
    sum_k dy[t, k] * yp[m, k] over the tile's columns (FP32, yp [M, K] bf16 contiguous) stored to dwp [n_k, M];
    4, SwiGLU's backward: x is da [M, K] and h_ptr h [M, 2K] (contiguous; bf16, or H_FP8: E4M3 bytes with E8M0
    scales hs [M, 2K/32] row-major, taken at their BF16 MX values); the tiles cover dh [M, 2K] (K_cover 2K), k-tile
    2j + 0 / 1 being d_gate / d_up of da's columns j (dh[:, k] / dh[:, K + k]: layer_triton._swiglu_grads_bf16,
    torch's autograd arithmetic; two programs per tile of da keep the registers of one output, the second's reads
    hit L2), quantized both ways (ROW 1, COL 1, row-major scales): qr [M, 2K] + sr [M, 2K/32], qc [2K, M] + sc
    [2K, M/32] (K % BK == 0).
    M_OUT (IN_MODE 0, row-major scales): the outputs are rows [0, M) of wider destinations with M_OUT rows along M,
    qr [B, M_OUT, K] + sr [B, M_OUT, K/32] and qc [B, K, M_OUT] + sc [B, K, M_OUT/32], with qr_ptr / sr_ptr / qc_ptr
    / sc_ptr at the first row / column of this part (sc_stride_b, sr_stride_b: the destinations'); default M.
    """
    if M_OUT is None:
        M_OUT = M
    TPK: gl.constexpr = BK // VEC
    L_IN: gl.constexpr = gl.BlockedLayout([1, 1, VEC], [1, 32 // TPK, TPK], [WM, WK, 1], [2, 1, 0])
    L_COL: gl.constexpr = gl.BlockedLayout([1, RS, 1], [TM, 32 // RS, 32 // TM // (32 // RS)], [WM, 1, WK], [1, 0, 2])
    BM: gl.constexpr = MB * 32
    n_m = gl.cdiv(M_cover, BM)
    n_k = gl.cdiv(K_cover, BK)
    pid = gl.program_id(0)
    t = _k_fastest(pid, gl.num_programs(0), n_m, n_k) if K_FAST else pid  # one program per tile
    b, tm, tk = _tile_coords(t, n_m, n_k)  # the Triton kernel's tile orders
    b = b.to(gl.int64)

    # load [MB, 32, BK] in L_IN (zeros past M, K: the padding of blocked scales)
    m, k = _tile_index(tm, tk, MB, BK, L_IN)
    if IN_MODE == 1:  # gathered rows x[src[m]]
        row = gl.load(src_ptr + m, mask=m < M, other=-1).to(gl.int64)
        x = gl.load(x_ptr + row * stride_xm + k, mask=(row >= 0) & (row < T) & (k < K), other=0.0)
    elif IN_MODE == 2:  # SwiGLU: gate = h[:, :K], up = h[:, K:]
        hp = x_ptr + m.to(gl.int64) * stride_xm + k
        gate = gl.load(hp, mask=(m < M) & (k < K), other=0.0)
        up = gl.load(hp + K, mask=(m < M) & (k < K), other=0.0)
        x = _silu_mul_bf16(gate, up, False)
        if SAVE_H:
            _rowwise(gate, m, k, tm, tk, b, qh_ptr, sh_ptr, M, 2 * K, 0, rceil, 1, 0, MB, BK, WM, WK, L_IN, False,
                     GROUP)
            _rowwise(up, m, k, tm, tk, b, qh_ptr + K, sh_ptr + K // 32, M, 2 * K, 0, rceil, 1, 0, MB, BK, WM, WK,
                     L_IN, False, GROUP)
    elif IN_MODE == 3:  # combine backward: dyp[m] = w[s] * dy[s // TOP_K], and the partial <dy[t], yp[m]>
        slot = gl.load(src_ptr + m, mask=m < M, other=-1)
        live = slot >= 0
        g = _to_f32(gl.load(x_ptr + gl.where(live, slot // TOP_K, 0).to(gl.int64) * stride_xm + k,
                            mask=live & (k < K), other=0.0))
        x = (g * gl.load(w_ptr + slot, mask=live, other=0.0)).to(gl.bfloat16)
        yv = _to_f32(gl.load(yp_ptr + m.to(gl.int64) * K + k, mask=live & (k < K), other=0.0))
        gl.store(dwp_ptr + tk.to(gl.int64) * M + m, gl.expand_dims(gl.sum(g * yv, axis=2), 2), mask=m < M)
    elif IN_MODE == 4:  # SwiGLU backward: one half of dh per program (k-tiles 2j, 2j+1: d_gate, d_up of columns j)
        half = tk % 2
        tk = tk // 2
        m, k = _tile_index(tm, tk, MB, BK, L_IN)
        live = (m < M) & (k < K)
        da = gl.load(x_ptr + m.to(gl.int64) * stride_xm + k, mask=live, other=0.0)
        gate = _h_half(h_ptr, hs_ptr, m, k, M, K, 0, live, H_FP8)
        up = _h_half(h_ptr, hs_ptr, m, k, M, K, K, live & (half == 0), H_FP8)  # (d_up does not read up)
        d_gate, d_up = _swiglu_grads_bf16(da, gate, up, False)
        d = gl.where(half == 0, d_gate, d_up)
        col = half * K  # this half's first column of dh
        _rowwise(d, m, k, tm, tk, b, qr_ptr + col, sr_ptr + col // 32, M, 2 * K, 0, rceil, 1, 0, MB, BK, WM, WK, L_IN,
                 False, GROUP)
        _columnwise(d, tm, tk, b, qc_ptr + col.to(gl.int64) * M, sc_ptr + col.to(gl.int64) * (M // 32), M, K, 0,
                    rceil, 1, 0, MB, BK, False, GROUP, L_COL)
    else:
        x = gl.load(x_ptr + b * stride_xb + m.to(gl.int64) * stride_xm + k, mask=(m < M) & (k < K), other=0.0)

    if IN_MODE != 4:  # (mode 4 stored its two halves above)
        if ROW != 0:
            _rowwise(x, m, k, tm, tk, b, qr_ptr, sr_ptr, M, K, sr_stride_b, rceil, ROW, LAYOUT, MB, BK, WM, WK, L_IN,
                     TILE32, GROUP, M_OUT)
        _columnwise(x, tm, tk, b, qc_ptr, sc_ptr, M, K, sc_stride_b, rceil, COL, LAYOUT, MB, BK, TILE32, GROUP, L_COL,
                    M_OUT)


@gluon.jit
def _h_half(h_ptr, hs_ptr, m, k, M, K, col0, live, H_FP8: gl.constexpr):
    """SwiGLU's input h [M, 2K] (contiguous) at rows m [MB, 32, 1] and columns col0 + k [1, 1, BK], as BF16: loaded,
    or with H_FP8 its E4M3 bytes expanded at their row-major E8M0 scales hs [M, 2K/32] (one scale per 32 columns)."""
    off = m.to(gl.int64) * (2 * K) + col0 + k
    if H_FP8:
        q = gl.load(h_ptr + off, mask=live, other=0)
        byte = gl.load(hs_ptr + m.to(gl.int64) * (2 * K // 32) + (col0 + k) // 32, mask=live, other=127)
        v = _expand_bf16(q, byte.to(gl.int32))
    else:
        v = gl.load(h_ptr + off, mask=live, other=0.0)
    return v


@gluon.jit
def _columnwise(x, tm, tk, b, qc_ptr, sc_ptr, M, K, sc_stride_b, rceil, COL: gl.constexpr, LAYOUT: gl.constexpr,
                MB: gl.constexpr, BK: gl.constexpr, TILE32: gl.constexpr, GROUP: gl.constexpr, L_COL: gl.constexpr,
                M_OUT=None):
    """The column half, on the tile x [MB, 32, BK] (any layout; global tile (tm, tk) of x[b]): one layout
    conversion to L_COL, then the 32x1 (GROUP 128: 128x1) block maxima per thread and the transposed
    stores (COL 1: E4M3 qc [B, K, M] + scales sc; 2: BF16 MX values into qc). M_OUT: the columns of the destination
    qc [B, K, M_OUT] (default M; qc_ptr may point at a column inside it), and of sc [B, K, M_OUT/32] (row-major)."""
    if M_OUT is None:
        M_OUT = M
    # one layout conversion, then per thread (RS 16: the block max takes one shuffle between two lanes)
    xf = _to_f32(gl.convert_layout(x, L_COL))
    amax = gl.max(xf.to(gl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)  # [MB, BK]
    if GROUP == 128:  # 128x1 groups: the max over 4 neighbouring blocks of a column
        amax = _group_max(amax, 0)
    if TILE32:  # the max over each tile's 32 columns, spread back over them
        a3 = gl.reshape(amax, [MB, BK // 32, 32])
        tile = gl.max(a3, axis=2)  # [MB, NB]
        if GROUP == 128:  # 128x128 tiles: and over 4 neighbouring tiles along K
            tile = _group_max(tile, 1)
        a3, _ = gl.broadcast(gl.expand_dims(tile, 2), a3)
        amax = gl.convert_layout(gl.reshape(a3, [MB, BK]), amax.type.layout)
    byte = _e8m0_from_amax_bits(amax, rceil)
    q = _quantize_elems(xf, gl.expand_dims(byte, 1), False)

    mc, kc = _tile_index(tm, tk, MB, BK, L_COL)
    if COL == 2:
        v = _expand_bf16(q, gl.expand_dims(byte, 1))
        gl.store(qc_ptr + b * M_OUT * K + kc.to(gl.int64) * M_OUT + mc, v, mask=(mc < M) & (kc < K))
    else:
        gl.store(qc_ptr + b * M_OUT * K + kc.to(gl.int64) * M_OUT + mc, q, mask=(mc < M) & (kc < K))
        if TILE32 and LAYOUT == 2:
            _tile_scales(_e8m0_from_amax_bits(tile, rceil), tm, tk, sc_ptr + b * sc_stride_b, K // 32, M // 32,
                         MB, BK // 32, True)
        else:
            _columnwise_scales(byte, tm, tk, b, sc_ptr, M, K, sc_stride_b, LAYOUT, MB, BK, L_COL, M_OUT)


@gluon.jit
def _columnwise_scales(byte, tm, tk, b, sc_ptr, M, K, sc_stride_b, LAYOUT: gl.constexpr,
                       MB: gl.constexpr, BK: gl.constexpr, L_COL: gl.constexpr, M_OUT):
    """Store the columnwise scale bytes [MB, BK] of tile (tm, tk): scale row k, column m // 32 (row-major LAYOUT 0:
    of a row M_OUT / 32 wide)."""
    s0 = gl.arange(0, MB, layout=gl.SliceLayout(1, gl.SliceLayout(1, L_COL)))
    s2 = gl.arange(0, BK, layout=gl.SliceLayout(0, gl.SliceLayout(1, L_COL)))
    sk = tk * BK + gl.expand_dims(s2, 0)  # scale row = k
    sm = tm * MB + gl.expand_dims(s0, 1)  # scale column = block of 32 rows
    if LAYOUT == 0:  # _store_scales' row-major case, with the destination's row width
        gl.store(sc_ptr + b * sc_stride_b + sk.to(gl.int64) * (M_OUT // 32) + sm, byte.to(gl.uint8),
                 mask=(sk < K) & (sm < M // 32))
    else:
        _store_scales(sc_ptr + b * sc_stride_b, sk, sm, byte, K, M // 32, (M // 32 + 3) // 4, LAYOUT)


@gluon.jit
def _issue_swiglu_tile(h_desc, t, total, n_k, K, bar, gate_buf, up_buf, BM: gl.constexpr, BK: gl.constexpr):
    """TMA loads of tile t's gate box h[rows, k] and up box h[rows, K + k] into one ring slot, completing on
    bar; nothing is issued past the last tile (t >= total)."""
    ok = t < total
    mbarrier.expect(bar, 2 * h_desc.block_type.nbytes, pred=ok)
    _tma_load(h_desc, [(t // n_k) * BM, (t % n_k) * BK], bar, gate_buf, pred=ok)
    _tma_load(h_desc, [(t // n_k) * BM, K + (t % n_k) * BK], bar, up_buf, pred=ok)


@gluon.jit(do_not_specialize=["rceil"])
def mx_swiglu_quantize_tma_kernel(
    h_desc, qc_ptr, sc_ptr, qr_ptr, sr_ptr, M, K, rceil,
    MB: gl.constexpr, BK: gl.constexpr, VEC: gl.constexpr, WM: gl.constexpr, WK: gl.constexpr, TM: gl.constexpr,
    RS: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr,
):
    """mx_quantize_cols_kernel's SwiGLU mode (IN_MODE 2, ROW 1, COL 1, row-major scales, no SAVE_H) as a
    persistent kernel whose input tiles arrive by TMA into a STAGES-deep shared-memory ring: while a
    program computes one tile (the BF16 silu math and both quantizations, ~3x the instructions per
    element of the dual kernel), the loads of its next STAGES - 1 tiles are in flight. With one 16-warp
    program per SM, the register-fed form waits for each tile's loads; this one is 7-12% faster on the H200
    (the rest of its time is instruction latency: docs/quantization.md).

    h_desc: TMA descriptor of h [M, 2K] bf16 (box [MB*32, BK], unswizzled); outputs as
    mx_quantize_cols_kernel's (qr [M, K] + sr [M, K/32], qc [K, M] + sc [K, M/32]). Tiles run k fastest,
    tile t = pid + i * programs. Needs M % (MB*32) == 0 and K % BK == 0 (whole tiles: the caller checks)."""
    BM: gl.constexpr = MB * 32
    TPK: gl.constexpr = BK // VEC
    L_IN: gl.constexpr = gl.BlockedLayout([1, 1, VEC], [1, 32 // TPK, TPK], [WM, WK, 1], [2, 1, 0])
    L_COL: gl.constexpr = gl.BlockedLayout([1, RS, 1], [TM, 32 // RS, 32 // TM // (32 // RS)], [WM, 1, WK], [1, 0, 2])
    # the 2D view of L_IN over [BM, BK] (rows 32 * block + r): the smem tiles load straight into it
    gl.static_assert(WM == 1 and 32 % (WK * (32 // TPK)) == 0)
    L_2D: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // TPK, TPK], [WK, 1], [1, 0])
    n_k = K // BK
    total = (M // BM) * n_k
    pid = gl.program_id(0)
    progs = gl.num_programs(0)

    gates = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], h_desc.layout)
    ups = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], h_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()

    # prologue: the first STAGES - 1 tiles of this program
    for i in gl.static_range(STAGES - 1):
        _issue_swiglu_tile(h_desc, pid + i * progs, total, n_k, K, ready.index(i), gates.index(i), ups.index(i),
                           BM, BK)

    it = 0
    for t in range(pid, total, progs):
        # the load STAGES - 1 tiles ahead goes into the slot read last iteration (all threads passed the
        # barrier after reading it)
        sn = (it + STAGES - 1) % STAGES
        _issue_swiglu_tile(h_desc, t + (STAGES - 1) * progs, total, n_k, K, ready.index(sn), gates.index(sn),
                           ups.index(sn), BM, BK)

        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        gate = gates.index(s).load(L_2D)
        up = ups.index(s).load(L_2D)
        _cta_barrier()  # slot s is free for the load issued next iteration
        gate = gl.convert_layout(gl.reshape(gate, [MB, 32, BK]), L_IN)  # same registers: no data movement
        up = gl.convert_layout(gl.reshape(up, [MB, 32, BK]), L_IN)
        x = _silu_mul_bf16(gate, up, False)

        tm = t // n_k
        tk = t % n_k
        m, k = _tile_index(tm, tk, MB, BK, L_IN)
        b = 0
        _rowwise(x, m, k, tm, tk, b, qr_ptr, sr_ptr, M, K, 0, rceil, 1, 0, MB, BK, WM, WK, L_IN, False, GROUP)
        _columnwise(x, tm, tk, b, qc_ptr, sc_ptr, M, K, 0, rceil, 1, 0, MB, BK, False, GROUP, L_COL)
        it += 1

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
