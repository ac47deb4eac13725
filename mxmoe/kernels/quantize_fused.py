"""Fused MXFP8 quantizers' launchers: SwiGLU fused with the dual quantization of its output (``swiglu_qdq``,
``swiglu_quantize_128``: the down-projection's input) and the token permutation fused with the dual quantization of
the gathered rows (``permute_qdq``, ``permute_quantize_128``: the first expert product's input), and the top-k
combine's backward fused with the dual quantization of its expert-row gradient (``combine_backward_quantize_128``:
the down projection's dy), and SwiGLU's backward fused with the dual quantization of dh
(``swiglu_backward_quantize_128``: the up projection's dy); no intermediate is written. The Triton bodies are
:mod:`mxmoe.kernels.quantize_fused_triton` (imported on first use); on sm_90 the 1x128 forms take the Gluon kernels
of :mod:`mxmoe.kernels.quantize_gluon`.
"""

from __future__ import annotations

import torch

from mxmoe.formats import BLOCK, ScaleRule
from mxmoe.kernels.quantize_launch import (_G128, _check, _gluon, _interpreting, _launch_gluon, _launch_tiles, _rule,
                                           _use_gluon, triton_cdiv)
from mxmoe.kernels.quantize_tile_config import (_GLUON_TILE_COMBINE, _GLUON_TILE_SWIGLU_BACKWARD, _GLUON_TILES_SWIGLU,
                                                _GLUON_VEC, _SWIGLU_TMA_STAGES, _config_128_fused, _config_qdq,
                                                _config_swiglu)


def _kernels():
    """The triton kernel module, imported lazily (triton is an optional dependency)."""
    try:
        from mxmoe.kernels import quantize_fused_triton
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("mxmoe.kernels.quantize_fused needs triton (pip install 'mxmoe[gpu]')") from e
    return quantize_fused_triton


def swiglu_qdq(h: torch.Tensor, scale_rule: ScaleRule | str = "rceil", save_h: bool = False):
    """SwiGLU of ``h [M, 2F]`` (gate ``h[:, :F]``, up ``h[:, F:]``) fused with the dual QDQ of its
    result ``a = F.silu(gate) * up`` (BF16 math as torch's), from one read of h; a is not written.

    Args:
        h: bfloat16 ``[M, 2F]``, CUDA, ``M % 32 == F % 32 == 0``; any strides.
        save_h: also return h quantized along 2F (for the SwiGLU backward), from the same read.
    Returns:
        ``(a_bf16 [M, F], data_t [F, M], scale_t [F, M/32], h_data, h_scale)``: :func:`qdq_dual`
        of a, then with ``save_h`` h quantized along 2F (``h_data [M, 2F]`` e4m3, ``h_scale
        [M, 2F/32]`` e8m0 row-major: :func:`quantize_rowwise` of h, bit for bit), else two empty tensors.
    Raises:
        TypeError: h not bfloat16. ValueError: bad shape, CPU tensor.
    """
    return _launch_swiglu(h, scale_rule, save_h, fp8_rows=False, group=BLOCK, name="swiglu_qdq")


def swiglu_quantize_128(h: torch.Tensor, scale_rule: ScaleRule | str = "rceil", save_h: bool = False):
    """SwiGLU of ``h [M, 2F]`` fused with the dual 1x128 / 128x1 quantization of ``a = F.silu(gate) * up`` (BF16
    math as torch's, :func:`swiglu_qdq`'s), from one read of h; a is not written: the recipe ``mxfp8_128``'s
    down-projection input (fprop rows, wgrad columns).

    Args:
        h: bfloat16 ``[M, 2F]``, CUDA, ``M % 128 == F % 128 == 0``; any strides.
        save_h: also return h quantized along 2F in 1x128 groups, from the same read.
    Returns:
        ``(data, scale, data_t, scale_t, h_data, h_scale)``: :func:`quantize_dual_128` of a (``data`` e4m3
        ``[M, F]``, ``scale`` e8m0 ``[M, F/32]``, ``data_t`` ``[F, M]``, ``scale_t`` ``[F, M/32]``), then with
        ``save_h`` :func:`quantize_rowwise_128` of h (``[M, 2F]`` e4m3, ``[M, 2F/32]`` e8m0), else two empty tensors.
    Raises:
        TypeError: h not bfloat16. ValueError: bad shape, CPU tensor.
    """
    return _launch_swiglu(h, scale_rule, save_h, fp8_rows=True, group=_G128, name="swiglu_quantize_128")


def _launch_swiglu(h: torch.Tensor, scale_rule, save_h: bool, fp8_rows: bool, group: int, name: str,
                   tma: bool = True):
    """mx_swiglu_qdq_kernel: a's rows as BF16 MX values (``swiglu_qdq``) or, ``fp8_rows``, as E4M3 + scales
    (``swiglu_quantize_128``); outputs in the order rows (bf16, or data + scale), data_t, scale_t, h_data, h_scale.
    On the Gluon route, 1x128 without save_h runs the TMA-fed kernel where h allows it (:func:`_tma_ready`);
    ``tma=False`` keeps the register-fed one (benchmarks compare the two)."""
    if not isinstance(h, torch.Tensor) or h.dtype != torch.bfloat16:
        raise TypeError(f"{name} expects a bfloat16 tensor, got {getattr(h, 'dtype', type(h).__name__)}")
    if h.dim() != 2 or h.shape[1] % (2 * group):
        raise ValueError(f"{name} expects h [M, 2F] with F % {group} == 0, got shape {tuple(h.shape)}")
    _check(h, name, need_k32=True, need_m32=True, group=group)
    M, F = h.shape[0], h.shape[1] // 2
    dev = h.device
    rows = torch.empty(M, F, dtype=torch.uint8 if fp8_rows else torch.bfloat16, device=dev)
    srow = torch.empty(M, F // BLOCK, dtype=torch.uint8, device=dev) if fp8_rows else None
    qc = torch.empty(F, M, dtype=torch.uint8, device=dev)
    sc = torch.empty(F, M // BLOCK, dtype=torch.uint8, device=dev)
    qh = torch.empty((M, 2 * F) if save_h else (0,), dtype=torch.uint8, device=dev)
    sh = torch.empty((M, 2 * F // BLOCK) if save_h else (0,), dtype=torch.uint8, device=dev)
    gluon = M and F and fp8_rows and _use_gluon(h[None]) and F % _GLUON_TILES_SWIGLU[save_h]["BK"] == 0
    if gluon and tma and not save_h and group == _G128 and _tma_ready(h):
        _launch_swiglu_tma(h, qc, sc, rows, srow, _rule(scale_rule))
    elif gluon:
        fused = dict(IN_MODE=2, SAVE_H=save_h, qh_ptr=qh if save_h else qc, sh_ptr=sh if save_h else sc)
        _launch_gluon(h[None], qc, sc, rows, srow, M, F, _rule(scale_rule), row=1, col=1, layout=0, group=group,
                      shape=(1, M, F), fused=fused, tile=_GLUON_TILES_SWIGLU[save_h])
    elif M and F:
        BM, BK, num_warps, persistent = _config_swiglu(save_h) if group == BLOCK else _config_128_fused(save_h)
        total = triton_cdiv(M, BM) * triton_cdiv(F, BK)
        args = (h, rows, sc if srow is None else srow, qc, sc, qh if save_h else qc, sh if save_h else sc, M, F,
                h.stride(0), h.stride(1), _rule(scale_rule))
        kwargs = dict(SAVE_H=save_h, BM=BM, BK=BK, SOFT_CVT=_interpreting(), num_warps=num_warps)
        if fp8_rows:
            kwargs.update(ROW_FP8=True, GROUP=group)
        kernel = _kernels().mx_swiglu_qdq_kernel
        _launch_tiles(kernel, args, kwargs, total, persistent, dev)
    out = (rows.view(torch.float8_e4m3fn), srow.view(torch.float8_e8m0fnu)) if fp8_rows else (rows,)
    return (*out, qc.view(torch.float8_e4m3fn), sc.view(torch.float8_e8m0fnu),
            qh.view(torch.float8_e4m3fn), sh.view(torch.float8_e8m0fnu))


def _tma_ready(h: torch.Tensor) -> bool:
    """Whether TMA can read h [M, 2F] bf16 in boxes: unit stride along 2F, rows that do not overlap, 16-byte
    aligned base and row pitch."""
    return (h.stride(1) == 1 and h.stride(0) >= h.shape[1] and h.data_ptr() % 16 == 0
            and (h.stride(0) * h.element_size()) % 16 == 0)


def _launch_swiglu_tma(h: torch.Tensor, qc, sc, rows, srow, rceil: int, tile: dict | None = None,
                       stages: int = _SWIGLU_TMA_STAGES, **options) -> None:
    """quantize_gluon.mx_swiglu_quantize_tma_kernel on h [M, 2F] (M % 128 == F % 128 == 0, checked by the caller),
    persistent: as many programs as fit (one per SM at this tile), each looping over tiles. tile / stages /
    options (e.g. maxnreg): other launches of the same kernel, for benchmarks (default: _GLUON_TILES_SWIGLU's)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    g = _GLUON_TILES_SWIGLU[False] if tile is None else tile
    M, F = h.shape[0], h.shape[1] // 2
    box = [32 * g["MB"], g["BK"]]
    desc = TensorDescriptor(h, [M, 2 * F], [h.stride(0), 1], box,
                            gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2))
    kernel = _gluon().mx_swiglu_quantize_tma_kernel
    args = (desc, qc, sc, rows, srow, M, F, rceil)
    kwargs = dict(VEC=_GLUON_VEC, GROUP=_G128, STAGES=stages, num_warps=g["WM"] * g["WK"], **g, **options)
    _launch_tiles(kernel, args, kwargs, (M // box[0]) * (F // box[1]), True, h.device)


def permute_qdq(x: torch.Tensor, src: torch.Tensor, scale_rule: ScaleRule | str = "rceil"):
    """Token rows gathered into a row buffer, fused with that buffer's dual QDQ; the buffer
    ``xp[m] = x[src[m]]`` (a zero row where ``src[m] == -1``) is never written.

    Args:
        x: ``[T, K]`` bfloat16/float16/float32, CUDA, ``K % 32 == 0``; any strides.
        src: ``[M]`` int32/int64 on x's device, ``M % 32 == 0``: the source token of each row, or -1.
            Values outside ``[0, T)`` give zero rows (not checked: that would synchronize).
        scale_rule: ``"rceil"`` or ``"floor"``.
    Returns:
        ``(xp_bf16 [M, K], data_t [K, M], scale_t [K, M/32])``: :func:`qdq_dual` of xp, bit for bit.
    Raises:
        TypeError: x not a float tensor of a supported dtype, src not int32/int64.
        ValueError: bad shapes, devices differ, CPU tensors (outside the interpreter).
    """
    return _launch_permute(x, src, scale_rule, fp8_rows=False, group=BLOCK, name="permute_qdq")


def permute_quantize_128(x: torch.Tensor, src: torch.Tensor, scale_rule: ScaleRule | str = "rceil"):
    """Token rows gathered into the expert buffer ``xp[m] = x[src[m]]`` (zero row where ``src[m] == -1``), fused
    with the dual 1x128 / 128x1 quantization of xp, FP8 out both ways; xp is never written (the recipe
    ``mxfp8_128``'s first expert product: fprop rows, wgrad columns).

    Args:
        x: ``[T, K]`` bfloat16/float16/float32, CUDA, ``K % 128 == 0``; any strides.
        src: ``[M]`` int32/int64 on x's device, ``M % 128 == 0`` (a 128-row group along M never spans two experts
            when each expert's rows are padded to 128); values outside ``[0, T)`` give zero rows (not checked).
    Returns:
        ``(data, scale, data_t, scale_t)``: :func:`quantize_dual_128` of xp, bit for bit (``data`` e4m3
        ``[M, K]``, ``scale`` e8m0 ``[M, K/32]``, ``data_t`` ``[K, M]``, ``scale_t`` ``[K, M/32]``).
    Raises:
        TypeError / ValueError as :func:`permute_qdq` (with 128 for 32).
    """
    return _launch_permute(x, src, scale_rule, fp8_rows=True, group=_G128, name="permute_quantize_128")


def _launch_permute(x: torch.Tensor, src: torch.Tensor, scale_rule, fp8_rows: bool, group: int, name: str):
    """mx_permute_qdq_kernel: xp's rows as BF16 MX values (``permute_qdq``) or, ``fp8_rows``, as E4M3 + scales
    (``permute_quantize_128``); outputs in the order rows (bf16, or data + scale), data_t, scale_t."""
    if not isinstance(src, torch.Tensor) or src.dtype not in (torch.int32, torch.int64):
        got = getattr(src, "dtype", type(src).__name__)
        raise TypeError(f"{name} expects src as an int32/int64 tensor, got {got}")
    if src.dim() != 1 or src.device != getattr(x, "device", None):
        raise ValueError(f"{name} expects src [M] on x's device, got shape {tuple(src.shape)} on {src.device}")
    if src.numel() % group:
        raise ValueError(f"{name}: the buffer's row count (M={src.numel()}) must be divisible by {group}")
    _check(x, name, need_k32=True, need_m32=False, group=group)
    if x.dim() != 2:
        raise ValueError(f"{name} expects x [T, K], got shape {tuple(x.shape)}")
    (T, K), M = x.shape, src.numel()
    dev = x.device
    rows = torch.empty(M, K, dtype=torch.uint8 if fp8_rows else torch.bfloat16, device=dev)
    srow = torch.empty(M, K // BLOCK, dtype=torch.uint8, device=dev) if fp8_rows else None
    qc = torch.empty(K, M, dtype=torch.uint8, device=dev)
    sc = torch.empty(K, M // BLOCK, dtype=torch.uint8, device=dev)
    if M and K and T and fp8_rows and _use_gluon(x[None]):
        _launch_gluon(x[None], qc, sc, rows, srow, M, K, _rule(scale_rule), row=1, col=1, layout=0, group=group,
                      shape=(1, M, K), fused=dict(IN_MODE=1, src_ptr=src.contiguous(), T=T))
    elif M and K:
        BM, BK, num_warps, persistent = _config_qdq(True) if group == BLOCK else _config_128_fused(False)
        total = triton_cdiv(M, BM) * triton_cdiv(K, BK)
        if T == 0:  # no tokens: every row is zero; an empty CUDA tensor has no address triton accepts
            x = x.new_zeros(1, K)
        args = (x, src.contiguous(), rows, sc if srow is None else srow, qc, sc, M, K, T, x.stride(0), x.stride(1),
                _rule(scale_rule))
        kwargs = dict(BM=BM, BK=BK, SOFT_CVT=_interpreting(), num_warps=num_warps)
        if fp8_rows:
            kwargs.update(ROW_FP8=True, GROUP=group)
        kernel = _kernels().mx_permute_qdq_kernel
        _launch_tiles(kernel, args, kwargs, total, persistent, dev)
    out = (rows.view(torch.float8_e4m3fn), srow.view(torch.float8_e8m0fnu)) if fp8_rows else (rows,)
    return (*out, qc.view(torch.float8_e4m3fn), sc.view(torch.float8_e8m0fnu))


def combine_backward_quantize_128(dy: torch.Tensor, w: torch.Tensor, yp: torch.Tensor, slot: torch.Tensor,
                                  top_k: int, scale_rule: ScaleRule | str = "rceil"):
    """Backward of the top-k combine ``y[t] = sum_j w[t*k + j] * yp[slot_rows[t*k + j]]`` fused with the dual
    1x128 / 128x1 quantization of the expert rows' gradient ``dyp[r] = w[s] * dy[s // k]`` (s = ``slot[r]``; the
    FP32 product rounded to BF16, zero on padding rows: :func:`mxmoe.kernels.layer.combine_backward`'s dyp), which
    is never written: the recipe ``mxfp8_128``'s down-projection dy, FP8 both ways (dgrad rows, wgrad columns).

    Args:
        dy: ``[T, D]`` bfloat16, CUDA, ``D % 128 == 0``, unit stride along D.
        w: ``[T*k]`` float32 router weights.
        yp: ``[M, D]`` bfloat16, the combine's input (contiguous rows).
        slot: ``[M]`` int32, the slot each row feeds (-1: a padding row), ``M % 128 == 0``.
        top_k: k.
    Returns:
        ``(data, scale, data_t, scale_t, dw_rows)``: :func:`quantize_dual_128` of dyp, bit for bit, and
        ``dw_rows [M]`` float32, each row's router-weight gradient ``<dy[t], yp[r]>`` (FP32 sums; 0 on padding
        rows): the gradient of weight s is ``dw_rows[slot_rows[s]]``.
    Raises:
        TypeError: dy or yp not bfloat16, w not float32, slot not int32. ValueError: bad shapes, CPU tensors.
    On sm_90 with the Gluon kernels one pass (mx_quantize_cols_kernel's IN_MODE 3); elsewhere the combine's
    backward kernel, then :func:`quantize_dual_128` (the same values).
    """
    name = "combine_backward_quantize_128"
    if dy.dtype != torch.bfloat16 or yp.dtype != torch.bfloat16 or w.dtype != torch.float32 or slot.dtype != torch.int32:
        raise TypeError(f"{name} expects bfloat16 dy and yp, float32 w and int32 slot, got {dy.dtype}, {yp.dtype}, "
                        f"{w.dtype}, {slot.dtype}")
    if (dy.dim() != 2 or yp.dim() != 2 or yp.shape[1] != dy.shape[1] or slot.shape != (yp.shape[0],)
            or w.shape != (dy.shape[0] * top_k,)):
        raise ValueError(f"{name} expects dy [T, D], w [T*{top_k}], yp [M, D] and slot [M], got {tuple(dy.shape)}, "
                         f"{tuple(w.shape)}, {tuple(yp.shape)}, {tuple(slot.shape)}")
    if yp.shape[0] % _G128:
        raise ValueError(f"{name}: the buffer's row count (M={yp.shape[0]}) must be divisible by {_G128}")
    _check(dy, name, need_k32=True, need_m32=False, group=_G128)
    (T, D), M = dy.shape, yp.shape[0]
    if not (M and D and T and _use_gluon(dy[None])):
        from mxmoe.kernels import layer
        from mxmoe.kernels.quantize import quantize_dual_128

        dyp, dw = layer.combine_backward(dy, w, yp, slot, top_k)
        live = slot >= 0
        dw_rows = torch.where(live, dw[torch.where(live, slot, 0).long()], 0.0) if dw.numel() else dyp.new_zeros(
            M, dtype=torch.float32)
        return (*quantize_dual_128(dyp, scale_rule), dw_rows)
    yp = yp if yp.stride(1) == 1 and yp.stride(0) == D else yp.contiguous()
    dev = dy.device
    rows = torch.empty(M, D, dtype=torch.uint8, device=dev)
    srow = torch.empty(M, D // BLOCK, dtype=torch.uint8, device=dev)
    qc = torch.empty(D, M, dtype=torch.uint8, device=dev)
    sc = torch.empty(D, M // BLOCK, dtype=torch.uint8, device=dev)
    tile = _GLUON_TILE_COMBINE
    dwp = torch.empty(triton_cdiv(D, tile["BK"]), M, dtype=torch.float32, device=dev)
    _launch_gluon(dy[None], qc, sc, rows, srow, M, D, _rule(scale_rule), row=1, col=1, layout=0, group=_G128,
                  shape=(1, M, D), tile=tile,
                  fused=dict(IN_MODE=3, src_ptr=slot.contiguous(), T=T, w_ptr=w.contiguous(), yp_ptr=yp,
                             dwp_ptr=dwp, TOP_K=top_k))
    return (rows.view(torch.float8_e4m3fn), srow.view(torch.float8_e8m0fnu), qc.view(torch.float8_e4m3fn),
            sc.view(torch.float8_e8m0fnu), dwp.sum(0))


def swiglu_backward_quantize_128(da: torch.Tensor, h: torch.Tensor, h_scale: torch.Tensor | None = None,
                                 scale_rule: ScaleRule | str = "rceil"):
    """SwiGLU's backward ``dh [M, 2F]`` of ``a = F.silu(h[:, :F]) * h[:, F:]`` from ``da [M, F]`` (torch autograd's
    BF16 arithmetic: :func:`mxmoe.kernels.layer.swiglu_backward`), fused with dh's dual 1x128 / 128x1 quantization;
    dh is never written: the recipe ``mxfp8_128``'s up-projection dy, FP8 both ways (dgrad rows, wgrad columns).

    Args:
        da: ``[M, F]`` bfloat16, CUDA, unit stride along F, ``M % 128 == F % 128 == 0``.
        h: ``[M, 2F]``, SwiGLU's input: bfloat16, or with ``h_scale`` its MXFP8 copy along 2F (float8_e4m3fn
            data, the gradient then taken at its BF16 MX values).
        h_scale: ``[M, 2F/32]`` float8_e8m0fnu, h's row-major scales (one per 32 elements; 1x128 groups store
            each group's scale 4 times), or None.
    Returns:
        ``(data, scale, data_t, scale_t)``: :func:`quantize_dual_128` of dh, bit for bit (``data`` e4m3
        ``[M, 2F]``, ``scale`` e8m0 ``[M, 2F/32]``, ``data_t`` ``[2F, M]``, ``scale_t`` ``[2F, M/32]``).
    Raises:
        TypeError: da not bfloat16, h not bfloat16 (or, with h_scale, not float8_e4m3fn).
        ValueError: bad shapes, CPU tensors.
    On sm_90 with the Gluon kernels one pass (mx_quantize_cols_kernel's IN_MODE 4); elsewhere the layer's
    SwiGLU-backward kernel, then :func:`quantize_dual_128` (the same values).
    """
    name = "swiglu_backward_quantize_128"
    h_fp8 = h_scale is not None
    want_h = torch.float8_e4m3fn if h_fp8 else torch.bfloat16
    if da.dtype != torch.bfloat16 or h.dtype != want_h:
        raise TypeError(f"{name} expects bfloat16 da and {want_h} h, got {da.dtype} and {h.dtype}")
    if da.dim() != 2 or h.dim() != 2 or h.shape != (da.shape[0], 2 * da.shape[1]):
        raise ValueError(f"{name} expects da [M, F] and h [M, 2F], got {tuple(da.shape)} and {tuple(h.shape)}")
    if h_fp8 and tuple(h_scale.shape) != (h.shape[0], h.shape[1] // BLOCK):
        raise ValueError(f"{name} expects h_scale [M, 2F/32] = {(h.shape[0], h.shape[1] // BLOCK)}, "
                         f"got {tuple(h_scale.shape)}")
    _check(da, name, need_k32=True, need_m32=True, group=_G128)
    M, F = da.shape
    if not (M and F and _use_gluon(da[None]) and F % _GLUON_TILE_SWIGLU_BACKWARD["BK"] == 0):
        from mxmoe.kernels import layer
        from mxmoe.kernels.quantize import quantize_dual_128

        return tuple(quantize_dual_128(layer.swiglu_backward(da, h, h_scale), scale_rule))
    dev = da.device
    rows = torch.empty(M, 2 * F, dtype=torch.uint8, device=dev)
    srow = torch.empty(M, 2 * F // BLOCK, dtype=torch.uint8, device=dev)
    qc = torch.empty(2 * F, M, dtype=torch.uint8, device=dev)
    sc = torch.empty(2 * F, M // BLOCK, dtype=torch.uint8, device=dev)
    hq = h.contiguous().view(torch.uint8) if h_fp8 else h.contiguous()
    hs = h_scale.contiguous().view(torch.uint8) if h_fp8 else hq  # (without scales the kernel does not read it)
    _launch_gluon(da[None], qc, sc, rows, srow, M, 2 * F, _rule(scale_rule), row=1, col=1, layout=0, group=_G128,
                  shape=(1, M, F), tile=_GLUON_TILE_SWIGLU_BACKWARD,
                  fused=dict(IN_MODE=4, h_ptr=hq, hs_ptr=hs, H_FP8=h_fp8))
    return (rows.view(torch.float8_e4m3fn), srow.view(torch.float8_e8m0fnu), qc.view(torch.float8_e4m3fn),
            sc.view(torch.float8_e8m0fnu))
