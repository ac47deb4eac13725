"""Triton kernels of the fused MXFP8 quantizers: SwiGLU fused with the dual QDQ (or 1x128 quantization) of its output
(the down-projection's input), and the token permutation fused with the dual QDQ (or 1x128 quantization) of the
gathered rows (the first expert product's input); the BF16 SwiGLU math shared with :mod:`mxmoe.kernels.layer_triton`
and :mod:`mxmoe.kernels.quantize_gluon`. (The bodies only; launchers in :mod:`mxmoe.kernels.quantize_fused`.)
Importing this module imports triton.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from mxmoe.kernels.qdq_triton import _qdq_tile
from mxmoe.kernels.quantize_triton import (_e8m0_from_amax_bits, _load_tile, _max4, _quantize_elems, _quantize_tile,
                                           _tile_coords, _to_f32)


# ----------------------------------------------------------------------------------------------
# SwiGLU fused with the dual QDQ of its output (the down-projection's input on the expansion route)
# ----------------------------------------------------------------------------------------------
@triton.jit
def _to_bf16(x, SOFT: tl.constexpr):
    """FP32 -> BF16, round to nearest even. SOFT: on the integer bits (the interpreter's numpy
    conversion truncates); NaN stays a quiet NaN."""
    if SOFT:
        b = x.to(tl.int32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        r = tl.where((b & 0x7FFFFFFF) > 0x7F800000, (b >> 16) | 0x40, r)
        return r.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def _silu_mul_bf16(gate_raw, up_raw, SOFT: tl.constexpr):
    """BF16 ``silu(gate) * up`` for BF16 gate/up, as torch computes ``F.silu(gate) * up``: silu in
    FP32 as ``g / (1 + exp(-g))`` (CUDA expf, IEEE division) rounded to BF16, then the FP32 product
    (exact for two BF16 values) rounded to BF16. SOFT (interpreter): numpy's exp and division."""
    g = _to_f32(gate_raw)
    if SOFT:
        s = g / (1.0 + tl.exp(-g))
    else:
        s = tl.math.div_rn(g, 1.0 + libdevice.exp(-g))
    return _to_bf16(_to_f32(_to_bf16(s, SOFT)) * _to_f32(up_raw), SOFT)


@triton.jit
def _fused_dual_tile(x, t, n_m, n_k, br_ptr, sr_ptr, qc_ptr, sc_ptr, M, K, rceil, BM: tl.constexpr, BK: tl.constexpr,
                     SOFT_CVT: tl.constexpr, ROW_FP8: tl.constexpr, GROUP: tl.constexpr):
    """The fused kernels' outputs of one computed tile x of a [M, K] grid: its rows as BF16 MX values into br
    (1x32), or with ROW_FP8 as E4M3 into br + scales sr (GROUP 32 or 128), and its columns E4M3 qc [K, M] + sc."""
    if ROW_FP8:
        _quantize_tile(x, t, n_m, n_k, br_ptr, sr_ptr, qc_ptr, sc_ptr, M, K, 0, 0, sr_ptr, sc_ptr, 0, 0, rceil,
                       True, True, False, 0, 0, False, BM, BK, SOFT_CVT, GROUP)
    else:
        _qdq_tile(x, t, n_m, n_k, br_ptr, br_ptr, qc_ptr, sc_ptr, M, K, rceil,
                  True, False, True, False, BM, BK, SOFT_CVT)


@triton.jit
def _quantize_rows_into(x_raw, t, n_m, n_k, q_ptr, s_ptr, M, K, ldq, rceil,
                        BM: tl.constexpr, BK: tl.constexpr, SOFT_CVT: tl.constexpr, GROUP: tl.constexpr = 32):
    """Quantize one loaded tile of a [M, K] grid along its rows (1x32 blocks; GROUP 128: 1x128 groups,
    BK % 128 == 0) into columns of a wider row-major destination: data q [M, ldq] E4M3 bytes, scales
    s [M, ldq/32] E8M0 bytes (q_ptr / s_ptr already offset to the grid's first column; K % GROUP == 0)."""
    _, tm, tk = _tile_coords(t, n_m, n_k)
    NB: tl.constexpr = BK // 32
    m = (tm * BM + tl.arange(0, BM))[:, None]  # [BM, 1]
    x = tl.reshape(_to_f32(x_raw), (BM, NB, 32))
    amax = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2)  # [BM, NB]
    if GROUP == 128:
        amax = tl.max(_max4(amax[:, :, None], 1), axis=2)
    byte = _e8m0_from_amax_bits(amax, rceil)  # [BM, NB]
    d = tl.reshape(_quantize_elems(x, byte[:, :, None], SOFT_CVT), (BM, BK))
    k = tk * BK + tl.arange(0, BK)[None, :]
    tl.store(q_ptr + m.to(tl.int64) * ldq + k, d, mask=(m < M) & (k < K))
    c = tk * NB + tl.arange(0, NB)[None, :]
    tl.store(s_ptr + m.to(tl.int64) * (ldq // 32) + c, byte.to(tl.uint8), mask=(m < M) & (c < K // 32))


@triton.jit(do_not_specialize=["rceil"])
def mx_swiglu_qdq_kernel(
    h_ptr, br_ptr, sr_ptr, qc_ptr, sc_ptr, qh_ptr, sh_ptr, M, F, stride_hm, stride_hk, rceil,
    SAVE_H: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, SOFT_CVT: tl.constexpr,
    ROW_FP8: tl.constexpr = False, GROUP: tl.constexpr = 32,
):
    """h [M, 2F] bf16 (gate = h[:, :F], up = h[:, F:]) -> a = silu(gate) * up as BF16 MX values
    along F, br [M, F], plus a's FP8 copy along M, qc [F, M] + sc [F, M/32] (mx_qdq_kernel's
    ROW_BF16 + COL_FP8 outputs of a); a itself is never written. SAVE_H: also h quantized along
    2F, qh [M, 2F] E4M3 + sh [M, 2F/32] E8M0 (quantize_rowwise of h, bit for bit), from the same
    read of h. Persistent, one-tile prefetch.
    ROW_FP8: a's rows as E4M3 into br (uint8 [M, F]) + scales sr [M, F/32] instead of BF16 values
    (quantize_dual of a; sr unused otherwise). GROUP 128: 1x128 / 128x1 groups for every output
    (quantize_dual_128 of a, h's rows 1x128), BM and BK multiples of 128."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_m = tl.cdiv(M, BM)
    n_k = tl.cdiv(F, BK)
    total = n_m * n_k
    up_ptr = h_ptr + F * stride_hk
    gate = _load_tile(h_ptr, pid, total, n_m, n_k, M, F, 0, stride_hm, stride_hk, BM, BK)
    up = _load_tile(up_ptr, pid, total, n_m, n_k, M, F, 0, stride_hm, stride_hk, BM, BK)
    t = pid
    while t < total:
        gate_next = _load_tile(h_ptr, t + nprog, total, n_m, n_k, M, F, 0, stride_hm, stride_hk, BM, BK)
        up_next = _load_tile(up_ptr, t + nprog, total, n_m, n_k, M, F, 0, stride_hm, stride_hk, BM, BK)
        a = _silu_mul_bf16(gate, up, SOFT_CVT)
        _fused_dual_tile(a, t, n_m, n_k, br_ptr, sr_ptr, qc_ptr, sc_ptr, M, F, rceil, BM, BK, SOFT_CVT, ROW_FP8, GROUP)
        if SAVE_H:
            _quantize_rows_into(gate, t, n_m, n_k, qh_ptr, sh_ptr, M, F, 2 * F, rceil, BM, BK, SOFT_CVT, GROUP)
            _quantize_rows_into(up, t, n_m, n_k, qh_ptr + F, sh_ptr + F // 32, M, F, 2 * F, rceil, BM, BK, SOFT_CVT,
                                GROUP)
        gate = gate_next
        up = up_next
        t += nprog


# ----------------------------------------------------------------------------------------------
# Token permutation fused with the dual QDQ (the first expert product's input on the expansion route)
# ----------------------------------------------------------------------------------------------
@triton.jit
def _load_gathered_tile(x_ptr, src_ptr, t, total, n_m, n_k, M, K, T, stride_xm, stride_xk,
                        BM: tl.constexpr, BK: tl.constexpr):
    """Tile number t of the gathered matrix xp [M, K], xp[m] = x[src[m]] (zeros where src[m] is
    outside [0, T), past the edges and for t >= total): _load_tile with a gathered row pointer."""
    _, tm, tk = _tile_coords(t, n_m, n_k)
    m = tm * BM + tl.arange(0, BM)[:, None]  # [BM, 1]
    k = tk * BK + tl.arange(0, BK)[None, :]  # [1, BK]
    live = tl.full([BM, 1], t, tl.int32) < total
    row = tl.load(src_ptr + m, mask=(m < M) & live, other=-1).to(tl.int64)  # [BM, 1] source token
    mask = (row >= 0) & (row < T) & (k < K)
    return tl.load(x_ptr + row * stride_xm + k.to(tl.int64) * stride_xk, mask=mask, other=0.0)


@triton.jit(do_not_specialize=["rceil"])
def mx_permute_qdq_kernel(
    x_ptr, src_ptr, br_ptr, sr_ptr, qc_ptr, sc_ptr, M, K, T, stride_xm, stride_xk, rceil,
    BM: tl.constexpr, BK: tl.constexpr, SOFT_CVT: tl.constexpr, ROW_FP8: tl.constexpr = False,
    GROUP: tl.constexpr = 32,
):
    """x [T, K] (any strides) gathered by src [M] (int32/int64 token per row, -1: a zero row) into
    xp [M, K], xp never written: br [M, K] bf16 (xp's MX values along K) + qc [K, M] / sc [K, M/32]
    (xp along M), i.e. mx_qdq_kernel's ROW_BF16 + COL_FP8 outputs of xp. Persistent, one-tile prefetch.
    ROW_FP8: xp's rows as E4M3 into br (uint8 [M, K]) + scales sr [M, K/32] instead (quantize_dual of
    xp; sr unused otherwise). GROUP 128: 1x128 / 128x1 groups (quantize_dual_128 of xp), BM and BK
    multiples of 128."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_m = tl.cdiv(M, BM)
    n_k = tl.cdiv(K, BK)
    total = n_m * n_k
    x = _load_gathered_tile(x_ptr, src_ptr, pid, total, n_m, n_k, M, K, T, stride_xm, stride_xk, BM, BK)
    t = pid
    while t < total:
        x_next = _load_gathered_tile(x_ptr, src_ptr, t + nprog, total, n_m, n_k, M, K, T, stride_xm, stride_xk,
                                     BM, BK)
        _fused_dual_tile(x, t, n_m, n_k, br_ptr, sr_ptr, qc_ptr, sc_ptr, M, K, rceil, BM, BK, SOFT_CVT, ROW_FP8, GROUP)
        x = x_next
        t += nprog
