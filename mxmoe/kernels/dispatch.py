"""Chooses the fast CUDA path for an op, or returns None so the caller runs the torch reference.

One place decides which kernel serves which case: Triton quantization kernels
(:mod:`mxmoe.kernels.quantize`), the Hopper grouped GEMM (:mod:`mxmoe.kernels.sm90_mxfp8_grouped_gemm`)
and, on Blackwell, PyTorch's block-scaled grouped product (:mod:`mxmoe.kernels.sm100`).
"""

from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _ops():
    """The kernels' entry points (:mod:`mxmoe.kernels.torch_ops`, registered on first use): under
    torch.compile the custom ops, which the graph keeps as single nodes with fake implementations; in
    eager mode the same Python functions without the custom-op dispatch (``torch_ops.EAGER``)."""
    from mxmoe.kernels import torch_ops

    return torch_ops if torch.compiler.is_compiling() else torch_ops.EAGER


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

    ops = _ops()
    if block == (1, BLOCK):
        if axis == nd - 1:
            return q.rowwise_mxtensor(*ops.quantize_rowwise(x, scale_rule), scale_rule)
        return q.columnwise_mxtensor(*ops.quantize_columnwise(x, scale_rule), scale_rule)
    if x.shape[-1] % BLOCK or x.shape[-2] % BLOCK:
        return None
    data, scale, data_t, scale_t = ops.quantize_32x32(x, scale_rule)
    if axis == nd - 1:
        return q.rowwise_mxtensor(data, scale, scale_rule, (BLOCK, BLOCK))
    return q.columnwise_mxtensor(data_t, scale_t, scale_rule, (BLOCK, BLOCK))


def quantize_dual_cuda(x: torch.Tensor, scale_rule: str):
    """2D ``[M, K]`` along K and along M from one read, or None."""
    from mxmoe.formats import BLOCK

    if x.dim() != 2 or x.dtype not in _QUANT_DTYPES or x.shape[0] % BLOCK or x.shape[1] % BLOCK or not _triton_ok():
        return None
    from mxmoe.kernels import quantize as q

    data, scale, data_t, scale_t = _ops().quantize_dual(x, scale_rule)
    return q.rowwise_mxtensor(data, scale, scale_rule), q.columnwise_mxtensor(data_t, scale_t, scale_rule)


def quantize_weight_both_cuda(w: torch.Tensor, scale_rule: str):
    """32x32-block weights ``[E, N, K]`` in both orientations from one read: (along K, along N)."""
    from mxmoe.formats import BLOCK

    if w.dim() != 3 or w.dtype not in _QUANT_DTYPES or w.shape[-1] % BLOCK or w.shape[-2] % BLOCK or not _triton_ok():
        return None
    from mxmoe.kernels import quantize as q

    data, scale, data_t, scale_t = _ops().quantize_32x32(w, scale_rule)
    return (q.rowwise_mxtensor(data, scale, scale_rule, (BLOCK, BLOCK)),
            q.columnwise_mxtensor(data_t, scale_t, scale_rule, (BLOCK, BLOCK)))


def sm90_gemm_backend(weight_block: int) -> str:
    """Which Hopper route serves an MX grouped product.

    ``"gluon"``: our warp-specialized MXFP8 kernel (FP8 wgmma + promotion every 32,
    :mod:`mxmoe.kernels.sm90_mxfp8_grouped_gemm`) for all three products. ``"bf16"``: exact
    expansion of the MX operands to BF16 (:mod:`mxmoe.kernels.dequantize`) and BF16
    ``torch._grouped_mm``. ``"mixed"``: our kernel for the M-grouped products (fprop, dgrad), the
    expansion for the K-grouped one (wgrad, whose operands are 1x32-block activations and gradients
    under every recipe). Chosen by the environment variable ``MXMOE_SM90_GEMM`` (``gluon`` /
    ``bf16`` / ``mixed`` / ``auto``); by default the route that made the MoE layer fastest on an H200
    for the weight block (``_SM90_DEFAULT``). Only the ``bf16`` route uses the quantize-dequantize
    kernels and the fused SwiGLU / permutation (they write BF16 operands); ``gluon`` and ``mixed``
    read FP8 operands from the quantization kernels.

    Raises:
        ValueError: ``MXMOE_SM90_GEMM`` set to anything else.
    """
    choice = os.environ.get("MXMOE_SM90_GEMM", "auto")
    if choice in ("gluon", "bf16", "mixed"):
        return choice
    if choice != "auto":
        raise ValueError(f"MXMOE_SM90_GEMM must be 'gluon', 'bf16', 'mixed' or 'auto', got {choice!r}")
    return _SM90_DEFAULT[weight_block]


# H200, 2026-11-30 (benchmarks/results/h200/grouped_gemm_routes.json), vs BF16 torch._grouped_mm:
# Gluon 0.32-0.54x (1x32 weights) and 0.41-0.89x (32x32); BF16 expansion (kernel v2) 0.61-0.97x on
# qwen3/dsv3 for either weight block, where Gluon 32x32 reached 0.41-0.78x. In the MoE layer the
# expansion route (mxfp8) beat Gluon (mxfp8_2d) on 3 of 4 shapes. Gluon stays selectable.
# Session 10 (TMA-store epilogue; grouped_gemm.json, moe_layer_routes_s10.json): Gluon 32x32 fprop/dgrad
# 0.67-1.05x, ahead of the expansion on most GEMMs, but the layer on Gluon is still slower (mxfp8_2d
# 0.76-0.93x BF16 vs 0.85-1.02x expanded): its 1x32 wgrad runs at 0.49-0.64x.
# Session 11 (moe_layer_routes_s11.json): "mixed" (Gluon fprop/dgrad, expanded wgrad) with 32x32 weights
# 0.95x on Llama-4 (default 0.89-0.90x) but 0.62-1.01x elsewhere (default 0.80-1.03x): our kernel's
# fprop+dgrad match the BF16 products' time in the layer, and the fused BF16-writing permutation and
# SwiGLU are lost.
_SM90_DEFAULT = {1: "bf16", 32: "bf16"}


def _kmajor(t):
    """(data, row-major scale) of an MXTensor quantized along its last dim, contraction contiguous."""
    data = t.data if t.data.stride(-1) == 1 else t.data.contiguous()
    return data, t.scale.contiguous()


def mx_grouped_mm_cuda(a, b, offs: torch.Tensor, out_dtype: torch.dtype, trusted: bool = False):
    """Fast-path MX grouped product of CUDA MXTensors, or None where no kernel covers the case.

    ``trusted``: the caller guarantees the offsets (wgrad: multiples of 32), so no host sync.
    """
    major, _ = _capability(a.device.index or 0)
    if major == 10:
        from mxmoe.kernels.sm100 import sm100_mxfp8_grouped_mm

        return sm100_mxfp8_grouped_mm(a, b, offs, out_dtype)
    if (major, _) != (9, 0) or not _triton_ok() or out_dtype not in (torch.bfloat16, torch.float32):
        return None
    from mxmoe.formats import BLOCK

    wb = BLOCK if b.block == (BLOCK, BLOCK) else 1
    route = sm90_gemm_backend(wb)
    if route == "bf16" or (route == "mixed" and b.dim() == 2):
        return bf16_grouped_mm(a, b, offs, out_dtype)
    a_data, a_scale = _kmajor(a)
    b_data, b_scale = _kmajor(b.mT)  # [E, N, K] or [K, T]: contraction last
    ops = _ops()
    dt = str(out_dtype).removeprefix("torch.")
    if b.dim() == 3:
        return ops.sm90_m_grouped_gemm(a_data, a_scale, b_data, b_scale, offs, dt, wb)
    return ops.sm90_k_grouped_gemm(a_data, a_scale, b_data, b_scale, offs, dt, not trusted)


# --------------------------------------------------------------------------------------------
# Hopper expansion route: BF16 MX values straight from the quantize-dequantize (QDQ) kernels
# --------------------------------------------------------------------------------------------
def expansion_route(weight_block: int, x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the MX products of an expert linear layer (x ``[M, K]``, w ``[E, N, K]``) run on
    the Hopper expansion route (``sm90_gemm_backend(weight_block) == "bf16"``) with the QDQ
    kernels covering both inputs (CUDA bf16/fp16/fp32, triton present)."""
    if not (x.is_cuda and x.dtype in _QUANT_DTYPES and w.dtype in _QUANT_DTYPES and _triton_ok()):
        return False
    return _capability(x.device.index or 0) == (9, 0) and sm90_gemm_backend(weight_block) == "bf16"


def qdq_rowwise(x: torch.Tensor, scale_rule: str, tile32: bool = False) -> torch.Tensor:
    """BF16 MX values of ``x [.., M, K]`` along K: ``expand_bf16(quantize(x, -1))`` from one read
    (``tile32``: 32x32-tile scales, the same values along M)."""
    return _ops().qdq_rowwise(x, scale_rule, tile32)


def qdq_dual(x: torch.Tensor, scale_rule: str, tile32: bool = False):
    """``x [.., M, K]`` (``M % 32 == K % 32 == 0``) -> (BF16 MX values along K, the MXTensor along M).

    The second is :func:`quantize_dual_cuda`'s columnwise half (1x32) or :func:`quantize_weight_both_cuda`'s
    along-N half (``tile32``), the FP8 copy kept for a later product along M.
    """
    from mxmoe.formats import BLOCK
    from mxmoe.kernels import quantize as q

    x16, data_t, scale_t = _ops().qdq_dual(x, scale_rule, tile32)
    return x16, q.columnwise_mxtensor(data_t, scale_t, scale_rule, (BLOCK, BLOCK) if tile32 else (1, BLOCK))


def qdq_columnwise(x: torch.Tensor, scale_rule: str) -> torch.Tensor:
    """``x [.., M, K]`` -> BF16 MX values along M (1x32), transposed ``[.., K, M]`` (weights: dgrad's operand)."""
    return _ops().qdq_columnwise(x, scale_rule)


def qdq_dual_bf16(x: torch.Tensor, scale_rule: str):
    """``x [M, N]`` -> (BF16 MX values along N ``[M, N]``, along M ``[N, M]``) from one read (dy: dgrad, wgrad)."""
    return _ops().qdq_dual_bf16(x, scale_rule)


def swiglu_qdq(h: torch.Tensor, scale_rule: str, save_h: bool = False):
    """``h [M, 2F]`` bf16 -> (BF16 MX values of ``a = silu(gate) * up`` along F, and a quantized
    along M as columnwise storage: data ``[F, M]`` e4m3, scales ``[F, M/32]`` e8m0; wrap it with
    ``quantize.columnwise_mxtensor``; then, with ``save_h``, h quantized along 2F: data ``[M, 2F]``
    e4m3, scales ``[M, 2F/32]`` e8m0 row-major, else two empty tensors)."""
    return _ops().swiglu_qdq(h, scale_rule, save_h)


def permute_qdq(x: torch.Tensor, src: torch.Tensor, scale_rule: str):
    """Tokens ``x [T, K]`` gathered by ``src [M]`` (token per row, -1: zero row) -> ``qdq_dual`` of
    that buffer without writing it: (BF16 MX values along K ``[M, K]``, data ``[K, M]`` e4m3, scales
    ``[K, M/32]`` e8m0; wrap the last two with ``quantize.columnwise_mxtensor``)."""
    return _ops().permute_qdq(x, src, scale_rule)


def layer_ops():
    """The layer kernels (gather, gather-sum, combine backward, SwiGLU and its backward, the FP32
    cast: :mod:`mxmoe.kernels.layer`), or None without triton or with ``MXMOE_LAYER_KERNELS=0``
    (read at every call; the torch ops run instead). Under torch.compile their custom ops
    (:mod:`mxmoe.kernels.torch_ops`, same names and arguments); in eager mode the launchers
    themselves, which skips the custom-op dispatch (small layers are CPU-bound)."""
    if os.environ.get("MXMOE_LAYER_KERNELS", "1") == "0" or not _triton_ok():
        return None
    if torch.compiler.is_compiling():
        return _ops()  # the custom ops
    from mxmoe.kernels import layer

    return layer


def expand_bf16(t):
    """The BF16 operand of the expansion route for an MXTensor quantized along one of its last two
    dims, in its logical shape (a transposed view when quantized along dim -2); plain tensors pass."""
    from mxmoe.formats import MXTensor

    if not isinstance(t, MXTensor):
        return t
    if t.axis == t.dim() - 1:
        return _ops().dequantize_bf16(*_kmajor(t))
    return _ops().dequantize_bf16(*_kmajor(t.mT)).mT


def bf16_grouped_mm(a, b, offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``torch._grouped_mm`` of the BF16 values of ``a`` and ``b`` (MXTensors expanded by
    :func:`expand_bf16`, BF16 tensors as they are); it writes BF16 (torch 2.11 takes no other output
    dtype), cast to ``out_dtype`` afterwards (to FP32 by the layer's cast kernel) once the expansions
    are freed (peak memory). So ``out_dtype=torch.float32`` gives the FP32-summed product rounded to
    BF16, then widened: every element is a BF16 value, up to 2^-9 relative error against the exact
    product, not FP32 accuracy (pinned by ``tests/test_out_dtype.py``)."""
    return bf16_to(torch._grouped_mm(expand_bf16(a), expand_bf16(b), offs), out_dtype)


def bf16_to(out: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """A BF16 product in ``out_dtype``: FP32 through the layer's cast kernel on CUDA (torch's
    dtype-converting copy elsewhere); BF16 as is."""
    ops = layer_ops() if out_dtype == torch.float32 and out.is_cuda else None
    if ops is not None:
        return ops.to_float32(out)
    return out if out_dtype == torch.bfloat16 else out.to(out_dtype)
