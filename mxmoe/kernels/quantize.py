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
``swiglu_quantize_128`` (SwiGLU + dual); same outputs and storage as the 1x32 forms above (E4M3 data, E8M0
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
their QDQ forms), :mod:`mxmoe.kernels.quantize_gluon` (``_use_gluon`` says when;
``MXMOE_QUANT_GLUON=0`` keeps Triton); tile choices are the ``_config_*`` functions and
``_GLUON_TILES`` below.

Wrap results as :class:`~mxmoe.formats.MXTensor` with :func:`rowwise_mxtensor` /
:func:`columnwise_mxtensor` (row-major scales only), grouped output with :func:`grouped_rowwise_mxtensor`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mxmoe.backend import interpreting, resolve
from mxmoe.formats import BLOCK, GroupedScale, MXTensor, ScaleRule
from mxmoe.layouts import blocked_group_offsets, blocked_numel, round_up

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_LAYOUTS = ("row_major", "blocked", "sm90")  # kernel codes 0, 1, 2


def _kernels():
    """The triton kernel module, imported lazily (triton is an optional dependency)."""
    try:
        from mxmoe.kernels import quantize_triton
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("mxmoe.kernels.quantize needs triton (pip install 'mxmoe[gpu]')") from e
    return quantize_triton


_interpreting = interpreting  # (the kernels pick their soft float conversions under the interpreter)


# ----------------------------------------------------------------------------------------------
# Tile heuristics (kept out of the kernel bodies)
# ----------------------------------------------------------------------------------------------

class TileConfig(NamedTuple):
    """How a quantization kernel is launched: [BM, BK] tiles of num_warps warps; persistent: as
    many programs as fit on the GPU, each looping over tiles with a one-tile prefetch (else one
    program per tile)."""
    BM: int
    BK: int
    num_warps: int
    persistent: bool


def _config_2d(row: bool, col: bool, tile32: bool) -> TileConfig:
    """Launch config of the 2D kernels, by family (``_TUNED`` key, default below).

    A [BM, BK] tile is 8-32 KB of BF16 input (16-byte loads along K, BM a multiple of 32 rows);
    persistent launches keep loads in flight while a program reduces, converts and stores. Values:
    the best of ``benchmarks/bench_quantize.py --sweep`` (figures in benchmarks/NOTES_quantize.md).
    """
    if _interpreting():  # few large programs: the interpreter's cost is per program
        return TileConfig(128, 256, 4, True)
    key = ("col" if col else "") + ("row" if row else "") + ("32" if tile32 else "")
    return _TUNED.get(key) or TileConfig(32, 256, 4, True)


def _config_128(row: bool, col: bool, tile32: bool) -> TileConfig:
    """Launch config of mx_quantize_kernel with GROUP 128 (1x128 / 128x1 groups, 128x128 tiles): BK % 128 == 0
    for a row output, BM % 128 == 0 for a column output or tiles. Chosen from offline sm_90 compiles
    (benchmarks/NOTES_quantize.md): rowwise keeps the 1x32 "row" tile's shape and bytes in flight
    (32 x 256, 4 warps, a 1x128 group is 16 lanes of one warp); the column family needs 128 rows per tile."""
    if _interpreting():
        return TileConfig(128, 256, 4, True)
    key = ("col" if col else "") + ("row" if row else "") + ("128x128" if tile32 else "128")
    return _TUNED.get(key) or _DEFAULT_128[key]


def _config_128_fused(save_h: bool) -> TileConfig:
    """Launch config of the fused permutation / SwiGLU kernels with GROUP 128 (FP8 rows and columns; BM and BK
    multiples of 128): see _DEFAULT_128."""
    if _interpreting():
        return TileConfig(128, 256, 4, True)
    key = "swiglu128_save_h" if save_h else "fused128"
    return _TUNED.get(key) or _DEFAULT_128[key]


# GROUP 128 tiles: each the one with the fewest registers and spill bytes per thread in offline sm_90 compiles
# (benchmarks/NOTES_quantize.md). The Triton column family (off sm_90 or MXMOE_QUANT_GLUON=0; on sm_90 the
# Gluon kernel runs) needs 128-row tiles, and its dual and 128x128 tiles still spill.
_DEFAULT_128 = {
    "row128": TileConfig(32, 256, 4, False),
    "row128x128": TileConfig(128, 128, 16, True),
    "col128": TileConfig(128, 32, 4, True),
    "colrow128": TileConfig(128, 128, 16, True),
    "colrow128x128": TileConfig(128, 128, 16, True),
    "fused128": TileConfig(128, 128, 16, True),
    "swiglu128_save_h": TileConfig(128, 128, 16, True),
}


# Tile configs by kernel family ("row", "col", "colrow" = dual, "colrow32" = 32x32 tiles, "grouped";
# a missing key uses the default of _config_2d): the best of `bench_quantize.py --sweep` (figures in
# benchmarks/NOTES_quantize.md), each checked bit for bit against the reference on the GPU by
# tests/test_quantize_kernels.py::test_gpu_tuned_configs (the "swiglu" entries by
# tests/test_qdq_kernels.py::test_gpu_swiglu_qdq_equals_composition).
_TUNED: dict[str, TileConfig] = {
    "row": TileConfig(32, 256, 4, False),
    "col": TileConfig(64, 64, 2, True),  # on sm_90 the Gluon kernel runs instead
    # dual (the Triton path: MXMOE_QUANT_GLUON=0 or not sm_90). Not 32x128/w2: with blocked scales an
    # LLVM/NVPTX miscompile of its scale index makes it fault (benchmarks/NOTES_quantize.md)
    "colrow": TileConfig(64, 64, 2, True),
    "colrow32": TileConfig(64, 64, 2, True),
    "grouped": TileConfig(32, 512, 8, True),
    # fused SwiGLU + QDQ: smaller than the dual QDQ tile 64x64/w2, which spills with the SwiGLU math
    "swiglu": TileConfig(32, 64, 2, True),
    "swiglu_save_h": TileConfig(32, 128, 4, True),
}


# Gluon column-family kernel (quantize_gluon.py): [MB*32, BK] tiles, warps WM x WK, TM lanes over blocks
# in the column layout, RS rows of a 32-row block per thread there. One tile per output family -- the column
# output alone ("col") or with the rowwise output too ("dual") -- and input width (2: BF16/FP16, 4: FP32): the
# best of the Gluon tile sweeps (figures in benchmarks/NOTES_quantize.md).
# RS 16 (two lanes per block, one shuffle for its max) makes each warp store write whole 32-byte sectors of the
# transposed output instead of halves; FP32 input keeps 32.
_GLUON_TILES = {
    ("col", 2): dict(MB=4, BK=128, WM=1, WK=4, TM=4, RS=16),
    ("col", 4): dict(MB=8, BK=64, WM=1, WK=4, TM=8, RS=32),
    ("dual", 2): dict(MB=4, BK=128, WM=1, WK=8, TM=4, RS=16),
    ("dual", 4): dict(MB=4, BK=128, WM=1, WK=8, TM=4, RS=32),
}


# Gluon tiles of the SwiGLU input mode (swiglu_quantize_128, 16-bit): two input tiles and the silu math per element
# need more registers than dual's tile (8 warps spill, offline sm_90), so 16 warps over the same 128x128 tile, and
# with save_h WM 2 / TM 2, the one that does not spill there (registers: benchmarks/NOTES_quantize.md).
_GLUON_TILES_SWIGLU = {
    False: dict(MB=4, BK=128, WM=1, WK=16, TM=4, RS=16),
    True: dict(MB=4, BK=128, WM=2, WK=8, TM=2, RS=16),
}


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


# Elements per thread per load in the Gluon kernel, every input dtype: 8 (16 bytes for 16-bit input; two
# 16-byte loads for FP32, so a 1x32 row block spans 4 lanes as for BF16); for FP32 it is faster than 4
# (benchmarks/NOTES_quantize.md).
_GLUON_VEC = 8

# Tile order of the Gluon kernel: k-tiles fastest when it writes E4M3 columns and a row output (quantize_dual,
# quantize_32x32, qdq_dual). A tile writes 4 scale bytes per row; in M-fastest order the next 4 bytes of that row
# come from a program n_m launches later, so 32-byte scale sectors would be written in pieces far apart in time.
# The BF16 column output (qdq_dual_bf16) and columnwise alone are slower K-fastest and keep M-fastest
# (benchmarks/NOTES_quantize.md).
def _gluon_k_fast(row: int, col: int) -> bool:
    return row != 0 and col == 1


def _gluon_tile_fits(MB: int, BK: int, WM: int, WK: int, TM: int, RS: int) -> bool:
    """Whether a Gluon tile meets mx_quantize_cols_kernel's layout rules (its docstring): L_IN takes
    BK/_GLUON_VEC lanes along K (a divisor of 32); L_COL puts RS rows of a block per thread, 32/RS lanes
    per block, TM lanes over blocks and the rest over columns, so TM <= RS, MB % (TM*WM) == 0 and
    BK % (RS/TM*WK) == 0."""
    tpk = BK // _GLUON_VEC
    return (RS in (8, 16, 32) and TM <= RS and 32 % TM == 0 and (32 // TM) % (32 // RS) == 0
            and MB % (TM * WM) == 0 and BK % (RS // TM * WK) == 0
            and BK % _GLUON_VEC == 0 and tpk <= 32 and 32 % tpk == 0)


def _gluon_tile(row: int, x3: torch.Tensor) -> dict:
    """The Gluon kernel's tile for x3: _GLUON_TILES' "dual" (with a row output) or "col", by input width."""
    return dict(_GLUON_TILES[("dual" if row else "col", 2 if x3.element_size() == 2 else 4)])


def _launch_gluon(x3, qc, sc, qr, sr, m_cover: int, k_cover: int, rceil: int, row: int, col: int, layout: int,
                  tile32: bool = False, group: int = 32, shape: tuple | None = None, fused: dict | None = None,
                  tile: dict | None = None):
    """Run quantize_gluon.mx_quantize_cols_kernel on x3 [B, M, K] over [m_cover, k_cover]; row / col
    are its ROW / COL output modes (qc, qr: E4M3 bytes or BF16; sc, sr: scales or None); tile32: one
    scale per 32x32 tile (group 128: 128x128); group: the scale group along each output's axis.
    shape: the tile grid's (B, M, K) where it is not x3's (the fused input modes); fused: the kernel's
    IN_MODE arguments (src_ptr / T, or qh_ptr / sh_ptr / SAVE_H); tile: the tile, where not _gluon_tile's."""
    B, M, K = x3.shape if shape is None else shape
    g = _gluon_tile(row, x3) if tile is None else dict(tile)
    n_tiles = B * triton_cdiv(m_cover, 32 * g["MB"]) * triton_cdiv(k_cover, g["BK"])
    _gluon().mx_quantize_cols_kernel[(n_tiles,)](
        x3, qc, qc if sc is None else sc, qc if qr is None else qr, qc if sr is None else sr,
        M, K, m_cover, k_cover, x3.stride(0), x3.stride(1), 0 if sc is None else sc[0].numel(),
        0 if sr is None else sr[0].numel(), rceil,
        ROW=row, COL=col, LAYOUT=layout, VEC=_GLUON_VEC, TILE32=tile32, K_FAST=_gluon_k_fast(row, col),
        num_warps=g["WM"] * g["WK"], **g, **({"GROUP": group} if group != 32 else {}), **(fused or {}))


# Scale groups the Gluon kernel takes (128: 1x128 / 128x1 groups and 128x128 tiles, GROUP constexpr); other
# groups run the Triton kernel.
_GLUON_GROUPS = (32, 128)


# Groups up to which mx_quantize_grouped_kernel finds a tile's group with a vector sum over the groups (warp-local
# while they fit one warp); past it, a binary search over the padded ends: the sum had become a cross-warp
# reduction (benchmarks/NOTES_quantize.md).
_GROUPED_VECTOR_SEARCH_MAX = 32


def _config_grouped() -> TileConfig:
    """Launch config of mx_quantize_grouped_kernel ("tile" kind; BM must divide 128)."""
    if _interpreting():
        return TileConfig(128, 256, 4, True)
    return _TUNED.get("grouped") or TileConfig(32, 256, 4, True)


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------

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
        # it is slower (benchmarks/NOTES_quantize.md)
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
    n_sm = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(total, per_sm * n_sm))


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
_G128 = 128


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


# ----------------------------------------------------------------------------------------------
# Quantize-dequantize (QDQ): BF16 MX values from one read, for the Hopper expansion route
# ----------------------------------------------------------------------------------------------

def _config_qdq(col: bool) -> TileConfig:
    """Launch config of the QDQ kernels (mx_quantize_kernel's structure, BF16 outputs): with a
    columnwise output the quantize kernel's "colrow" tile, rowwise 32x512/w8. The columnwise one is
    the fastest of a sweep of the QDQ kernels (benchmarks/NOTES_quantize.md)."""
    if _interpreting():
        return TileConfig(128, 256, 4, True)
    return TileConfig(64, 64, 2, True) if col else TileConfig(32, 512, 8, True)


def _config_swiglu(save_h: bool) -> TileConfig:
    """Launch config of mx_swiglu_qdq_kernel: ``_TUNED["swiglu"]``, with ``save_h`` (two more
    quantized outputs) ``_TUNED["swiglu_save_h"]``."""
    if _interpreting():
        return TileConfig(128, 256, 4, True)
    return _TUNED["swiglu_save_h" if save_h else "swiglu"]


def _launch_qdq(x: torch.Tensor, scale_rule, row_bf16: bool, col_bf16: bool, col_fp8: bool, tile32: bool,
                name: str) -> tuple:
    """Run mx_qdq_kernel; outputs in the order bf16 rowwise, bf16 columnwise, (data_t, scale_t)."""
    rceil = _rule(scale_rule)
    col = col_bf16 or col_fp8
    x3, was_2d = _check(x, name, need_k32=True, need_m32=col or tile32)
    B, M, K = x3.shape
    dev = x.device
    br = torch.empty(B, M, K, dtype=torch.bfloat16, device=dev) if row_bf16 else None
    bc = torch.empty(B, K, M, dtype=torch.bfloat16, device=dev) if col_bf16 else None
    qc = torch.empty(B, K, M, dtype=torch.uint8, device=dev) if col_fp8 else None
    sc = torch.empty(B, K, M // BLOCK, dtype=torch.uint8, device=dev) if col_fp8 else None
    if x3.numel() > 0 and col and not (col_bf16 and col_fp8) and not (tile32 and (col_bf16 or not row_bf16)) \
            and _use_gluon(x3):
        _launch_gluon(x3, bc if col_bf16 else qc, sc, br, None, M, K, rceil, row=2 if row_bf16 else 0,
                      col=2 if col_bf16 else 1, layout=0, tile32=tile32)
    elif x3.numel() > 0:
        BM, BK, num_warps, persistent = _config_qdq(col)
        total = triton_cdiv(M, BM) * triton_cdiv(K, BK) * B
        dummy = next(t for t in (br, bc, qc) if t is not None)
        args = (x3, br if row_bf16 else dummy, bc if col_bf16 else dummy, qc if col_fp8 else dummy,
                sc if col_fp8 else dummy, M, K, B, x3.stride(0), x3.stride(1), x3.stride(2), rceil)
        kwargs = dict(ROW_BF16=row_bf16, COL_BF16=col_bf16, COL_FP8=col_fp8, TILE32=tile32, BM=BM, BK=BK,
                      SOFT_CVT=_interpreting(), num_warps=num_warps)
        kernel = _kernels().mx_qdq_kernel
        _launch_tiles(kernel, args, kwargs, total, persistent, dev)

    def finish(t, dtype=None):
        t = t[0] if was_2d else t
        return t.view(dtype) if dtype is not None else t

    out = []
    if row_bf16:
        out.append(finish(br))
    if col_bf16:
        out.append(finish(bc))
    if col_fp8:
        out += [finish(qc, torch.float8_e4m3fn), finish(sc, torch.float8_e8m0fnu)]
    return tuple(out)


def qdq_rowwise(x: torch.Tensor, scale_rule: ScaleRule | str = "rceil", tile32: bool = False) -> torch.Tensor:
    """BF16 MX values of x along the last dim (the fprop operand of the expansion route).

    Args:
        x: ``[M, K]`` or ``[B, M, K]`` bfloat16/float16/float32, CUDA, ``K % 32 == 0``; any strides.
        scale_rule: ``"rceil"`` or ``"floor"``.
        tile32: one scale per 32x32 tile (needs ``M % 32 == 0``; weights): the values are then the
            same along either dim, so they serve fprop and dgrad alike.
    Returns:
        contiguous ``bfloat16`` ``[.., M, K]`` equal bit for bit to
        ``dequantize_bf16(*quantize_rowwise(x, scale_rule))`` (``tile32``: to :func:`qdq_dual`'s BF16
        output with ``tile32``).
    Raises:
        TypeError / ValueError as :func:`quantize_rowwise` (and :func:`quantize_32x32` with ``tile32``).
    """
    return _launch_qdq(x, scale_rule, True, False, False, tile32, "qdq_rowwise")[0]


def qdq_dual(x: torch.Tensor, scale_rule: ScaleRule | str = "rceil", tile32: bool = False):
    """BF16 MX values along K plus the columnwise FP8 copy, from one read (``M % 32 == K % 32 == 0``).

    The FP8 copy is what is kept for a later product along M (activations: wgrad; weights: dgrad).

    Args:
        x: ``[M, K]`` or ``[B, M, K]`` (e.g. weights ``[E, N, K]``), bfloat16/float16/float32, CUDA.
        tile32: one scale per 32x32 tile (2D weight blocks) instead of 1x32 blocks.
    Returns:
        ``(x_bf16, data_t, scale_t)``: bfloat16 ``[.., M, K]`` as :func:`qdq_rowwise` (32x32: as
        ``dequantize_bf16`` of :func:`quantize_32x32`'s ``(data, scale)``), and ``float8_e4m3fn``
        ``[.., K, M]`` / ``float8_e8m0fnu`` ``[.., K, M/32]`` equal to :func:`quantize_columnwise`
        (32x32: :func:`quantize_32x32`'s ``(data_t, scale_t)``).
    Raises:
        TypeError / ValueError as :func:`quantize_dual`.
    """
    return _launch_qdq(x, scale_rule, True, False, True, tile32, "qdq_dual")


def qdq_columnwise(x: torch.Tensor, scale_rule: ScaleRule | str = "rceil") -> torch.Tensor:
    """BF16 MX values of x along M (dim -2, 1x32 blocks), written transposed: the dgrad operand of
    weights ``[E, N, K]`` quantized along N, requantized from the parameter in backward.

    Args:
        x: ``[M, K]`` or ``[B, M, K]`` bfloat16/float16/float32, CUDA, ``M % 32 == K % 32 == 0``; any strides.
    Returns:
        contiguous bfloat16 ``[.., K, M]`` equal bit for bit to ``dequantize_bf16(*quantize_columnwise(x))``.
    Raises:
        TypeError / ValueError as :func:`quantize_dual`.
    """
    return _launch_qdq(x, scale_rule, False, True, False, False, "qdq_columnwise")[0]


def qdq_dual_bf16(x: torch.Tensor, scale_rule: ScaleRule | str = "rceil"):
    """BF16 MX values along K and along M (transposed), from one read (``M % 32 == K % 32 == 0``).

    The output gradient dy ``[M, N]`` of an expert linear layer: along N for dgrad, along tokens
    for wgrad.

    Returns:
        ``(x_bf16 [.., M, K], xt_bf16 [.., K, M])``: :func:`qdq_rowwise` of x, and
        ``dequantize_bf16(*quantize_columnwise(x))``, both contiguous bfloat16.
    """
    return _launch_qdq(x, scale_rule, True, True, False, False, "qdq_dual_bf16")


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


# Ring depth of mx_swiglu_quantize_tma_kernel: two stages of the gate and up tiles (2 x 2 x 32 KB) leave room
# for the layout conversion's scratch within an SM's 227 KB.
_SWIGLU_TMA_STAGES = 2


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
