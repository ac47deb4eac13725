"""Launch glue of the MoE layer's kernels around the expert products (bodies in
:mod:`mxmoe.kernels.layer_triton`). CUDA tensors (or CPU under ``TRITON_INTERPRET=1``); callers
validate shapes (these are reached through :mod:`mxmoe.ops`, which checks them once).

==========================  ====================================================================
``gather_rows``             x ``[T, D]``, src ``[M]`` int (-1: zero row) -> ``x[src]`` ``[M, D]``
``gather_sum``              src ``[M, D]``, idx ``[T*k]`` int64, optional w ``[T*k]`` fp32 ->
                            ``sum_j w * src[idx]`` ``[T, D]`` (FP32 sums, one rounding)
``combine_backward``        (dy ``[T, D]``, w ``[T*k]``, yp ``[M, D]``, slot ``[M]`` int32) ->
                            (dyp ``[M, D]``, dw ``[T*k]`` fp32)
``swiglu``                  h ``[M, 2F]`` bf16 -> ``silu(h[:, :F]) * h[:, F:]`` ``[M, F]`` bf16
``swiglu_backward``         (da ``[M, F]``, h ``[M, 2F]``) bf16 -> dh ``[M, 2F]`` bf16; or h as MXFP8
                            along 2F (data e4m3 + h_scale ``[M, 2F/32]`` e8m0), expanded in the kernel
``to_float32``              bf16/fp16/fp32 x (any shape) -> float32 copy (e.g. a weight gradient)
``router_logits``           bf16 x ``[T, D]``, w3 ``[3, E, D]`` bf16 (an FP32 weight's pieces, E <= 128)
                            -> FP32 ``x @ w^T`` ``[T, E]``
``split_bf16``              x (bf16/fp16/fp32, any shape) -> ``[3, *x.shape]`` bf16 pieces summing to x exactly
``router_dx``               (dl ``[T, E]`` fp32, w3) -> ``dl @ w`` ``[T, D]`` bf16
``router_dw``               (dl3 ``[3, T, E]``: the pieces of FP32 dl, x ``[T, D]`` bf16) -> ``dl^T @ x`` ``[E, D]`` fp32
==========================  ====================================================================
"""

from __future__ import annotations

import torch

from mxmoe.backend import interpreting as _soft
from mxmoe.backend import sm_count
from mxmoe.kernels.quantize_launch import triton_cdiv as _cdiv

_BLOCK_ROWS, _BLOCK_COLS, _WARPS = 4, 1024, 4  # [4, 1024] tiles: 8 KB of BF16 per program, 16-byte accesses
# swiglu_backward: one row per program (H200, h [32768, 8192]: 98% of copy against 91% at 4 rows;
# docs/quantization.md)
_BWD_ROWS = 1


def _k():
    from mxmoe.kernels import layer_triton

    return layer_triton


def _rows_last_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _grid(rows: int, cols: int, block_rows: int = _BLOCK_ROWS):
    """Programs of a [rows, cols] launch in [block_rows, _BLOCK_COLS] tiles."""
    return (_cdiv(rows, block_rows), _cdiv(cols, _BLOCK_COLS))


def gather_rows(x: torch.Tensor, src: torch.Tensor, rows: int) -> torch.Tensor:
    """``out[r] = x[src[r]]`` for ``r < rows`` (zero rows where ``src[r]`` is -1 or out of range)."""
    x = _rows_last_contiguous(x)
    T, D = x.shape
    out = torch.empty(rows, D, dtype=x.dtype, device=x.device)
    if rows and D:
        _k().gather_rows_kernel[_grid(rows, D)](x, src, out, rows, D, T, x.stride(0), out.stride(0),
                                      BR=_BLOCK_ROWS, BD=_BLOCK_COLS, num_warps=_WARPS)
    return out


def gather_sum(src: torch.Tensor, idx: torch.Tensor, top_k: int, w: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t] = sum_j w[t*top_k + j] * src[idx[t*top_k + j]]`` ``[T, D]`` in src's dtype (FP32 sums)."""
    src = _rows_last_contiguous(src)
    T, D = idx.numel() // top_k, src.shape[1]
    out = torch.empty(T, D, dtype=src.dtype, device=src.device)
    if T and D:
        _k().gather_sum_kernel[_grid(T, D)](src, idx, w if w is not None else src, out, T, D, src.shape[0],
                                     src.stride(0), out.stride(0),
                                     TOP_K=top_k, HAS_W=w is not None, BT=_BLOCK_ROWS, BD=_BLOCK_COLS,
                                     SOFT=_soft(), num_warps=_WARPS)
    return out


def combine_backward(dy: torch.Tensor, w: torch.Tensor, yp: torch.Tensor, slot: torch.Tensor, top_k: int):
    """Gradients of ``y = gather_sum(yp, slot_rows, top_k, w)``: ``(dyp [M, D] in yp's dtype, dw [T*k] fp32)``;
    ``slot [M]`` int32 is the inverse of slot_rows (-1 on padding rows)."""
    dy, yp = _rows_last_contiguous(dy), _rows_last_contiguous(yp)
    M, D = yp.shape
    dyp = torch.empty(M, D, dtype=yp.dtype, device=yp.device)
    dw = torch.zeros(w.numel(), dtype=torch.float32, device=yp.device)  # slots whose row is missing stay 0
    if M and D:
        grid = (_cdiv(M, _BLOCK_ROWS),)
        _k().combine_backward_kernel[grid](dy, w, yp, slot, dyp, dw, M, D, dy.stride(0), yp.stride(0),
                                           dyp.stride(0), TOP_K=top_k, BR=_BLOCK_ROWS, BD=_BLOCK_COLS,
                                           SOFT=_soft(), num_warps=_WARPS)
    return dyp, dw


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """``silu(h[:, :F]) * h[:, F:]`` of bf16 ``h [M, 2F]`` (torch's BF16 arithmetic, bit for bit)."""
    h = _rows_last_contiguous(h)
    M, F = h.shape[0], h.shape[1] // 2
    a = torch.empty(M, F, dtype=torch.bfloat16, device=h.device)
    if M and F:
        _k().swiglu_kernel[_grid(M, F)](h, a, M, F, h.stride(0), a.stride(0), BR=_BLOCK_ROWS,
                                        BF=_BLOCK_COLS, SOFT=_soft(), num_warps=_WARPS)
    return a


def swiglu_backward(da: torch.Tensor, h: torch.Tensor, h_scale: torch.Tensor | None = None) -> torch.Tensor:
    """dh ``[M, 2F]`` bf16 of :func:`swiglu` from ``da [M, F]`` (torch autograd's BF16 arithmetic).
    With ``h_scale``, h is MXFP8 along 2F (e4m3 data ``[M, 2F]``, e8m0 scales ``[M, 2F/32]``
    row-major, ``F % 32 == 0``) and the gradient is taken at its BF16 MX values."""
    da, h = _rows_last_contiguous(da), _rows_last_contiguous(h)
    M, F = h.shape[0], h.shape[1] // 2
    dh = torch.empty(M, 2 * F, dtype=torch.bfloat16, device=h.device)
    hs = h  # (no scales: the kernel does not read this argument)
    if h_scale is not None:
        if F % 32 or tuple(h_scale.shape) != (M, 2 * F // 32):
            raise ValueError(f"swiglu_backward: MXFP8 h [M, 2F] needs F % 32 == 0 and h_scale [M, 2F/32]; "
                             f"got h {tuple(h.shape)}, h_scale {tuple(h_scale.shape)}")
        h, hs = h.view(torch.uint8), h_scale.contiguous().view(torch.uint8)
    if M and F:
        _k().swiglu_backward_kernel[_grid(M, F, _BWD_ROWS)](da, h, hs, dh, M, F, da.stride(0), h.stride(0),
                                                            hs.stride(0), dh.stride(0), MX=h_scale is not None,
                                                            BR=_BWD_ROWS, BF=_BLOCK_COLS, SOFT=_soft(),
                                                            num_warps=_WARPS)
    return dh


ROUTER_MAX_EXPERTS = 128  # one tile of each router kernel holds all experts


def _router_dw_programs(BE: int, sms: int) -> int:
    """Programs of router_dw that run at once (its [BE, 128] tiles, 8 warps, 3 stages; offline sm_90 compile): up
    to 32 experts ~36 KB of shared memory and 80 registers, 3 per SM; at 64-128 experts 123-192 KB, 1 per SM."""
    return sms * (3 if BE <= 32 else 1)


def _router_be(E: int) -> int:
    """The expert tile of the router kernels: E rounded up to a power of two, at least 16 (a tl.dot operand)."""
    if not 0 < E <= ROUTER_MAX_EXPERTS:
        raise ValueError(f"the router kernels take 1 to {ROUTER_MAX_EXPERTS} experts, got {E}")
    return max(16, 1 << (E - 1).bit_length())


def router_logits(x: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """FP32 logits ``[T, E]`` of bf16 ``x [T, D]`` against an FP32 weight ``[E, D]`` given as its three
    BF16 pieces ``w3 [3, E, D]`` (``w == w3[0] + w3[1] + w3[2]``): BF16 tensor cores, FP32 sums, so the FP32
    product up to summation order, without an FP32 copy of x."""
    x = _rows_last_contiguous(x)
    T, D = x.shape
    E = w3.shape[1]
    out = torch.empty(T, E, dtype=torch.float32, device=x.device)
    BE = _router_be(E)
    BT, warps = (128, 8) if BE == 128 else (64, 4)  # H100: 51 against 63 us at Qwen3's 128; 2-3% slower below
    if T:
        _k().router_logits_kernel[(_cdiv(T, BT),)](x, w3, out, T, D, E, x.stride(0), BT=BT, BE=BE, BK=64,
                                                   SOFT=_soft(), num_warps=warps)
    return out


def split_bf16(x: torch.Tensor) -> torch.Tensor:
    """``x [...]`` (BF16/FP16/FP32) as three BF16 pieces ``[3, ...]`` whose FP32 sum is ``x.float()`` exactly
    (8 + 8 + 8 significand bits; each piece the nearest BF16, ties to even, of what the pieces before it
    leave): the operands of the router kernels' exact FP32 products from BF16 tensor cores."""
    x = x.contiguous()
    out = torch.empty((3, *x.shape), dtype=torch.bfloat16, device=x.device)
    n, block = x.numel(), 1024
    if n:
        _k().split_bf16_kernel[(_cdiv(n, block),)](x, out, n, BLOCK=block, SOFT=_soft(), num_warps=4)
    return out


def router_dx(dl: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """``dl @ w`` ``[T, D]`` bf16 (FP32 sums, one rounding) of FP32 ``dl [T, E]`` and ``w3`` as in
    :func:`router_logits`."""
    dl = dl.contiguous()
    T, E = dl.shape
    D = w3.shape[2]
    dx = torch.empty(T, D, dtype=torch.bfloat16, device=dl.device)
    BE, BT = _router_be(E), 64
    if T and D:
        _k().router_dx_kernel[(_cdiv(T, BT), _cdiv(D, 64))](dl, w3, dx, T, D, E, dx.stride(0), BT=BT, BE=BE,
                                                           BD=64, SOFT=_soft(), num_warps=4)
    return dx


def router_dw(dl3: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``dl^T @ x`` ``[E, D]`` FP32 of the logits' gradient as its pieces ``dl3 [3, T, E]`` (:func:`split_bf16`)
    and bf16 ``x [T, D]``: tensor-core tiles [E, 128] over token ranges, as many as run at once, the pieces
    of dl read transposed from shared memory; the partial sums are added in a fixed order (deterministic)."""
    dl3, x = dl3.contiguous(), _rows_last_contiguous(x)
    T, E = dl3.shape[1:]
    D = x.shape[1]
    BE, BT, BD = _router_be(E), 64, 128
    splits = max(1, min(_cdiv(T, 4 * BT), _router_dw_programs(BE, sm_count(x.device)) // _cdiv(D, BD)))  # >= 4 steps each
    rows = _cdiv(_cdiv(max(T, 1), splits), BT) * BT
    splits = _cdiv(max(T, 1), rows)
    part = torch.empty(splits, E, D, dtype=torch.float32, device=x.device)
    if D:
        _k().router_dw_kernel[(_cdiv(D, BD), splits)](dl3, x, part, T, D, E, x.stride(0), rows, BT=BT, BE=BE,
                                                     BD=BD, SOFT=_soft(), num_warps=8, num_stages=3)
    return part[0] if splits == 1 else part.sum(0)


def to_float32(x: torch.Tensor) -> torch.Tensor:
    """FP32 copy of a BF16/FP16/FP32 tensor (contiguous result of x's shape)."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    n, block = x.numel(), 4096
    if n:
        _k().to_float32_kernel[(_cdiv(n, block),)](x, out, n, BLOCK=block, num_warps=4)
    return out
