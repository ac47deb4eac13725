"""Chooses the fast CUDA path for an op, or returns None so the caller runs the torch reference.

One place decides which kernel serves which case: Triton quantization kernels
(:mod:`mxmoe.kernels.quantize`), the Hopper grouped GEMM (:mod:`mxmoe.kernels.sm90_mxfp8_grouped_gemm`)
and, on Blackwell, PyTorch's block-scaled grouped product (:mod:`mxmoe.kernels.sm100`).
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _triton_ok() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


_QUANT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def quantize_cuda(x: torch.Tensor, axis: int, scale_rule: str, block):
    """Fast-path quantization of a CUDA tensor, or None where no kernel covers the case.

    Covered: 2D/3D bf16/fp16/fp32 along either of the last two dims, 1x32 or 32x32 blocks (32x32
    with both of the last two dims divisible by 32). Quantization along dim -2 returns the
    K-major storage (data ``[.., K, M]``) viewed as the logical ``[.., M, K]`` tensor.
    """
    from mxmoe.formats import BLOCK

    block = (1, block) if isinstance(block, int) else tuple(block)
    if x.dim() not in (2, 3) or x.dtype not in _QUANT_DTYPES or not _triton_ok():
        return None
    nd, axis = x.dim(), axis % x.dim()
    if axis not in (nd - 1, nd - 2) or x.shape[axis] % BLOCK:
        return None
    from mxmoe.kernels import quantize as q

    if block == (1, BLOCK):
        if axis == nd - 1:
            return q.rowwise_mxtensor(*q.quantize_rowwise(x, scale_rule), scale_rule)
        return q.columnwise_mxtensor(*q.quantize_columnwise(x, scale_rule), scale_rule)
    if x.shape[-1] % BLOCK or x.shape[-2] % BLOCK:
        return None
    if axis == nd - 1:
        data, scale = q.quantize_32x32(x, scale_rule, transposed=False)[:2]
        return q.rowwise_mxtensor(data, scale, scale_rule, (BLOCK, BLOCK))
    data_t, scale_t = q.quantize_32x32(x, scale_rule)[2:]
    return q.columnwise_mxtensor(data_t, scale_t, scale_rule, (BLOCK, BLOCK))


def quantize_dual_cuda(x: torch.Tensor, scale_rule: str):
    """2D ``[M, K]`` along K and along M from one read, or None."""
    from mxmoe.formats import BLOCK

    if x.dim() != 2 or x.dtype not in _QUANT_DTYPES or x.shape[0] % BLOCK or x.shape[1] % BLOCK or not _triton_ok():
        return None
    from mxmoe.kernels import quantize as q

    data, scale, data_t, scale_t = q.quantize_dual(x, scale_rule)
    return q.rowwise_mxtensor(data, scale, scale_rule), q.columnwise_mxtensor(data_t, scale_t, scale_rule)


def quantize_weight_both_cuda(w: torch.Tensor, scale_rule: str):
    """32x32-block weights ``[E, N, K]`` in both orientations from one read: (along K, along N)."""
    from mxmoe.formats import BLOCK

    if w.dim() != 3 or w.dtype not in _QUANT_DTYPES or w.shape[-1] % BLOCK or w.shape[-2] % BLOCK or not _triton_ok():
        return None
    from mxmoe.kernels import quantize as q

    data, scale, data_t, scale_t = q.quantize_32x32(w, scale_rule)
    return (q.rowwise_mxtensor(data, scale, scale_rule, (BLOCK, BLOCK)),
            q.columnwise_mxtensor(data_t, scale_t, scale_rule, (BLOCK, BLOCK)))


def mx_grouped_mm_cuda(a, b, offs: torch.Tensor, out_dtype: torch.dtype):
    """Fast-path MX grouped product of CUDA MXTensors, or None where no kernel covers the case."""
    return None
