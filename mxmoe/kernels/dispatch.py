"""The kernels' entry points for the ops: each takes the fast CUDA path the :class:`~mxmoe.backend.Backend`
names for the case, or returns None so the caller runs the torch reference.

The backend (:mod:`mxmoe.backend`) decides the routes; this module maps them onto the kernels:
Triton quantization kernels (:mod:`mxmoe.kernels.quantize`, :mod:`mxmoe.kernels.qdq`,
:mod:`mxmoe.kernels.quantize_fused`), the Hopper grouped GEMM (:mod:`mxmoe.kernels.sm90_gemm_promote32`,
:mod:`mxmoe.kernels.sm90_gemm_promote128`) and, on Blackwell, PyTorch's block-scaled grouped product
(:mod:`mxmoe.kernels.sm100`).
"""

from __future__ import annotations

import torch

from mxmoe.backend import Backend
from mxmoe.formats import MXTensor


def _ops():
    """The kernels' entry points (:mod:`mxmoe.kernels.torch_ops`, registered on first use): under
    torch.compile the custom ops, which the graph keeps as single nodes with fake implementations; in
    eager mode the same Python functions without the custom-op dispatch (``torch_ops.EAGER``)."""
    from mxmoe.kernels import torch_ops

    return torch_ops if torch.compiler.is_compiling() else torch_ops.EAGER


_QUANT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def quantize_cuda(x: torch.Tensor, axis: int, scale_rule: str, block, be: Backend):
    """Fast-path quantization of a CUDA tensor, or None where no kernel covers the case.

    Covered: 2D/3D bf16/fp16/fp32 along either of the last two dims, with 1x32 or 1x128 groups, or
    32x32 / 128x128 tiles (both of the last two dims whole tiles). Quantization along dim -2 returns
    the K-major storage (data ``[.., K, M]``) viewed as the logical ``[.., M, K]`` tensor.
    """
    from mxmoe.formats import normalize_block

    block = normalize_block(block)
    tile, group = block
    if x.dim() not in (2, 3) or x.dtype not in _QUANT_DTYPES or not be.kernels:
        return None
    nd, axis = x.dim(), axis % x.dim()
    if axis not in (nd - 1, nd - 2) or x.shape[axis] % group:
        return None
    from mxmoe.kernels import quantize as q

    ops = _ops()
    if tile == 1:
        if axis == nd - 1:
            fn = ops.quantize_rowwise if group == 32 else ops.quantize_rowwise_128
            return q.rowwise_mxtensor(*fn(x, scale_rule), scale_rule, block)
        fn = ops.quantize_columnwise if group == 32 else ops.quantize_columnwise_128
        return q.columnwise_mxtensor(*fn(x, scale_rule), scale_rule, block)
    if x.shape[-1] % tile or x.shape[-2] % tile:
        return None
    data, scale, data_t, scale_t = (ops.quantize_32x32 if tile == 32 else ops.quantize_128x128)(x, scale_rule)
    if axis == nd - 1:
        return q.rowwise_mxtensor(data, scale, scale_rule, block)
    return q.columnwise_mxtensor(data_t, scale_t, scale_rule, block)


def quantize_grouped_cuda(x: torch.Tensor, offs: torch.Tensor, scale_rule: str, be: Backend):
    """``x [M, K]`` (rows grouped by ``offs``, int32 ``[E]`` cumulative end rows) along K in 1x32 blocks,
    with the per-group blocked scales carried (:attr:`~mxmoe.formats.MXTensor.grouped`) beside the
    row-major ones, from one read; None where the kernel does not cover the case (not 2D, K not a multiple
    of 32, a dtype other than bf16/fp16/fp32, no kernels). Synchronizes with the host once (the blocked
    size)."""
    if (x.dim() != 2 or x.dtype not in _QUANT_DTYPES or x.shape[1] % 32 or not be.kernels
            or offs.device != x.device):
        return None
    from mxmoe.kernels import quantize as q

    data, blocked, blocked_offs, scale = q.quantize_grouped_rowwise(x, offs, scale_rule, row_major_scale=True)
    return q.grouped_rowwise_mxtensor(data, scale, blocked, offs, blocked_offs, scale_rule)


def quantize_weight_blocked_cuda(w: torch.Tensor, axis: int, scale_rule: str, be: Backend):
    """Expert weights ``w [E, N, K]`` along ``axis`` (-1: K, fprop; -2: N, dgrad) in 1x32 blocks, with the
    scales also in the per-expert blocked layout the sm_100 product reads, carried as
    :attr:`~mxmoe.formats.MXTensor.grouped` (``offs`` None), from one pass of the kernel; None where it does
    not cover the case (not 3D, a dtype other than bf16/fp16/fp32, the axis' size not a multiple of 32,
    another axis, no kernels). :meth:`~mxmoe.backend.Backend.blocked_weight_scales` says when to call it."""
    if w.dim() != 3 or w.dtype not in _QUANT_DTYPES or not be.kernels or axis % 3 not in (1, 2) or w.shape[axis] % 32:
        return None
    from mxmoe.kernels import quantize as q

    if axis % 3 == 2:
        data, scale, blocked = _ops().quantize_rowwise_blocked(w, scale_rule)
        return q.rowwise_mxtensor(data, scale, scale_rule, blocked=blocked)
    data_t, scale_t, blocked = _ops().quantize_columnwise_blocked(w, scale_rule)
    return q.columnwise_mxtensor(data_t, scale_t, scale_rule, blocked=blocked)


def quantize_dual_cuda(x: torch.Tensor, scale_rule: str, group: int, be: Backend):
    """2D ``[M, K]`` along K and along M in 1 x ``group`` blocks (32 or 128) from one read, or None."""
    if (x.dim() != 2 or x.dtype not in _QUANT_DTYPES or x.shape[0] % group or x.shape[1] % group
            or not be.kernels):
        return None
    from mxmoe.kernels import quantize as q

    data, scale, data_t, scale_t = (_ops().quantize_dual if group == 32 else _ops().quantize_dual_128)(x, scale_rule)
    block = (1, group)
    return q.rowwise_mxtensor(data, scale, scale_rule, block), q.columnwise_mxtensor(data_t, scale_t, scale_rule, block)


def quantize_weight_both_cuda(w: "torch.Tensor | tuple[torch.Tensor, ...]", scale_rule: str, tile: int, be: Backend):
    """``tile`` x ``tile`` block weights ``[E, N, K]`` (32 or 128) in both orientations from one read:
    (along K, along N), or None. ``w`` may be a tuple of parts ``[E, N_i, K]`` along N (128x128 only): the
    result is their concatenation's, which is never written (:func:`mxmoe.kernels.quantize.quantize_128x128_parts`)."""
    parts = tuple(w) if isinstance(w, (tuple, list)) else (w,)
    if (not be.kernels or (len(parts) > 1 and tile != 128)
            or any(p.dim() != 3 or p.dtype not in _QUANT_DTYPES or p.shape[-1] % tile or p.shape[-2] % tile
                   for p in parts)):
        return None
    from mxmoe.kernels import quantize as q

    if len(parts) > 1:
        data, scale, data_t, scale_t = _ops().quantize_128x128_parts(list(parts), scale_rule)
    else:
        data, scale, data_t, scale_t = (_ops().quantize_32x32 if tile == 32 else _ops().quantize_128x128)(w, scale_rule)
    block = (tile, tile)
    return (q.rowwise_mxtensor(data, scale, scale_rule, block),
            q.columnwise_mxtensor(data_t, scale_t, scale_rule, block))


def permute_quantize_128(x: torch.Tensor, src: torch.Tensor, scale_rule: str):
    """Tokens ``x [T, K]`` gathered by ``src [M]`` (token per row, -1: zero row) and quantized both ways in
    1x128 / 128x1 groups without writing the buffer: (data ``[M, K]``, scale ``[M, K/32]``, data_t
    ``[K, M]``, scale_t ``[K, M/32]``)."""
    return _ops().permute_quantize_128(x, src, scale_rule)


def combine_backward_quantize_128(dy: torch.Tensor, w: torch.Tensor, yp: torch.Tensor, slot: torch.Tensor, top_k: int,
                                  scale_rule: str):
    """The top-k combine's backward fused with the dual 1x128 / 128x1 quantization of the expert rows' gradient
    (never written): ``(dyp along D, dyp along rows)`` as MXTensors ``[M, D]`` and the FP32 router-weight gradient
    of each row ``[M]`` (:func:`mxmoe.kernels.quantize_fused.combine_backward_quantize_128`)."""
    from mxmoe.kernels import quantize as q

    data, scale, data_t, scale_t, dw_rows = _ops().combine_backward_quantize_128(dy, w, yp, slot, top_k, scale_rule)
    g = (1, 128)
    return q.rowwise_mxtensor(data, scale, scale_rule, g), q.columnwise_mxtensor(data_t, scale_t, scale_rule, g), dw_rows


def swiglu_backward_quantize_128(da: torch.Tensor, h: "torch.Tensor | MXTensor", scale_rule: str):
    """SwiGLU's backward fused with the dual 1x128 / 128x1 quantization of dh ``[M, 2F]`` (never written), from
    ``da [M, F]`` and h (bf16, or an MXTensor along 2F: the gradient at its MX values): ``(dh along 2F, dh along
    rows)`` as MXTensors ``[M, 2F]`` (:func:`mxmoe.kernels.quantize_fused.swiglu_backward_quantize_128`)."""
    from mxmoe.kernels import quantize as q

    hd, hs = (h.data, h.scale) if isinstance(h, MXTensor) else (h, None)
    data, scale, data_t, scale_t = _ops().swiglu_backward_quantize_128(da, hd, hs, scale_rule)
    g = (1, 128)
    return q.rowwise_mxtensor(data, scale, scale_rule, g), q.columnwise_mxtensor(data_t, scale_t, scale_rule, g)


def swiglu_quantize_128(h: torch.Tensor, scale_rule: str, save_h: bool):
    """``h [M, 2F]`` bf16 -> ``a = silu(gate) * up`` quantized both ways in 1x128 / 128x1 groups (a never
    written), then with ``save_h`` h along 2F in 1x128 groups (else two empty tensors)."""
    return _ops().swiglu_quantize_128(h, scale_rule, save_h)


# The Hopper default route for 1x32 / 32x32 operands is the expansion (mxmoe.backend: MXMOE_SM90_GEMM=auto):
# the sm90 kernels for those groups are slower than BF16, and in the MoE layer the expansion route is ahead
# on most shapes (docs/hopper.md, docs/moe-layer.md), so both stay selectable
# and the expansion is the default.


def _kmajor(t):
    """(data, row-major scale) of an MXTensor quantized along its last dim, contraction contiguous."""
    data = t.data if t.data.stride(-1) == 1 else t.data.contiguous()
    return data, t.scale.contiguous()


def mx_grouped_mm_cuda(a, b, offs: torch.Tensor, out_dtype: torch.dtype, be: Backend, trusted: bool = False):
    """Fast-path MX grouped product of CUDA MXTensors on the route ``be.gemm_route`` names, or None
    where no kernel covers the case (the caller runs the reference).

    ``trusted``: the caller guarantees the offsets (wgrad: multiples of the scale group), so no host sync.
    ``out_dtype=torch.float32`` is an FP32 product on every route: where the route is the expansion (BF16
    ``torch._grouped_mm``, which writes BF16), that call runs on the promote-per-32 kernel instead.
    """
    route = be.gemm_route(b.dim() == 2, a.block, b.block)
    if route == "sm100":
        from mxmoe.kernels.sm100 import sm100_mxfp8_grouped_mm

        return sm100_mxfp8_grouped_mm(a, b, offs, out_dtype)
    if route == "reference" or out_dtype not in (torch.bfloat16, torch.float32):
        return None
    if route == "expansion":
        if out_dtype == torch.bfloat16:
            return bf16_grouped_mm(a, b, offs, out_dtype, be)
        route = "sm90"  # BF16 torch._grouped_mm writes BF16: an FP32 result comes from the FP32-summing kernel
    from mxmoe.formats import BLOCK

    wb = BLOCK if b.block == (BLOCK, BLOCK) else 1
    a_data, a_scale = _kmajor(a)
    b_data, b_scale = _kmajor(b.mT)  # [E, N, K] or [K, T]: contraction last
    ops = _ops()
    dt = str(out_dtype).removeprefix("torch.")
    if route == "sm90_128":  # promotion once per 128 of K (mxfp8_128 operands)
        if b.dim() == 3:
            return ops.sm90_mx128_m_grouped_gemm(a_data, a_scale, b_data, b_scale, offs, dt)
        return ops.sm90_mx128_k_grouped_gemm(a_data, a_scale, b_data, b_scale, offs, dt, not trusted)
    if b.dim() == 3:
        return ops.sm90_m_grouped_gemm(a_data, a_scale, b_data, b_scale, offs, dt, wb)
    return ops.sm90_k_grouped_gemm(a_data, a_scale, b_data, b_scale, offs, dt, not trusted)


# --------------------------------------------------------------------------------------------
# Hopper expansion route: BF16 MX values straight from the quantize-dequantize (QDQ) kernels
# --------------------------------------------------------------------------------------------
def expansion_route(recipe, x: torch.Tensor, w: torch.Tensor, be: Backend) -> bool:
    """Whether the MX products of an expert linear layer (x ``[M, K]``, w ``[E, N, K]``) under
    ``recipe`` (a :class:`mxmoe.recipes.Recipe`) run on the Hopper expansion route
    (:meth:`~mxmoe.backend.Backend.expansion`) with the QDQ kernels covering both inputs (CUDA
    bf16/fp16/fp32)."""
    return x.is_cuda and x.dtype in _QUANT_DTYPES and w.dtype in _QUANT_DTYPES and be.expansion(recipe)


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


def layer_ops(be: Backend):
    """The layer kernels (gather, gather-sum, combine backward, SwiGLU and its backward, the FP32
    cast: :mod:`mxmoe.kernels.layer`), or None where ``be.layer_kernels`` is off (no triton, or
    ``MXMOE_LAYER_KERNELS=0``; the torch ops run instead). Under torch.compile their custom ops
    (:mod:`mxmoe.kernels.torch_ops`, same names and arguments); in eager mode the launchers
    themselves, which skips the custom-op dispatch (small layers are CPU-bound)."""
    if not be.layer_kernels:
        return None
    if torch.compiler.is_compiling():
        return _ops()  # the custom ops
    from mxmoe.kernels import layer

    return layer


def layer_ops_for(t: torch.Tensor, be: Backend):
    """The layer kernels (:mod:`mxmoe.kernels.layer`, :func:`layer_ops`)
    for a CUDA BF16/FP16/FP32 tensor where ``be.layer_kernels`` is on, else None (the torch ops run).
    ``MXMOE_LAYER_KERNELS=0`` turns them off (e.g. to time the layer with and without them in one run)."""
    if not t.is_cuda or t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return None  # (FP64 keeps the torch ops: the kernels sum in FP32)
    return layer_ops(be)


def expand_bf16(t):
    """The BF16 operand of the expansion route for an MXTensor quantized along one of its last two
    dims, in its logical shape (a transposed view when quantized along dim -2); plain tensors pass."""
    from mxmoe.formats import MXTensor

    if not isinstance(t, MXTensor):
        return t
    if t.axis == t.dim() - 1:
        return _ops().dequantize_bf16(*_kmajor(t))
    return _ops().dequantize_bf16(*_kmajor(t.mT)).mT


def bf16_grouped_mm(a, b, offs: torch.Tensor, out_dtype: torch.dtype, be: Backend) -> torch.Tensor:
    """``torch._grouped_mm`` of the BF16 values of ``a`` and ``b`` (MXTensors expanded by
    :func:`expand_bf16`, BF16 tensors as they are); it writes BF16 (torch 2.11 takes no other output
    dtype), cast to ``out_dtype`` afterwards (to FP32 by the layer's cast kernel) once the expansions
    are freed (peak memory). So ``out_dtype=torch.float32`` here is the FP32-summed product rounded to
    BF16, then widened (every element a BF16 value, up to 2^-9 relative error): the layer's own wgrad on
    the expansion route asks for that, as the BF16 recipes' wgrad is; :func:`mx_grouped_mm_cuda` never
    returns it for an FP32 request."""
    return bf16_to(torch._grouped_mm(expand_bf16(a), expand_bf16(b), offs), out_dtype, be)


def bf16_to(out: torch.Tensor, out_dtype: torch.dtype, be: Backend) -> torch.Tensor:
    """A BF16 product in ``out_dtype``: FP32 through the layer's cast kernel on CUDA (torch's
    dtype-converting copy elsewhere); BF16 as is."""
    ops = layer_ops(be) if out_dtype == torch.float32 and out.is_cuda else None
    if ops is not None:
        return ops.to_float32(out)
    return out if out_dtype == torch.bfloat16 else out.to(out_dtype)
