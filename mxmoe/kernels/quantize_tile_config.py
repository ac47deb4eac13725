"""Tile heuristics of the MXFP8 quantization kernels (kept out of the kernel bodies and their launchers): the
Triton kernels' ``TileConfig`` per kernel family, the Gluon column kernel's tiles and tile order, and the
constants the launchers size their launches with. The figures behind each choice: docs/quantization.md.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mxmoe.backend import interpreting

_interpreting = interpreting  # (under the interpreter: few large programs)


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
    the best of ``benchmarks/bench_quantize.py --sweep`` (figures in docs/quantization.md).
    """
    if _interpreting():  # few large programs: the interpreter's cost is per program
        return TileConfig(128, 256, 4, True)
    key = ("col" if col else "") + ("row" if row else "") + ("32" if tile32 else "")
    return _TUNED.get(key) or TileConfig(32, 256, 4, True)


def _config_128(row: bool, col: bool, tile32: bool) -> TileConfig:
    """Launch config of mx_quantize_kernel with GROUP 128 (1x128 / 128x1 groups, 128x128 tiles): BK % 128 == 0
    for a row output, BM % 128 == 0 for a column output or tiles. Chosen from offline sm_90 compiles
    (docs/quantization.md): rowwise keeps the 1x32 "row" tile's shape and bytes in flight
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
# (docs/quantization.md). The Triton column family (off sm_90 or MXMOE_QUANT_GLUON=0; on sm_90 the
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
# docs/quantization.md), each checked bit for bit against the reference on the GPU by
# tests/test_quantize_kernels.py::test_gpu_tuned_configs (the "swiglu" entries by
# tests/test_qdq_kernels.py::test_gpu_swiglu_qdq_equals_composition).
_TUNED: dict[str, TileConfig] = {
    "row": TileConfig(32, 256, 4, False),
    "col": TileConfig(64, 64, 2, True),  # on sm_90 the Gluon kernel runs instead
    # dual (the Triton path: MXMOE_QUANT_GLUON=0 or not sm_90). Not 32x128/w2: with blocked scales an
    # LLVM/NVPTX miscompile of its scale index makes it fault (docs/quantization.md)
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
# best of the Gluon tile sweeps (figures in docs/quantization.md).
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
# with save_h WM 2 / TM 2, the one that does not spill there (registers: docs/quantization.md).
_GLUON_TILES_SWIGLU = {
    False: dict(MB=4, BK=128, WM=1, WK=16, TM=4, RS=16),
    True: dict(MB=4, BK=128, WM=2, WK=8, TM=2, RS=16),
}


# Gluon tile of the combine-backward input mode (combine_backward_quantize_128): dual's 128x128 tile on 4 warps. At
# the layer's Qwen3 / DeepSeek-V3-16B shapes (H200, 2026-12-04, benchmarks/tools/bench_combine_backward.py) it took
# 0.621 / 0.454 ms against 0.704 / 0.516 ms on dual's 8 warps and 0.780 / 0.574 ms on 16 warps over 256 rows.
_GLUON_TILE_COMBINE = dict(MB=4, BK=128, WM=1, WK=4, TM=4, RS=16)

# Gluon tile of the SwiGLU-backward input mode (swiglu_backward_quantize_128; one half of dh per program): three input
# tiles (da, gate, up) and the gradient math before the dual quantization. Offline sm_90 (Triton 3.6), bf16 / MXFP8 h:
# this tile (save_h's) 127 / 128 registers and no spill, as (MB 4, WK 16, TM 4, RS 32); WK 16 / RS 16 spills 8 / 18
# bytes, 8 warps 0 / 656-664 bytes, and both halves in one program 296-310 bytes at 16 warps. Timed on an H100
# (2026-12-06, benchmarks/tools/bench_swiglu_backward.py): 0.750 / 1.019 ms at Qwen3 / DeepSeek-V3-16B (bf16 h), 35-49%
# of copy bandwidth; WK 16 0.732 / 0.986, 8 warps 0.869 / 1.174, 4 warps 6.6-9.6. The unfused pair: 0.668 / 1.068.
_GLUON_TILE_SWIGLU_BACKWARD = dict(MB=4, BK=128, WM=2, WK=8, TM=2, RS=16)


# Elements per thread per load in the Gluon kernel, every input dtype: 8 (16 bytes for 16-bit input; two
# 16-byte loads for FP32, so a 1x32 row block spans 4 lanes as for BF16); for FP32 it is faster than 4
# (docs/quantization.md).
_GLUON_VEC = 8

# Tile order of the Gluon kernel: k-tiles fastest when it writes E4M3 columns and a row output (quantize_dual,
# quantize_32x32, qdq_dual). A tile writes 4 scale bytes per row; in M-fastest order the next 4 bytes of that row
# come from a program n_m launches later, so 32-byte scale sectors would be written in pieces far apart in time.
# The BF16 column output (qdq_dual_bf16) and columnwise alone are slower K-fastest and keep M-fastest
# (docs/quantization.md).
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


# Groups up to which mx_quantize_grouped_kernel finds a tile's group with a vector sum over the groups (warp-local
# while they fit one warp); past it, a binary search over the padded ends: the sum had become a cross-warp
# reduction (docs/quantization.md).
_GROUPED_VECTOR_SEARCH_MAX = 32


def _config_grouped() -> TileConfig:
    """Launch config of mx_quantize_grouped_kernel ("tile" kind; BM must divide 128)."""
    if _interpreting():
        return TileConfig(128, 256, 4, True)
    return _TUNED.get("grouped") or TileConfig(32, 256, 4, True)


def _config_qdq(col: bool) -> TileConfig:
    """Launch config of the QDQ kernels (mx_quantize_kernel's structure, BF16 outputs): with a
    columnwise output the quantize kernel's "colrow" tile, rowwise 32x512/w8. The columnwise one is
    the fastest of a sweep of the QDQ kernels (docs/quantization.md)."""
    if _interpreting():
        return TileConfig(128, 256, 4, True)
    return TileConfig(64, 64, 2, True) if col else TileConfig(32, 512, 8, True)


def _config_swiglu(save_h: bool) -> TileConfig:
    """Launch config of mx_swiglu_qdq_kernel: ``_TUNED["swiglu"]``, with ``save_h`` (two more
    quantized outputs) ``_TUNED["swiglu_save_h"]``."""
    if _interpreting():
        return TileConfig(128, 256, 4, True)
    return _TUNED["swiglu_save_h" if save_h else "swiglu"]


# Ring depth of mx_swiglu_quantize_tma_kernel: two stages of the gate and up tiles (2 x 2 x 32 KB) leave room
# for the layout conversion's scratch within an SM's 227 KB.
_SWIGLU_TMA_STAGES = 2
