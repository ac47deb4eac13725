"""The CUDA kernels as ``torch.library`` custom ops (namespace ``mxmoe``), each with a fake
(meta) implementation, so ``torch.compile`` traces them as single nodes and CUDA graphs capture
them. The dispatch layer (:mod:`mxmoe.kernels.dispatch`) calls the kernels through these ops under
torch.compile, and in eager mode through the same functions without the custom-op dispatch
(:data:`EAGER` for quantization and GEMMs, the launchers of :mod:`mxmoe.kernels.layer` for the layer
kernels: gather, combine, SwiGLU, cast).

Shapes (``...`` = optional leading batch dim, e.g. experts):

==========================  =====================================================================
``quantize_rowwise``        x ``[..., M, K]`` -> data ``[..., M, K]`` e4m3, scale ``[..., M, K/32]`` e8m0
``quantize_columnwise``     x ``[..., M, K]`` -> data_t ``[..., K, M]``, scale_t ``[..., K, M/32]``
``quantize_dual``           both of the above, from one read
``quantize_*wise_blocked``  the same (rowwise, columnwise) + the scales in the 128x4 blocked layout,
                            ``[..., blocked_numel(rows, cols)]`` of the scale matrix (sm_100 weights)
``quantize_32x32``          (data, scale, data_t, scale_t), one scale per 32x32 tile
``quantize_*_128``          the same with 1x128 groups (rowwise, columnwise, dual) or 128x128 tiles
``quantize_128x128_parts``  (xs, rule) -> ``quantize_128x128`` of ``torch.cat(xs, dim=-2)``, not written
``permute_quantize_128``    (x ``[T, K]``, src ``[M]`` int) -> quantize_dual_128 of ``x[src]`` (src -1: zero row)
``swiglu_quantize_128``     (h ``[M, 2F]`` bf16, rule, save_h) -> quantize_dual_128 of ``silu(h[:, :F]) * h[:, F:]``,
                            + h quantized along 2F in 1x128 groups (data, scale) if save_h, else two empty tensors
``combine_backward_quantize_128``  (dy ``[T, D]``, w ``[T*k]``, yp ``[M, D]``, slot ``[M]`` int32, top_k, rule) ->
                            quantize_dual_128 of the combine's dyp + FP32 ``[M]`` router-weight gradient per row
``swiglu_backward_quantize_128``  (da ``[M, F]`` bf16, h ``[M, 2F]`` bf16 or e4m3, h_scale e8m0 or None, rule) ->
                            quantize_dual_128 of SwiGLU's dh ``[M, 2F]``
``dequantize_bf16``         (data ``[..., R, C]``, scale ``[..., R, C/32]``) -> bf16 ``[..., R, C]``
``qdq_rowwise``             (x ``[..., M, K]``, rule, tile32) -> bf16 ``[..., M, K]``: MX values along K
``qdq_dual``                x -> (bf16 ``[..., M, K]``, data_t ``[..., K, M]``, scale_t ``[..., K, M/32]``)
``qdq_columnwise``          x -> bf16 ``[..., K, M]``: MX values along M, transposed
``qdq_dual_bf16``           x -> (bf16 ``[..., M, K]``, bf16 ``[..., K, M]``): along K and along M
``swiglu_qdq``              (h ``[M, 2F]`` bf16, rule, save_h) -> ``qdq_dual`` of ``silu(h[:, :F]) * h[:, F:]``,
                            + h quantized along 2F (data, scale) if save_h, else two empty tensors
``permute_qdq``             (x ``[T, K]``, src ``[M]`` int) -> ``qdq_dual`` of ``x[src]`` (rows with src -1: zero)
``gather_rows``             (x ``[T, D]``, src ``[M]`` int, rows) -> ``x[src]`` ``[M, D]`` (src -1: zero row)
``gather_sum``              (src ``[M, D]``, idx ``[T*k]``, top_k, w ``[T*k]`` or None) -> ``[T, D]``
``combine_backward``        (dy ``[T, D]``, w ``[T*k]``, yp ``[M, D]``, slot ``[M]``, top_k) -> (dyp, dw)
``swiglu``                  h ``[M, 2F]`` bf16 -> ``silu(h[:, :F]) * h[:, F:]`` ``[M, F]``
``swiglu_backward``         (da ``[M, F]``, h ``[M, 2F]`` bf16 or e4m3, h_scale e8m0 or None) -> dh ``[M, 2F]``
``to_float32``              bf16/fp16/fp32 x -> float32 copy
``router_logits``           (x ``[T, D]`` bf16, w3 ``[3, E, D]`` bf16 pieces of an FP32 weight) -> FP32 ``[T, E]``
``split_bf16``              x (bf16/fp16/fp32) -> ``[3, *x.shape]`` bf16 pieces whose FP32 sum is x exactly
``router_dx``               (dl ``[T, E]`` fp32, w3) -> bf16 ``[T, D]``
``router_dw``               (dl3 ``[3, T, E]`` bf16 pieces of the FP32 logits' gradient, x ``[T, D]`` bf16) -> FP32 ``[E, D]``
``sm90_m_grouped_gemm``     (a ``[M, K]``, sa, b ``[E, N, K]``, sb, offs) -> ``[M, N]``
``sm90_k_grouped_gemm``     (a ``[N, T]``, sa, b ``[K, T]``, sb, offs) -> ``[E, N, K]``
``sm90_mx128_m_grouped_gemm``  as ``sm90_m_grouped_gemm``, 1x128 activations x 128x128 weight tiles
``sm90_mx128_k_grouped_gemm``  as ``sm90_k_grouped_gemm``, both operands 128x1 along tokens
==========================  =====================================================================
"""

from __future__ import annotations

import types

import torch

from mxmoe.layouts import blocked_numel

E4M3, E8M0 = torch.float8_e4m3fn, torch.float8_e8m0fnu
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

# The same functions without the custom-op dispatch, for eager mode (mxmoe.kernels.dispatch._ops):
# each custom-op call adds Python dispatch (schema checks, autograd and aliasing wrappers) on top of
# the launch, and small MoE layers are bound by host time (docs/training.md).
EAGER = types.SimpleNamespace()


def _op(fn):
    """Register ``fn`` as the custom op ``mxmoe::<fn name>`` (no mutated arguments); keep ``fn``
    itself in :data:`EAGER`."""
    setattr(EAGER, fn.__name__, fn)
    return torch.library.custom_op(f"mxmoe::{fn.__name__}", mutates_args=())(fn)


def _row(x):
    return x.new_empty(x.shape, dtype=E4M3), x.new_empty((*x.shape[:-1], x.shape[-1] // 32), dtype=E8M0)


def _col(x):
    lead, M, K = x.shape[:-2], x.shape[-2], x.shape[-1]
    return x.new_empty((*lead, K, M), dtype=E4M3), x.new_empty((*lead, K, M // 32), dtype=E8M0)


def _cat_shape(xs):
    """An empty stand-in for ``torch.cat(xs, dim=-2)`` (its shape, dtype and device)."""
    n = sum(x.shape[-2] for x in xs)
    return xs[0].new_empty((*xs[0].shape[:-2], n, xs[0].shape[-1]))


def _blocked(x, transposed: bool):
    lead, M, K = x.shape[:-2], x.shape[-2], x.shape[-1]
    n = blocked_numel(K, M // 32) if transposed else blocked_numel(M, K // 32)
    return x.new_empty((*lead, n), dtype=E8M0)


@_op
def quantize_rowwise(x: torch.Tensor, scale_rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    from mxmoe.kernels import quantize as q

    return q.quantize_rowwise(x, scale_rule)


@_op
def quantize_columnwise(x: torch.Tensor, scale_rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    from mxmoe.kernels import quantize as q

    return q.quantize_columnwise(x, scale_rule)


@_op
def quantize_rowwise_blocked(x: torch.Tensor, scale_rule: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from mxmoe.kernels import quantize as q

    return q.quantize_rowwise(x, scale_rule, blocked_copy=True)


@_op
def quantize_columnwise_blocked(x: torch.Tensor, scale_rule: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from mxmoe.kernels import quantize as q

    return q.quantize_columnwise(x, scale_rule, blocked_copy=True)


@_op
def quantize_dual(x: torch.Tensor, scale_rule: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from mxmoe.kernels import quantize as q

    return tuple(q.quantize_dual(x, scale_rule))


@_op
def quantize_32x32(x: torch.Tensor, scale_rule: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from mxmoe.kernels import quantize as q

    return tuple(q.quantize_32x32(x, scale_rule))


@_op
def quantize_rowwise_128(x: torch.Tensor, scale_rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    from mxmoe.kernels import quantize as q

    return q.quantize_rowwise_128(x, scale_rule)


@_op
def quantize_columnwise_128(x: torch.Tensor, scale_rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    from mxmoe.kernels import quantize as q

    return q.quantize_columnwise_128(x, scale_rule)


@_op
def quantize_dual_128(x: torch.Tensor, scale_rule: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from mxmoe.kernels import quantize as q

    return tuple(q.quantize_dual_128(x, scale_rule))


@_op
def quantize_128x128(x: torch.Tensor, scale_rule: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from mxmoe.kernels import quantize as q

    return tuple(q.quantize_128x128(x, scale_rule))


@_op
def quantize_128x128_parts(xs: list[torch.Tensor], scale_rule: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                               torch.Tensor]:
    from mxmoe.kernels import quantize as q

    return tuple(q.quantize_128x128_parts(xs, scale_rule))


@_op
def permute_quantize_128(x: torch.Tensor, src: torch.Tensor,
                         scale_rule: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from mxmoe.kernels import quantize_fused as q

    return tuple(q.permute_quantize_128(x, src, scale_rule))


@_op
def swiglu_quantize_128(h: torch.Tensor, scale_rule: str, save_h: bool) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from mxmoe.kernels import quantize_fused as q

    return tuple(q.swiglu_quantize_128(h, scale_rule, save_h))


@_op
def combine_backward_quantize_128(dy: torch.Tensor, w: torch.Tensor, yp: torch.Tensor, slot: torch.Tensor, top_k: int,
                                  scale_rule: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                            torch.Tensor]:
    from mxmoe.kernels import quantize_fused as q

    return tuple(q.combine_backward_quantize_128(dy, w, yp, slot, top_k, scale_rule))


@_op
def swiglu_backward_quantize_128(da: torch.Tensor, h: torch.Tensor, h_scale: torch.Tensor | None,
                                 scale_rule: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from mxmoe.kernels import quantize_fused as q

    return tuple(q.swiglu_backward_quantize_128(da, h, h_scale, scale_rule))


@_op
def dequantize_bf16(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    from mxmoe.kernels.dequantize import dequantize_bf16 as deq

    return deq(data, scale)


@_op
def qdq_rowwise(x: torch.Tensor, scale_rule: str, tile32: bool = False) -> torch.Tensor:
    from mxmoe.kernels import qdq as q

    return q.qdq_rowwise(x, scale_rule, tile32)


@_op
def qdq_dual(x: torch.Tensor, scale_rule: str, tile32: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from mxmoe.kernels import qdq as q

    return tuple(q.qdq_dual(x, scale_rule, tile32))


@_op
def qdq_columnwise(x: torch.Tensor, scale_rule: str) -> torch.Tensor:
    from mxmoe.kernels import qdq as q

    return q.qdq_columnwise(x, scale_rule)


@_op
def qdq_dual_bf16(x: torch.Tensor, scale_rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    from mxmoe.kernels import qdq as q

    return tuple(q.qdq_dual_bf16(x, scale_rule))


@_op
def swiglu_qdq(h: torch.Tensor, scale_rule: str, save_h: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                          torch.Tensor, torch.Tensor]:
    from mxmoe.kernels import quantize_fused as q

    return tuple(q.swiglu_qdq(h, scale_rule, save_h))


@_op
def permute_qdq(x: torch.Tensor, src: torch.Tensor, scale_rule: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from mxmoe.kernels import quantize_fused as q

    return tuple(q.permute_qdq(x, src, scale_rule))


@_op
def gather_rows(x: torch.Tensor, src: torch.Tensor, rows: int) -> torch.Tensor:
    from mxmoe.kernels import layer

    return layer.gather_rows(x, src, rows)


@_op
def gather_sum(src: torch.Tensor, idx: torch.Tensor, top_k: int, w: torch.Tensor | None) -> torch.Tensor:
    from mxmoe.kernels import layer

    return layer.gather_sum(src, idx, top_k, w)


@_op
def combine_backward(dy: torch.Tensor, w: torch.Tensor, yp: torch.Tensor, slot: torch.Tensor,
                     top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    from mxmoe.kernels import layer

    return layer.combine_backward(dy, w, yp, slot, top_k)


@_op
def swiglu(h: torch.Tensor) -> torch.Tensor:
    from mxmoe.kernels import layer

    return layer.swiglu(h)


@_op
def swiglu_backward(da: torch.Tensor, h: torch.Tensor, h_scale: torch.Tensor | None = None) -> torch.Tensor:
    from mxmoe.kernels import layer

    return layer.swiglu_backward(da, h, h_scale)


@_op
def to_float32(x: torch.Tensor) -> torch.Tensor:
    from mxmoe.kernels import layer

    return layer.to_float32(x)


@_op
def router_logits(x: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    from mxmoe.kernels import layer

    return layer.router_logits(x, w3)


@_op
def split_bf16(x: torch.Tensor) -> torch.Tensor:
    from mxmoe.kernels import layer

    return layer.split_bf16(x)


@_op
def router_dx(dl: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    from mxmoe.kernels import layer

    return layer.router_dx(dl, w3)


@_op
def router_dw(dl3: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    from mxmoe.kernels import layer

    return layer.router_dw(dl3, x)


def _bf16(x, transposed=False):
    shape = (*x.shape[:-2], x.shape[-1], x.shape[-2]) if transposed else x.shape
    return x.new_empty(shape, dtype=torch.bfloat16)


@_op
def sm90_m_grouped_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                        offs: torch.Tensor, out_dtype: str, weight_block: int) -> torch.Tensor:
    from mxmoe.kernels import sm90_gemm_promote32 as g

    return g.sm90_mxfp8_m_grouped_gemm(a, a_scale, b, b_scale, offs, _DTYPES[out_dtype], weight_block=weight_block)


@_op
def sm90_k_grouped_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                        offs: torch.Tensor, out_dtype: str, check_offsets: bool) -> torch.Tensor:
    from mxmoe.kernels import sm90_gemm_promote32 as g

    return g.sm90_mxfp8_k_grouped_gemm(a, a_scale, b, b_scale, offs, _DTYPES[out_dtype], check_offsets=check_offsets)


@_op
def sm90_mx128_m_grouped_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                              offs: torch.Tensor, out_dtype: str) -> torch.Tensor:
    from mxmoe.kernels import sm90_gemm_promote128 as g

    return g.sm90_mx128_m_grouped_gemm(a, a_scale, b, b_scale, offs, _DTYPES[out_dtype])


@_op
def sm90_mx128_k_grouped_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                              offs: torch.Tensor, out_dtype: str, check_offsets: bool) -> torch.Tensor:
    from mxmoe.kernels import sm90_gemm_promote128 as g

    return g.sm90_mx128_k_grouped_gemm(a, a_scale, b, b_scale, offs, _DTYPES[out_dtype], check_offsets=check_offsets)


quantize_rowwise.register_fake(lambda x, scale_rule: _row(x))
quantize_columnwise.register_fake(lambda x, scale_rule: _col(x))
quantize_rowwise_blocked.register_fake(lambda x, scale_rule: (*_row(x), _blocked(x, transposed=False)))
quantize_columnwise_blocked.register_fake(lambda x, scale_rule: (*_col(x), _blocked(x, transposed=True)))
quantize_dual.register_fake(lambda x, scale_rule: (*_row(x), *_col(x)))
quantize_32x32.register_fake(lambda x, scale_rule: (*_row(x), *_col(x)))
quantize_rowwise_128.register_fake(lambda x, scale_rule: _row(x))
quantize_columnwise_128.register_fake(lambda x, scale_rule: _col(x))
quantize_dual_128.register_fake(lambda x, scale_rule: (*_row(x), *_col(x)))
quantize_128x128.register_fake(lambda x, scale_rule: (*_row(x), *_col(x)))
quantize_128x128_parts.register_fake(lambda xs, scale_rule: (
    *_row(_cat_shape(xs)), *_col(_cat_shape(xs))))
permute_quantize_128.register_fake(lambda x, src, scale_rule: (
    *_row(x.new_empty((src.shape[0], x.shape[1]))), *_col(x.new_empty((src.shape[0], x.shape[1])))))
swiglu_quantize_128.register_fake(lambda h, scale_rule, save_h: (
    *_row(h.new_empty((h.shape[0], h.shape[1] // 2))), *_col(h.new_empty((h.shape[0], h.shape[1] // 2))),
    h.new_empty(h.shape if save_h else (0,), dtype=E4M3),
    h.new_empty((h.shape[0], h.shape[1] // 32) if save_h else (0,), dtype=E8M0)))
combine_backward_quantize_128.register_fake(lambda dy, w, yp, slot, top_k, scale_rule: (
    *_row(yp), *_col(yp), yp.new_empty((yp.shape[0],), dtype=torch.float32)))
swiglu_backward_quantize_128.register_fake(lambda da, h, h_scale, scale_rule: (*_row(h), *_col(h)))
dequantize_bf16.register_fake(lambda data, scale: data.new_empty(data.shape, dtype=torch.bfloat16))
qdq_rowwise.register_fake(lambda x, scale_rule, tile32=False: _bf16(x))
qdq_dual.register_fake(lambda x, scale_rule, tile32: (_bf16(x), *_col(x)))
qdq_columnwise.register_fake(lambda x, scale_rule: _bf16(x, transposed=True))
qdq_dual_bf16.register_fake(lambda x, scale_rule: (_bf16(x), _bf16(x, transposed=True)))
swiglu_qdq.register_fake(lambda h, scale_rule, save_h: (
    h.new_empty((h.shape[0], h.shape[1] // 2), dtype=torch.bfloat16),
    h.new_empty((h.shape[1] // 2, h.shape[0]), dtype=E4M3), h.new_empty((h.shape[1] // 2, h.shape[0] // 32), dtype=E8M0),
    h.new_empty(h.shape if save_h else (0,), dtype=E4M3),
    h.new_empty((h.shape[0], h.shape[1] // 32) if save_h else (0,), dtype=E8M0)))
permute_qdq.register_fake(lambda x, src, scale_rule: (
    x.new_empty((src.shape[0], x.shape[1]), dtype=torch.bfloat16),
    x.new_empty((x.shape[1], src.shape[0]), dtype=E4M3), x.new_empty((x.shape[1], src.shape[0] // 32), dtype=E8M0)))
gather_rows.register_fake(lambda x, src, rows: x.new_empty((rows, x.shape[1])))
gather_sum.register_fake(lambda src, idx, top_k, w: src.new_empty((idx.shape[0] // top_k, src.shape[1])))
combine_backward.register_fake(lambda dy, w, yp, slot, top_k: (
    yp.new_empty(yp.shape), w.new_empty((w.numel(),), dtype=torch.float32)))
swiglu.register_fake(lambda h: h.new_empty((h.shape[0], h.shape[1] // 2), dtype=torch.bfloat16))
swiglu_backward.register_fake(lambda da, h, h_scale=None: h.new_empty(h.shape, dtype=torch.bfloat16))
to_float32.register_fake(lambda x: x.new_empty(x.shape, dtype=torch.float32))
router_logits.register_fake(lambda x, w3: x.new_empty((x.shape[0], w3.shape[1]), dtype=torch.float32))
split_bf16.register_fake(lambda x: x.new_empty((3, *x.shape), dtype=torch.bfloat16))
router_dx.register_fake(lambda dl, w3: dl.new_empty((dl.shape[0], w3.shape[2]), dtype=torch.bfloat16))
router_dw.register_fake(lambda dl3, x: dl3.new_empty((dl3.shape[2], x.shape[1]), dtype=torch.float32))
sm90_m_grouped_gemm.register_fake(
    lambda a, a_scale, b, b_scale, offs, out_dtype, weight_block:
    a.new_empty((a.shape[0], b.shape[1]), dtype=_DTYPES[out_dtype]))
sm90_k_grouped_gemm.register_fake(
    lambda a, a_scale, b, b_scale, offs, out_dtype, check_offsets:
    a.new_empty((offs.shape[0], a.shape[0], b.shape[0]), dtype=_DTYPES[out_dtype]))
sm90_mx128_m_grouped_gemm.register_fake(
    lambda a, a_scale, b, b_scale, offs, out_dtype: a.new_empty((a.shape[0], b.shape[1]), dtype=_DTYPES[out_dtype]))
sm90_mx128_k_grouped_gemm.register_fake(
    lambda a, a_scale, b, b_scale, offs, out_dtype, check_offsets:
    a.new_empty((offs.shape[0], a.shape[0], b.shape[0]), dtype=_DTYPES[out_dtype]))
