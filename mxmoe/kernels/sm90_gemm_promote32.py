"""Hopper (sm_90) MXFP8 grouped GEMMs, promotion per 32: M-grouped (fprop, dgrad) and K-grouped (wgrad).

Hopper's FP8 tensor cores (``wgmma``, QGMMA in SASS) have no block scaling, so the E8M0 scales
are applied on the CUDA cores ("promotion", DESIGN §2): every 32-deep K step is one async
``wgmma`` into a fresh FP32 partial, and the partial is folded into the FP32 accumulator as

    acc[m, n] += P_k[m, n] * 2^(ea[m, k]) * 2^(eb[n, k])

which is the MX product up to summation order and rounding: the FP8 x FP8 products are exact,
but Hopper's FP8 tensor core sums the 32 products of a step with a truncated alignment; measured
relative error against FP64 is 4.5e-5 with FP32 output (1.7e-3 with BF16 output, its own
rounding). A NaN scale (0xFF) is a NaN factor.

The kernel (its structure, tile order and the mx128 mode of :mod:`mxmoe.kernels.sm90_gemm_promote128`) is
:mod:`mxmoe.kernels.sm90_gemm_kernel`.

Scale layouts the kernels read (made from the E8M0 scales in the wrapper, one launch per operand:
:mod:`mxmoe.kernels.sm90_scales`): FP32 values that are exactly ``2^(b-127)``
(NaN for 0xFF), transposed so that one K step's scales for a tile's rows are contiguous:

* activations (A, M-grouped):   ``[K/32, W]``, each expert group starting at a multiple of 4 columns
  (the address a TMA load starts at must be 16-byte aligned, cf. triton-lang/triton#7385: a group
  starting at a row that is not a multiple of 4 would otherwise fault with "illegal instruction")
* weights 1x32 (B, M-grouped):  ``[E * K/32, N_pad]``
* weights 32x32 (B, M-grouped): ``[E * K/32, N/32 padded to 4]`` (one value per 32x32 tile)
* wgrad operands (K-grouped):   ``[T/32, N_pad]`` and ``[T/32, K_pad]``
"""

from __future__ import annotations

import torch

from mxmoe.backend import sm_count
from mxmoe.kernels.sm90_gemm_kernel import HAS_GLUON
from mxmoe.kernels.sm90_gemm_launch import (MX_BLOCK, _check_offs, _check_operand, _check_scale, _check_sm90, _desc,
                                            _out_desc, _search_steps)
from mxmoe.kernels.sm90_scales import sm90_k_grouped_schedule, sm90_m_grouped_scales, sm90_scale_layout
from mxmoe.kernels.sm90_tile_config import Sm90TileConfig, check_tile_config, sm90_tile_config

if HAS_GLUON:
    import triton

    from mxmoe.kernels.sm90_gemm_kernel import sm90_mxfp8_grouped_gemm_kernel

__all__ = ["sm90_mxfp8_m_grouped_gemm", "sm90_mxfp8_k_grouped_gemm"]


def sm90_mxfp8_m_grouped_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                              offs: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16, weight_block: int = 1,
                              out: torch.Tensor | None = None, config: Sm90TileConfig | None = None) -> torch.Tensor:
    """M-grouped MXFP8 GEMM, "NT" (fprop and dgrad): ``C[m, :] = deq(a)[m, :] @ deq(b)[e(m)]^T``.

    Args:
        a: ``[M, K]`` ``float8_e4m3fn``, K contiguous; rows grouped by expert.
        a_scale: ``[M, K/32]`` ``float8_e8m0fnu``, row-major.
        b: ``[E, N, K]`` ``float8_e4m3fn``, K contiguous (one ``[N, K]`` weight per expert).
        b_scale: ``[E, N, K/32]`` ``float8_e8m0fnu``, row-major. With ``weight_block=32`` the weight
            was quantized in 32x32 tiles: scales are equal within each group of 32 rows of N
            (not checked) and ``N`` must be a multiple of 32.
        offs: ``[E]`` int32 cumulative END offsets of the row groups (non-decreasing,
            ``offs[-1] <= M``); expert ``e`` owns rows ``offs[e-1] .. offs[e]-1``. Empty groups allowed.
        out_dtype: ``torch.bfloat16`` (default) or ``torch.float32``.
        weight_block: 1 (standard 1x32 weight blocks) or 32 (32x32 weight blocks: one FFMA per
            element of promotion instead of FMUL + FFMA).
        out: optional preallocated ``[M, N]`` output of ``out_dtype`` (rows past ``offs[-1]`` are
            left untouched).
        config: tile configuration; default from :func:`sm90_tile_config`; a hand-made one is checked by
            :func:`~mxmoe.kernels.sm90_tile_config.check_tile_config` (ValueError).
    Returns:
        ``[M, N]`` tensor of ``out_dtype``; rows past ``offs[-1]`` are unspecified.
    Raises:
        TypeError / ValueError: wrong dtypes, shapes, layout, K not a multiple of 32, bad ``offs``.
        RuntimeError: not a Hopper GPU, or Triton/Gluon missing.

    The scales are re-laid here: A by :func:`~mxmoe.kernels.sm90_scales.sm90_m_grouped_scales` to FP32 ``[K/32, W]`` with
    each group's rows starting at a multiple of 4 columns; B by :func:`sm90_scale_layout` to FP32
    ``[E*K/32, N_pad]`` (1x32) or ``[E*K/32, N/32 padded to 4]`` (32x32).
    """
    _check_operand("a", a, 2)
    _check_operand("b", b, 3)
    _check_sm90(a)
    _check_scale("a_scale", a_scale, a)
    _check_scale("b_scale", b_scale, b)
    M, K = a.shape
    E, N, Kb = b.shape
    if Kb != K:
        raise ValueError(f"a has K={K} but b has K={Kb}")
    if b.device != a.device:
        raise ValueError("a and b must be on the same device")
    offs = _check_offs(offs, E, a.device)
    if weight_block not in (1, 32):
        raise ValueError(f"weight_block must be 1 or 32, got {weight_block}")
    if weight_block == 32 and N % 32 != 0:
        raise ValueError(f"weight_block=32 needs N a multiple of 32, got N={N}")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype must be bfloat16 or float32, got {out_dtype}")
    if out is None:
        out = torch.empty(M, N, dtype=out_dtype, device=a.device)
    elif out.shape != (M, N) or out.dtype != out_dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{M}, {N}] {out_dtype} tensor")
    if M == 0 or N == 0 or E == 0:
        return out
    cfg = config or sm90_tile_config(M, N, K, E, weight_block=weight_block)
    check_tile_config(cfg, weight_block)
    BM, BN, BK = cfg.block_m, cfg.block_n, cfg.block_k
    KB = BK // MX_BLOCK

    nt = triton.cdiv(N, BN)
    # [K/32, W], groups 4-aligned; [2, E]: cumulative tile counts, A-scale group starts
    sa, sched = sm90_m_grouped_scales(a_scale, offs, BM, nt)
    if weight_block == 32:
        # one value per 32x32 tile: [E*K/32, N/32 padded]
        sb = sm90_scale_layout(b_scale[:, ::MX_BLOCK, :]).reshape(E * (K // MX_BLOCK), -1)
        sb_block = [KB, 8]
    else:
        sb = sm90_scale_layout(b_scale).reshape(E * (K // MX_BLOCK), -1)  # [E*K/32, N_pad]
        sb_block = [KB, BN]
    max_tiles = (triton.cdiv(M, BM) + E) * nt
    grid = (min(sm_count(a.device), max_tiles), )
    c_desc = _out_desc(out, cfg, sb_block[1])
    sm90_mxfp8_grouped_gemm_kernel[grid](
        _desc(a, [BM, BK]), _desc(b.view(E * N, K), [BN, BK]), _desc(sa, [KB, BM]), _desc(sb, sb_block), c_desc,
        out, offs, sched, E, N, K // MX_BLOCK, 0, nt, M, N,
        K_GROUPED=False, WB32=weight_block == 32, STAGES=cfg.stages, GROUP_M=cfg.group_m,
        SEARCH_STEPS=_search_steps(E), VEC_SEARCH=cfg.vec_search, SPLIT_WG=cfg.split_wg, TMA_STORE=c_desc is not None,
        num_warps=4 if cfg.split_wg else 8,
        maxnreg=cfg.maxnreg)
    return out


def sm90_mxfp8_k_grouped_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                              offs: torch.Tensor, out_dtype: torch.dtype = torch.float32,
                              check_offsets: bool = True, out: torch.Tensor | None = None,
                              config: Sm90TileConfig | None = None) -> torch.Tensor:
    """K-grouped MXFP8 GEMM (wgrad): ``out[e] = deq(a)[:, group e] @ deq(b)[:, group e]^T``.

    Args:
        a: ``[N, T]`` ``float8_e4m3fn`` (e.g. dy^T), T (tokens) contiguous.
        a_scale: ``[N, T/32]`` ``float8_e8m0fnu``, row-major.
        b: ``[K, T]`` ``float8_e4m3fn`` (e.g. x^T), T contiguous.
        b_scale: ``[K, T/32]`` ``float8_e8m0fnu``, row-major.
        offs: ``[E]`` int32 cumulative END offsets along T; each a multiple of 32 (the MoE layer
            pads every group to 32 tokens), non-decreasing, ``offs[-1] <= T``.
        out_dtype: ``torch.float32`` (default) or ``torch.bfloat16``.
        check_offsets: verify ``offs % 32 == 0`` (one device-to-host sync).
        out: optional preallocated ``[E, N, K]`` output.
        config: tile configuration; default from :func:`sm90_tile_config`; a hand-made one is checked by
            :func:`~mxmoe.kernels.sm90_tile_config.check_tile_config` (ValueError).
    Returns:
        ``[E, N, K]`` of ``out_dtype``; all zeros for an expert with no tokens.
    Raises:
        TypeError / ValueError: wrong dtypes, shapes, layout, T not a multiple of 32, offsets not
        multiples of 32. RuntimeError: not a Hopper GPU, or Triton/Gluon missing.

    Scales are re-laid here to FP32 ``[T/32, N_pad]`` and ``[T/32, K_pad]``.
    """
    _check_operand("a", a, 2)
    _check_operand("b", b, 2)
    _check_sm90(a)
    _check_scale("a_scale", a_scale, a)
    _check_scale("b_scale", b_scale, b)
    N, T = a.shape
    K, Tb = b.shape
    if Tb != T:
        raise ValueError(f"a has T={T} but b has T={Tb}")
    if offs.dim() != 1:
        raise ValueError(f"offs must be 1-D, got shape {tuple(offs.shape)}")
    E = offs.shape[0]
    offs = _check_offs(offs, E, a.device)
    if E == 0:
        raise ValueError("offs must name at least one group")
    if check_offsets and bool((offs % MX_BLOCK != 0).any()):
        raise ValueError("every K-grouped offset must be a multiple of 32 (pad each group to 32 tokens)")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    if out is None:
        out = torch.empty(E, N, K, dtype=out_dtype, device=a.device)
    elif out.shape != (E, N, K) or out.dtype != out_dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{E}, {N}, {K}] {out_dtype} tensor")
    if N == 0 or K == 0:
        return out
    if T == 0:
        return out.zero_()
    cfg = config or sm90_tile_config(N, K, T, E, k_grouped=True)
    check_tile_config(cfg)
    BM, BN, BK = cfg.block_m, cfg.block_n, cfg.block_k
    KB = BK // MX_BLOCK
    sa = sm90_scale_layout(a_scale)  # [T/32, N_pad]
    sb = sm90_scale_layout(b_scale)  # [T/32, K_pad]
    mt, nt = triton.cdiv(N, BM), triton.cdiv(K, BN)
    grid = (min(sm_count(a.device), E * mt * nt), )
    c_desc = _out_desc(out.view(E * N, K), cfg, BN)
    sm90_mxfp8_grouped_gemm_kernel[grid](
        _desc(a, [BM, BK]), _desc(b, [BN, BK]), _desc(sa, [KB, BM]), _desc(sb, [KB, BN]), c_desc,
        out, offs, sm90_k_grouped_schedule(offs), E, 0, 0, mt, nt, N, K,
        K_GROUPED=True, WB32=False, STAGES=cfg.stages, GROUP_M=cfg.group_m,
        SEARCH_STEPS=0, VEC_SEARCH=False, SPLIT_WG=cfg.split_wg, TMA_STORE=c_desc is not None,
        num_warps=4 if cfg.split_wg else 8,
        maxnreg=cfg.maxnreg)
    return out
