"""MXFP8 quantize-dequantize (QDQ) kernels' launchers: BF16 MX values from one read of x (and the FP8 copy along M),
for the Hopper expansion route (BF16 tensor cores multiply exactly the MX values); bit for bit
``dequantize_bf16`` of :mod:`mxmoe.kernels.quantize`'s outputs. The Triton body is
:mod:`mxmoe.kernels.qdq_triton` (imported on first use); the column outputs on sm_90 take the Gluon kernel
(:mod:`mxmoe.kernels.quantize_gluon`).
"""

from __future__ import annotations

import torch

from mxmoe.formats import BLOCK, ScaleRule
from mxmoe.kernels.quantize_launch import (_check, _interpreting, _launch_gluon, _launch_tiles, _rule, _use_gluon,
                                           triton_cdiv)
from mxmoe.kernels.quantize_tile_config import _config_qdq


def _kernels():
    """The triton kernel module, imported lazily (triton is an optional dependency)."""
    try:
        from mxmoe.kernels import qdq_triton
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("mxmoe.kernels.qdq needs triton (pip install 'mxmoe[gpu]')") from e
    return qdq_triton


def _launch_qdq(x: torch.Tensor, scale_rule, row_bf16: bool, col_bf16: bool, col_fp8: bool, tile32: bool,
                name: str) -> tuple:
    """Run mx_qdq_kernel; outputs in the order bf16 rowwise, bf16 columnwise, (data_t, scale_t)."""
    rceil = _rule(scale_rule)
    col = col_bf16 or col_fp8
    x3, was_2d = _check(x, name, need_k32=True, need_m32=col or tile32)
    B, M, K = x3.shape
    dev = x.device
    br = torch.empty(B, M, K, dtype=torch.bfloat16, device=dev) if row_bf16 else None
    bc = torch.empty(B, K, M, dtype=torch.bfloat16, device=dev) if col_bf16 else None
    qc = torch.empty(B, K, M, dtype=torch.uint8, device=dev) if col_fp8 else None
    sc = torch.empty(B, K, M // BLOCK, dtype=torch.uint8, device=dev) if col_fp8 else None
    if x3.numel() > 0 and col and not (col_bf16 and col_fp8) and not (tile32 and (col_bf16 or not row_bf16)) \
            and _use_gluon(x3):
        _launch_gluon(x3, bc if col_bf16 else qc, sc, br, None, M, K, rceil, row=2 if row_bf16 else 0,
                      col=2 if col_bf16 else 1, layout=0, tile32=tile32)
    elif x3.numel() > 0:
        BM, BK, num_warps, persistent = _config_qdq(col)
        total = triton_cdiv(M, BM) * triton_cdiv(K, BK) * B
        dummy = next(t for t in (br, bc, qc) if t is not None)
        args = (x3, br if row_bf16 else dummy, bc if col_bf16 else dummy, qc if col_fp8 else dummy,
                sc if col_fp8 else dummy, M, K, B, x3.stride(0), x3.stride(1), x3.stride(2), rceil)
        kwargs = dict(ROW_BF16=row_bf16, COL_BF16=col_bf16, COL_FP8=col_fp8, TILE32=tile32, BM=BM, BK=BK,
                      SOFT_CVT=_interpreting(), num_warps=num_warps)
        kernel = _kernels().mx_qdq_kernel
        _launch_tiles(kernel, args, kwargs, total, persistent, dev)

    def finish(t, dtype=None):
        t = t[0] if was_2d else t
        return t.view(dtype) if dtype is not None else t

    out = []
    if row_bf16:
        out.append(finish(br))
    if col_bf16:
        out.append(finish(bc))
    if col_fp8:
        out += [finish(qc, torch.float8_e4m3fn), finish(sc, torch.float8_e8m0fnu)]
    return tuple(out)


def qdq_rowwise(x: torch.Tensor, scale_rule: ScaleRule | str = "rceil", tile32: bool = False) -> torch.Tensor:
    """BF16 MX values of x along the last dim (the fprop operand of the expansion route).

    Args:
        x: ``[M, K]`` or ``[B, M, K]`` bfloat16/float16/float32, CUDA, ``K % 32 == 0``; any strides.
        scale_rule: ``"rceil"`` or ``"floor"``.
        tile32: one scale per 32x32 tile (needs ``M % 32 == 0``; weights): the values are then the
            same along either dim, so they serve fprop and dgrad alike.
    Returns:
        contiguous ``bfloat16`` ``[.., M, K]`` equal bit for bit to
        ``dequantize_bf16(*quantize_rowwise(x, scale_rule))`` (``tile32``: to :func:`qdq_dual`'s BF16
        output with ``tile32``).
    Raises:
        TypeError / ValueError as :func:`quantize_rowwise` (and :func:`quantize_32x32` with ``tile32``).
    """
    return _launch_qdq(x, scale_rule, True, False, False, tile32, "qdq_rowwise")[0]


def qdq_dual(x: torch.Tensor, scale_rule: ScaleRule | str = "rceil", tile32: bool = False):
    """BF16 MX values along K plus the columnwise FP8 copy, from one read (``M % 32 == K % 32 == 0``).

    The FP8 copy is what is kept for a later product along M (activations: wgrad; weights: dgrad).

    Args:
        x: ``[M, K]`` or ``[B, M, K]`` (e.g. weights ``[E, N, K]``), bfloat16/float16/float32, CUDA.
        tile32: one scale per 32x32 tile (2D weight blocks) instead of 1x32 blocks.
    Returns:
        ``(x_bf16, data_t, scale_t)``: bfloat16 ``[.., M, K]`` as :func:`qdq_rowwise` (32x32: as
        ``dequantize_bf16`` of :func:`quantize_32x32`'s ``(data, scale)``), and ``float8_e4m3fn``
        ``[.., K, M]`` / ``float8_e8m0fnu`` ``[.., K, M/32]`` equal to :func:`quantize_columnwise`
        (32x32: :func:`quantize_32x32`'s ``(data_t, scale_t)``).
    Raises:
        TypeError / ValueError as :func:`quantize_dual`.
    """
    return _launch_qdq(x, scale_rule, True, False, True, tile32, "qdq_dual")


def qdq_columnwise(x: torch.Tensor, scale_rule: ScaleRule | str = "rceil") -> torch.Tensor:
    """BF16 MX values of x along M (dim -2, 1x32 blocks), written transposed: the dgrad operand of
    weights ``[E, N, K]`` quantized along N, requantized from the parameter in backward.

    Args:
        x: ``[M, K]`` or ``[B, M, K]`` bfloat16/float16/float32, CUDA, ``M % 32 == K % 32 == 0``; any strides.
    Returns:
        contiguous bfloat16 ``[.., K, M]`` equal bit for bit to ``dequantize_bf16(*quantize_columnwise(x))``.
    Raises:
        TypeError / ValueError as :func:`quantize_dual`.
    """
    return _launch_qdq(x, scale_rule, False, True, False, False, "qdq_columnwise")[0]


def qdq_dual_bf16(x: torch.Tensor, scale_rule: ScaleRule | str = "rceil"):
    """BF16 MX values along K and along M (transposed), from one read (``M % 32 == K % 32 == 0``).

    The output gradient dy ``[M, N]`` of an expert linear layer: along N for dgrad, along tokens
    for wgrad.

    Returns:
        ``(x_bf16 [.., M, K], xt_bf16 [.., K, M])``: :func:`qdq_rowwise` of x, and
        ``dequantize_bf16(*quantize_columnwise(x))``, both contiguous bfloat16.
    """
    return _launch_qdq(x, scale_rule, True, True, False, False, "qdq_dual_bf16")

