"""Triton kernels of the MoE layer around the expert products (bodies only; launch glue in
:mod:`mxmoe.kernels.layer`): row gather (the token permutation), weighted gather-sum (the top-k
combine, and the permutation's backward), the combine's backward, and SwiGLU with its backward.

Each replaces a chain of torch ops that writes and re-reads [rows, D] intermediates: in torch the
combine is index_select + broadcast multiply + sum (and in backward: zeros + index_copy, two broadcast
multiplies and a reduction); SwiGLU's backward is silu_backward, two multiplies and a cat.

Arithmetic: sums and products in FP32, one rounding to the output dtype. SwiGLU follows torch's
BF16 formulas op for op (see the kernels), so its outputs equal torch's bit for bit on the GPU.
Row indices are widened to int64 before they are multiplied by strides.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from mxmoe.kernels.qdq_triton import _expand_e4m3
from mxmoe.kernels.quantize_fused_triton import _silu_mul_bf16, _to_bf16
from mxmoe.kernels.quantize_triton import _to_f32


@triton.jit
def _store_as(ptr, x, mask, SOFT: tl.constexpr):
    """Store FP32 x into ptr's dtype, BF16 rounded to nearest even also under the interpreter."""
    if ptr.dtype.element_ty == tl.bfloat16:
        tl.store(ptr, _to_bf16(x, SOFT), mask=mask)
    else:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def gather_rows_kernel(x_ptr, src_ptr, out_ptr, M, D, T, stride_x, stride_out,
                       BR: tl.constexpr, BD: tl.constexpr):
    """out [M, D]: out[r] = x[src[r]] (x [T, D]); zero rows where src[r] is outside [0, T)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    src = tl.load(src_ptr + r, mask=r < M, other=-1).to(tl.int64)
    live = (src >= 0) & (src < T)
    v = tl.load(x_ptr + src[:, None] * stride_x + d[None, :], mask=live[:, None] & (d < D)[None, :], other=0.0)
    tl.store(out_ptr + r.to(tl.int64)[:, None] * stride_out + d[None, :], v, mask=(r < M)[:, None] & (d < D)[None, :])


@triton.jit
def gather_sum_kernel(src_ptr, idx_ptr, w_ptr, out_ptr, T, D, R, stride_src, stride_out,
                      TOP_K: tl.constexpr, HAS_W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                      SOFT: tl.constexpr):
    """out [T, D]: out[t] = sum_j w[t*TOP_K + j] * src[idx[t*TOP_K + j]] (w = 1 without HAS_W),
    summed in FP32 in order j = 0, 1, ..., rounded once to out's dtype. src has R rows; an index
    outside [0, R) reads nothing (adds zero) rather than out-of-bounds memory."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    tmask = t < T
    mask = tmask[:, None] & (d < D)[None, :]
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        s = t.to(tl.int64) * TOP_K + j
        row = tl.load(idx_ptr + s, mask=tmask, other=0).to(tl.int64)
        inside = ((row >= 0) & (row < R))[:, None]
        v = _to_f32(tl.load(src_ptr + row[:, None] * stride_src + d[None, :], mask=mask & inside, other=0.0))
        if HAS_W:
            v = v * tl.load(w_ptr + s, mask=tmask, other=0.0)[:, None]
        acc += v
    _store_as(out_ptr + t.to(tl.int64)[:, None] * stride_out + d[None, :], acc, mask, SOFT)


@triton.jit
def combine_backward_kernel(dy_ptr, w_ptr, yp_ptr, slot_ptr, dyp_ptr, dw_ptr, M, D,
                            stride_dy, stride_yp, stride_dyp,
                            TOP_K: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, SOFT: tl.constexpr):
    """Backward of y[t] = sum_j w[t, j] * yp[slot_rows[t*TOP_K + j]], one pass over the rows of yp.

    slot [M] int32: the slot s = t*TOP_K + j that row r feeds, or -1 (a padding row).
    dyp [M, D] = w[s] * dy[t] (zero for padding rows), rounded once to dyp's dtype;
    dw [T*TOP_K] FP32: dw[s] = sum_d dy[t, d] * yp[r, d] (FP32, deterministic: one program per row
    block loops over D).
    """
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = r < M
    s = tl.load(slot_ptr + r, mask=rmask, other=-1)
    live = s >= 0
    tok = tl.where(live, s // TOP_K, 0).to(tl.int64)
    w = tl.load(w_ptr + s, mask=live, other=0.0)
    r64 = r.to(tl.int64)
    dot = tl.zeros([BR], dtype=tl.float32)
    d0 = 0
    while d0 < D:  # (a while loop: the interpreter cannot range over runtime bounds)
        d = d0 + tl.arange(0, BD)
        dmask = (d < D)[None, :]
        g = _to_f32(tl.load(dy_ptr + tok[:, None] * stride_dy + d[None, :], mask=live[:, None] & dmask, other=0.0))
        y = _to_f32(tl.load(yp_ptr + r64[:, None] * stride_yp + d[None, :], mask=live[:, None] & dmask, other=0.0))
        _store_as(dyp_ptr + r64[:, None] * stride_dyp + d[None, :], g * w[:, None], rmask[:, None] & dmask, SOFT)
        dot += tl.sum(g * y, axis=1)
        d0 += BD
    tl.store(dw_ptr + s, dot, mask=live)


@triton.jit
def to_float32_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out[i] = float32(x[i]) for a flat contiguous x (exact for BF16/FP16): 16-byte loads, where
    torch's dtype-converting copy takes an unvectorized path."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, _to_f32(tl.load(x_ptr + i, mask=i < n)), mask=i < n)


@triton.jit
def _swiglu_grads_bf16(da_raw, gate_raw, up_raw, SOFT: tl.constexpr):
    """(d_gate, d_up) in BF16 for ``a = F.silu(gate) * up`` (all BF16), torch autograd's arithmetic
    op for op: d_up = bf16(da * bf16(silu(g))); d_gate = silu_backward(bf16(da * up), g), i.e. in
    FP32 ``t * s * (1 + g * (1 - s))`` with s = 1 / (1 + exp(-g)) (the inner ``1 + g*(1-s)`` one
    FMA, as nvcc contracts it), rounded to BF16. silu and the exp/division are those of
    quantize_fused_triton._silu_mul_bf16 (CUDA's expf, IEEE division; numpy's under the interpreter)."""
    g = _to_f32(gate_raw)
    da = _to_f32(da_raw)
    if SOFT:
        e = 1.0 + tl.exp(-g)
        silu = g / e
        s = 1.0 / e
        inner = 1.0 + g * (1.0 - s)
    else:
        e = 1.0 + libdevice.exp(-g)
        silu = tl.math.div_rn(g, e)
        s = tl.math.div_rn(1.0, e)
        inner = tl.fma(g, 1.0 - s, 1.0)
    t = _to_f32(_to_bf16(da * _to_f32(up_raw), SOFT))
    d_up = _to_bf16(da * _to_f32(_to_bf16(silu, SOFT)), SOFT)
    return _to_bf16(t * s * inner, SOFT), d_up


@triton.jit
def _swiglu_rows(h_ptr, M, F, stride_h, BR: tl.constexpr, BF: tl.constexpr):
    """This program's [BR, BF] tile of the [M, F] grid: (rows as int64 [BR, 1], columns [1, BF],
    mask, pointers to the gate half of h; the up half is F further)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    f = tl.program_id(1) * BF + tl.arange(0, BF)
    mask = (r < M)[:, None] & (f < F)[None, :]
    r64 = r.to(tl.int64)[:, None]
    return r64, f[None, :], mask, h_ptr + r64 * stride_h + f[None, :]


@triton.jit
def swiglu_kernel(h_ptr, a_ptr, M, F, stride_h, stride_a, BR: tl.constexpr, BF: tl.constexpr, SOFT: tl.constexpr):
    """a [M, F] = silu(gate) * up of h [M, 2F] bf16 (gate = h[:, :F], up = h[:, F:]), as torch
    computes ``F.silu(gate) * up`` in BF16 (quantize_fused_triton._silu_mul_bf16, shared with the fused
    SwiGLU + QDQ kernel)."""
    r64, f, mask, gp = _swiglu_rows(h_ptr, M, F, stride_h, BR, BF)
    a = _silu_mul_bf16(tl.load(gp, mask=mask, other=0.0), tl.load(gp + F, mask=mask, other=0.0), SOFT)
    tl.store(a_ptr + r64 * stride_a + f, a, mask=mask)


@triton.jit
def _mx_half(q_ptr, s_ptr, r64, c0, n_blocks, mask, M, stride_s, BR: tl.constexpr, BF: tl.constexpr):
    """BF16 MX values of h's E4M3 bytes at q_ptr [BR, BF] with their row-major E8M0 scales, whose
    first column is c0 (n_blocks of this tile's 32-element blocks lie inside the half): one scale
    load per block, broadcast over its 32 elements."""
    NB: tl.constexpr = BF // 32
    c = tl.arange(0, NB)[None, :]  # [1, NB]
    byte = tl.load(s_ptr + r64 * stride_s + c0 + c, mask=(r64 < M) & (c < n_blocks), other=127)
    q = tl.reshape(tl.load(q_ptr, mask=mask, other=0), (BR, NB, 32))
    return tl.reshape(_expand_e4m3(q, byte.to(tl.int32)[:, :, None]), (BR, BF))


@triton.jit
def swiglu_backward_kernel(da_ptr, h_ptr, hs_ptr, dh_ptr, M, F, stride_da, stride_h, stride_hs, stride_dh,
                           MX: tl.constexpr, BR: tl.constexpr, BF: tl.constexpr, SOFT: tl.constexpr):
    """dh [M, 2F] from da [M, F] and h [M, 2F] (all bf16), the gradient torch's autograd computes
    for ``F.silu(gate) * up`` in BF16, op for op (_swiglu_grads_bf16). MX: h is E4M3 bytes with
    E8M0 scales hs [M, 2F/32] (row-major, F % 32 == 0), expanded to its BF16 MX values first."""
    r64, f, mask, gp = _swiglu_rows(h_ptr, M, F, stride_h, BR, BF)
    da = tl.load(da_ptr + r64 * stride_da + f, mask=mask, other=0.0)
    if MX:
        f0 = tl.program_id(1) * BF  # a multiple of 32, as F is
        n_blocks = (F - f0) // 32
        gate = _mx_half(gp, hs_ptr, r64, f0 // 32, n_blocks, mask, M, stride_hs, BR, BF)
        up = _mx_half(gp + F, hs_ptr, r64, (F + f0) // 32, n_blocks, mask, M, stride_hs, BR, BF)
    else:
        gate = tl.load(gp, mask=mask, other=0.0)
        up = tl.load(gp + F, mask=mask, other=0.0)
    d_gate, d_up = _swiglu_grads_bf16(da, gate, up, SOFT)
    dp = dh_ptr + r64 * stride_dh + f
    tl.store(dp, d_gate, mask=mask)
    tl.store(dp + F, d_up, mask=mask)


@triton.jit
def _split3_bf16(x, SOFT: tl.constexpr):
    """FP32 ``x`` as three BF16 pieces with ``hi + mid + lo == x`` exactly (8 + 8 + 8 significand bits,
    each rounded to nearest even from the remainder of the pieces before it)."""
    hi = _to_bf16(x, SOFT)
    r = x - _to_f32(hi)
    mid = _to_bf16(r, SOFT)
    return hi, mid, _to_bf16(r - _to_f32(mid), SOFT)


@triton.jit
def _dot_bf16(a, b, acc, SOFT: tl.constexpr):
    """``acc + a @ b`` of BF16 tiles with FP32 sums (tensor cores); SOFT: as FP32 operands, whose
    products of BF16 values are just as exact (the interpreter's BF16 handling is not)."""
    if SOFT:
        return tl.dot(_to_f32(a), _to_f32(b), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def router_logits_kernel(x_ptr, w_ptr, out_ptr, T, D, E, stride_x,
                         BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, SOFT: tl.constexpr):
    """out [T, E] FP32 = x @ w^T for BF16 x [T, D] and an FP32 weight given as its three BF16 pieces
    w [3, E, D] (:func:`_split3_bf16`): BF16 x BF16 products are exact in FP32 and the tensor cores sum
    them in FP32 (each BK-deep partial then added in FP32), so this is the FP32 product up to summation
    order and the tensor cores' accumulation (H200, D 1024: 3e-6 relative to FP64 without the per-BK adds,
    cuBLAS SGEMM 3e-7)."""
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    e = tl.arange(0, BE)
    acc = tl.zeros([BT, BE], dtype=tl.float32)
    for k0 in range(0, D, BK):
        k = k0 + tl.arange(0, BK)
        xt = tl.load(x_ptr + t[:, None] * stride_x + k[None, :], mask=(t < T)[:, None] & (k < D)[None, :], other=0.0)
        part = tl.zeros([BT, BE], dtype=tl.float32)
        for j in tl.static_range(3):  # the small pieces first
            wt = tl.load(w_ptr + ((2 - j) * E + e[:, None]).to(tl.int64) * D + k[None, :],
                         mask=(e < E)[:, None] & (k < D)[None, :], other=0.0)
            part = _dot_bf16(xt, tl.trans(wt), part, SOFT)
        acc += part  # the tensor cores' own FP32 sums round coarser than FP32 adds: summed here per BK
    tl.store(out_ptr + t[:, None] * E + e[None, :], acc, mask=(t < T)[:, None] & (e < E)[None, :])


@triton.jit
def split_bf16_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, SOFT: tl.constexpr):
    """out [3, n] BF16: the three pieces (:func:`_split3_bf16`) of x [n] (any float dtype, widened to FP32)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    hi, mid, lo = _split3_bf16(tl.load(x_ptr + i, mask=live, other=0.0).to(tl.float32), SOFT)
    tl.store(out_ptr + i, hi, mask=live)
    tl.store(out_ptr + n + i, mid, mask=live)
    tl.store(out_ptr + 2 * n + i, lo, mask=live)


@triton.jit
def router_dx_kernel(dl_ptr, w_ptr, dx_ptr, T, D, E, stride_dx,
                     BT: tl.constexpr, BE: tl.constexpr, BD: tl.constexpr, SOFT: tl.constexpr):
    """dx [T, D] = dl @ w in FP32, rounded once to dx's dtype, for FP32 dl [T, E] and w [3, E, D] (the
    FP32 weight's BF16 pieces): dl split into BF16 pieces too, every product of pieces whose combined
    weight is at least 2^-16 of the leading one (6 of the 9), smallest first."""
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    e = tl.arange(0, BE)
    dl = tl.load(dl_ptr + t[:, None] * E + e[None, :], mask=(t < T)[:, None] & (e < E)[None, :], other=0.0)
    d_hi, d_mid, d_lo = _split3_bf16(dl, SOFT)
    wm = (e < E)[:, None] & (d < D)[None, :]
    w_off = e[:, None].to(tl.int64) * D + d[None, :]
    w_hi = tl.load(w_ptr + w_off, mask=wm, other=0.0)
    w_mid = tl.load(w_ptr + E * D + w_off, mask=wm, other=0.0)
    w_lo = tl.load(w_ptr + 2 * E * D + w_off, mask=wm, other=0.0)
    acc = _dot_bf16(d_lo, w_hi, tl.zeros([BT, BD], dtype=tl.float32), SOFT)
    acc = _dot_bf16(d_mid, w_mid, acc, SOFT)
    acc = _dot_bf16(d_hi, w_lo, acc, SOFT)
    acc = _dot_bf16(d_mid, w_hi, acc, SOFT)
    acc = _dot_bf16(d_hi, w_mid, acc, SOFT)
    acc = _dot_bf16(d_hi, w_hi, acc, SOFT)
    _store_as(dx_ptr + t[:, None] * stride_dx + d[None, :], acc, (t < T)[:, None] & (d < D)[None, :], SOFT)


@triton.jit
def router_dw_kernel(dl_ptr, x_ptr, part_ptr, T, D, E, stride_x, rows_per_split,
                     BT: tl.constexpr, BE: tl.constexpr, BD: tl.constexpr, SOFT: tl.constexpr):
    """part [S, E, D] FP32: program (j, s) sums dl^T @ x over tokens [s * rows_per_split, (s + 1) *
    rows_per_split) for columns j * BD ...; dl as its three BF16 pieces [3, T, E] (:func:`_split3_bf16`),
    BF16 x [T, D]: every product exact, each partial the FP32 product up to summation order."""
    d = tl.program_id(0) * BD + tl.arange(0, BD)
    t_begin = tl.program_id(1) * rows_per_split
    t_end = tl.minimum(t_begin + rows_per_split, T)
    e = tl.arange(0, BE)
    acc = tl.zeros([BE, BD], dtype=tl.float32)
    for t0 in range(t_begin, t_end, BT):
        t = (t0 + tl.arange(0, BT)).to(tl.int64)
        live = t < t_end
        xt = tl.load(x_ptr + t[:, None] * stride_x + d[None, :], mask=live[:, None] & (d < D)[None, :], other=0.0)
        for j in tl.static_range(3):  # the small pieces first
            dl = tl.load(dl_ptr + ((2 - j) * T + t[:, None]) * E + e[None, :], mask=live[:, None] & (e < E)[None, :],
                         other=0.0)
            acc = _dot_bf16(tl.trans(dl), xt, acc, SOFT)
    out = part_ptr + (tl.program_id(1) * E + e[:, None]).to(tl.int64) * D + d[None, :]
    tl.store(out, acc, mask=(e < E)[:, None] & (d < D)[None, :])
