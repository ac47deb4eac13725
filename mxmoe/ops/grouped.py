"""Grouped matrix products with the ``torch._grouped_mm`` contract, plain or MX operands; the
per-group reference product (:func:`reference_grouped_mm`) is the twin of every fast route."""

from __future__ import annotations

import torch

from mxmoe.backend import Backend, resolve
from mxmoe.formats import MXTensor
from mxmoe.layouts import check_offsets


Operand = "torch.Tensor | MXTensor"


def is_mx(t) -> bool:
    return isinstance(t, MXTensor)


def reference_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, out_dtype) -> torch.Tensor:
    """Plain per-group products, FP32 (or FP64) accumulate, one rounding to ``out_dtype``; rows/groups outside
    offs are zero. 16-bit operands are multiplied as FP32 copies of their values (what a BF16 tensor-core
    GEMM computes, up to summation order; also far faster than CPU BF16 matmuls without BF16 instructions)."""
    if torch.compiler.is_compiling():  # one opaque node: the loop's group sizes are data (no graph break)
        return torch.ops.mxmoe.reference_grouped_mm(a, b, offs, out_dtype)
    return _reference_loop(a, b, offs, out_dtype)


def _reference_loop(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, out_dtype) -> torch.Tensor:
    if a.dtype in (torch.bfloat16, torch.float16):
        a, b = a.float(), b.float()
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    if b.dim() == 3:  # [M,K] x [E,K,N] -> [M,N]
        out = torch.zeros(a.shape[0], b.shape[2], dtype=out_dtype, device=a.device)
        for e, (s, t) in enumerate(zip(starts, ends)):
            if t > s:
                out[s:t] = (a[s:t] @ b[e]).to(out_dtype)
    else:  # [N,T] x [T,K] -> [E,N,K]
        out = torch.zeros(len(ends), a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
        for e, (s, t) in enumerate(zip(starts, ends)):
            if t > s:
                out[e] = (a[:, s:t] @ b[s:t]).to(out_dtype)
    if not any(t > s for s, t in zip(starts, ends)):  # no rows: keep a and b in the graph (zero gradients)
        out = out + (a.flatten()[:0].sum() + b.flatten()[:0].sum()).to(out_dtype)
    return out


@torch.library.custom_op("mxmoe::reference_grouped_mm", mutates_args=())
def _reference_grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
                             out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`reference_grouped_mm` as one custom op, what torch.compile traces (the per-group loop's sizes
    are the offsets' values, which would break the graph); its own backward is two such products."""
    return _reference_loop(a, b, offs, out_dtype)


@_reference_grouped_mm_op.register_fake
def _(a, b, offs, out_dtype):
    shape = (a.shape[0], b.shape[2]) if b.dim() == 3 else (offs.shape[0], a.shape[0], b.shape[1])
    return a.new_empty(shape, dtype=out_dtype)


def _reference_setup(ctx, inputs, output):
    a, b, offs, _ = inputs
    ctx.save_for_backward(a, b, offs)


def _reference_backward(ctx, g):
    a, b, offs = ctx.saved_tensors
    op = torch.ops.mxmoe.reference_grouped_mm
    da = db = None
    if b.dim() == 3:  # out[s:t] = a[s:t] @ b[e]
        if ctx.needs_input_grad[0]:
            da = op(g, b.mT, offs, a.dtype)
        if ctx.needs_input_grad[1]:
            db = op(a.mT, g, offs, b.dtype)
    else:  # out[e] = a[:, s:t] @ b[s:t]
        if ctx.needs_input_grad[0]:
            da = op(b, g.mT, offs, a.dtype).mT
        if ctx.needs_input_grad[1]:
            db = op(a.mT, g, offs, b.dtype)
    return da, db, None, None


_reference_grouped_mm_op.register_autograd(_reference_backward, setup_context=_reference_setup)


def _check_grouped_operands(a, b, offs) -> None:
    if is_mx(a) != is_mx(b):
        raise TypeError("grouped_mm: both operands must be MXTensors or both plain tensors")
    if a.dim() != 2 or b.dim() not in (2, 3):
        raise ValueError(f"grouped_mm supports 2D x 3D (fprop/dgrad) and 2D x 2D (wgrad); got {a.dim()}D x {b.dim()}D")
    if is_mx(a):
        if a.axis != 1 or b.axis != b.dim() - 2:
            raise ValueError(
                f"grouped_mm: MX operands must be quantized along the contraction dim "
                f"(a along dim 1, b along dim {b.dim() - 2}); got a.axis={a.axis}, b.axis={b.axis}")
    else:
        if not (a.is_floating_point() and b.is_floating_point()):
            raise TypeError(f"grouped_mm expects floating tensors, got {a.dtype} and {b.dtype}")
        if a.dtype != b.dtype:
            raise TypeError(f"grouped_mm: operand dtypes differ ({a.dtype} vs {b.dtype})")
    k_a, k_b = a.shape[1], b.shape[-2]
    if k_a != k_b:
        raise ValueError(f"grouped_mm: contraction sizes differ: a {tuple(a.shape)} vs b {tuple(b.shape)}")
    if b.dim() == 3:
        check_offsets(offs, b.shape[0], a.shape[0], "rows")
    else:
        check_offsets(offs, None, a.shape[1], "contraction elements")
        group = max(a.block[1], b.block[1]) if is_mx(a) else 1
        if is_mx(a) and bool((offs % group != 0).any()):  # a scale group would mix two experts
            raise ValueError(f"grouped_mm: MX operands contracted per group (wgrad) need every group to end on a "
                             f"multiple of {group} (their scale group), got offs {offs.tolist()}")


def grouped_mm(a: Operand, b: Operand, offs: torch.Tensor, out_dtype: torch.dtype | None = None,
               _validate: bool = True, *, backend: Backend | None = None) -> torch.Tensor:
    """Grouped matrix product with the contract of ``torch._grouped_mm``.

    Forms:
        * 2D x 3D (fprop, dgrad): ``a [M, K]``, ``b [E, K, N]``, ``offs`` int32 ``[E]`` cumulative
          end rows of ``a``; returns ``[M, N]`` with rows of group ``e`` multiplied by ``b[e]``.
          Rows past ``offs[-1]`` are unspecified (the reference writes zeros there).
        * 2D x 2D (wgrad): ``a [N, T]``, ``b [T, K]``, ``offs`` int32 ``[E]`` cumulative end along
          T; returns ``[E, N, K]``, ``out[e] = a[:, group e] @ b[group e]``; empty groups give zero.
          MX operands' groups end on multiples of their scale group along T (32, or 128 for 1x128).

    Operands are both plain float tensors (bf16/fp16/fp32) or both :class:`MXTensor` quantized
    along the contraction dim (``a.axis == 1``; ``b.axis`` = its K dim). MX products equal the
    FP64 product of the dequantized operands up to FP32 summation order, rounded once to ``out_dtype``, on
    every route (the CPU reference, our Hopper kernels, sm_100). On Hopper's expansion route (1x32 / 32x32
    operands on sm_90 with ``MXMOE_SM90_GEMM`` unset, ``auto`` or ``bf16``, the default; the 2D x 2D form
    under ``mixed``) the operands are expanded exactly to BF16 and multiplied by BF16 ``torch._grouped_mm``,
    which writes BF16: so an ``out_dtype=torch.float32`` call there runs on the promote-per-32 kernel
    instead, which sums and writes FP32 (``tests/test_out_dtype.py``: within 1e-4 of the FP64 product on
    every route). ``mxfp8_128`` operands take the promote-per-128 kernel, which writes FP32.

    Args:
        out_dtype: result dtype; default ``a.dtype`` for plain tensors, ``bfloat16`` for MX.
        backend: the route of MX products (:func:`mxmoe.backend.resolve` of the device by default).
    Raises:
        TypeError: mixed operand kinds, non-float dtypes, mismatched dtypes, offs not int32.
        TypeError: also a non-float ``out_dtype``.
        ValueError: wrong ranks, contraction mismatch, wrong quantized axis, offsets not
            non-decreasing, past the tensor, or a group count different from ``b.shape[0]``; 2D x 2D MX
            operands with a group not ending on a multiple of their scale group (32 or 128).
    """
    if _validate:
        _check_grouped_operands(a, b, offs)
        if out_dtype is not None and not (isinstance(out_dtype, torch.dtype) and out_dtype.is_floating_point):
            raise TypeError(f"grouped_mm: out_dtype must be a floating dtype, got {out_dtype}")
    if is_mx(a):
        out_dtype = out_dtype or torch.bfloat16
        if a.device.type == "cuda":
            from mxmoe.kernels import dispatch

            out = dispatch.mx_grouped_mm_cuda(a, b, offs, out_dtype, backend or resolve(a.device),
                                              trusted=not _validate)
            if out is not None:
                return out
        acc = torch.float64 if out_dtype == torch.float64 else torch.float32
        return reference_grouped_mm(a.dequantize(acc), b.dequantize(acc), offs, out_dtype)
    out_dtype = out_dtype or a.dtype
    # torch._grouped_mm on CUDA only: no groups give the reference's zeros (it leaves memory unset), and its
    # CPU kernel's backward leaves the gradients of empty groups and of rows past offs[-1] unset
    if (a.is_cuda and a.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm") and offs.numel() > 0
            and _aligned_16b(a) and _aligned_16b(b)):
        return torch._grouped_mm(a, b, offs, out_dtype=out_dtype)
    return reference_grouped_mm(a, b, offs, out_dtype)


def _aligned_16b(t: torch.Tensor) -> bool:
    """torch._grouped_mm needs one unit-stride dim, other strides and the base on 16 bytes.

    Under torch.compile the base address cannot be traced (data_ptr / storage_offset break the
    graph), so only the strides are checked there: a view starting off a 16-byte boundary is then
    not routed to the reference product (the layer's own operands are fresh casts or views at
    multiples of 16 bytes)."""
    size = t.element_size()
    strides_ok = 1 in t.stride()[-2:] and all((s * size) % 16 == 0 for s in t.stride() if s != 1)
    if torch.compiler.is_compiling():
        return strides_ok
    return strides_ok and t.data_ptr() % 16 == 0
