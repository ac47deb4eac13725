"""Launch plumbing shared by the MXFP8 quantization launchers (:mod:`mxmoe.kernels.quantize`,
:mod:`mxmoe.kernels.qdq`, :mod:`mxmoe.kernels.quantize_fused`): input checks, scale storage, the tile launch
(persistent or one program per tile) and the Gluon column kernel's launch on sm_90.
"""

from __future__ import annotations

import torch

from mxmoe.backend import interpreting, resolve, sm_count
from mxmoe.formats import BLOCK, ScaleRule
from mxmoe.kernels.quantize_tile_config import _GLUON_VEC, _gluon_k_fast, _gluon_tile
from mxmoe.layouts import blocked_numel

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_LAYOUTS = ("row_major", "blocked", "sm90")  # kernel codes 0, 1, 2
_G128 = 128  # the 1x128 / 128x1 scale group and 128x128 tiles (docs/DESIGN.md §9, recipe mxfp8_128)

_interpreting = interpreting  # (the kernels pick their soft float conversions under the interpreter)


def _use_gluon(x3: torch.Tensor) -> bool:
    """Whether the column-family kernels (quantize_columnwise / quantize_dual, qdq_dual / qdq_columnwise /
    qdq_dual_bf16 with 1x32 blocks) run the Gluon kernel on x3 [B, M, K]: CUDA sm_90 (the GPUs it was checked on),
    unit stride along K, Gluon importable, not disabled by MXMOE_QUANT_GLUON=0 (``Backend.quant_gluon``)."""
    if not x3.is_cuda or not resolve(x3.device).quant_gluon:  # checked on H200 only (sm_100: Triton)
        return False
    if x3.stride(2) != 1 and x3.shape[2] > 1:
        return False
    try:
        _gluon()
    except (ImportError, AttributeError):  # pragma: no cover - triton without Gluon, or with other Gluon names
        return False
    return True


def _gluon():
    from mxmoe.kernels import quantize_gluon

    return quantize_gluon


def _launch_gluon(x3, qc, sc, qr, sr, m_cover: int, k_cover: int, rceil: int, row: int, col: int, layout: int,
                  tile32: bool = False, group: int = 32, shape: tuple | None = None, fused: dict | None = None,
                  tile: dict | None = None, m_out: int | None = None):
    """Run quantize_gluon.mx_quantize_cols_kernel on x3 [B, M, K] over [m_cover, k_cover]; row / col
    are its ROW / COL output modes (qc, qr: E4M3 bytes or BF16; sc, sr: scales or None); tile32: one
    scale per 32x32 tile (group 128: 128x128); group: the scale group along each output's axis.
    shape: the tile grid's (B, M, K) where it is not x3's (the fused input modes); fused: the kernel's
    IN_MODE arguments (src_ptr / T, or qh_ptr / sh_ptr / SAVE_H); tile: the tile, where not _gluon_tile's.
    m_out: the outputs are a part of wider row-major destinations with m_out rows along M (the kernel's M_OUT; qc,
    sc, qr, sr are then views starting at the part, and sc / sr's batch strides are the destinations')."""
    B, M, K = x3.shape if shape is None else shape
    g = _gluon_tile(row, x3) if tile is None else dict(tile)
    n_tiles = B * triton_cdiv(m_cover, 32 * g["MB"]) * triton_cdiv(k_cover, g["BK"])
    _gluon().mx_quantize_cols_kernel[(n_tiles,)](
        x3, qc, qc if sc is None else sc, qc if qr is None else qr, qc if sr is None else sr,
        M, K, m_cover, k_cover, x3.stride(0), x3.stride(1), _batch_stride(sc, m_out), _batch_stride(sr, m_out), rceil,
        ROW=row, COL=col, LAYOUT=layout, VEC=_GLUON_VEC, TILE32=tile32, K_FAST=_gluon_k_fast(row, col),
        num_warps=g["WM"] * g["WK"], **g, **({"GROUP": group} if group != 32 else {}), **(fused or {}),
        **({} if m_out is None else {"M_OUT": m_out}))


def _batch_stride(s, m_out):
    """A scale output's per-batch size as the kernel steps it: the tensor's first-row size, or with m_out (a part
    of a wider destination, s a view into it) the destination's batch stride; 0 for none."""
    if s is None:
        return 0
    return s[0].numel() if m_out is None else s.stride(0)


# Scale groups the Gluon kernel takes (128: 1x128 / 128x1 groups and 128x128 tiles, GROUP constexpr); other
# groups run the Triton kernel.
_GLUON_GROUPS = (32, 128)


def _check(x: torch.Tensor, name: str, need_k32: bool, need_m32: bool,
           group: int = BLOCK, group_m: int | None = None) -> tuple[torch.Tensor, bool]:
    """Validate x and return it as a 3D [B, M, K] view plus whether it was 2D (need_k32 / need_m32:
    K a multiple of ``group``, the scale group along it, M of ``group_m``, default ``group``)."""
    group_m = group if group_m is None else group_m
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"{name} expects a bfloat16/float16/float32 tensor, got dtype {x.dtype}")
    if x.dim() not in (2, 3):
        raise ValueError(f"{name} expects a 2D [M, K] or 3D [B, M, K] tensor, got shape {tuple(x.shape)}")
    M, K = x.shape[-2], x.shape[-1]
    if need_k32 and K % group:
        raise ValueError(f"{name}: the last dim (K={K}) must be divisible by {group}")
    if need_m32 and M % group_m:
        raise ValueError(f"{name}: dim -2 (M={M}) must be divisible by {group_m} (columnwise blocks run along it)")
    if not x.is_cuda and not _interpreting():
        raise ValueError(f"{name} runs on CUDA tensors; got a tensor on {x.device} "
                         "(use mxmoe.formats.quantize, the pure-torch reference, on CPU)")
    was_2d = x.dim() == 2
    return (x.unsqueeze(0) if was_2d else x), was_2d


def _rule(scale_rule) -> int:
    return 1 if ScaleRule(scale_rule) is ScaleRule.RCEIL else 0


def _layout(scale_layout: str) -> int:
    if scale_layout not in _LAYOUTS:
        raise ValueError(f"scale_layout must be one of {_LAYOUTS}, got {scale_layout!r}")
    return _LAYOUTS.index(scale_layout)


def _alloc_scales(B: int, rows: int, cols: int, layout: int, device) -> torch.Tensor:
    """Scale storage of a [rows, cols] scale matrix per batch entry: uint8 bytes (row-major or
    blocked; callers view them as float8_e8m0fnu) or, for "sm90", int32 bits of FP32 values,
    transposed to [cols, ceil4(rows)] (callers view them as float32)."""
    if layout == 1:
        return torch.empty(B, blocked_numel(rows, cols), dtype=torch.uint8, device=device)
    if layout == 2:
        return torch.empty(B, cols, -(-rows // 4) * 4, dtype=torch.int32, device=device)
    return torch.empty(B, rows, cols, dtype=torch.uint8, device=device)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


_OCCUPANCY: dict = {}


def _launch_tiles(kernel, args, kwargs, total: int, persistent: bool, device: torch.device) -> None:
    """Launch ``kernel`` over ``total`` tiles: persistent (as many programs as fit, each looping over
    tiles, see :func:`_persistent_grid`) or one program per tile."""
    grid = (_persistent_grid(kernel, args, kwargs, total, device) if persistent else total,)
    kernel[grid](*args, **kwargs)


def _persistent_grid(kernel, args, kwargs, total: int, device: torch.device) -> int:
    """Programs of a persistent launch: as many as fit on the GPU at once (never more than tiles).

    Occupancy comes from the compiled kernel's registers, warps and shared memory (Hopper: 64K
    registers, 64 warps, 32 CTAs and 227 KB of shared memory per SM). Under the interpreter the
    grid is about half the tiles, so programs run the prefetch loop more than once.
    """
    if _interpreting():
        return max(1, min(total, 3, (total + 1) // 2))
    key = (kernel.fn.__name__ if hasattr(kernel, "fn") else id(kernel), device.index,
           tuple((a.dtype, a.stride(-1) == 1) if isinstance(a, torch.Tensor) else None for a in args),
           tuple(sorted(kwargs.items())))
    per_sm = _OCCUPANCY.get(key)
    if per_sm is None:
        per_sm = 4
        try:
            compiled = kernel.warmup(*args, grid=(1,), **kwargs)
            if hasattr(compiled, "result"):
                compiled = compiled.result()
            compiled._init_handles()
            warps = compiled.metadata.num_warps
            regs_per_warp = -(-max(compiled.n_regs, 1) * 32 // 256) * 256
            smem = compiled.metadata.shared
            per_sm = min(65536 // (regs_per_warp * warps), 64 // warps, 32,
                         (227 * 1024) // smem if smem else 32)
            per_sm = max(per_sm, 1)
        except Exception:  # pragma: no cover - older/newer triton internals: keep the default
            pass
        _OCCUPANCY[key] = per_sm
    return max(1, min(total, per_sm * sm_count(device)))
