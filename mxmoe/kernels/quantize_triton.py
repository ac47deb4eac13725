"""Triton kernels of MXFP8 quantization (the bodies only; launchers in :mod:`mxmoe.kernels.quantize`, tile choices in
:mod:`mxmoe.kernels.quantize_tile_config`); the element math and tile helpers here are shared with the QDQ
(:mod:`mxmoe.kernels.qdq_triton`), fused (:mod:`mxmoe.kernels.quantize_fused_triton`) and Gluon kernels.
Importing this module imports triton.

Every kernel views its tile of ``x`` as 4D ``[BM/32, 32, BK/32, 32]`` (row block ``mb``, row in block
``i``, column block ``nb``, column in block ``j``), so the three block shapes are reductions of one
tensor::

        rowwise (1x32 along K)     columnwise (32x1 along M)     2D (32x32)
        max over axis 3            max over axis 1               max over axes 1 and 3
        -> [MB, 32, NB]            -> [MB, NB, 32]               -> [MB, NB]

The block max is taken on the integer bits ``bits & 0x7FFFFFFF`` of the FP32 value: for finite
values that is the bit pattern of ``max |x|``, and any NaN/Inf (exponent field 0xFF) wins the
integer max, so "non-finite block" is simply ``E == 0xFF`` -- no NaN-dropping float max, no
``isnan`` pass. Scale byte (formats.scale_byte_from_amax): ``E - 8 (+1 if rceil and m > 0x600000)``,
clamped to [0, 254], 0xFF for non-finite blocks. A finite block gives a byte <= 247, so the
multiplier ``2^(127 - byte)`` is always a normal FP32 number built from its bits (exponent field
``254 - byte``), and ``x * 2^(127 - byte)`` is exact (no overflow: ``|x * mult| < 512``; results
below FP32's normal range are < 2^-126 and round to a signed zero in E4M3 either way).

E4M3 rounding: on the GPU, triton's fp32 -> float8e4nv conversion (``cvt.rn.satfinite.e4m3x2.f32``
on sm_90: round to nearest even, saturating to +-448). Under ``TRITON_INTERPRET=1`` triton's numpy
conversion rounds half away from zero and truncates subnormals, so the interpreter path
(``SOFT_CVT``) rounds with integer arithmetic instead (RNE, subnormals kept, same bits).
Blocks with NaN/Inf get data 0x7F and scale 0xFF.

Indexing: rows and batch indices are widened to int64 before they are multiplied by strides, so
tensors past 2^31 elements address correctly.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _to_f32(x):
    """Exact upcast to FP32. BF16 goes through its bits (<< 16): the interpreter's own BF16
    conversion mishandles subnormals, and on the GPU this is what the conversion does anyway."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def _e8m0_from_amax_bits(amax_bits, rceil):
    """E8M0 byte (int32) from the FP32 bits of a block's |max| (NaN/Inf -> 255)."""
    e = amax_bits >> 23
    mant = amax_bits & 0x7FFFFF
    byte = e - 8 + ((mant > 0x600000) & (rceil != 0)).to(tl.int32)
    byte = tl.minimum(tl.maximum(byte, 0), 254)
    return tl.where(e == 255, 255, byte)


@triton.jit
def _pow2_from_byte(byte):
    """2^(127 - byte) as FP32 (exact and normal for byte in [0, 247], i.e. every finite block);
    a quiet NaN for byte 255, so a non-finite block's elements all become NaN."""
    return tl.where(byte == 255, 0x7FC00000, (254 - byte) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_bits_soft(q):
    """fp32 -> E4M3 byte (int32), round to nearest even, subnormals kept, |q| <= 448 assumed."""
    b = q.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    # normal E4M3 (|q| >= 2^-6): keep 3 mantissa bits, RNE on the 20 dropped ones, rebias 127 -> 7
    r = (a + 0x7FFFF + ((a >> 20) & 1)) >> 20
    code_n = r - (120 << 3)
    # subnormal E4M3 (|q| < 2^-6): round |q| * 2^9 to an integer, RNE, on the integer significand
    e = a >> 23
    mant = (a & 0x7FFFFF) | tl.where(e > 0, 0x800000, 0)
    sh = tl.minimum(141 - tl.maximum(e, 1), 31)
    qn = mant >> sh
    rem = mant & ((1 << sh) - 1)
    half = 1 << (sh - 1)
    qn = qn + ((rem > half) | ((rem == half) & ((qn & 1) == 1))).to(tl.int32)
    code = tl.where(a >= (121 << 23), code_n, qn)
    return code | sign


@triton.jit
def _quantize_elems(x, byte, SOFT_CVT: tl.constexpr):
    """E4M3 bytes (uint8) of x (fp32) scaled by 2^(127 - byte); 0x7F where byte == 255.

    GPU: x * NaN is NaN and cvt.rn.satfinite turns NaN into 0x7F, so bad blocks need no
    per-element select (the tests check 0x7F bit for bit). Interpreter: explicit select.
    """
    q = x * _pow2_from_byte(byte)
    if SOFT_CVT:
        q = tl.minimum(tl.maximum(q, -448.0), 448.0)
        return tl.where(byte == 255, 0x7F, _e4m3_bits_soft(q)).to(tl.uint8)
    else:
        return q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def _blocked_index(r, c, n_col_tiles):
    """Offset of scale entry (r, c) in the cuBLAS 128x4 blocked layout (layouts.to_blocked)."""
    return ((r // 128) * n_col_tiles + c // 4) * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + (c % 4)


@triton.jit
def _store_scales(s_ptr, r, c, byte, n_rows, n_cols, n_col_tiles, LAYOUT: tl.constexpr):
    """Store the scales (r, c) of a [n_rows, n_cols] scale matrix; LAYOUT picks the storage.

    0 row-major bytes. 1 cuBLAS 128x4 blocked bytes, zero padding included (rows up to a multiple
    of 128, columns up to a multiple of 4; the caller passes byte 0 there, a zero block). 2 the
    Hopper GEMM's layout (sm90_scales.sm90_scale_layout): FP32 values 2^(b-127)
    stored as their bits, transposed to [n_cols, ceil4(n_rows)] with zero padding; byte 0 is the
    subnormal 2^-127 (0x00400000), byte 255 a NaN (0x7FC00000).
    """
    r64 = r.to(tl.int64)
    if LAYOUT == 1:
        mask = (r < ((n_rows + 127) // 128) * 128) & (c < n_col_tiles * 4)
        tl.store(s_ptr + _blocked_index(r64, c, n_col_tiles), byte.to(tl.uint8), mask=mask)
    elif LAYOUT == 2:
        rows_pad = (n_rows + 3) // 4 * 4
        bits = tl.where(byte == 0, 0x00400000, tl.where(byte == 255, 0x7FC00000, byte << 23))
        bits = tl.where(r < n_rows, bits, 0)
        mask = (r < rows_pad) & (c < n_cols)
        tl.store(s_ptr + c.to(tl.int64) * rows_pad + r64, bits.to(tl.int32), mask=mask)
    else:
        mask = (r < n_rows) & (c < n_cols)
        tl.store(s_ptr + r64 * n_cols + c, byte.to(tl.uint8), mask=mask)


@triton.jit
def _tile_coords(t, n_m, n_k):
    """Tile index -> (batch, m-tile, k-tile), m fastest: programs running at the same time take
    neighbouring tiles along M, so the transposed outputs they write fill whole L2 lines."""
    tm = t % n_m
    rest = t // n_m
    return rest // n_k, tm, rest % n_k


@triton.jit
def _k_fastest(t, total, n_m, n_k):
    """The _tile_coords index of the t-th tile in K-fastest order (t >= total kept): programs running
    at the same time then take neighbouring tiles along K, so a row's scales are written together."""
    tk = t % n_k
    rest = t // n_k
    return tl.where(t < total, ((rest // n_m) * n_k + tk) * n_m + rest % n_m, t)


@triton.jit
def _load_tile(x_ptr, t, total, n_m, n_k, M, K, stride_xb, stride_xm, stride_xk,
               BM: tl.constexpr, BK: tl.constexpr):
    """The [BM, BK] input tile number t (zeros past the edges and for t >= total)."""
    b, tm, tk = _tile_coords(t, n_m, n_k)
    m = tm * BM + tl.arange(0, BM)[:, None]  # [BM, 1]
    k = tk * BK + tl.arange(0, BK)[None, :]  # [1, BK]
    live = tl.full([BM, 1], t, tl.int32) < total  # a tensor, not a scalar term: t >= total loads nothing
    mask = (m < M) & (k < K) & live
    ptrs = x_ptr + b.to(tl.int64) * stride_xb + m.to(tl.int64) * stride_xm + k.to(tl.int64) * stride_xk
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _tile_frame(x_raw, t, n_m, n_k, M, K, BM: tl.constexpr, BK: tl.constexpr):
    """What the tile kernels derive from tile t of a loaded [BM, BK] tile: (batch b as int64, m-tile,
    k-tile, rows m [BM, 1], columns k [1, BK], both as int64, the in-bounds mask, x as FP32
    [BM/32, 32, BK/32, 32] blocks, |x|'s FP32 bits, the offset of batch b in [B, M, K] outputs)."""
    b, tm, tk = _tile_coords(t, n_m, n_k)
    b64 = b.to(tl.int64)
    m = tm * BM + tl.arange(0, BM)[:, None]  # [BM, 1]
    k = tk * BK + tl.arange(0, BK)[None, :]  # [1, BK]
    m64 = m.to(tl.int64)
    k64 = k.to(tl.int64)
    in_bounds = (m < M) & (k < K)
    x = tl.reshape(_to_f32(x_raw), (BM // 32, 32, BK // 32, 32))
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return b64, tm, tk, m, k, m64, k64, in_bounds, x, bits, b64 * M * K


@triton.jit
def _max4(a, AXIS: tl.constexpr):
    """Max of a 3D tensor over groups of 4 neighbouring entries along AXIS (its size a multiple of 4),
    spread back over them: 32-block maxima -> the maxima of 128-element groups (docs/DESIGN.md §9)."""
    A: tl.constexpr = a.shape[0]
    B: tl.constexpr = a.shape[1]
    C: tl.constexpr = a.shape[2]
    if AXIS == 0:
        g = tl.max(tl.reshape(a, (A // 4, 4, B, C)), axis=1, keep_dims=True)
        return tl.reshape(tl.broadcast_to(g, (A // 4, 4, B, C)), (A, B, C))
    elif AXIS == 1:
        g = tl.max(tl.reshape(a, (A, B // 4, 4, C)), axis=2, keep_dims=True)
        return tl.reshape(tl.broadcast_to(g, (A, B // 4, 4, C)), (A, B, C))
    else:
        g = tl.max(tl.reshape(a, (A, B, C // 4, 4)), axis=3, keep_dims=True)
        return tl.reshape(tl.broadcast_to(g, (A, B, C // 4, 4)), (A, B, C))


@triton.jit
def _quantize_tile(
    x_raw, t, n_m, n_k, qr_ptr, sr_ptr, qc_ptr, sc_ptr, M, K, sr_stride_b, sc_stride_b,
    br_ptr, bc_ptr, br_stride_b, bc_stride_b, rceil,
    ROW: tl.constexpr, COL: tl.constexpr, TILE32: tl.constexpr,
    ROW_LAYOUT: tl.constexpr, COL_LAYOUT: tl.constexpr, BLOCKED_COPY: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr, SOFT_CVT: tl.constexpr, GROUP: tl.constexpr = 32,
):
    """Quantize and store one loaded tile (see mx_quantize_kernel)."""
    b64, tm, tk, m, k, m64, k64, in_bounds, x, bits, plane = _tile_frame(x_raw, t, n_m, n_k, M, K, BM, BK)
    MB: tl.constexpr = BM // 32
    NB: tl.constexpr = BK // 32
    mb = tl.arange(0, MB)
    ii = tl.arange(0, 32)
    nb = tl.arange(0, NB)
    jj = tl.arange(0, 32)
    # block maxima (as FP32 bits): rows [MB, 32, NB], columns [MB, NB, 32]
    if ROW:
        amax_r = tl.max(bits, axis=3)
    if COL or (TILE32 and GROUP == 32):
        amax_c = tl.max(bits, axis=1)
    if GROUP == 128:  # 1x128 along K, 128x1 along M: the max of 4 neighbouring blocks (BM, BK % 128 == 0)
        if ROW and not TILE32:
            amax_r = _max4(amax_r, 2)
        if COL:
            amax_c = _max4(amax_c, 0)
        if TILE32 and not COL:  # 128x128 tiles, rows only: from the row-block maxima (no reduction along M of x)
            amax_c = _max4(_max4(tl.max(amax_r, axis=1)[:, :, None], 0), 1)  # [MB, NB, 1]
    if TILE32:  # one max per 32x32 tile, spread back over both block shapes
        tile = tl.max(amax_c, axis=2)  # [MB, NB]
        if GROUP == 128 and COL:  # 128x128 tiles: amax_c already holds the max over 128 rows
            tile = tl.max(_max4(tile[:, :, None], 1), axis=2)
        amax_c = tl.maximum(amax_c, tile[:, :, None])
        if ROW:
            amax_r = tl.maximum(amax_r, tile[:, None, :])
        tile_byte = _e8m0_from_amax_bits(tile, rceil)
        tile_r = tm * MB + mb[:, None]  # [MB, 1] block row
        tile_c = tk * NB + nb[None, :]  # [1, NB] block column
    if ROW:
        byte = _e8m0_from_amax_bits(amax_r, rceil)  # [MB, 32, NB]
        d = tl.reshape(_quantize_elems(x, byte[:, :, :, None], SOFT_CVT), (BM, BK))
        tl.store(qr_ptr + plane + m64 * K + k, d, mask=in_bounds)
        if TILE32 and ROW_LAYOUT == 2:  # compact: one value per tile, [K/32, ceil4(M/32)]
            _store_scales(sr_ptr + b64 * sr_stride_b, tile_r, tile_c, tile_byte, M // 32, K // 32, 0, 2)
        else:
            r = tm * BM + mb[:, None, None] * 32 + ii[None, :, None]  # [MB, 32, 1]
            c = tk * NB + nb[None, None, :]  # [1, 1, NB]
            _store_scales(sr_ptr + b64 * sr_stride_b, r, c, byte, M, K // 32, (K // 32 + 3) // 4, ROW_LAYOUT)
            if BLOCKED_COPY:
                _store_scales(br_ptr + b64 * br_stride_b, r, c, byte, M, K // 32, (K // 32 + 3) // 4, 1)
    if COL:
        byte = _e8m0_from_amax_bits(amax_c, rceil)  # [MB, NB, 32]
        d = tl.reshape(_quantize_elems(x, byte[:, None, :, :], SOFT_CVT), (BM, BK))
        tl.store(qc_ptr + plane + k64 * M + m, d, mask=in_bounds)
        if TILE32 and COL_LAYOUT == 2:  # compact: [M/32, ceil4(K/32)]
            _store_scales(sc_ptr + b64 * sc_stride_b, tile_c, tile_r, tile_byte, K // 32, M // 32, 0, 2)
        else:
            r = tk * BK + nb[None, :, None] * 32 + jj[None, None, :]  # [1, NB, 32]
            c = tm * MB + mb[:, None, None]  # [MB, 1, 1]
            _store_scales(sc_ptr + b64 * sc_stride_b, r, c, byte, K, M // 32, (M // 32 + 3) // 4, COL_LAYOUT)
            if BLOCKED_COPY:
                _store_scales(bc_ptr + b64 * bc_stride_b, r, c, byte, K, M // 32, (M // 32 + 3) // 4, 1)


@triton.jit(do_not_specialize=["rceil"])
def mx_quantize_kernel(
    x_ptr, qr_ptr, sr_ptr, qc_ptr, sc_ptr,
    M, K, B, M_cover, K_cover,
    stride_xb, stride_xm, stride_xk,
    sr_stride_b, sc_stride_b,
    br_ptr, bc_ptr, br_stride_b, bc_stride_b,
    rceil,
    ROW: tl.constexpr, COL: tl.constexpr, TILE32: tl.constexpr,
    ROW_LAYOUT: tl.constexpr, COL_LAYOUT: tl.constexpr, BLOCKED_COPY: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr, SOFT_CVT: tl.constexpr, K_FAST: tl.constexpr, GROUP: tl.constexpr = 32,
):
    """MXFP8 of x [B, M, K] (any strides), persistent: program p takes tiles p, p + P, ...

    ROW: data qr[b] [M, K] + scales sr[b] [M, K/32] (1x32 blocks along K, or the 32x32 tile's).
    COL: data qc[b] [K, M] (x transposed, M contiguous) + scales sc[b] [K, M/32] (blocks along M).
    TILE32: one scale per 32x32 tile (ROW and COL data then hold the same bytes).
    BLOCKED_COPY (row-major layouts, not compact): each output's scales also into br[b] / bc[b] in the 128x4
    blocked layout (layout 1), from the same pass.
    GROUP 128 (docs/DESIGN.md §9): one scale per 128 elements along each output's axis (1x128 along K, 128x1
    along M), with TILE32 per 128x128 tile; scales still stored per 32 (replicated). Needs BK % 128 == 0
    with ROW, BM % 128 == 0 with COL or TILE32.
    Tiles cover [M_cover, K_cover] (M, K rounded up to 128 when a blocked scale layout needs
    its zero padding written). The next tile is loaded before the current one is processed, so
    every program keeps a tile's loads in flight while it reduces, converts and stores.

        K ->  nb=0     nb=1  ...          one tile:
      M  +--------+--------+              [BM, BK] -> 4D [BM/32, 32, BK/32, 32]
      |  | 32x32  | 32x32  |              row blocks: 1 x 32 (max over axis 3)
      v  +--------+--------+              col blocks: 32 x 1 (max over axis 1)
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_m = tl.cdiv(M_cover, BM)
    n_k = tl.cdiv(K_cover, BK)
    total = n_m * n_k * B
    t = pid
    tt = _k_fastest(t, total, n_m, n_k) if K_FAST else t
    x = _load_tile(x_ptr, tt, total, n_m, n_k, M, K, stride_xb, stride_xm, stride_xk, BM, BK)
    while t < total:  # (a while loop: the interpreter cannot range over runtime bounds)
        tt_next = _k_fastest(t + nprog, total, n_m, n_k) if K_FAST else t + nprog
        x_next = _load_tile(x_ptr, tt_next, total, n_m, n_k, M, K, stride_xb, stride_xm, stride_xk, BM, BK)
        _quantize_tile(x, tt, n_m, n_k, qr_ptr, sr_ptr, qc_ptr, sc_ptr, M, K, sr_stride_b, sc_stride_b,
                       br_ptr, bc_ptr, br_stride_b, bc_stride_b, rceil,
                       ROW, COL, TILE32, ROW_LAYOUT, COL_LAYOUT, BLOCKED_COPY, BM, BK, SOFT_CVT, GROUP)
        x = x_next
        tt = tt_next
        t += nprog


@triton.jit
def _group_rows(p, pad_end, tiles, gmask, offs_ptr, bo_ptr, n_groups, M, SEARCH_BITS: tl.constexpr):
    """Input rows behind padded scale row p: (first row, end row, p lies inside a group).

    p's group g is the number of groups whose padded span ends at or before p. Vector search: one
    packed sum gives g (low 32 bits) and g's first padded row (high bits * 128); it is warp-local
    while EP fits one warp, but for more groups it becomes a cross-warp reduction (barriers, more
    registers: docs/quantization.md). SEARCH_BITS > 0 (2**SEARCH_BITS > n_groups): a branch-free binary
    search over the padded ends bo_ptr[0:n_groups] instead, SEARCH_BITS + 1 dependent scalar loads
    (L1 hits), no reduction.
    """
    if SEARCH_BITS > 0:
        g = p * 0
        for j in tl.static_range(SEARCH_BITS):
            cand = g + (1 << (SEARCH_BITS - 1 - j))
            v = tl.load(bo_ptr + cand - 1, mask=cand <= n_groups, other=2147483647)
            g = tl.where(v <= p, cand, g)
        pad_start = tl.load(bo_ptr + g - 1, mask=g > 0, other=0)
    else:
        packed = tl.sum(tl.where(gmask & (pad_end <= p), (tiles.to(tl.int64) << 32) + 1, 0), 0)
        g = (packed & 0xFFFFFFFF).to(tl.int32)
        pad_start = (packed >> 32).to(tl.int32) * 128
    start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
    in_group = g < n_groups
    end = tl.load(offs_ptr + g, mask=in_group, other=M)
    return start + (p - pad_start), end, in_group


@triton.jit
def _load_group_tile(x_ptr, t, total, n_t, pad_end, tiles, gmask, offs_ptr, bo_ptr, n_groups, M, K, stride_xm,
                     stride_xk, SEARCH_BITS: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """Tile t of the grouped input and its group rows (row0, row_end, in_group) from _group_rows,
    which the caller keeps for the tile's quantization (one group search per tile)."""
    tr = t % n_t
    tk = t // n_t
    row0, row_end, in_group = _group_rows(tr * BM, pad_end, tiles, gmask, offs_ptr, bo_ptr, n_groups, M,
                                          SEARCH_BITS)
    m = row0 + tl.arange(0, BM)[:, None]
    k = tk * BK + tl.arange(0, BK)[None, :]
    live = tl.full([BM, 1], t, tl.int32) < total
    mask = (m < row_end) & (m < M) & (k < K) & live
    x = tl.load(x_ptr + m.to(tl.int64) * stride_xm + k.to(tl.int64) * stride_xk, mask=mask, other=0.0)
    return x, row0, row_end, in_group


@triton.jit(do_not_specialize=["rceil"])
def mx_quantize_grouped_kernel(
    x_ptr, q_ptr, s_ptr, offs_ptr, bo_ptr, sr_ptr,
    M, K, stride_xm, stride_xk,
    n_groups, n_row_tiles, padded_rows, rceil,
    EP: tl.constexpr, SEARCH_BITS: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, SOFT_CVT: tl.constexpr,
    ROW_SCALE: tl.constexpr,
):
    """Rowwise MXFP8 of grouped rows x [M, K], scales straight into the per-group blocked layout.

    Group g holds rows [offs[g-1], offs[g]) and owns ceil(n_g/128)*128 rows of the blocked scale
    tensor (layouts.to_blocked_grouped). Tile (tr, tk) covers the BM padded scale rows from
    p = tr*BM (BM divides 128) and BK columns: it finds the group whose padded span holds p from
    the offsets alone (no host sync), quantizes the matching input rows, and writes zero scales
    for the padding rows. Tiles past the last group's padded rows quantize the tail rows
    [offs[-1], M) (data only; their scale rows, up to padded_rows, are zeros).
    n_row_tiles = max(cdiv(M,128) + n_groups, padded_rows/128) * 128/BM row tiles cover everything; with
    the scalar search the kernel runs exactly max(sum of padded spans + the tail rounded up to 128,
    padded_rows) / BM of them (half the bound for 128 groups of 128 rows).
    Every program writes the padded end offsets bo [n_groups] (int32, layouts.blocked_group_offsets;
    the same values, so the launch needs no torch ops around it), which the scalar group search
    (SEARCH_BITS > 0, _group_rows) reads back after a CTA barrier. Persistent with a one-tile
    prefetch, like mx_quantize_kernel.
    With ROW_SCALE the scales are also written row-major to sr [M, K/32] (every row, the tail's too).
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    # per-group padded spans, once per program
    g = tl.arange(0, EP)
    gmask = g < n_groups
    ends = tl.load(offs_ptr + g, mask=gmask, other=0)
    starts = tl.load(offs_ptr + g - 1, mask=gmask & (g > 0), other=0)
    tiles = tl.where(gmask, (ends - starts + 127) // 128, 0)
    pad_end = tl.cumsum(tiles, 0) * 128
    if SEARCH_BITS > 0:
        # exactly the row tiles the groups need (the argument is a bound), at least one (tiles are numbered
        # modulo it); with the vector search a loop bound from a reduction made ptxas keep a divergent copy
        # of the loop (+60% SASS)
        last = tl.load(offs_ptr + n_groups - 1, mask=n_groups > 0, other=0)
        rows = tl.maximum(tl.max(pad_end, 0) + tl.cdiv(M - last, 128) * 128, padded_rows)
        n_row_tiles = tl.maximum(rows, BM) // BM
        tl.store(bo_ptr + g, pad_end, mask=gmask)  # every program stores the same values, then reads them back
        tl.debug_barrier()
    else:
        # program 0 alone: a block comparison, not gmask & (pid == 0), whose broadcast scalar Triton 3.9's
        # interpreter turns into an int32 mask that its store rejects ('mask has unsupported dtype')
        tl.store(bo_ptr + g, pad_end, mask=g < tl.where(pid == 0, n_groups, 0))
    n_k = tl.cdiv(tl.cdiv(K, 128) * 128, BK)
    total = n_row_tiles * n_k
    n_col_tiles = (K // 32 + 3) // 4
    MB: tl.constexpr = BM // 32
    NB: tl.constexpr = BK // 32
    mb = tl.arange(0, MB)
    ii = tl.arange(0, 32)
    nb = tl.arange(0, NB)
    x, row0, row_end, in_group = _load_group_tile(x_ptr, pid, total, n_row_tiles, pad_end, tiles, gmask, offs_ptr,
                                                  bo_ptr, n_groups, M, K, stride_xm, stride_xk, SEARCH_BITS, BM, BK)
    t = pid
    while t < total:
        x_next, row0_next, row_end_next, in_group_next = _load_group_tile(
            x_ptr, t + nprog, total, n_row_tiles, pad_end, tiles, gmask, offs_ptr, bo_ptr, n_groups, M, K,
            stride_xm, stride_xk, SEARCH_BITS, BM, BK)
        tr = t % n_row_tiles
        tk = t // n_row_tiles
        p = tr * BM
        m = row0 + tl.arange(0, BM)[:, None]
        k = tk * BK + tl.arange(0, BK)[None, :]
        m64 = m.to(tl.int64)
        in_bounds = (m < row_end) & (m < M) & (k < K)
        xf = tl.reshape(_to_f32(x), (MB, 32, NB, 32))
        bits = xf.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        byte = _e8m0_from_amax_bits(tl.max(bits, axis=3), rceil)  # [MB, 32, NB]
        d = tl.reshape(_quantize_elems(xf, byte[:, :, :, None], SOFT_CVT), (BM, BK))
        tl.store(q_ptr + m64 * K + k, d, mask=in_bounds)
        if ROW_SCALE:
            rm = row0 + mb[:, None, None] * 32 + ii[None, :, None]  # [MB, 32, 1] input rows
            rc = tk * NB + nb[None, None, :]  # [1, 1, NB] scale columns
            rmask = (rm < row_end) & (rm < M) & (rc < K // 32)
            tl.store(sr_ptr + rm.to(tl.int64) * (K // 32) + rc, byte.to(tl.uint8), mask=rmask)
        # scales: padded rows p + local; rows outside any group (the tail) get zeros
        byte = tl.where(in_group, byte, 0)
        r = p + mb[:, None, None] * 32 + ii[None, :, None]  # [MB, 32, 1]
        c = tk * NB + nb[None, None, :]  # [1, 1, NB]
        smask = (r < padded_rows) & (c < n_col_tiles * 4)
        tl.store(s_ptr + _blocked_index(r.to(tl.int64), c, n_col_tiles), byte.to(tl.uint8), mask=smask)
        x, row0, row_end, in_group = x_next, row0_next, row_end_next, in_group_next
        t += nprog
