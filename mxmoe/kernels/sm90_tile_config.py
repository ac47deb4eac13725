"""Tile heuristics for the Hopper MXFP8 grouped GEMMs (kept apart so re-tuning never touches a kernel).

Budgets that fix the choices (H200 / sm_90):

* Registers: each consumer thread holds the FP32 accumulator and two FP32 partials (the step being
  promoted and the step in flight). For an m64nBN warpgroup tile that is 3 * BN / 2 registers per
  thread; with BN = 128 that is 192 of the 240 a consumer gets after ``setmaxnreg`` (the producer
  warp keeps 24). BN = 256 would need 384: does not fit. Two consumer warpgroups stack along M,
  so BM = 128.
* Shared memory (227 KB per CTA): one stage holds A and B tiles (BM x BK + BN x BK bytes of FP8 =
  32 KB at BK = 128) plus the FP32 scales (4 x BM + 4 x BN floats = 4 KB) -> 4 stages = 144 KB,
  plus the TMA-store epilogue's staging buffer (BM x BN outputs: 32 KB BF16, 64 KB FP32) = 176 /
  208 KB. The epilogue falls back to register stores where the buffer does not fit.
* BK = 128 = four MX steps per stage: few barrier round-trips, and a stage ends with all its
  wgmmas retired (a wgmma kept in flight across the loop back-edge makes ptxas serialize them).
  32x32 weights, whose promotion is cheap, take BK = 256 x 2 stages (64 KB of A and B tiles plus
  4.25 KB of scale boxes per stage, + 32 KB staging; ptxas reports 169 KB): half the drains (see
  :func:`sm90_tile_config`).
* mx128 mode (1x128 / 128x128 scale groups): BN = BK = 128 so a tile lies in one weight tile and a stage
  is one promotion; 4 stages (5 would leave FP32 output no room for the TMA-store buffer); ``chain`` 4
  stages per wgmma drain (chain 2 measured equal on Mixtral, 4 has half the drains).
* split_wg: each consumer warpgroup is its own partition (own barriers); measured equal to one
  8-warp partition on the H200 (docs/hopper.md), kept for the independence.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sm90TileConfig:
    block_m: int = 128  # output rows per CTA tile (2 consumer warpgroups x 64)
    block_n: int = 128  # output columns per CTA tile (wgmma n)
    block_k: int = 128  # contraction depth per smem stage (multiple of 32)
    stages: int = 4  # smem ring depth
    group_m: int = 8  # m-tiles per supergroup inside one expert's sub-problem
    split_wg: bool = True  # each consumer warpgroup its own partition (else one 8-warp partition)
    tma_store: bool = True  # epilogue through shared memory + TMA store where a tile's rows fill its group
    chain: int = 4  # mx128 mode only: 128-deep stages per unrolled K-loop chain (one wgmma drain per chain)
    maxnreg: int = 168  # per-thread cap at launch: 12 warps x 168 = producer warpgroup x 24 + 8 consumer
    #                     warps x 240 after setmaxnreg (Triton's AllocateWarpGroups arithmetic)
    vec_search: bool = False  # M-grouped: the CTA finds a tile's group with vector loads and warp reductions
    #                           (consumers up to 256 groups, the producer up to 128), not a binary search of
    #                           dependent loads; the heuristics below turn it on for 33-128 groups


def sm90_tile_config(m: int, n: int, k: int, num_groups: int, k_grouped: bool = False,
                     weight_block: int = 1) -> Sm90TileConfig:
    """Tile configuration for a grouped problem (sizes of the whole problem, not one group).

    32x32 weights (M-grouped) with K a multiple of 256 take 256-deep stages, 2 of them, so the
    TMA-store epilogue's staging buffer fits beside the ring (3 would not): the wgmma pipeline drains
    every 8 MX steps instead of 4; on the H200 that beat 256 x 3 with register stores and 128 x 4 on
    15 of 16 cases. 1x32 keeps 128 x 4: its promotion, not the drains, is its bound, and 256-deep
    stages lost 11-23% (the A/B runs: ``docs/hopper.md``).
    """
    del m, n
    vec = _vector_search(num_groups, k_grouped)
    if weight_block == 32 and not k_grouped and k % 256 == 0:
        return Sm90TileConfig(block_k=256, stages=2, vec_search=vec)
    return Sm90TileConfig(vec_search=vec)


def _vector_search(num_groups: int, k_grouped: bool) -> bool:
    """The vector group search for 33-128 groups (M-grouped). H100, 2026-12-06, mx128 products, same outputs
    (``benchmarks/results/h100/group_search.json``): 1.00-1.04x at 64 and 128 experts (DeepSeek-V3-16B,
    Qwen3-30B-A3B), 0.93-0.99x at Mixtral's 8, where the binary search is 3 steps; past 128 not timed."""
    return not k_grouped and 33 <= num_groups <= 128


SMEM_PER_CTA = 232448  # bytes of shared memory one CTA may use on sm_90 (227 KB)


def smem_bytes(cfg: Sm90TileConfig, sb_cols: int, out_elt: int = 0) -> int:
    """Shared memory of a configuration's ring (A and B FP8 tiles, FP32 scale boxes: A ``[BK/32, BM]``,
    B ``[BK/32, sb_cols]``) plus, with ``out_elt`` bytes per output, the TMA-store staging buffer
    (``BM x BN``). ptxas reports ~300 bytes more (barriers, alignment)."""
    ring = cfg.stages * ((cfg.block_m + cfg.block_n) * cfg.block_k + 4 * (cfg.block_k // 32) * (cfg.block_m + sb_cols))
    return ring + cfg.block_m * cfg.block_n * out_elt


def sm90_mx128_tile_config(m: int, n: int, k: int, num_groups: int, k_grouped: bool = False) -> Sm90TileConfig:
    """Tile configuration of the mx128 mode (1x128 activations, 128x128 weight tiles; wgrad 128x1 both):
    128 x 128 tiles aligned to the weight tiles, 128-deep stages (one promotion each), 4 of them, TMA
    stores. With FP32 output the ring + staging buffer is 4 x 33 KB + 64 KB (198 KB), BF16 166 KB."""
    del m, n, k
    return Sm90TileConfig(vec_search=_vector_search(num_groups, k_grouped))


def check_tile_config(cfg: Sm90TileConfig, weight_block: int = 1, scale_group: int = 32) -> None:
    """Refuse a hand-made tile configuration that breaks the ``block_k`` rules below (one such config
    crashed on the GPU). Other fields are not checked here: shared memory beyond 227 KB fails at launch
    in Triton, and ``_out_desc`` drops the TMA-store epilogue where its buffer would not fit.

    Raises:
        ValueError: ``block_k`` not a positive multiple of 32 (one MX step), or, with 32x32 weights,
            not a multiple of 128: the weight-scale box of one stage is ``block_k / 32`` rows of 8 FP32
            values (``block_k`` bytes) and each stage's box must start 128-byte aligned in shared
            memory (``block_k`` 64 dies with a misaligned-address fault).
            With ``scale_group=128`` (the mx128 mode): ``block_k`` other than 128, or ``block_n``
            other than 128 (a tile must lie in one 128x128 weight tile; the K loop promotes once per
            stage).
    """
    if cfg.block_k <= 0 or cfg.block_k % 32 != 0:
        raise ValueError(f"block_k must be a positive multiple of 32, got {cfg.block_k}")
    if weight_block == 32 and cfg.block_k % 128 != 0:
        raise ValueError(f"with 32x32 weights block_k must be a multiple of 128 (128-byte aligned scale boxes "
                         f"per stage), got {cfg.block_k}")
    if scale_group == 128 and cfg.chain not in (1, 2, 4, 8):
        raise ValueError(f"the mx128 mode's chain must be 1, 2, 4 or 8 stages, got {cfg.chain}")
    if scale_group == 128 and (cfg.block_k != 128 or cfg.block_n != 128):
        raise ValueError(f"the mx128 mode needs block_k == block_n == 128 (one promotion per 128-deep stage, "
                         f"tiles inside one 128x128 weight tile), got block_k={cfg.block_k}, block_n={cfg.block_n}")
