"""Hopper (sm_90) MXFP8 grouped GEMMs in Gluon: M-grouped (fprop, dgrad) and K-grouped (wgrad).

Hopper's FP8 tensor cores (``wgmma``, QGMMA in SASS) have no block scaling, so the E8M0 scales
are applied on the CUDA cores ("promotion", DESIGN §2): every 32-deep K step is one async
``wgmma`` into a fresh FP32 partial, and the partial is folded into the FP32 accumulator as

    acc[m, n] += P_k[m, n] * 2^(ea[m, k]) * 2^(eb[n, k])

which is the MX product up to summation order and rounding: the FP8 x FP8 products are exact,
but Hopper's FP8 tensor core sums the 32 products of a step with a truncated alignment; measured
relative error against FP64 is 4.5e-5 with FP32 output (1.7e-3 with BF16 output, its own
rounding). A NaN scale (0xFF) is a NaN factor.

Kernel structure (one kernel serves both forms; ``K_GROUPED`` picks the tile map)::

    persistent grid, one CTA per SM, tiles BM x BN = 128 x 128, K stages of 128 (4 MX steps; 32x32
    weights with K % 256 == 0: 2 stages of 256, 8 MX steps, see sm90_tile_config)

    producer partition (1 warp, 24 regs)         consumer partitions (2 x 1 warpgroup, 240 regs)
    ---------------------------------------      ---------------------------------------------
    for tile in my tiles:                        for tile in my tiles:
      for stage in tile's K range:                 for stage:
        wait empty[s]   (2 arrivals)                 wait ready[s]
        expect ready[s]; TMA A, B, sa, sb            per step j: wgmma step j -> partial (async);
                                                         retire step j-1 (wait(1)); promote it
                                                     wait(0); promote the last step; arrive empty[s]
                                                   store its 64 rows of the tile: TMA store from
                                                   smem if all 64 are in the group (not waited
                                                   for until its next epilogue), else masked
                                                   stores from registers

    consumer warpgroup 0 (the default partition) owns rows 0..63 of every tile and warpgroup 1 (a
    worker partition) rows 64..127, each with m64n128k32 wgmmas and its own barriers, so one
    warpgroup's promotion overlaps the other's tensor-core work (``split_wg=False`` makes them one
    8-warp partition instead: measured the same). Registers per consumer thread: accumulator + 2
    partials = 192 FP32.

The mx128 mode (``SG=4``; :func:`sm90_mx128_m_grouped_gemm`, :func:`sm90_mx128_k_grouped_gemm`, recipe
``mxfp8_128``, DESIGN §9): activations / gradients with one scale per 128 of the contraction dim, weights
one per 128x128 tile (M-grouped), or both operands one per 128 tokens (K-grouped). The same producer,
scheduler and epilogue; the consumer's K loop (``_mainloop128``) issues each 128-deep stage as ONE wgmma
call (four m64n128k32 chained in the tensor core into a fresh partial) and promotes once per stage::

    chains of CHAIN stages: stage j -> partial j % 2 (async); retire stage j-1 (wait(1)); promote it:
        M-grouped acc += P * (sa[m] * sb)      (sb one value per 128x128 tile: 1 FFMA per element)
        K-grouped acc += P * (sa[n] * sb[k])   (FMUL + FFMA per element)
    last stage of the chain: wait(0) (nothing in flight at the back-edge), promote

measured FP32-output error 1.2-2.7e-4 against FP64 (the tensor core's 128-deep FP8 sums); scale layouts:
:func:`sm90_mx128_scale_layouts`.

Tile order (the "scheduler"): tiles are numbered expert by expert; inside an expert's
sub-problem (m-tiles x n-tiles) tiles are ordered in supergroups of ``GROUP_M`` m-tiles
(expert-wise supergrouping: concurrently running CTAs share one expert's B tiles in L2).
CTA ``p`` takes tiles ``p, p + P, p + 2P, ...``. For the M-grouped form the wrapper computes
each expert's tile count on the device (no host sync); the kernel finds a tile's expert by
binary search over the cumulative tile counts.

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

import functools

import torch

from mxmoe.backend import capability
from mxmoe.kernels.sm90_scales import sm90_m_grouped_scales, sm90_scale_layout
from mxmoe.kernels.sm90_tile_config import (SMEM_PER_CTA, Sm90TileConfig, check_tile_config, sm90_mx128_tile_config,
                                             sm90_tile_config, smem_bytes)

try:  # Triton (and Gluon) are optional: `import mxmoe` must work without them.
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAS_GLUON = True
except Exception:  # pragma: no cover - depends on the installed triton
    HAS_GLUON = False

__all__ = [
    "HAS_GLUON",
    "sm90_mxfp8_m_grouped_gemm",
    "sm90_mxfp8_k_grouped_gemm",
    "sm90_mx128_m_grouped_gemm",
    "sm90_mx128_k_grouped_gemm",
    "sm90_mx128_scale_layouts",
    "sm90_scale_layout",
]

MX_BLOCK = 32


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------

if HAS_GLUON:

    @gluon.jit
    def _tile_info(tile, offs_ptr, tile_end_ptr, E, N_B, KSTEPS, MT_K, NT, OUT_ROWS, OUT_COLS,
                   K_GROUPED: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr,
                   SEARCH_STEPS: gl.constexpr):
        """Map a tile number to (a_row, b_row, kb0, sb_row0, nsteps, row_hi, col0, out_base, sa_col).

        a_row/b_row: first rows of the A and B tiles (TMA coordinates); sa_col: first column of the
        tile's rows in the A-scale tensor (M-grouped: each group starts at a multiple of 4 columns,
        ``tile_end_ptr[E + e]``, because a TMA box must start 16-byte aligned in its inner dim);
        kb0: first 32-block of the
        contraction range; sb_row0: row of the B-scale tensor for that block; nsteps: 32-deep steps;
        row_hi: rows of the output tile at or past it are not written; col0: first output column;
        out_base: element offset of the output matrix (expert slice for wgrad).
        """
        if K_GROUPED:
            per = MT_K * NT
            e = tile // per
            local = tile - e * per
            t_lo = gl.load(offs_ptr + e - 1, mask=e > 0, other=0)
            t_hi = gl.load(offs_ptr + e)
            mt_count = MT_K
        else:
            # Binary search for the first expert whose cumulative tile count exceeds `tile`.
            lo = tile * 0
            hi = lo + (E - 1)
            for _ in gl.static_range(SEARCH_STEPS):
                mid = (lo + hi) // 2
                v = gl.load(tile_end_ptr + mid)
                left = v > tile
                hi = gl.where(left, mid, hi)
                lo = gl.where(left, lo, mid + 1)
            e = lo
            first = gl.load(tile_end_ptr + e - 1, mask=e > 0, other=0)
            local = tile - first
            t_lo = gl.load(offs_ptr + e - 1, mask=e > 0, other=0)
            t_hi = gl.load(offs_ptr + e)
            mt_count = (t_hi - t_lo + BM - 1) // BM
        # Supergrouping inside the expert's (mt_count x NT) sub-problem.
        width = GROUP_M * NT
        gid = local // width
        first_m = gid * GROUP_M
        gsz = gl.minimum(mt_count - first_m, GROUP_M)
        in_group = local - gid * width
        mt = first_m + in_group % gsz
        nt = in_group // gsz
        col0 = nt * BN
        if K_GROUPED:
            a_row = mt * BM
            sa_col = a_row
            b_row = col0
            kb0 = t_lo // 32
            sb_row0 = kb0
            nsteps = (t_hi - t_lo) // 32
            row_hi = OUT_ROWS
            out_base = e.to(gl.int64) * OUT_ROWS * OUT_COLS
        else:
            a_row = t_lo + mt * BM
            sa_col = gl.load(tile_end_ptr + E + e) + mt * BM
            b_row = e * N_B + col0
            kb0 = t_lo * 0
            sb_row0 = e * KSTEPS
            nsteps = KSTEPS + t_lo * 0
            row_hi = t_hi
            out_base = t_lo.to(gl.int64) * 0
        return a_row, b_row, kb0, sb_row0, nsteps, row_hi, col0, out_base, sa_col

    @gluon.jit
    def _num_tiles(tile_end_ptr, E, MT_K, NT, K_GROUPED: gl.constexpr):
        if K_GROUPED:
            total = E * MT_K * NT
        else:
            total = gl.load(tile_end_ptr + E - 1)
        return total

    @gluon.jit
    def _producer(a_desc, b_desc, sa_desc, sb_desc, a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty,
                  offs_ptr, tile_end_ptr, E, N_B, KSTEPS, MT_K, NT, OUT_ROWS, OUT_COLS,
                  K_GROUPED: gl.constexpr, WB32: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                  BK: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, SEARCH_STEPS: gl.constexpr,
                  SG: gl.constexpr):
        """TMA warp: fill the smem ring with A, B tiles and their scales, stage by stage.

        SG: 32-blocks per scale row (1: one row per 32 of K; 4: the 128-deep groups of the mx128 mode,
        one scale row per 128 of K)."""
        KB: gl.constexpr = BK // 32
        nbytes: gl.constexpr = (a_desc.block_type.nbytes + b_desc.block_type.nbytes + sa_desc.block_type.nbytes +
                                sb_desc.block_type.nbytes)
        total = _num_tiles(tile_end_ptr, E, MT_K, NT, K_GROUPED)
        it = 0
        for tile in range(gl.program_id(0), total, gl.num_programs(0)):
            a_row, b_row, kb0, sb_row0, nsteps, row_hi, col0, out_base, sa_col = _tile_info(
                tile, offs_ptr, tile_end_ptr, E, N_B, KSTEPS, MT_K, NT, OUT_ROWS, OUT_COLS, K_GROUPED, BM, BN,
                GROUP_M, SEARCH_STEPS)
            for s in range(gl.cdiv(nsteps, KB)):
                idx = it % STAGES
                phase = (it // STAGES) & 1
                mbarrier.wait(empty.index(idx), phase ^ 1)
                bar = ready.index(idx)
                mbarrier.expect(bar, nbytes)
                kb = kb0 + s * KB
                tma.async_copy_global_to_shared(a_desc, [a_row, kb * 32], bar, a_bufs.index(idx))
                tma.async_copy_global_to_shared(b_desc, [b_row, kb * 32], bar, b_bufs.index(idx))
                if SG == 1:
                    sa_r = kb
                    sb_r = sb_row0 + s * KB
                else:
                    sa_r = kb // SG
                    sb_r = (sb_row0 + s * KB) // SG
                tma.async_copy_global_to_shared(sa_desc, [sa_r, sa_col], bar, sa_bufs.index(idx))
                if WB32:
                    tma.async_copy_global_to_shared(sb_desc, [sb_r, col0 // 32], bar, sb_bufs.index(idx))
                else:
                    tma.async_copy_global_to_shared(sb_desc, [sb_r, col0], bar, sb_bufs.index(idx))
                it += 1

    @gluon.jit
    def _load_scales(sa_rows, sb_rows, row, ROW0: gl.constexpr, BMW: gl.constexpr, BN: gl.constexpr,
                     WB32: gl.constexpr, mma_layout: gl.constexpr, l3: gl.constexpr):
        """One MX step's scales from smem (row ``row`` of the rings), in the layouts _promote needs.

        l3 is the register layout of the [BMW, BN/32, 32] view of an MMA tile (32x32 weights)."""
        if WB32:
            l2: gl.constexpr = gl.SliceLayout(2, l3)
            sa = sa_rows.index(row).slice(ROW0, BMW).load(gl.SliceLayout(1, l2))
            sb = sb_rows.index(row).slice(0, BN // 32).load(gl.SliceLayout(0, l2))
        else:
            sa = sa_rows.index(row).slice(ROW0, BMW).load(gl.SliceLayout(1, mma_layout))
            sb = sb_rows.index(row).load(gl.SliceLayout(0, mma_layout))
        return sa, sb

    @gluon.jit
    def _promote(acc, p, sa, sb, BMW: gl.constexpr, BN: gl.constexpr, WB32: gl.constexpr):
        """acc += p * 2^(ea) * 2^(eb) for one MX step (sa: per row, sb: per column or per 32 columns)."""
        if WB32:
            # One weight scale per 32 output columns: view the tile as [BMW, BN/32, 32] so the scale
            # product is formed once per (row, 32-column group) and broadcast (1 FFMA per element).
            p3 = gl.reshape(p, [BMW, BN // 32, 32])
            s2 = gl.expand_dims(sa, 1) * gl.expand_dims(sb, 0)
            acc = gl.fma(p3, gl.expand_dims(s2, 2), acc)
        else:
            scale = gl.expand_dims(sa, 1) * gl.expand_dims(sb, 0)
            acc = gl.fma(p, scale, acc)
        return acc

    @gluon.jit
    def _mx_step(a_buf, b_buf, j: gl.constexpr, ROW0: gl.constexpr, BMW: gl.constexpr, p, use_acc=False):
        """Issue MX step j of a stage: one async wgmma (m64nBNk32 per warpgroup) into a fresh partial."""
        a_j = a_buf.slice(ROW0, BMW, dim=0).slice(j * 32, 32, dim=1)
        b_j = b_buf.slice(j * 32, 32, dim=1).permute((1, 0))
        return warpgroup_mma(a_j, b_j, p, use_acc=use_acc, is_async=True)

    @gluon.jit
    def _stage_mma(a_buf, b_buf, ROW0: gl.constexpr, BMW: gl.constexpr, p):
        """mx128 mode: one whole stage (BK deep) as one async wgmma call into a fresh partial: its BK/32
        m64nBNk32 instructions are issued back to back, chained in the tensor core, one commit group."""
        return warpgroup_mma(a_buf.slice(ROW0, BMW, dim=0), b_buf.permute((1, 0)), p, use_acc=False, is_async=True)

    @gluon.jit
    def _release(empty, idx):
        # Generic-proxy reads of this stage (scales) must be ordered before the next TMA write.
        fence_async_shared()
        mbarrier.arrive(empty.index(idx), count=1)

    @gluon.jit
    def _retire128(p, acc, sa, sb, sa_rows, sb_rows, empty, idx, N_OUT: gl.constexpr, EARLY: gl.constexpr,
                   ROW0: gl.constexpr, BMW: gl.constexpr, BN: gl.constexpr, WB32: gl.constexpr,
                   mma_layout: gl.constexpr, l3: gl.constexpr):
        """mx128 mode: retire partial ``p`` (slot ``idx``; N_OUT wgmma groups may stay in flight), hand the
        slot back and promote it. EARLY: ``sa, sb`` are the slot's scales, read by the caller before it
        issued the next stage (latency under the tensor core; few scales with 128x128 weight tiles); else
        they are placeholders and the scales are read after the wait (the K-grouped column scales do not
        fit in registers across the wait beside three FP32 tiles: ptxas spilled)."""
        p = warpgroup_mma_wait(num_outstanding=N_OUT, deps=(p, ))
        if not EARLY:
            sa, sb = _load_scales(sa_rows, sb_rows, idx, ROW0, BMW, BN, WB32, mma_layout, l3)
        _release(empty, idx)
        acc = _promote(acc, p, sa, sb, BMW, BN, WB32)
        return p, acc

    @gluon.jit
    def _chain128(a_bufs, b_bufs, sa_rows, sb_rows, ready, empty, acc, p_a, p_b, it, U: gl.constexpr,
                  ROW0: gl.constexpr, BMW: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                  WB32: gl.constexpr, mma_layout: gl.constexpr, l3: gl.constexpr):
        """mx128 mode: U consecutive 128-deep stages (ring slots it .. it+U-1), unrolled.

        Stage j's wgmmas go into partial j % 2 (one wgmma call = one commit group); once stage j is
        issued, stage j-1 is retired with wait(1) and promoted while j runs in the tensor core; the last
        one is retired with wait(0), so nothing is in flight at any loop back-edge (that makes ptxas
        serialize every wgmma, C7514). Promotion: ``acc += P * (sa[m] * sb)``: WB32 (M-grouped, 128x128
        weight tiles) the weight scale is uniform over the tile (its 4 equal per-32-column values): 8 FMUL
        per thread, then one FFMA per element; else (K-grouped) ``sb[n]`` per column, FMUL + FFMA per
        element. A slot goes back to the producer once its wgmmas are retired and its scales read."""
        i_prev = it % STAGES
        mbarrier.wait(ready.index(i_prev), (it // STAGES) & 1)
        p_a = _stage_mma(a_bufs.index(i_prev), b_bufs.index(i_prev), ROW0, BMW, p_a)
        for j in gl.static_range(1, U):
            i_j = (it + j) % STAGES
            mbarrier.wait(ready.index(i_j), ((it + j) // STAGES) & 1)
            if WB32:
                sa, sb = _load_scales(sa_rows, sb_rows, i_prev, ROW0, BMW, BN, WB32, mma_layout, l3)
            else:
                sa, sb = acc, acc  # placeholders: _retire128 reads the scales after its wait
            if j % 2 == 1:
                p_b = _stage_mma(a_bufs.index(i_j), b_bufs.index(i_j), ROW0, BMW, p_b)
                p_a, acc = _retire128(p_a, acc, sa, sb, sa_rows, sb_rows, empty, i_prev, 1, WB32, ROW0, BMW, BN, WB32,
                                      mma_layout, l3)
            else:
                p_a = _stage_mma(a_bufs.index(i_j), b_bufs.index(i_j), ROW0, BMW, p_a)
                p_b, acc = _retire128(p_b, acc, sa, sb, sa_rows, sb_rows, empty, i_prev, 1, WB32, ROW0, BMW, BN, WB32,
                                      mma_layout, l3)
            i_prev = i_j
        sa, sb = _load_scales(sa_rows, sb_rows, i_prev, ROW0, BMW, BN, WB32, mma_layout, l3)
        if (U - 1) % 2 == 0:
            p_a, acc = _retire128(p_a, acc, sa, sb, sa_rows, sb_rows, empty, i_prev, 0, True, ROW0, BMW, BN, WB32,
                                  mma_layout, l3)
        else:
            p_b, acc = _retire128(p_b, acc, sa, sb, sa_rows, sb_rows, empty, i_prev, 0, True, ROW0, BMW, BN, WB32,
                                  mma_layout, l3)
        return acc, p_a, p_b, it + U

    @gluon.jit
    def _mainloop128(a_bufs, b_bufs, sa_rows, sb_rows, ready, empty, acc, p_a, p_b, it, nstages,
                     ROW0: gl.constexpr, BMW: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                     WB32: gl.constexpr, mma_layout: gl.constexpr, l3: gl.constexpr, CHAIN: gl.constexpr):
        """mx128 mode: the K loop of one tile, ``nstages`` stages of 128 (one scale row each): chains of
        CHAIN stages (one wgmma drain per chain), then the remainder in chains of 2 and 1."""
        for _ in range(nstages // CHAIN):
            acc, p_a, p_b, it = _chain128(a_bufs, b_bufs, sa_rows, sb_rows, ready, empty, acc, p_a, p_b, it, CHAIN,
                                          ROW0, BMW, BN, STAGES, WB32, mma_layout, l3)
        if CHAIN > 2:
            for _ in range((nstages % CHAIN) // 2):
                acc, p_a, p_b, it = _chain128(a_bufs, b_bufs, sa_rows, sb_rows, ready, empty, acc, p_a, p_b, it, 2,
                                              ROW0, BMW, BN, STAGES, WB32, mma_layout, l3)
        if CHAIN > 1:
            if nstages % 2 == 1:
                acc, p_a, p_b, it = _chain128(a_bufs, b_bufs, sa_rows, sb_rows, ready, empty, acc, p_a, p_b, it, 1,
                                              ROW0, BMW, BN, STAGES, WB32, mma_layout, l3)
        return acc, p_a, p_b, it

    @gluon.jit
    def _store_masked(c_ptr, acc, a_row, row_hi, col0, out_base, OUT_COLS, ROW0: gl.constexpr, BMW: gl.constexpr,
                      BN: gl.constexpr, mma_layout: gl.constexpr):
        """Masked stores from registers: rows that end past their group's last row, or every tile when
        the TMA-store epilogue is off."""
        out = gl.convert_layout(gl.reshape(acc, [BMW, BN]), mma_layout)
        rows = a_row + ROW0 + gl.arange(0, BMW, gl.SliceLayout(1, mma_layout))
        cols = col0 + gl.arange(0, BN, gl.SliceLayout(0, mma_layout))
        ptrs = c_ptr + out_base + gl.expand_dims(rows.to(gl.int64) * OUT_COLS, 1) + gl.expand_dims(cols, 0)
        mask = gl.expand_dims(rows < row_hi, 1) & gl.expand_dims(cols < OUT_COLS, 0)
        gl.store(ptrs, out.to(c_ptr.dtype.element_ty), mask=mask)

    @gluon.jit
    def _consumer(a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, c_ptr, c_desc, c_bufs,
                  offs_ptr, tile_end_ptr, E, N_B, KSTEPS, MT_K, NT, OUT_ROWS, OUT_COLS,
                  K_GROUPED: gl.constexpr, WB32: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                  BK: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, SEARCH_STEPS: gl.constexpr,
                  ROW0: gl.constexpr, BMW: gl.constexpr, NW: gl.constexpr,
                  TMA_STORE: gl.constexpr, SG: gl.constexpr, CHAIN: gl.constexpr):
        """Consumer warps (NW of them) owning rows ROW0 .. ROW0+BMW-1 of every tile: async wgmma per
        MX step, promotion of the previous step while the next one runs, then the tile's store."""
        KB: gl.constexpr = BK // 32
        EARLY_SCALES: gl.constexpr = WB32
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                              instr_shape=[16, BN, 32])
        p_a = gl.zeros([BMW, BN], gl.float32, mma_layout)
        p_b = gl.zeros([BMW, BN], gl.float32, mma_layout)
        l3: gl.constexpr = gl.reshape(p_a, [BMW, BN // 32, 32]).type.layout
        # The scale boxes land unswizzled (row-major); view them with a plain layout so one MX
        # step's row of scales can be indexed.
        plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        sa_rows = sa_bufs._reinterpret(sa_bufs.dtype, [STAGES * sa_bufs.shape[1], sa_bufs.shape[2]], plain)
        sb_rows = sb_bufs._reinterpret(sb_bufs.dtype, [STAGES * sb_bufs.shape[1], sb_bufs.shape[2]], plain)
        total = _num_tiles(tile_end_ptr, E, MT_K, NT, K_GROUPED)
        it = 0
        for tile in range(gl.program_id(0), total, gl.num_programs(0)):
            a_row, b_row, kb0, sb_row0, nsteps, row_hi, col0, out_base, sa_col = _tile_info(
                tile, offs_ptr, tile_end_ptr, E, N_B, KSTEPS, MT_K, NT, OUT_ROWS, OUT_COLS, K_GROUPED, BM, BN,
                GROUP_M, SEARCH_STEPS)
            if WB32:
                acc = gl.zeros([BMW, BN // 32, 32], gl.float32, l3)
            else:
                acc = gl.zeros([BMW, BN], gl.float32, mma_layout)
            if SG > 1:  # mx128 mode: one promotion per 128-deep stage
                acc, p_a, p_b, it = _mainloop128(a_bufs, b_bufs, sa_rows, sb_rows, ready, empty, acc, p_a, p_b, it,
                                                 nsteps // KB, ROW0, BMW, BN, STAGES, WB32, mma_layout, l3, CHAIN)
            else:
                for s in range(gl.cdiv(nsteps, KB)):
                    idx = it % STAGES
                    phase = (it // STAGES) & 1
                    mbarrier.wait(ready.index(idx), phase)
                    a_buf = a_bufs.index(idx)
                    b_buf = b_bufs.index(idx)
                    r0 = idx * KB
                    if nsteps - s * KB >= KB:
                        # Full stage. Step j's wgmma runs while step j-1 is promoted. With 32x32 weights the
                        # few scales of step j-1 are read before the wait (latency hidden behind the tensor
                        # core); with 1x32 the 32 column scales per thread would not fit in registers.
                        p_a = _mx_step(a_buf, b_buf, 0, ROW0, BMW, p_a)
                        for j in gl.static_range(1, KB):
                            if EARLY_SCALES:
                                sa, sb = _load_scales(sa_rows, sb_rows, r0 + j - 1, ROW0, BMW, BN, WB32, mma_layout, l3)
                            if j % 2 == 1:
                                p_b = _mx_step(a_buf, b_buf, j, ROW0, BMW, p_b)
                                p_a = warpgroup_mma_wait(num_outstanding=1, deps=(p_a, ))
                                if not EARLY_SCALES:
                                    sa, sb = _load_scales(sa_rows, sb_rows, r0 + j - 1, ROW0, BMW, BN, WB32, mma_layout,
                                                          l3)
                                acc = _promote(acc, p_a, sa, sb, BMW, BN, WB32)
                            else:
                                p_a = _mx_step(a_buf, b_buf, j, ROW0, BMW, p_a)
                                p_b = warpgroup_mma_wait(num_outstanding=1, deps=(p_b, ))
                                if not EARLY_SCALES:
                                    sa, sb = _load_scales(sa_rows, sb_rows, r0 + j - 1, ROW0, BMW, BN, WB32, mma_layout,
                                                          l3)
                                acc = _promote(acc, p_b, sa, sb, BMW, BN, WB32)
                        # The last step retires with wait(0): no wgmma stays in flight across the loop
                        # back-edge (that makes ptxas serialize every wgmma, warning C7514).
                        if KB % 2 == 0:
                            p_b = warpgroup_mma_wait(num_outstanding=0, deps=(p_b, ))
                            sa, sb = _load_scales(sa_rows, sb_rows, r0 + KB - 1, ROW0, BMW, BN, WB32, mma_layout, l3)
                            acc = _promote(acc, p_b, sa, sb, BMW, BN, WB32)
                        else:
                            p_a = warpgroup_mma_wait(num_outstanding=0, deps=(p_a, ))
                            sa, sb = _load_scales(sa_rows, sb_rows, r0 + KB - 1, ROW0, BMW, BN, WB32, mma_layout, l3)
                            acc = _promote(acc, p_a, sa, sb, BMW, BN, WB32)
                    else:
                        # Tail stage of a contraction range that is not a multiple of BK: synchronous steps.
                        for j in gl.static_range(KB):
                            if j < nsteps - s * KB:
                                sa, sb = _load_scales(sa_rows, sb_rows, r0 + j, ROW0, BMW, BN, WB32, mma_layout, l3)
                                p_a = _mx_step(a_buf, b_buf, j, ROW0, BMW, p_a)
                                p_a = warpgroup_mma_wait(num_outstanding=0, deps=(p_a, ))
                                acc = _promote(acc, p_a, sa, sb, BMW, BN, WB32)
                    # Generic-proxy reads of this stage (scales) must be ordered before the next TMA write.
                    fence_async_shared()
                    mbarrier.arrive(empty.index(idx), count=1)
                    it += 1
            # Epilogue: the rows that belong to this tile's group (TMA store or masked stores).
            if TMA_STORE:
                if a_row + ROW0 + BMW <= row_hi:
                    # All BMW rows inside the group: through shared memory and one TMA store, which
                    # drains while the next tile's main loop runs (columns clipped at the tensor's edge).
                    c_buf = c_bufs.index(ROW0 // BMW)
                    tma.store_wait(0)  # the previous tile's store has finished reading c_buf
                    c_buf.store(gl.reshape(acc, [BMW, BN]).to(c_buf.dtype))
                    fence_async_shared()
                    c_row = (out_base // OUT_COLS).to(gl.int32) + a_row + ROW0
                    tma.async_copy_shared_to_global(c_desc, [c_row, col0], c_buf)
                else:
                    _store_masked(c_ptr, acc, a_row, row_hi, col0, out_base, OUT_COLS, ROW0, BMW, BN, mma_layout)
            else:
                _store_masked(c_ptr, acc, a_row, row_hi, col0, out_base, OUT_COLS, ROW0, BMW, BN, mma_layout)
        if TMA_STORE:
            tma.store_wait(0)

    @gluon.jit(do_not_specialize=["E", "N_B", "KSTEPS", "MT_K", "NT", "OUT_ROWS", "OUT_COLS"])
    def sm90_mxfp8_grouped_gemm_kernel(
            a_desc, b_desc, sa_desc, sb_desc,  # TMA descriptors: A/B data tiles, A/B scale tiles
            c_desc,  # TMA descriptor of the output ([rows, cols] view, box [rows per consumer, BN]) or None
            c_ptr, offs_ptr, tile_end_ptr,  # output, group ends [E], [2, E] cumul. tile counts + A-scale starts
            E, N_B, KSTEPS, MT_K, NT, OUT_ROWS, OUT_COLS,  # problem sizes (see _tile_info)
            K_GROUPED: gl.constexpr, WB32: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
            SEARCH_STEPS: gl.constexpr, SPLIT_WG: gl.constexpr, TMA_STORE: gl.constexpr,
            num_warps: gl.constexpr, SG: gl.constexpr = 1, CHAIN: gl.constexpr = 2):
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BN: gl.constexpr = b_desc.block_type.shape[0]
        gl.static_assert(BK % 32 == 0)

        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        sa_bufs = gl.allocate_shared_memory(sa_desc.dtype, [STAGES] + sa_desc.block_type.shape, sa_desc.layout)
        sb_bufs = gl.allocate_shared_memory(sb_desc.dtype, [STAGES] + sb_desc.block_type.shape, sb_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        # SPLIT_WG: each consumer warpgroup is its own partition (own barriers, no CTA-wide sync)
        # and both arrive on `empty`; else one 8-warp partition arrives once.
        NCONS: gl.constexpr = 2 if SPLIT_WG else 1
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=NCONS)
        fence_async_shared()

        HALF: gl.constexpr = BM // 2
        if TMA_STORE:  # one output staging buffer per consumer partition
            c_bufs = gl.allocate_shared_memory(c_desc.dtype, [NCONS] + c_desc.block_type.shape, c_desc.layout)
            c_tma = c_desc
        else:  # placeholders (never read): partitions cannot take None
            c_bufs = ready
            c_tma = ready
        if SPLIT_WG:
            gl.static_assert(num_warps == 4)
            gl.warp_specialize([
                (_consumer, (a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, c_ptr, c_tma, c_bufs, offs_ptr,
                             tile_end_ptr, E, N_B, KSTEPS, MT_K, NT, OUT_ROWS, OUT_COLS, K_GROUPED, WB32, BM, BN, BK,
                             STAGES, GROUP_M, SEARCH_STEPS, gl.constexpr(0), HALF, gl.constexpr(4), TMA_STORE, SG, CHAIN)),
                (_consumer, (a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, c_ptr, c_tma, c_bufs, offs_ptr,
                             tile_end_ptr, E, N_B, KSTEPS, MT_K, NT, OUT_ROWS, OUT_COLS, K_GROUPED, WB32, BM, BN, BK,
                             STAGES, GROUP_M, SEARCH_STEPS, HALF, HALF, gl.constexpr(4), TMA_STORE, SG, CHAIN)),
                (_producer, (a_desc, b_desc, sa_desc, sb_desc, a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty,
                             offs_ptr, tile_end_ptr, E, N_B, KSTEPS, MT_K, NT, OUT_ROWS, OUT_COLS, K_GROUPED, WB32,
                             BM, BN, BK, STAGES, GROUP_M, SEARCH_STEPS, SG)),
            ], [4, 1], [240, 24])
        else:
            gl.warp_specialize([
                (_consumer, (a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, c_ptr, c_tma, c_bufs, offs_ptr,
                             tile_end_ptr, E, N_B, KSTEPS, MT_K, NT, OUT_ROWS, OUT_COLS, K_GROUPED, WB32, BM, BN, BK,
                             STAGES, GROUP_M, SEARCH_STEPS, gl.constexpr(0), BM, num_warps, TMA_STORE, SG, CHAIN)),
                (_producer, (a_desc, b_desc, sa_desc, sb_desc, a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty,
                             offs_ptr, tile_end_ptr, E, N_B, KSTEPS, MT_K, NT, OUT_ROWS, OUT_COLS, K_GROUPED, WB32,
                             BM, BN, BK, STAGES, GROUP_M, SEARCH_STEPS, SG)),
            ], [1], [24])


def _nvmma_layout(block, gl_dtype):
    """Shared-memory layout of a TMA box: 128-byte swizzle for FP8 tiles, none for FP32 scale rows."""
    return _box_layout(tuple(block), gl_dtype, gl_dtype != gl.float32)


@functools.lru_cache(maxsize=None)
def _box_layout(block: tuple, gl_dtype, swizzled: bool):
    """The layout object of a TMA box, built once per (box, dtype, swizzle): every product makes four
    to five descriptors, and building their layouts is host time on the step's critical path."""
    if not swizzled:
        return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=len(block))
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)


# ----------------------------------------------------------------------------------------------
# Launch wrappers
# ----------------------------------------------------------------------------------------------


# Triton releases this kernel's Gluon code compiles under: 3.6 (the GPU machines'). 3.9 renamed or removed
# parts of the Gluon API it uses (shared-memory reinterpretation, the TMA copy names, warp_specialize's
# arguments: offline sm_90 compile, 2026-12-02); 3.7 and 3.8 were not tried.
GLUON_TRITON = ((3, 6),)


@functools.lru_cache(maxsize=None)
def _triton_release() -> tuple[int, int]:
    import re

    import triton

    m = re.match(r"(\d+)\.(\d+)", triton.__version__)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _check_sm90(t: torch.Tensor) -> None:
    if not HAS_GLUON:
        raise RuntimeError("the sm_90 MXFP8 grouped GEMM needs triton >= 3.6 with Gluon")
    if not t.is_cuda:
        raise ValueError("the sm_90 MXFP8 grouped GEMM needs CUDA tensors")
    cap = capability(t.device.index if t.device.index is not None else torch.cuda.current_device())
    if cap != (9, 0):
        raise RuntimeError(f"the sm_90 MXFP8 grouped GEMM runs on Hopper (sm_90) only; this is sm_{cap[0]}{cap[1]}")
    if _triton_release() not in GLUON_TRITON:
        import triton

        raise RuntimeError(f"the sm_90 MXFP8 grouped GEMM is written for triton "
                           f"{', '.join('%d.%d' % v for v in GLUON_TRITON)}; this is triton {triton.__version__}, "
                           "whose Gluon API differs (install triton 3.6, torch 2.11's)")


def _check_operand(name: str, x: torch.Tensor, dim: int) -> None:
    if x.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{name} must be torch.float8_e4m3fn, got {x.dtype}")
    if x.dim() != dim:
        raise ValueError(f"{name} must have {dim} dims, got shape {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous with the contraction dim last (K-major)")
    if x.shape[-1] % MX_BLOCK != 0:
        raise ValueError(f"{name}: contraction dim {x.shape[-1]} is not a multiple of {MX_BLOCK}")


def _check_scale(name: str, s: torch.Tensor, data: torch.Tensor) -> None:
    if s.dtype != torch.float8_e8m0fnu:
        raise TypeError(f"{name} must be torch.float8_e8m0fnu, got {s.dtype}")
    want = (*data.shape[:-1], data.shape[-1] // MX_BLOCK)
    if tuple(s.shape) != want:
        raise ValueError(f"{name} must have shape {want} (row-major, one scale per 32 along the last dim), "
                         f"got {tuple(s.shape)}")


def _check_offs(offs: torch.Tensor, num_groups: int, device: torch.device) -> torch.Tensor:
    """offs, validated, as a contiguous tensor (the kernel reads offs[e] at offs_ptr + e)."""
    if offs.dtype != torch.int32:
        raise TypeError(f"offs must be torch.int32, got {offs.dtype}")
    if offs.dim() != 1 or offs.shape[0] != num_groups:
        raise ValueError(f"offs must have shape ({num_groups},), got {tuple(offs.shape)}")
    if offs.device != device:
        raise ValueError(f"offs must be on {device}, got {offs.device}")
    return offs.contiguous()


def _fit_box(t: torch.Tensor, block: list[int]) -> torch.Tensor:
    """``t`` itself, or a zero-padded copy when a dim is smaller than the TMA box.

    Defensive: keeps every tensor map's box inside its tensor (small operands, e.g. K < 128 or
    N < 128 scale rows; whether sm_90 needs this was not isolated). The padding is never read into
    a valid output element (those steps, rows and columns are skipped or masked). Only small
    tensors are ever copied.
    """
    if all(d >= b for d, b in zip(t.shape, block)):
        return t
    shape = [max(d, b) for d, b in zip(t.shape, block)]
    out = torch.zeros(shape, dtype=torch.uint8 if t.element_size() == 1 else t.dtype, device=t.device)
    out = out.view(t.dtype)
    out[tuple(slice(0, d) for d in t.shape)] = t
    return out


def _desc(t: torch.Tensor, block: list[int]):
    gl_dtype = {torch.float8_e4m3fn: gl.float8e4nv, torch.float32: gl.float32}[t.dtype]
    t = _fit_box(t, block)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, _nvmma_layout(block, gl_dtype))


def _out_desc(out2d: torch.Tensor, cfg: Sm90TileConfig, sb_cols: int):
    """TMA descriptor of the ``[rows, cols]`` output for the TMA-store epilogue (box: one consumer
    partition's rows x BN), or None where the epilogue falls back to masked stores from registers:
    ``cfg.tma_store`` off, a row pitch or base address not 16-byte aligned, a tensor smaller than the
    box, or no room in shared memory for the staging buffer beside the ring (``sb_cols``: columns of
    the B-scale box; ptxas's figures run ~300 bytes above :func:`smem_bytes`, hence the 1 KB margin)."""
    block = [cfg.block_m // 2 if cfg.split_wg else cfg.block_m, cfg.block_n]
    rows, cols = out2d.shape
    elt = out2d.element_size()
    if not (cfg.tma_store and out2d.data_ptr() % 16 == 0 and cols * elt % 16 == 0
            and rows >= block[0] and cols >= block[1] and smem_bytes(cfg, sb_cols, elt) + 1024 <= SMEM_PER_CTA):
        return None
    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}[out2d.dtype]
    return TensorDescriptor(out2d, [rows, cols], [cols, 1], block, _box_layout(tuple(block), gl_dtype, True))


def _search_steps(num_groups: int) -> int:
    return max(0, (num_groups - 1).bit_length())


_SM_COUNT: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


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
    grid = (min(_num_sms(a.device), max_tiles), )
    c_desc = _out_desc(out, cfg, sb_block[1])
    sm90_mxfp8_grouped_gemm_kernel[grid](
        _desc(a, [BM, BK]), _desc(b.view(E * N, K), [BN, BK]), _desc(sa, [KB, BM]), _desc(sb, sb_block), c_desc,
        out, offs, sched, E, N, K // MX_BLOCK, 0, nt, M, N,
        K_GROUPED=False, WB32=weight_block == 32, STAGES=cfg.stages, GROUP_M=cfg.group_m,
        SEARCH_STEPS=_search_steps(E), SPLIT_WG=cfg.split_wg, TMA_STORE=c_desc is not None,
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
    grid = (min(_num_sms(a.device), E * mt * nt), )
    c_desc = _out_desc(out.view(E * N, K), cfg, BN)
    sm90_mxfp8_grouped_gemm_kernel[grid](
        _desc(a, [BM, BK]), _desc(b, [BN, BK]), _desc(sa, [KB, BM]), _desc(sb, [KB, BN]), c_desc,
        out, offs, offs, E, 0, 0, mt, nt, N, K,
        K_GROUPED=True, WB32=False, STAGES=cfg.stages, GROUP_M=cfg.group_m,
        SEARCH_STEPS=0, SPLIT_WG=cfg.split_wg, TMA_STORE=c_desc is not None,
        num_warps=4 if cfg.split_wg else 8,
        maxnreg=cfg.maxnreg)
    return out


# ----------------------------------------------------------------------------------------------
# mx128 mode: 1x128 activations / gradients, 128x128 weight tiles (DESIGN §9, recipe mxfp8_128)
# ----------------------------------------------------------------------------------------------

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
    grid = (min(_num_sms(a_data.device), (triton.cdiv(M, BM) + E) * nt), )
    sb_block = [BK // GROUP, 32]  # 128 bytes: every stage's box starts 128-byte aligned in smem
    c_desc = _out_desc(out, cfg, sb_block[1])
    sm90_mxfp8_grouped_gemm_kernel[grid](
        _desc(a_data, [BM, BK]), _desc(b_data.view(E * N, K), [BN, BK]), _desc(sa, [BK // GROUP, BM]),
        _desc(sb, sb_block), c_desc, out, offs, sched, E, N, K // MX_BLOCK, 0, nt, M, N,
        K_GROUPED=False, WB32=True, STAGES=cfg.stages, GROUP_M=cfg.group_m, SEARCH_STEPS=_search_steps(E),
        SPLIT_WG=cfg.split_wg, TMA_STORE=c_desc is not None, num_warps=4 if cfg.split_wg else 8,
        maxnreg=cfg.maxnreg, SG=_SG, CHAIN=cfg.chain)
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
    grid = (min(_num_sms(a_data.device), E * mt * nt), )
    c_desc = _out_desc(out.view(E * N, K), cfg, BN)
    sm90_mxfp8_grouped_gemm_kernel[grid](
        _desc(a_data, [BM, BK]), _desc(b_data, [BN, BK]), _desc(sa, [BK // GROUP, BM]), _desc(sb, [BK // GROUP, BN]),
        c_desc, out, offs, offs, E, 0, 0, mt, nt, N, K,
        K_GROUPED=True, WB32=False, STAGES=cfg.stages, GROUP_M=cfg.group_m, SEARCH_STEPS=0,
        SPLIT_WG=cfg.split_wg, TMA_STORE=c_desc is not None, num_warps=4 if cfg.split_wg else 8,
        maxnreg=cfg.maxnreg, SG=_SG, CHAIN=cfg.chain)
    return out
