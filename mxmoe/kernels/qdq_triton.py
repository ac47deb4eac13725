"""Triton kernel of MXFP8 quantize-dequantize (QDQ): the BF16 values of MX quantization from one read of x, for the
Hopper expansion route (BF16 tensor cores multiply exactly the MX values). Same numerics as
:mod:`mxmoe.kernels.quantize_triton` (_e8m0_from_amax_bits, _quantize_elems) followed by the one MX -> BF16
expansion of mxmoe.kernels.dequantize, so every BF16 output equals dequantize_bf16(quantize(x)) bit for bit.
(The body only; its launchers are :mod:`mxmoe.kernels.qdq`.) Importing this module imports triton.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mxmoe.kernels.dequantize import mx_expand_bf16
from mxmoe.kernels.quantize_triton import _e8m0_from_amax_bits, _load_tile, _quantize_elems, _store_scales, _tile_frame


@triton.jit
def _expand_e4m3(q_bytes, byte):
    """BF16 values of E4M3 bytes (uint8) with scale bytes ``byte`` (broadcast), as dequantize_bf16."""
    return mx_expand_bf16(q_bytes.to(tl.float8e4nv, bitcast=True).to(tl.float32), byte)


@triton.jit
def _qdq_tile(
    x_raw, t, n_m, n_k, br_ptr, bc_ptr, qc_ptr, sc_ptr, M, K, rceil,
    ROW_BF16: tl.constexpr, COL_BF16: tl.constexpr, COL_FP8: tl.constexpr, TILE32: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr, SOFT_CVT: tl.constexpr,
):
    """QDQ outputs of one loaded tile (see mx_qdq_kernel)."""
    b64, tm, tk, m, k, m64, k64, in_bounds, x, bits, plane = _tile_frame(x_raw, t, n_m, n_k, M, K, BM, BK)
    MB: tl.constexpr = BM // 32
    NB: tl.constexpr = BK // 32
    if TILE32:  # one byte per 32x32 tile, spread over both block shapes
        tile = _e8m0_from_amax_bits(tl.max(tl.max(bits, axis=3), axis=1), rceil)  # [MB, NB]
        byte_r = tl.broadcast_to(tile[:, None, :], (MB, 32, NB))
        byte_c = tl.broadcast_to(tile[:, :, None], (MB, NB, 32))
    else:
        if ROW_BF16:
            byte_r = _e8m0_from_amax_bits(tl.max(bits, axis=3), rceil)  # [MB, 32, NB]
        if COL_BF16 or COL_FP8:
            byte_c = _e8m0_from_amax_bits(tl.max(bits, axis=1), rceil)  # [MB, NB, 32]
    if ROW_BF16:  # along K, [B, M, K]
        q = _quantize_elems(x, byte_r[:, :, :, None], SOFT_CVT)
        v = tl.reshape(_expand_e4m3(q, byte_r[:, :, :, None]), (BM, BK))
        tl.store(br_ptr + plane + m64 * K + k, v, mask=in_bounds)
    if COL_BF16 or COL_FP8:  # along M, written transposed [B, K, M]
        q = _quantize_elems(x, byte_c[:, None, :, :], SOFT_CVT)
        if COL_FP8:
            tl.store(qc_ptr + plane + k64 * M + m, tl.reshape(q, (BM, BK)), mask=in_bounds)
            mb = tl.arange(0, MB)
            r = tk * BK + tl.arange(0, NB)[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]  # [1, NB, 32]
            c = tm * MB + mb[:, None, None]  # [MB, 1, 1]
            _store_scales(sc_ptr + b64 * K * (M // 32), r, c, byte_c, K, M // 32, 0, 0)
        if COL_BF16:
            v = tl.reshape(_expand_e4m3(q, byte_c[:, None, :, :]), (BM, BK))
            tl.store(bc_ptr + plane + k64 * M + m, v, mask=in_bounds)


@triton.jit(do_not_specialize=["rceil"])
def mx_qdq_kernel(
    x_ptr, br_ptr, bc_ptr, qc_ptr, sc_ptr,
    M, K, B, stride_xb, stride_xm, stride_xk, rceil,
    ROW_BF16: tl.constexpr, COL_BF16: tl.constexpr, COL_FP8: tl.constexpr, TILE32: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr, SOFT_CVT: tl.constexpr,
):
    """QDQ of x [B, M, K] (any strides), persistent with a one-tile prefetch like mx_quantize_kernel.

    ROW_BF16: br[b] [M, K] bf16, the MX values along K (1x32 blocks, or the 32x32 tile's scale).
    COL_BF16: bc[b] [K, M] bf16, the MX values along M, transposed (M contiguous).
    COL_FP8: qc[b] [K, M] E4M3 + sc[b] [K, M/32] E8M0 row-major: quantize_columnwise's output.
    TILE32: one scale per 32x32 tile for all outputs.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_m = tl.cdiv(M, BM)
    n_k = tl.cdiv(K, BK)
    total = n_m * n_k * B
    x = _load_tile(x_ptr, pid, total, n_m, n_k, M, K, stride_xb, stride_xm, stride_xk, BM, BK)
    t = pid
    while t < total:
        x_next = _load_tile(x_ptr, t + nprog, total, n_m, n_k, M, K, stride_xb, stride_xm, stride_xk, BM, BK)
        _qdq_tile(x, t, n_m, n_k, br_ptr, bc_ptr, qc_ptr, sc_ptr, M, K, rceil,
                  ROW_BF16, COL_BF16, COL_FP8, TILE32, BM, BK, SOFT_CVT)
        x = x_next
        t += nprog
