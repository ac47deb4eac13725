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


def quantize_cuda(x: torch.Tensor, axis: int, scale_rule: str, block):
    """Fast-path quantization of a CUDA tensor, or None where no kernel covers the case."""
    return None


def mx_grouped_mm_cuda(a, b, offs: torch.Tensor, out_dtype: torch.dtype):
    """Fast-path MX grouped product of CUDA MXTensors, or None where no kernel covers the case."""
    return None
