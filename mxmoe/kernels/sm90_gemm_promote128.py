"""Hopper (sm_90) MXFP8 grouped GEMMs, promotion per 128: the mx128 mode of the kernel in
:mod:`mxmoe.kernels.sm90_gemm_kernel` (recipe ``mxfp8_128``, DESIGN §9).

The mx128 mode (``SG=4``; :func:`sm90_mx128_m_grouped_gemm`, :func:`sm90_mx128_k_grouped_gemm`): activations /
gradients with one scale per 128 of the contraction dim, weights one per 128x128 tile (M-grouped), or both operands
one per 128 tokens (K-grouped). The same producer, scheduler and epilogue; the consumer's K loop (``_mainloop128``)
issues each 128-deep stage as ONE wgmma call (four m64n128k32 chained in the tensor core into a fresh partial) and
promotes once per stage::

    chains of CHAIN stages: stage j -> partial j % 2 (async); retire stage j-1 (wait(1)); promote it:
        M-grouped acc += P * (sa[m] * sb)      (sb one value per 128x128 tile: 1 FFMA per element)
        K-grouped acc += P * (sa[n] * sb[k])   (FMUL + FFMA per element)
    last stage of the chain: wait(0) (nothing in flight at the back-edge), promote

measured FP32-output error 1.2-2.7e-4 against FP64 (the tensor core's 128-deep FP8 sums); scale layouts:
:func:`sm90_mx128_scale_layouts`.
"""

from __future__ import annotations

import torch

from mxmoe.backend import sm_count
from mxmoe.kernels.sm90_gemm_kernel import HAS_GLUON
from mxmoe.kernels.sm90_gemm_launch import (MX_BLOCK, _check_offs, _check_operand, _check_scale, _check_sm90, _desc,
                                            _out_desc, _search_steps)
from mxmoe.kernels.sm90_scales import sm90_k_grouped_schedule, sm90_m_grouped_scales, sm90_scale_layout
from mxmoe.kernels.sm90_tile_config import Sm90TileConfig, check_tile_config, sm90_mx128_tile_config

if HAS_GLUON:
    import triton

    from mxmoe.kernels.sm90_gemm_kernel import sm90_mxfp8_grouped_gemm_kernel

__all__ = ["sm90_mx128_m_grouped_gemm", "sm90_mx128_k_grouped_gemm", "sm90_mx128_scale_layouts"]

GROUP = 128  # scale group along the contraction dim in the mx128 mode
_SG = GROUP // MX_BLOCK  # 32-blocks per scale group


def sm90_mx128_scale_layouts(a_scale: torch.Tensor, b_scale: torch.Tensor, offs: torch.Tensor | None = None):
    """Per-32 E8M0 scales of mx128 operands -> the compact FP32 layouts the mx128 kernel reads.

    Each 128-group's scale is read from its first 32-block (the others replicate it; not checked),
    so the work is a strided gather of 1/128 (activations) or 1/16384 (weights) of the scale bytes, on
    the device, one launch per operand (:mod:`mxmoe.kernels.sm90_scales`), with no host sync.

    M-grouped (``offs`` given): ``a_scale`` ``[M, K/32]`` (1x128 rows), ``b_scale`` ``[E, N, K/32]``
    (128x128 tiles) -> ``(sa [K/128, W], starts [E] int32, sb [E*K/128, ceil(N/32) padded to 4])``:
    ``sa`` as :func:`~mxmoe.kernels.sm90_scales.sm90_grouped_scale_layout` (each group's rows start at a
    multiple of 4 columns), ``sb[e*K/128 + k, c]`` the scale of weight rows ``32c..32c+31`` (one value per
    32 output columns, equal in fours inside a 128x128 tile: the kernel's TMA box must start 16-byte
    aligned).

    K-grouped (``offs`` None): ``a_scale`` ``[N, T/32]``, ``b_scale`` ``[K, T/32]`` (128x1 along
    tokens) -> ``(sa [ceil(T/128), N_pad], None, sb [ceil(T/128), K_pad])`` as :func:`sm90_scale_layout`.
    """
    if offs is None:
        return sm90_scale_layout(a_scale[:, ::_SG]), None, sm90_scale_layout(b_scale[:, ::_SG])
    sa, sched = sm90_m_grouped_scales(a_scale[:, ::_SG], offs, GROUP, 1)
    return sa, sched[1], _mx128_weight_scales(b_scale)


def _mx128_weight_scales(b_scale: torch.Tensor) -> torch.Tensor:
    """``[E, N, K/32]`` per-32 scales of 128x128 weight tiles -> FP32 ``[E*K/128, ceil(N/32) padded to 4]``."""
    E, _, kb = b_scale.shape
    return sm90_scale_layout(b_scale[:, ::MX_BLOCK, ::_SG]).reshape(E * (kb // _SG), -1)


def _check_group_dim(name: str, n: int) -> None:
    if n % GROUP != 0:
        raise ValueError(f"{name} = {n} is not a multiple of {GROUP} (the mx128 scale group)")


def _check_out(out, shape, out_dtype, device):
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype must be bfloat16 or float32, got {out_dtype}")
    if out is None:
        return torch.empty(*shape, dtype=out_dtype, device=device)
    if tuple(out.shape) != tuple(shape) or out.dtype != out_dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {list(shape)} {out_dtype} tensor")
    return out


def sm90_mx128_m_grouped_gemm(a_data: torch.Tensor, a_scale: torch.Tensor, b_data: torch.Tensor,
                              b_scale: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                              out: torch.Tensor | None = None, config: Sm90TileConfig | None = None) -> torch.Tensor:
    """M-grouped mx128 GEMM, "NT" (fprop, dgrad): ``C[m, :] = deq(a)[m, :] @ deq(b)[e(m)]^T``.

    The operands are ordinary MXFP8 tensors (:class:`mxmoe.formats.MXTensor` data and per-32 scales)
    whose scales are shared in coarser groups: ``a`` quantized with ``block=(1, 128)`` along K (one
    scale per 128 consecutive elements of a row), ``b`` with ``block=(128, 128)`` (one scale per
    128x128 tile of each ``[N, K]`` weight). Per 128-deep stage the kernel issues the stage's four
    wgmmas into one FP32 partial and promotes it once, ``acc += P * (sa[m] * sb)``.

    Args:
        a_data: ``[M, K]`` ``float8_e4m3fn``, K contiguous; rows grouped by expert; K a multiple of 128.
        a_scale: ``[M, K/32]`` ``float8_e8m0fnu``, row-major, equal in each group of 4 (only the first
            of each 4 is read).
        b_data: ``[E, N, K]`` ``float8_e4m3fn``, K contiguous. For dgrad pass the weight's other
            orientation (``[E, K, N]`` contiguous: the same 128x128 tiles, transposed).
        b_scale: ``[E, N, K/32]`` ``float8_e8m0fnu``, row-major, uniform on each 128x128 tile (only the
            first row and column of each tile's scales are read).
        offs: ``[E]`` int32 cumulative END offsets of the row groups (non-decreasing, ``offs[-1] <= M``);
            any group sizes, empty groups allowed.
        out_dtype: ``torch.bfloat16`` (default) or ``torch.float32``.
        out: optional preallocated contiguous ``[M, N]`` output (rows past ``offs[-1]`` untouched).
        config: tile configuration (default :func:`~mxmoe.kernels.sm90_tile_config.sm90_mx128_tile_config`);
            needs ``block_k == block_n == 128``.
    Returns:
        ``[M, N]`` of ``out_dtype``; rows past ``offs[-1]`` unspecified.
    Raises:
        TypeError / ValueError: wrong dtypes, shapes or layout, K not a multiple of 128, bad ``offs``,
        ``out`` or ``config``. RuntimeError: not a Hopper GPU, or Triton/Gluon missing.
    """
    _check_operand("a_data", a_data, 2)
    _check_operand("b_data", b_data, 3)
    _check_scale("a_scale", a_scale, a_data)
    _check_scale("b_scale", b_scale, b_data)
    M, K = a_data.shape
    E, N, Kb = b_data.shape
    if Kb != K:
        raise ValueError(f"a_data has K={K} but b_data has K={Kb}")
    _check_group_dim("K", K)
    cfg = config or sm90_mx128_tile_config(M, N, K, E)
    check_tile_config(cfg, scale_group=GROUP)
    _check_sm90(a_data)
    if b_data.device != a_data.device:
        raise ValueError("a_data and b_data must be on the same device")
    offs = _check_offs(offs, E, a_data.device)
    out = _check_out(out, (M, N), out_dtype, a_data.device)
    if M == 0 or N == 0 or E == 0:
        return out
    BM, BN, BK = cfg.block_m, cfg.block_n, cfg.block_k
    nt = triton.cdiv(N, BN)
    sa, sched = sm90_m_grouped_scales(a_scale[:, ::_SG], offs, BM, nt)  # [K/128, W]; [2, E] tiles, starts
    sb = _mx128_weight_scales(b_scale)
    grid = (min(sm_count(a_data.device), (triton.cdiv(M, BM) + E) * nt), )
    sb_block = [BK // GROUP, 32]  # 128 bytes: every stage's box starts 128-byte aligned in smem
    c_desc = _out_desc(out, cfg, sb_block[1])
    sm90_mxfp8_grouped_gemm_kernel[grid](
        _desc(a_data, [BM, BK]), _desc(b_data.view(E * N, K), [BN, BK]), _desc(sa, [BK // GROUP, BM]),
        _desc(sb, sb_block), c_desc, out, offs, sched, E, N, K // MX_BLOCK, 0, nt, M, N,
        K_GROUPED=False, WB32=True, STAGES=cfg.stages, GROUP_M=cfg.group_m, SEARCH_STEPS=_search_steps(E),
        VEC_SEARCH=cfg.vec_search, SPLIT_WG=cfg.split_wg, TMA_STORE=c_desc is not None,
        num_warps=4 if cfg.split_wg else 8, maxnreg=cfg.maxnreg, SG=_SG, CHAIN=cfg.chain)
    return out


def sm90_mx128_k_grouped_gemm(a_data: torch.Tensor, a_scale: torch.Tensor, b_data: torch.Tensor,
                              b_scale: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype = torch.float32,
                              check_offsets: bool = True, out: torch.Tensor | None = None,
                              config: Sm90TileConfig | None = None) -> torch.Tensor:
    """K-grouped mx128 GEMM (wgrad): ``out[e] = deq(a)[:, group e] @ deq(b)[:, group e]^T``.

    Both operands are MXFP8 quantized along tokens in groups of 128 (``block=(1, 128)`` on the
    ``[., T]`` layout: 128x1 scale groups of ``dy`` and ``x``); the kernel promotes once per 128
    tokens, ``acc += P * (sa[n] * sb[k])``.

    Args:
        a_data: ``[N, T]`` ``float8_e4m3fn`` (e.g. dy^T), T (tokens) contiguous.
        a_scale: ``[N, T/32]`` ``float8_e8m0fnu``, row-major, equal in each group of 4 (first read).
        b_data: ``[K, T]`` ``float8_e4m3fn`` (e.g. x^T), T contiguous.
        b_scale: ``[K, T/32]`` ``float8_e8m0fnu``, likewise.
        offs: ``[E]`` int32 cumulative END offsets along T; every one a multiple of 128 (the layer pads
            each expert's tokens to 128, so no scale group spans two experts), non-decreasing,
            ``offs[-1] <= T``.
        out_dtype: ``torch.float32`` (default) or ``torch.bfloat16``.
        check_offsets: verify ``offs % 128 == 0`` (one device-to-host sync; pass False under
            CUDA graphs / torch.compile when the caller guarantees it).
        out: optional preallocated contiguous ``[E, N, K]`` output.
        config: tile configuration (default :func:`~mxmoe.kernels.sm90_tile_config.sm90_mx128_tile_config`).
    Returns:
        ``[E, N, K]`` of ``out_dtype``; zeros for an expert with no tokens.
    Raises:
        TypeError / ValueError: wrong dtypes, shapes or layout, T not a multiple of 32, offsets not
        multiples of 128, bad ``out`` or ``config``. RuntimeError: not a Hopper GPU, or Triton/Gluon missing.
    """
    _check_operand("a_data", a_data, 2)
    _check_operand("b_data", b_data, 2)
    _check_scale("a_scale", a_scale, a_data)
    _check_scale("b_scale", b_scale, b_data)
    N, T = a_data.shape
    K, Tb = b_data.shape
    if Tb != T:
        raise ValueError(f"a_data has T={T} but b_data has T={Tb}")
    if offs.dim() != 1 or offs.shape[0] == 0:
        raise ValueError(f"offs must be 1-D with at least one group, got shape {tuple(offs.shape)}")
    E = offs.shape[0]
    cfg = config or sm90_mx128_tile_config(N, K, T, E, k_grouped=True)
    check_tile_config(cfg, scale_group=GROUP)
    _check_sm90(a_data)
    offs = _check_offs(offs, E, a_data.device)
    if check_offsets and bool((offs % GROUP != 0).any()):
        raise ValueError(f"every K-grouped mx128 offset must be a multiple of {GROUP} (pad each group to "
                         f"{GROUP} tokens)")
    out = _check_out(out, (E, N, K), out_dtype, a_data.device)
    if N == 0 or K == 0:
        return out
    if T == 0:
        return out.zero_()
    BM, BN, BK = cfg.block_m, cfg.block_n, cfg.block_k
    sa, _, sb = sm90_mx128_scale_layouts(a_scale, b_scale)
    mt, nt = triton.cdiv(N, BM), triton.cdiv(K, BN)
    grid = (min(sm_count(a_data.device), E * mt * nt), )
    c_desc = _out_desc(out.view(E * N, K), cfg, BN)
    sm90_mxfp8_grouped_gemm_kernel[grid](
        _desc(a_data, [BM, BK]), _desc(b_data, [BN, BK]), _desc(sa, [BK // GROUP, BM]), _desc(sb, [BK // GROUP, BN]),
        c_desc, out, offs, sm90_k_grouped_schedule(offs), E, 0, 0, mt, nt, N, K,
        K_GROUPED=True, WB32=False, STAGES=cfg.stages, GROUP_M=cfg.group_m, SEARCH_STEPS=0, VEC_SEARCH=False,
        SPLIT_WG=cfg.split_wg, TMA_STORE=c_desc is not None, num_warps=4 if cfg.split_wg else 8,
        maxnreg=cfg.maxnreg, SG=_SG, CHAIN=cfg.chain)
    return out
