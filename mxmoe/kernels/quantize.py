"""MXFP8 quantization kernels (CUDA path of :func:`mxmoe.formats.quantize`), bit-identical to it.

Public functions (all take BF16 / FP16 / FP32 CUDA tensors ``[M, K]`` or batched ``[B, M, K]``,
e.g. expert weights ``[E, N, K]``; any strides, fastest when the last dim is contiguous):

==========================  ===============================================================
``quantize_rowwise``        data ``[.., M, K]`` + scales along K (``[.., M, K/32]``)
``quantize_columnwise``     blocks along M, data written transposed ``[.., K, M]`` (M
                            contiguous, the K-major operand of dgrad/wgrad) + scales
                            ``[.., K, M/32]``
``quantize_dual``           both of the above from one read of x
``quantize_32x32``          one scale per 32x32 tile; both orientations from one read, same
                            data bytes (docs/DESIGN.md §2: 2D weight blocks)
``quantize_grouped_rowwise``  grouped rows with int32 end offsets: rowwise data + scales
                            written straight into the per-group 128-row-aligned blocked layout
                            (and row-major beside it): the sm_100 products' activations
==========================  ===============================================================

The Hopper-fast recipe's forms (docs/DESIGN.md §9, ``mxfp8_128``): ``quantize_rowwise_128``,
``quantize_columnwise_128``, ``quantize_dual_128`` (1x128 along K / 128x1 along M), ``quantize_128x128``
(weights, both orientations from one read), and the fused ``permute_quantize_128`` (token gather + dual) and
``swiglu_quantize_128`` (SwiGLU + dual) of :mod:`mxmoe.kernels.quantize_fused`; same outputs and storage as the 1x32 forms above (E4M3 data, E8M0
scales per 32 elements, each group's scale replicated), equal to ``formats.quantize(.., block=128 / (128, 128))``.

Scale layouts (``scale_layout``), for a row-major scale matrix ``[rows, cols]`` of the output data:

* ``"row_major"``: that matrix, ``float8_e8m0fnu`` (the reference's layout);
* ``"blocked"``: cuBLAS 128x4 layout of :mod:`mxmoe.layouts`, zero padding included; flat ``[n]``
  for 2D inputs, ``[B, n]`` for batched ones (one blocked matrix per expert);
* ``"sm90"``: what the Hopper grouped GEMM reads (``sm90_scales.sm90_scale_layout``):
  FP32 values ``2^(b-127)`` (byte 0 -> 2^-127, 0xFF -> NaN), transposed to ``[.., cols,
  ceil4(rows)]``, zero padded; for :func:`quantize_32x32` one value per tile,
  ``[.., K/32, ceil4(N/32)]`` (and ``[.., N/32, ceil4(K/32)]`` for the transposed copy).

``quantize_rowwise`` and ``quantize_columnwise`` also write, with ``blocked_copy``, a blocked copy of their
row-major scales from the same pass (the sm_100 product's expert weights).

Exactness: data and scales equal :func:`mxmoe.formats.quantize` byte for byte (both scale rules,
zero / subnormal / NaN / Inf blocks); the tests check it under ``TRITON_INTERPRET=1`` on CPU and
on the GPU. The kernels are in :mod:`mxmoe.kernels.quantize_triton` (imported on first use, so
``import mxmoe`` works without triton) and, for the outputs along M on sm_90 (columnwise, dual and
their QDQ forms), :mod:`mxmoe.kernels.quantize_gluon` (``quantize_launch._use_gluon`` says when;
``MXMOE_QUANT_GLUON=0`` keeps Triton); tile choices are in :mod:`mxmoe.kernels.quantize_tile_config`, the
launch plumbing shared with the QDQ (:mod:`mxmoe.kernels.qdq`) and fused launchers in
:mod:`mxmoe.kernels.quantize_launch`.

Wrap results as :class:`~mxmoe.formats.MXTensor` with :func:`rowwise_mxtensor` /
:func:`columnwise_mxtensor` (row-major scales only), grouped output with :func:`grouped_rowwise_mxtensor`.
"""

from __future__ import annotations

import torch

from mxmoe.formats import BLOCK, GroupedScale, MXTensor, ScaleRule
from mxmoe.kernels.quantize_launch import (_G128, _GLUON_GROUPS, _alloc_scales, _check, _interpreting, _launch_gluon,
                                           _launch_tiles, _layout, _rule, _use_gluon, triton_cdiv)
from mxmoe.kernels.quantize_tile_config import _GROUPED_VECTOR_SEARCH_MAX, _config_2d, _config_128, _config_grouped
from mxmoe.layouts import blocked_group_offsets, round_up


def _kernels():
    """The triton kernel module, imported lazily (triton is an optional dependency)."""
    try:
        from mxmoe.kernels import quantize_triton
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("mxmoe.kernels.quantize needs triton (pip install 'mxmoe[gpu]')") from e
    return quantize_triton


def _launch_2d(x: torch.Tensor, scale_rule, scale_layout: str, row: bool, col: bool, tile32: bool, name: str,
               group: int = BLOCK, blocked_copy: bool = False):
    """mx_quantize_kernel (or the Gluon kernel) on x; group 128: 1x128 / 128x1 groups, with tile32 128x128 tiles
    (whose rows need not fill the last tile when there is no transposed copy: col False). ``blocked_copy``
    (row-major scales only, Triton kernel): each output's scales also in the blocked layout, returned after it."""
    layout = _layout(scale_layout)
    if blocked_copy and layout != 0:
        raise ValueError(f"{name}: a blocked copy of the scales goes with row-major scales, got {scale_layout!r}")
    rceil = _rule(scale_rule)
    # M: whole groups for a column output, whole 32-row blocks for tiles without one
    x3, was_2d = _check(x, name, need_k32=row or tile32, need_m32=col or tile32, group=group,
                        group_m=group if col else BLOCK)
    B, M, K = x3.shape
    dev = x.device

    scale_dtype = torch.float32 if layout == 2 else torch.float8_e8m0fnu

    def finish(t, dtype):
        return (t[0] if was_2d else t).view(dtype)

    qr = sr = qc = sc = br = bc = None
    compact = tile32 and layout == 2  # the Hopper layout keeps one value per 32x32 tile
    if row:
        qr = torch.empty(B, M, K, dtype=torch.uint8, device=dev)
        sr = _alloc_scales(B, M // BLOCK if compact else M, K // BLOCK, layout, dev)
        br = _alloc_scales(B, M, K // BLOCK, 1, dev) if blocked_copy else None
    if col:
        qc = torch.empty(B, K, M, dtype=torch.uint8, device=dev)
        sc = _alloc_scales(B, K // BLOCK if compact else K, M // BLOCK, layout, dev)
        bc = _alloc_scales(B, K, M // BLOCK, 1, dev) if blocked_copy else None
    if x3.numel() > 0 and B > 0:
        BM, BK, num_warps, persistent = _config_2d(row, col, tile32) if group == BLOCK else \
            _config_128(row, col, tile32)
        cover = 128 if layout == 1 or compact or blocked_copy else 1
        m_cover = -(-M // cover) * cover
        k_cover = -(-K // cover) * cover
        if col and not blocked_copy and _use_gluon(x3) and group in _GLUON_GROUPS:
            _launch_gluon(x3, qc, sc, qr, sr, m_cover, k_cover, rceil, row=int(row), col=1, layout=layout,
                          tile32=tile32, group=group)
            out = [finish(qr, torch.float8_e4m3fn), finish(sr, scale_dtype)] if row else []
            return (*out, finish(qc, torch.float8_e4m3fn), finish(sc, scale_dtype))
        total = triton_cdiv(m_cover, BM) * triton_cdiv(k_cover, BK) * B
        dummy = qr if qr is not None else qc
        args = (x3, qr if row else dummy, sr if row else dummy, qc if col else dummy, sc if col else dummy,
                M, K, B, m_cover, k_cover, x3.stride(0), x3.stride(1), x3.stride(2),
                sr[0].numel() if row else 0, sc[0].numel() if col else 0,
                br if blocked_copy and row else dummy, bc if blocked_copy and col else dummy,
                br[0].numel() if blocked_copy and row else 0, bc[0].numel() if blocked_copy and col else 0, rceil)
        # tile order: M-fastest (the transposed outputs need it) except rowwise with row-major scales, where
        # K-fastest lets neighbouring programs write a row's scale bytes together; with blocked / Hopper scales
        # it is slower (docs/quantization.md)
        kwargs = dict(ROW=row, COL=col, TILE32=tile32, ROW_LAYOUT=layout, COL_LAYOUT=layout, BLOCKED_COPY=blocked_copy,
                      BM=BM, BK=BK, SOFT_CVT=_interpreting(), K_FAST=not col and layout == 0 and not blocked_copy,
                      num_warps=num_warps)
        if group != BLOCK:
            kwargs["GROUP"] = group
        _launch_tiles(_kernels().mx_quantize_kernel, args, kwargs, total, persistent, x.device)
    out = []
    if row:
        out += [finish(qr, torch.float8_e4m3fn), finish(sr, scale_dtype)]
        out += [finish(br, torch.float8_e8m0fnu)] if blocked_copy else []
    if col:
        out += [finish(qc, torch.float8_e4m3fn), finish(sc, scale_dtype)]
        out += [finish(bc, torch.float8_e8m0fnu)] if blocked_copy else []
    return tuple(out)


def quantize_rowwise(x: torch.Tensor, scale_rule: ScaleRule | str = "rceil",
                     scale_layout: str = "row_major", blocked_copy: bool = False) -> tuple[torch.Tensor, ...]:
    """MXFP8 along the last dim (1x32 blocks): the fprop operand form.

    Args:
        x: ``[M, K]`` or ``[B, M, K]`` (e.g. weights ``[E, N, K]``), bfloat16/float16/float32, CUDA,
            ``K % 32 == 0``; any strides.
        scale_rule: ``"rceil"`` (default) or ``"floor"``.
        scale_layout: ``"row_major"`` -> scales ``[.., M, K/32]``; ``"blocked"`` -> flat 128x4
            blocked scales ``[.., blocked_numel(M, K/32)]`` (per batch entry), zero padded;
            ``"sm90"`` -> FP32 ``[.., K/32, ceil4(M)]`` (see the module docstring).
        blocked_copy: with ``"row_major"`` scales, also write them blocked, from the same pass: a third
            item, ``float8_e8m0fnu`` ``[.., blocked_numel(M, K/32)]`` (sm_100 weights: :func:`rowwise_mxtensor`).
    Returns:
        ``(data, scale)``: ``float8_e4m3fn`` ``[.., M, K]`` contiguous, ``float8_e8m0fnu`` scales;
        equal to ``formats.quantize(x, axis=-1)`` (and ``layouts.to_blocked`` of its scales); with
        ``blocked_copy`` ``(data, scale, blocked)``, ``blocked[e]`` = ``layouts.to_blocked(scale[e])``.
    Raises:
        TypeError: bad dtype. ValueError: bad rank, ``K % 32 != 0``, CPU tensor, bad layout/rule,
        ``blocked_copy`` with a layout other than ``"row_major"``.
    """
    return _launch_2d(x, scale_rule, scale_layout, row=True, col=False, tile32=False, name="quantize_rowwise",
                      blocked_copy=blocked_copy)


def quantize_columnwise(x: torch.Tensor, scale_rule: ScaleRule | str = "rceil",
                        scale_layout: str = "row_major", blocked_copy: bool = False) -> tuple[torch.Tensor, ...]:
    """MXFP8 along dim -2 (32x1 blocks), data written transposed: the dgrad/wgrad operand form.

    Args:
        x: ``[M, K]`` or ``[B, M, K]``, bfloat16/float16/float32, CUDA, ``M % 32 == 0``.
        scale_rule, scale_layout, blocked_copy: as :func:`quantize_rowwise` (the blocked copy is that of
            ``scale_t``, ``[.., blocked_numel(K, M/32)]``; it keeps the Triton kernel on sm_90).
    Returns:
        ``(data_t, scale_t)``: ``float8_e4m3fn`` ``[.., K, M]`` contiguous (M fastest) and scales
        ``[.., K, M/32]`` (or blocked of that matrix). ``data_t.mT`` equals
        ``formats.quantize(x, axis=-2).data``; see :func:`columnwise_mxtensor`. With ``blocked_copy``
        ``(data_t, scale_t, blocked)``, ``blocked[e]`` = ``layouts.to_blocked(scale_t[e])``.
    Raises:
        TypeError / ValueError as :func:`quantize_rowwise` (``M % 32`` instead of ``K % 32``).
    """
    return _launch_2d(x, scale_rule, scale_layout, row=False, col=True, tile32=False, name="quantize_columnwise",
                      blocked_copy=blocked_copy)


def quantize_dual(x: torch.Tensor, scale_rule: ScaleRule | str = "rceil", scale_layout: str = "row_major"):
    """Rowwise and columnwise MXFP8 of x from one read (``M % 32 == K % 32 == 0``).

    Returns:
        ``(data, scale, data_t, scale_t)`` as :func:`quantize_rowwise` then
        :func:`quantize_columnwise`.
    """
    return _launch_2d(x, scale_rule, scale_layout, row=True, col=True, tile32=False, name="quantize_dual")


def quantize_32x32(x: torch.Tensor, scale_rule: ScaleRule | str = "rceil", scale_layout: str = "row_major",
                   transposed: bool = True):
    """MXFP8 with one scale per 32x32 tile (2D weight blocks), both orientations from one read.

    Args:
        x: ``[N, K]`` or ``[E, N, K]`` weights, ``N % 32 == K % 32 == 0``, CUDA.
        scale_rule, scale_layout: as :func:`quantize_rowwise`.
        transposed: also write the transposed copy (else only ``(data, scale)`` is returned).
    Returns:
        ``(data, scale, data_t, scale_t)``: ``data`` ``[.., N, K]`` with scales ``[.., N, K/32]``
        (equal to ``formats.quantize(x, axis=-1, block=(32, 32))``); ``data_t`` ``[.., K, N]`` (the
        same bytes transposed) with scales ``[.., K, N/32]`` (``formats.quantize(x, axis=-2,
        block=(32, 32))`` transposed). Scales are stored replicated (standard 1x32 MX tensors).
    """
    return _launch_2d(x, scale_rule, scale_layout, row=True, col=transposed, tile32=True, name="quantize_32x32")


# 1x128 / 128x1 groups and 128x128 tiles (docs/DESIGN.md §9, recipe mxfp8_128): the same outputs and storage as the
# 1x32 functions above (E4M3 data, E8M0 scales per 32 elements, each group's scale replicated), equal byte for byte
# to formats.quantize(x, axis, rule, block=128 or (128, 128)).


def quantize_rowwise_128(x: torch.Tensor, scale_rule: ScaleRule | str = "rceil",
                         scale_layout: str = "row_major") -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 along the last dim with one scale per 128 elements (1x128 groups): fprop / dgrad operands.

    Args:
        x: ``[M, K]`` or ``[B, M, K]`` bfloat16/float16/float32, CUDA, ``K % 128 == 0``; any strides, any M.
        scale_rule, scale_layout: as :func:`quantize_rowwise`.
    Returns:
        ``(data, scale)``: ``float8_e4m3fn`` ``[.., M, K]``, ``float8_e8m0fnu`` ``[.., M, K/32]`` (row-major;
        each group's byte 4 times), equal to ``formats.quantize(x, -1, scale_rule, block=128)``.
    """
    return _launch_2d(x, scale_rule, scale_layout, row=True, col=False, tile32=False, name="quantize_rowwise_128",
                      group=_G128)


def quantize_columnwise_128(x: torch.Tensor, scale_rule: ScaleRule | str = "rceil",
                            scale_layout: str = "row_major") -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 along dim -2 with one scale per 128 rows (128x1 groups, the wgrad operand), data transposed.

    Args:
        x: ``[M, K]`` or ``[B, M, K]``, ``M % 128 == 0``, CUDA.
    Returns:
        ``(data_t, scale_t)``: ``float8_e4m3fn`` ``[.., K, M]``, scales ``[.., K, M/32]``;
        ``columnwise_mxtensor(data_t, scale_t, rule, (1, 128))`` equals ``formats.quantize(x, -2, rule, 128)``.
    """
    return _launch_2d(x, scale_rule, scale_layout, row=False, col=True, tile32=False,
                      name="quantize_columnwise_128", group=_G128)


def quantize_dual_128(x: torch.Tensor, scale_rule: ScaleRule | str = "rceil", scale_layout: str = "row_major"):
    """1x128 along K and 128x1 along M (stored transposed) from one read: x (fprop + wgrad), dy (dgrad + wgrad).

    Args:
        x: ``[M, K]`` or ``[B, M, K]``, ``M % 128 == K % 128 == 0``, CUDA.
    Returns:
        ``(data, scale, data_t, scale_t)``: :func:`quantize_rowwise_128` then :func:`quantize_columnwise_128`.
    """
    return _launch_2d(x, scale_rule, scale_layout, row=True, col=True, tile32=False, name="quantize_dual_128",
                      group=_G128)


def quantize_128x128(x: torch.Tensor, scale_rule: ScaleRule | str = "rceil", scale_layout: str = "row_major",
                     transposed: bool = True):
    """One scale per 128x128 tile (weights ``[E, N, K]``), both orientations from one read (as quantize_32x32).

    Args:
        x: ``[N, K]`` or ``[E, N, K]``, ``K % 128 == 0`` and, with ``transposed``, ``N % 128 == 0`` (without it N
            may end in a partial tile of whole 32-row blocks: ``N % 32 == 0``), CUDA.
        transposed: also write the copy along N (``[.., K, N]``, the same bytes transposed).
    Returns:
        ``(data, scale, data_t, scale_t)`` (``transposed=False``: ``(data, scale)``): ``data`` ``[.., N, K]`` with
        scales ``[.., N, K/32]`` = ``formats.quantize(x, -1, rule, (128, 128))``; ``data_t`` ``[.., K, N]`` with
        ``[.., K, N/32]`` = ``formats.quantize(x, -2, rule, (128, 128))`` transposed. "sm90" scales keep one
        value per 32x32 tile (as :func:`quantize_32x32`), replicated over each 128x128 tile.
    """
    return _launch_2d(x, scale_rule, scale_layout, row=True, col=transposed, tile32=True, name="quantize_128x128",
                      group=_G128)


def quantize_128x128_parts(parts, scale_rule: ScaleRule | str = "rceil"):
    """:func:`quantize_128x128` of ``torch.cat(parts, dim=-2)`` without the concatenation: each part is read once and
    quantized straight into its rows of the outputs (and its columns of the copy along N). The expert layer's gate
    and up weights ``w1``, ``w3 [E, F, D]`` become the FP8 operands of ``[w1; w3] [E, 2F, D]`` this way, where a
    concatenation would first write (and the quantization read) an FP32 copy of both.

    Args:
        parts: a non-empty sequence of ``[N_i, K]`` or ``[E, N_i, K]`` tensors, bfloat16/float16/float32, CUDA, all
            of one dtype, device, leading shape and ``K``; ``N_i % 128 == K % 128 == 0`` (so no 128x128 tile
            straddles two parts: the result equals the concatenation's, byte for byte).
    Returns:
        ``(data, scale, data_t, scale_t)`` with ``N = sum N_i``: ``data`` ``[.., N, K]`` e4m3, ``scale`` ``[.., N,
        K/32]`` e8m0, ``data_t`` ``[.., K, N]``, ``scale_t`` ``[.., K, N/32]`` (row-major scales), equal to
        ``quantize_128x128(torch.cat(parts, -2), scale_rule)``.
    Raises:
        TypeError: not tensors, or a dtype other than the three. ValueError: no parts, parts that differ in
        dtype, device, leading shape or K, a dim not a multiple of 128, CPU tensors outside the interpreter.
    """
    name = "quantize_128x128_parts"
    parts = list(parts) if isinstance(parts, (list, tuple)) else None
    if not parts:
        raise ValueError(f"{name} expects a non-empty list or tuple of tensors")
    first = parts[0]
    for p in parts:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{name} expects tensors, got {type(p).__name__}")
    for p in parts[1:]:
        if (p.dtype, p.device, p.dim(), p.shape[:-2], p.shape[-1]) != (first.dtype, first.device, first.dim(),
                                                                       first.shape[:-2], first.shape[-1]):
            raise ValueError(f"{name}: every part must have the first's dtype, device, leading shape and K; got "
                             f"{first.dtype} {tuple(first.shape)} on {first.device} and {p.dtype} {tuple(p.shape)} "
                             f"on {p.device}")
    views = [_check(p, name, need_k32=True, need_m32=True, group=_G128)[0] for p in parts]
    B, K = views[0].shape[0], views[0].shape[2]
    N = sum(v.shape[1] for v in views)
    lead = tuple(first.shape[:-2])
    dev = first.device
    if not all(_use_gluon(v) for v in views):  # (Triton kernel: each part, then its bytes copied into place)
        outs = [quantize_128x128(p, scale_rule) for p in parts]
        return (torch.cat([o[0] for o in outs], -2), torch.cat([o[1] for o in outs], -2),
                torch.cat([o[2] for o in outs], -1), torch.cat([o[3] for o in outs], -1))
    rceil = _rule(scale_rule)
    qr = torch.empty(B, N, K, dtype=torch.uint8, device=dev)
    sr = _alloc_scales(B, N, K // BLOCK, 0, dev)
    qc = torch.empty(B, K, N, dtype=torch.uint8, device=dev)
    sc = _alloc_scales(B, K, N // BLOCK, 0, dev)
    n0 = 0
    for v in views:
        n = v.shape[1]
        if B > 0 and n > 0 and K > 0:
            _launch_gluon(v, qc[:, :, n0:], sc[:, :, n0 // BLOCK:], qr[:, n0:], sr[:, n0:], n, K, rceil, row=1,
                          col=1, layout=0, tile32=True, group=_G128, m_out=N)
        n0 += n

    def finish(t, dtype):
        return t.view(*lead, *t.shape[1:]).view(dtype)

    return (finish(qr, torch.float8_e4m3fn), finish(sr, torch.float8_e8m0fnu), finish(qc, torch.float8_e4m3fn),
            finish(sc, torch.float8_e8m0fnu))


def quantize_grouped_rowwise(x: torch.Tensor, offs: torch.Tensor, scale_rule: ScaleRule | str = "rceil",
                             padded_rows: int | None = None, row_major_scale: bool = False):
    """Rowwise MXFP8 of expert-grouped rows, scales written in the per-group blocked layout.

    Args:
        x: ``[M, K]`` bfloat16/float16/float32, CUDA, ``K % 32 == 0``; rows sorted by group.
        offs: int32 ``[E]`` cumulative end rows of the groups (non-decreasing, ``offs[-1] <= M``;
            empty groups allowed); on the same device as x.
        scale_rule: ``"rceil"`` or ``"floor"``.
        padded_rows: capacity, in scale rows, of the blocked output. ``None`` (default) computes
            the exact ``sum ceil(n_g/128)*128``, which syncs with the host once; pass any value
            ``>=`` that (e.g. ``(ceil(M/128) + E) * 128``, always enough) to stay asynchronous:
            rows past the last group are then zero.
        row_major_scale: also write the scales row-major (from the same pass over x).
    Returns:
        ``(data, scale, blocked_offs)``: ``float8_e4m3fn`` ``[M, K]`` (all rows, also those past
        ``offs[-1]``), flat ``float8_e8m0fnu`` scales of ``padded_rows * ceil(K/128)*4`` entries,
        and int32 ``[E]`` padded end offsets. With ``padded_rows=None`` ``(scale, blocked_offs)``
        equal ``layouts.to_blocked_grouped(formats.quantize(x).scale, offs)``. With
        ``row_major_scale`` a fourth item, ``float8_e8m0fnu`` ``[M, K/32]``: ``formats.quantize(x).scale``
        (all rows), so ``rowwise_mxtensor(data, it)`` is ``formats.quantize(x)``.
    Raises:
        TypeError / ValueError as :func:`quantize_rowwise`; ValueError for bad ``offs``.
    """
    rceil = _rule(scale_rule)
    if not isinstance(offs, torch.Tensor) or offs.dim() != 1 or offs.dtype != torch.int32:
        raise ValueError("offs must be a 1D int32 tensor of cumulative group end rows")
    x3, was_2d = _check(x, "quantize_grouped_rowwise", need_k32=True, need_m32=False)
    if not was_2d:
        raise ValueError(f"quantize_grouped_rowwise expects a 2D [M, K] tensor, got shape {tuple(x.shape)}")
    if offs.device != x.device:
        raise ValueError(f"offs is on {offs.device}, x on {x.device}")
    offs = offs.contiguous()  # the kernel reads offs[g] at offs_ptr + g
    M, K = x.shape
    E = offs.numel()
    if padded_rows is None:  # the one host sync
        padded_rows = int(blocked_group_offsets(offs)[-1]) if E > 0 else 0
    if padded_rows % 128:
        raise ValueError(f"padded_rows must be a multiple of 128, got {padded_rows}")
    cols = K // BLOCK
    data = torch.empty(M, K, dtype=torch.uint8, device=x.device)
    scale = torch.empty(padded_rows * triton_cdiv(cols, 4) * 4, dtype=torch.uint8, device=x.device)
    row_scale = torch.empty(M, cols, dtype=torch.uint8, device=x.device) if row_major_scale else None
    extra = (row_scale.view(torch.float8_e8m0fnu),) if row_major_scale else ()
    n_tiles = max(triton_cdiv(M, 128) + E, padded_rows // 128)
    if n_tiles == 0 or K == 0:
        return (data.view(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu), blocked_group_offsets(offs),
                *extra)
    blocked_offs = torch.empty(E, dtype=torch.int32, device=x.device)  # written by the kernel
    BM, BK, num_warps, persistent = _config_grouped()
    n_row_tiles = n_tiles * (128 // BM)
    total = n_row_tiles * triton_cdiv(triton_cdiv(K, 128) * 128, BK)
    EP = max(16, 1 << max(E - 1, 0).bit_length())
    # group search per tile (_group_rows): a vector sum while the groups fit one warp, else a binary search
    search_bits = E.bit_length() if EP > _GROUPED_VECTOR_SEARCH_MAX else 0
    args = (x, data, scale, offs, blocked_offs, row_scale if row_major_scale else scale, M, K, x.stride(0),
            x.stride(1), E, n_row_tiles, padded_rows, rceil)
    kwargs = dict(EP=EP, SEARCH_BITS=search_bits, BM=BM, BK=BK, SOFT_CVT=_interpreting(), ROW_SCALE=row_major_scale,
                  num_warps=num_warps)
    _launch_tiles(_kernels().mx_quantize_grouped_kernel, args, kwargs, total, persistent, x.device)
    return data.view(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu), blocked_offs, *extra


# ----------------------------------------------------------------------------------------------
# MXTensor views
# ----------------------------------------------------------------------------------------------

def _per_expert(blocked: torch.Tensor | None, scale: torch.Tensor) -> GroupedScale | None:
    """The per-expert carrier of ``blocked``, the blocked copy of ``scale [E, r, c]``, or None."""
    return None if blocked is None else GroupedScale(blocked, None, None, round_up(scale.shape[-2], 128))


def rowwise_mxtensor(data: torch.Tensor, scale: torch.Tensor, scale_rule: str = "rceil",
                     block: tuple[int, int] = (1, BLOCK), blocked: torch.Tensor | None = None) -> MXTensor:
    """MXTensor of :func:`quantize_rowwise` / :func:`quantize_32x32` output (row-major scales); ``blocked``:
    :func:`quantize_rowwise`'s blocked copy of 3D output, carried per expert (:attr:`MXTensor.grouped`)."""
    return MXTensor(data, scale, data.dim() - 1, ScaleRule(scale_rule).value, block, _per_expert(blocked, scale))


def grouped_rowwise_mxtensor(data: torch.Tensor, scale: torch.Tensor, blocked: torch.Tensor, offs: torch.Tensor,
                             blocked_offs: torch.Tensor, scale_rule: str = "rceil") -> MXTensor:
    """MXTensor of :func:`quantize_grouped_rowwise` output with ``row_major_scale`` and ``padded_rows=None`` (the
    exact size): ``data`` ``[M, K]``, the row-major ``scale`` ``[M, K/32]``, and the per-group blocked scales
    (``blocked``, with the ``offs`` they were laid out for and their ``blocked_offs``) carried as
    :attr:`~mxmoe.formats.MXTensor.grouped`."""
    width = round_up(data.shape[-1] // BLOCK, 4)
    rows = blocked.numel() // width if width else 0
    return MXTensor(data, scale, data.dim() - 1, ScaleRule(scale_rule).value, (1, BLOCK),
                    GroupedScale(blocked, offs, blocked_offs, rows))


def columnwise_mxtensor(data_t: torch.Tensor, scale_t: torch.Tensor, scale_rule: str = "rceil",
                        block: tuple[int, int] = (1, BLOCK), blocked: torch.Tensor | None = None) -> MXTensor:
    """Logical ``[.., M, K]`` MXTensor quantized along dim -2, a view of columnwise output.

    ``data_t`` ``[.., K, M]`` / ``scale_t`` ``[.., K, M/32]`` (row-major) are the K-major storage;
    the result's ``.contiguous()`` data and scale equal ``formats.quantize(x, axis=-2)``. ``blocked``:
    :func:`quantize_columnwise`'s blocked copy of 3D output (of ``scale_t``), carried per expert.
    """
    return MXTensor(data_t, scale_t, data_t.dim() - 1, ScaleRule(scale_rule).value, block,
                    _per_expert(blocked, scale_t)).mT

