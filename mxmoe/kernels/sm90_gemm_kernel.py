"""The Gluon kernel of the Hopper (sm_90) MXFP8 grouped GEMMs: M-grouped (fprop, dgrad) and K-grouped (wgrad),
promotion per 32 (:mod:`mxmoe.kernels.sm90_gemm_promote32`, whose docstring has the numerics) or per 128
(:mod:`mxmoe.kernels.sm90_gemm_promote128`); the launch plumbing both share is :mod:`mxmoe.kernels.sm90_gemm_launch`.

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

The mx128 mode (``SG=4``) keeps the same producer, scheduler and epilogue; the consumer's K loop
(``_mainloop128``) issues each 128-deep stage as ONE wgmma call and promotes once per stage (see
:mod:`mxmoe.kernels.sm90_gemm_promote128`).

Tile order (the "scheduler"): tiles are numbered expert by expert; inside an expert's
sub-problem (m-tiles x n-tiles) tiles are ordered in supergroups of ``GROUP_M`` m-tiles
(expert-wise supergrouping: concurrently running CTAs share one expert's B tiles in L2).
M-grouped (every tile the same K depth): CTA ``p`` takes tiles ``p, p + P, p + 2P, ...``; the wrapper
computes each expert's tile count on the device (no host sync); the kernel finds a tile's expert by
binary search over the cumulative tile counts, or (``VEC_SEARCH``; 33-128 experts by default) by one
vector load and warp reductions (``_group_of_tile``).
K-grouped (a tile's depth is its expert's token count, so under skewed routing tiles differ 40x): the
tiles are ranked expert by expert in order of token count, most first (the wrapper's order, sorted on the
device), and handed out dynamically: CTA ``p`` starts with rank ``p`` and its producer warp then draws each
next rank from a counter in global memory (one atomic add, claimed a tile ahead), maps it to the tile's
expert-major number (one load of the order) and passes that to the consumer partitions through a two-slot
ring in shared memory (``_publish_tile`` / ``_take_tile``). Longest first, each to the CTA that
frees up first: greedy list scheduling (LPT), so no CTA is left with two of the longest tiles while others
idle. Each tile is still computed whole by one CTA in a fixed order, so reruns agree bit for bit.
"""

from __future__ import annotations

try:  # Triton (and Gluon) are optional: `import mxmoe` must work without them.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401 (sm90_gemm_launch's)

    HAS_GLUON = True
except Exception:  # pragma: no cover - depends on the installed triton
    HAS_GLUON = False

__all__ = ["HAS_GLUON", "sm90_mxfp8_grouped_gemm_kernel"]


if HAS_GLUON:

    @gluon.jit
    def _group_of_tile(tile, offs_ptr, tile_end_ptr, E, SEARCH_STEPS: gl.constexpr, NWARPS: gl.constexpr):
        """M-grouped: the expert e of output tile ``tile`` as a vector search, with (first tile of e, e's first
        row, e's end row, e's first A-scale column). Every warp loads the [E] cumulative tile counts, row
        ends and A-scale starts (one load each, issued together), and e is the count of tile ends at or below
        ``tile``; the other four are masked max / min reductions, valid because all three arrays are
        non-decreasing. The layout keeps each reduction inside one warp (the warps hold copies: no shared
        memory, no barrier). It replaces SEARCH_STEPS dependent loads plus one more round of them; in the
        producer they delay the next tile's first loads (H100 A/B: docs/hopper.md, "The tile lookup with many
        experts")."""
        EP: gl.constexpr = 1 << SEARCH_STEPS
        L: gl.constexpr = gl.BlockedLayout([(EP + 31) // 32], [32], [NWARPS], [0])
        i = gl.arange(0, EP, layout=L)
        live = i < E
        big = 2147483647
        ends = gl.load(tile_end_ptr + i, mask=live, other=big)
        rows = gl.load(offs_ptr + i, mask=live, other=big)
        starts = gl.load(tile_end_ptr + E + i, mask=live, other=big)
        before = ends <= tile
        e = gl.sum(before.to(gl.int32), axis=0)
        first = gl.max(gl.where(before, ends, 0), axis=0)
        t_lo = gl.max(gl.where(before, rows, 0), axis=0)
        t_hi = gl.min(gl.where(before, big, rows), axis=0)
        sa_start = gl.min(gl.where(before, big, starts), axis=0)
        return e, first, t_lo, t_hi, sa_start

    @gluon.jit
    def _tile_info(tile, offs_ptr, tile_end_ptr, E, N_B, KSTEPS, MT_K, NT, OUT_ROWS, OUT_COLS,
                   K_GROUPED: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr,
                   SEARCH_STEPS: gl.constexpr, VEC_SEARCH: gl.constexpr = False, NWARPS: gl.constexpr = 1):
        """Map a tile number to (a_row, b_row, kb0, sb_row0, nsteps, row_hi, col0, out_base, sa_col).

        a_row/b_row: first rows of the A and B tiles (TMA coordinates); sa_col: first column of the
        tile's rows in the A-scale tensor (M-grouped: each group starts at a multiple of 4 columns,
        ``tile_end_ptr[E + e]``, because a TMA box must start 16-byte aligned in its inner dim);
        kb0: first 32-block of the
        contraction range; sb_row0: row of the B-scale tensor for that block; nsteps: 32-deep steps;
        row_hi: rows of the output tile at or past it are not written; col0: first output column;
        out_base: element offset of the output matrix (expert slice for wgrad).
        M-grouped, the tile's expert comes from a binary search over the cumulative tile counts, or with
        VEC_SEARCH from :func:`_group_of_tile` (NWARPS: the calling partition's warps).
        """
        if K_GROUPED:
            per = MT_K * NT
            e = tile // per  # expert-major numbering (the producer maps the drawn tiles to it)
            local = tile - e * per
            t_lo = gl.load(offs_ptr + e - 1, mask=e > 0, other=0)
            t_hi = gl.load(offs_ptr + e)
            mt_count = MT_K
        elif VEC_SEARCH:
            e, first, t_lo, t_hi, sa_start = _group_of_tile(tile, offs_ptr, tile_end_ptr, E, SEARCH_STEPS, NWARPS)
            local = tile - first
            mt_count = (t_hi - t_lo + BM - 1) // BM
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
            sa_start = gl.load(tile_end_ptr + E + e)
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
            sa_col = sa_start + mt * BM
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
    def _load_tile(tile, it, a_desc, b_desc, sa_desc, sb_desc, a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty,
                   offs_ptr, tile_end_ptr, E, N_B, KSTEPS, MT_K, NT, OUT_ROWS, OUT_COLS,
                   K_GROUPED: gl.constexpr, WB32: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                   BK: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, SEARCH_STEPS: gl.constexpr,
                   SG: gl.constexpr, VEC_SEARCH: gl.constexpr):
        """The producer's stages of one tile (ring slots it, it + 1, ...); returns the next slot count."""
        KB: gl.constexpr = BK // 32
        nbytes: gl.constexpr = (a_desc.block_type.nbytes + b_desc.block_type.nbytes + sa_desc.block_type.nbytes +
                                sb_desc.block_type.nbytes)
        a_row, b_row, kb0, sb_row0, nsteps, row_hi, col0, out_base, sa_col = _tile_info(
            tile, offs_ptr, tile_end_ptr, E, N_B, KSTEPS, MT_K, NT, OUT_ROWS, OUT_COLS, K_GROUPED, BM, BN,
            GROUP_M, SEARCH_STEPS, VEC_SEARCH and SEARCH_STEPS <= 7, 1)
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
        return it

    @gluon.jit
    def _claim_tile(counter_ptr):
        """Producer (1 warp): draw a tile number from the counter, one atomic add by lane 0 whose result stays in
        flight in lane 0's register until :func:`_claimed_tile` reads it (a scalar atomic would be waited for at
        once: Triton broadcasts its result through shared memory)."""
        lanes: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        lane = gl.arange(0, 32, lanes)
        return gl.atomic_add(counter_ptr + lane * 0, gl.full([32], 1, gl.int32, lanes), mask=lane == 0,
                             sem="relaxed")

    @gluon.jit
    def _claimed_tile(claim):
        """The counter value a :func:`_claim_tile` drew (lane 0's), as a scalar (warp shuffles)."""
        lanes: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        lane = gl.arange(0, 32, lanes)
        return gl.max(gl.where(lane == 0, claim, 0), axis=0)

    @gluon.jit
    def _publish_tile(tile_ids, tile_ready, tile_free, j, tile, TSLOTS: gl.constexpr):
        """Producer: hand tile number ``tile`` (the CTA's j-th) to the consumers through slot j % TSLOTS of the
        tile ring, once both consumer partitions have read the slot's previous number."""
        slot = j % TSLOTS
        mbarrier.wait(tile_free.index(slot), ((j // TSLOTS) & 1) ^ 1)
        one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        tile_ids.index(slot).store(gl.full([1], tile, gl.int32, one))
        mbarrier.arrive(tile_ready.index(slot), count=1)

    @gluon.jit
    def _take_tile(tile_ids, tile_ready, tile_free, j, TSLOTS: gl.constexpr, NW: gl.constexpr):
        """Consumer (NW warps): the CTA's j-th tile number from the tile ring; the slot goes back at once."""
        slot = j % TSLOTS
        mbarrier.wait(tile_ready.index(slot), (j // TSLOTS) & 1)
        one: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        tile = gl.max(tile_ids.index(slot).load(one), axis=0)
        mbarrier.arrive(tile_free.index(slot), count=1)
        return tile

    @gluon.jit
    def _producer(a_desc, b_desc, sa_desc, sb_desc, a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty,
                  tile_ids, tile_ready, tile_free, offs_ptr, tile_end_ptr, E, N_B, KSTEPS, MT_K, NT, OUT_ROWS,
                  OUT_COLS, K_GROUPED: gl.constexpr, WB32: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                  BK: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, SEARCH_STEPS: gl.constexpr,
                  SG: gl.constexpr, VEC_SEARCH: gl.constexpr, TSLOTS: gl.constexpr):
        """TMA warp: fill the smem ring with A, B tiles and their scales, stage by stage.

        SG: 32-blocks per scale row (1: one row per 32 of K; 4: the 128-deep groups of the mx128 mode,
        one scale row per 128 of K)."""
        total = _num_tiles(tile_end_ptr, E, MT_K, NT, K_GROUPED)
        it = 0
        if K_GROUPED:
            # Dynamic schedule: the CTA's first tile is its program id, each next one the tile counter's
            # (tile_end_ptr[E], zeroed by the launcher), handed to the consumers through the tile ring; the
            # launcher's expert order puts the longest tiles first (greedy longest-first list scheduling).
            # The claim of the next tile is issued before the current tile's loads and read after them, so the
            # atomic's round trip to L2 is hidden (a CTA claims its next tile as it starts one).
            tile = gl.program_id(0)
            claim = _claim_tile(tile_end_ptr + E)
            j = 0
            while tile < total:
                # the drawn tile (in the launcher's expert order) as its expert-major number: the one lookup of
                # the order, so the consumers' tile start has no dependent load beyond the group offsets
                per = MT_K * NT
                rank = tile // per
                tile = gl.load(tile_end_ptr + rank) * per + (tile - rank * per)
                _publish_tile(tile_ids, tile_ready, tile_free, j, tile, TSLOTS)
                it = _load_tile(tile, it, a_desc, b_desc, sa_desc, sb_desc, a_bufs, b_bufs, sa_bufs, sb_bufs, ready,
                                empty, offs_ptr, tile_end_ptr, E, N_B, KSTEPS, MT_K, NT, OUT_ROWS, OUT_COLS, K_GROUPED,
                                WB32, BM, BN, BK, STAGES, GROUP_M, SEARCH_STEPS, SG, VEC_SEARCH)
                tile = gl.num_programs(0) + _claimed_tile(claim)
                claim = _claim_tile(tile_end_ptr + E)
                j += 1
            _publish_tile(tile_ids, tile_ready, tile_free, j, total, TSLOTS)  # total: no more tiles
        else:
            for tile in range(gl.program_id(0), total, gl.num_programs(0)):
                it = _load_tile(tile, it, a_desc, b_desc, sa_desc, sb_desc, a_bufs, b_bufs, sa_bufs, sb_bufs, ready,
                                empty, offs_ptr, tile_end_ptr, E, N_B, KSTEPS, MT_K, NT, OUT_ROWS, OUT_COLS, K_GROUPED,
                                WB32, BM, BN, BK, STAGES, GROUP_M, SEARCH_STEPS, SG, VEC_SEARCH)

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
    def _consume_tile(tile, it, p_a, p_b, a_bufs, b_bufs, sa_rows, sb_rows, ready, empty, c_ptr, c_desc, c_bufs,
                      offs_ptr, tile_end_ptr, E, N_B, KSTEPS, MT_K, NT, OUT_ROWS, OUT_COLS,
                      K_GROUPED: gl.constexpr, WB32: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                      BK: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, SEARCH_STEPS: gl.constexpr,
                      ROW0: gl.constexpr, BMW: gl.constexpr, NW: gl.constexpr, TMA_STORE: gl.constexpr,
                      SG: gl.constexpr, CHAIN: gl.constexpr, VEC_SEARCH: gl.constexpr, mma_layout: gl.constexpr,
                      l3: gl.constexpr):
        """One tile of a consumer partition: its K loop (ring slots it, it + 1, ...) and its store; returns the
        next slot count and the two wgmma partials (registers reused from tile to tile)."""
        KB: gl.constexpr = BK // 32
        EARLY_SCALES: gl.constexpr = WB32
        # The tile lookup sits between two tiles' tensor-core work. VEC_SEARCH (the tile config's vec_search):
        # the vector search, up to 256 groups here (8 registers per array) and 128 in the producer (its 24
        # registers spilled at 256), the binary search past that.
        a_row, b_row, kb0, sb_row0, nsteps, row_hi, col0, out_base, sa_col = _tile_info(
            tile, offs_ptr, tile_end_ptr, E, N_B, KSTEPS, MT_K, NT, OUT_ROWS, OUT_COLS, K_GROUPED, BM, BN,
            GROUP_M, SEARCH_STEPS, VEC_SEARCH and SEARCH_STEPS <= 8, NW)
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
        return it, p_a, p_b

    @gluon.jit
    def _consumer(a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, c_ptr, c_desc, c_bufs, tile_ids, tile_ready,
                  tile_free, offs_ptr, tile_end_ptr, E, N_B, KSTEPS, MT_K, NT, OUT_ROWS, OUT_COLS,
                  K_GROUPED: gl.constexpr, WB32: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                  BK: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, SEARCH_STEPS: gl.constexpr,
                  ROW0: gl.constexpr, BMW: gl.constexpr, NW: gl.constexpr,
                  TMA_STORE: gl.constexpr, SG: gl.constexpr, CHAIN: gl.constexpr, VEC_SEARCH: gl.constexpr,
                  TSLOTS: gl.constexpr):
        """Consumer warps (NW of them) owning rows ROW0 .. ROW0+BMW-1 of every tile: async wgmma per
        MX step, promotion of the previous step while the next one runs, then the tile's store."""
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
        if K_GROUPED:  # the tiles the producer drew from the tile counter, in its order; `total` ends them
            tile = _take_tile(tile_ids, tile_ready, tile_free, 0, TSLOTS, NW)
            j = 1
            while tile < total:
                it, p_a, p_b = _consume_tile(tile, it, p_a, p_b, a_bufs, b_bufs, sa_rows, sb_rows, ready, empty, c_ptr,
                                             c_desc, c_bufs, offs_ptr, tile_end_ptr, E, N_B, KSTEPS, MT_K, NT, OUT_ROWS,
                                             OUT_COLS, K_GROUPED, WB32, BM, BN, BK, STAGES, GROUP_M, SEARCH_STEPS, ROW0,
                                             BMW, NW, TMA_STORE, SG, CHAIN, VEC_SEARCH, mma_layout, l3)
                tile = _take_tile(tile_ids, tile_ready, tile_free, j, TSLOTS, NW)
                j += 1
        else:
            for tile in range(gl.program_id(0), total, gl.num_programs(0)):
                it, p_a, p_b = _consume_tile(tile, it, p_a, p_b, a_bufs, b_bufs, sa_rows, sb_rows, ready, empty, c_ptr,
                                             c_desc, c_bufs, offs_ptr, tile_end_ptr, E, N_B, KSTEPS, MT_K, NT, OUT_ROWS,
                                             OUT_COLS, K_GROUPED, WB32, BM, BN, BK, STAGES, GROUP_M, SEARCH_STEPS, ROW0,
                                             BMW, NW, TMA_STORE, SG, CHAIN, VEC_SEARCH, mma_layout, l3)
        if TMA_STORE:
            tma.store_wait(0)

    @gluon.jit(do_not_specialize=["E", "N_B", "KSTEPS", "MT_K", "NT", "OUT_ROWS", "OUT_COLS"])
    def sm90_mxfp8_grouped_gemm_kernel(
            a_desc, b_desc, sa_desc, sb_desc,  # TMA descriptors: A/B data tiles, A/B scale tiles
            c_desc,  # TMA descriptor of the output ([rows, cols] view, box [rows per consumer, BN]) or None
            c_ptr, offs_ptr, tile_end_ptr,  # output, group ends [E], the schedule: M-grouped [2, E] cumulative
            #                                 tile counts + A-scale starts, K-grouped [E + 1] the expert order + tile counter
            E, N_B, KSTEPS, MT_K, NT, OUT_ROWS, OUT_COLS,  # problem sizes (see _tile_info)
            K_GROUPED: gl.constexpr, WB32: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
            SEARCH_STEPS: gl.constexpr, SPLIT_WG: gl.constexpr, TMA_STORE: gl.constexpr,
            num_warps: gl.constexpr, SG: gl.constexpr = 1, CHAIN: gl.constexpr = 2,
            VEC_SEARCH: gl.constexpr = False):
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
        # K-grouped: the tile ring, the producer's tile numbers to the consumers (dynamic schedule)
        TSLOTS: gl.constexpr = 2
        tile_ids = gl.allocate_shared_memory(gl.int32, [TSLOTS, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        tile_ready = gl.allocate_shared_memory(gl.int64, [TSLOTS, 1], mbarrier.MBarrierLayout())
        tile_free = gl.allocate_shared_memory(gl.int64, [TSLOTS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(TSLOTS):
            mbarrier.init(tile_ready.index(i), count=1)
            mbarrier.init(tile_free.index(i), count=NCONS)
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
                (_consumer, (a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, c_ptr, c_tma, c_bufs, tile_ids,
                             tile_ready, tile_free, offs_ptr,
                             tile_end_ptr, E, N_B, KSTEPS, MT_K, NT, OUT_ROWS, OUT_COLS, K_GROUPED, WB32, BM, BN, BK,
                             STAGES, GROUP_M, SEARCH_STEPS, gl.constexpr(0), HALF, gl.constexpr(4), TMA_STORE, SG, CHAIN,
                             VEC_SEARCH, TSLOTS)),
                (_consumer, (a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, c_ptr, c_tma, c_bufs, tile_ids,
                             tile_ready, tile_free, offs_ptr,
                             tile_end_ptr, E, N_B, KSTEPS, MT_K, NT, OUT_ROWS, OUT_COLS, K_GROUPED, WB32, BM, BN, BK,
                             STAGES, GROUP_M, SEARCH_STEPS, HALF, HALF, gl.constexpr(4), TMA_STORE, SG, CHAIN,
                             VEC_SEARCH, TSLOTS)),
                (_producer, (a_desc, b_desc, sa_desc, sb_desc, a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty,
                             tile_ids, tile_ready, tile_free, offs_ptr, tile_end_ptr, E, N_B, KSTEPS, MT_K, NT,
                             OUT_ROWS, OUT_COLS, K_GROUPED, WB32, BM, BN, BK, STAGES, GROUP_M, SEARCH_STEPS, SG, VEC_SEARCH, TSLOTS)),
            ], [4, 1], [240, 24])
        else:
            gl.warp_specialize([
                (_consumer, (a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, c_ptr, c_tma, c_bufs, tile_ids,
                             tile_ready, tile_free, offs_ptr,
                             tile_end_ptr, E, N_B, KSTEPS, MT_K, NT, OUT_ROWS, OUT_COLS, K_GROUPED, WB32, BM, BN, BK,
                             STAGES, GROUP_M, SEARCH_STEPS, gl.constexpr(0), BM, num_warps, TMA_STORE, SG, CHAIN,
                             VEC_SEARCH, TSLOTS)),
                (_producer, (a_desc, b_desc, sa_desc, sb_desc, a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty,
                             tile_ids, tile_ready, tile_free, offs_ptr, tile_end_ptr, E, N_B, KSTEPS, MT_K, NT,
                             OUT_ROWS, OUT_COLS, K_GROUPED, WB32, BM, BN, BK, STAGES, GROUP_M, SEARCH_STEPS, SG, VEC_SEARCH, TSLOTS)),
            ], [1], [24])
