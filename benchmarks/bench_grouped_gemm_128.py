"""Benchmark the Hopper mx128 grouped GEMMs (recipe mxfp8_128) against BF16, FP8 rowwise and cuBLAS
block-scaled products, same run.

    python benchmarks/bench_grouped_gemm_128.py [--out benchmarks/results/h200/grouped_gemm_128.json] [--quick]

Shapes: DESIGN §5, up (N = 2 x FFN, K = hidden) and down (N = hidden, K = FFN) projections, balanced and
skewed (Zipf-like, some experts empty) token counts in multiples of 128 (the MoE layer pads each expert's
rows to 128 for this recipe). Passes, all with MXFP8 operands whose scales are shared in 1x128 groups
(activations, gradients; along tokens for wgrad) and 128x128 tiles (weights):

    fprop  y[M, N]  = x[M, K] @ W[e]^T       sm90_mx128_m_grouped_gemm, BF16 out
    dgrad  dx[M, K] = dy[M, N] @ W[e]        the same on W^T [E, K, N] (the same 128x128 tiles)
    wgrad  dW[e]    = dy[:, g_e]^T x[g_e]    sm90_mx128_k_grouped_gemm, FP32 out (BF16 timed too)

Timed (do_bench median; quantization excluded everywhere; ours includes its scale re-layout):
``bf16_tflops`` ``torch._grouped_mm`` on BF16 copies; ``fp8_rowwise_tflops`` ``torch._scaled_grouped_mm``
(rowwise scales); ``cublas_block_loop_tflops`` (fprop/dgrad) a per-expert loop of cuBLAS block-scaled
``torch._scaled_mm`` (1x128 x 128x128 FP32 scales, layouts of DESIGN §6, each expert's scales prepared
contiguous beforehand), replayed as one CUDA graph so its launch overhead is not counted.
``rel_err``: ||ours - ref|| / ||ref|| with FP32 output on sampled rows, ref = FP64 product of the
dequantized operands. (Rows of results before the kernel's ablation modes were removed also carry
``pipeline_tflops`` / ``pipeline_nostore_tflops``: the 1x32 kernel's bare-MMA ablations 3 and 4.)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import bench_grouped_gemm as B  # noqa: E402
from mxmoe.formats import e8m0_to_float  # noqa: E402
from mxmoe.kernels.sm90_gemm_promote128 import (  # noqa: E402
    sm90_mx128_k_grouped_gemm,
    sm90_mx128_m_grouped_gemm,
)

SHAPES = B.SHAPES
CONFIG = None  # --chain: a Sm90TileConfig for every call of ours, else the library's default


def token_counts(M: int, E: int, balance: str, gen: torch.Generator) -> list[int]:
    """Rows per expert, multiples of 128 summing to M (B.token_counts' rule on 128-row units)."""
    return B.token_counts(M, E, balance, gen, unit=128)


def scale_1x128(rows, k, device="cuda"):
    """Per-32 E8M0 scales [rows, k/32] of 1x128 groups (each group's byte replicated 4 times)."""
    s = torch.randint(120, 135, (rows, k // 128), device=device, dtype=torch.uint8)
    return s.repeat_interleave(4, dim=1).contiguous().view(torch.float8_e8m0fnu)


def scale_128x128(E, n, k, device="cuda"):
    """Per-32 E8M0 scales [E, n, k/32] of 128x128 tiles; also the tile bytes [E, n/128, k/128]."""
    t = torch.randint(120, 135, (E, n // 128, k // 128), device=device, dtype=torch.uint8)
    s = t.repeat_interleave(128, dim=1).repeat_interleave(4, dim=2).contiguous().view(torch.float8_e8m0fnu)
    return s, t


def cublas_block_loop(a, sa_bytes, b, tiles, counts):
    """A per-expert loop of cuBLAS block-scaled torch._scaled_mm (BF16 out) as a replayable callable:
    scale_a [M_e, K/128] outer-dim-major, scale_b the [K/128, N/128] transposed view of [N/128, K/128]."""
    jobs, start = [], 0
    for e, n in enumerate(counts):
        if n:
            s_a = e8m0_to_float(sa_bytes[start:start + n, ::4]).t().contiguous().t()
            s_b = e8m0_to_float(tiles[e]).contiguous().t()
            jobs.append((a[start:start + n], b[e].t(), s_a, s_b))
        start += n

    def run():
        return [torch._scaled_mm(x, w, scale_a=s1, scale_b=s2, out_dtype=torch.bfloat16) for x, w, s1, s2 in jobs]

    run()
    torch.cuda.synchronize()
    if B.CUDA_GRAPH:  # B.bench captures the loop in its own graph (a replay inside a capture records nothing)
        return run, "cuda graph (the bench's)"
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            keep = run()  # noqa: F841 (the graph's outputs stay allocated)
        return g.replay, "cuda graph"
    except Exception as exc:  # pragma: no cover - eager fallback
        return run, f"eager ({type(exc).__name__})"


def run_case(shape, proj, balance, quick, gen):
    E, M, hidden, ffn = SHAPES[shape]
    N, K = (2 * ffn, hidden) if proj == "up" else (hidden, ffn)
    counts = token_counts(M, E, balance, gen)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    tfl = lambda ms: 2.0 * M * N * K / (ms * 1e-3) / 1e12  # noqa: E731
    base = dict(shape=shape, proj=proj, balance=balance, E=E, M=M, N=N, K=K, counts_max=max(counts),
                empty_experts=sum(c == 0 for c in counts))
    rows = []
    bench = lambda fn: B.bench(fn, quick)  # noqa: E731
    for pas in ("fprop", "dgrad"):
        n_out, k_red = (N, K) if pas == "fprop" else (K, N)
        row = dict(base, **{"pass": pas})
        try:
            a = B.rand_fp8(M, k_red)
            sa = scale_1x128(M, k_red)
            b = B.rand_fp8(E, n_out, k_red)
            sb, tiles = scale_128x128(E, n_out, k_red)
            a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
            ms_bf16 = bench(lambda: torch._grouped_mm(a16, b16.transpose(-2, -1), offs=offs))
            del a16, b16
            rs, cs = torch.rand(M, device="cuda") + 0.5, torch.rand(E, n_out, device="cuda") + 0.5
            ms_fp8 = bench(lambda: torch._scaled_grouped_mm(a, b.transpose(-2, -1), rs, cs, offs=offs,
                                                            out_dtype=torch.bfloat16))
            try:
                loop, how = cublas_block_loop(a, sa.view(torch.uint8), b, tiles, counts)
                ms_loop = bench(loop)
                del loop
            except Exception as exc:
                ms_loop, how = float("nan"), "failed"
                row["cublas_error"] = f"{type(exc).__name__}: {exc}"[:300]
            out32 = sm90_mx128_m_grouped_gemm(a, sa, b, sb, offs, torch.float32, config=CONFIG)
            row["rel_err"] = B.m_grouped_rel_err(out32, a, sa, b, sb, counts, gen)
            del out32
            fn = lambda: sm90_mx128_m_grouped_gemm(a, sa, b, sb, offs, torch.bfloat16, config=CONFIG)  # noqa: E731
            o1, o2 = fn(), fn()
            row["bitwise_rerun"] = bool(torch.equal(o1[:sum(counts)].view(torch.int16),
                                                    o2[:sum(counts)].view(torch.int16)))
            row["rel_err_bf16_out"] = B.m_grouped_rel_err(o1, a, sa, b, sb, counts, gen)
            del o1, o2
            ms = bench(fn)
            row.update(ms=ms, tflops=tfl(ms), bf16_tflops=tfl(ms_bf16), fp8_rowwise_tflops=tfl(ms_fp8),
                       cublas_block_loop_tflops=tfl(ms_loop), cublas_block_loop_mode=how)
            row["vs_bf16"] = row["tflops"] / row["bf16_tflops"]
            row["vs_cublas_block_loop"] = row["tflops"] / row["cublas_block_loop_tflops"]
            row["pass_ok"] = bool(row["rel_err"] <= 5e-4 and row["bitwise_rerun"])
            del a, b, sa, sb
        except Exception as exc:  # one failing case must not hide the others
            row["error"] = f"{type(exc).__name__}: {exc}"[:400]
        rows.append(row)
        print_row(row)
        torch.cuda.empty_cache()

    row = dict(base, **{"pass": "wgrad"})
    try:
        a, sa = B.rand_fp8(N, M), scale_1x128(N, M)  # dy^T, 128x1 groups along tokens
        b, sb = B.rand_fp8(K, M), scale_1x128(K, M)  # x^T
        a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
        ms_bf16 = bench(lambda: torch._grouped_mm(a16, b16.transpose(0, 1), offs=offs))
        del a16, b16
        ra, rb = torch.rand(E * N, device="cuda") + 0.5, torch.rand(E * K, device="cuda") + 0.5
        try:
            ms_fp8 = bench(lambda: torch._scaled_grouped_mm(a, b.transpose(0, 1), ra, rb, offs=offs,
                                                            out_dtype=torch.bfloat16))
        except Exception as exc:
            ms_fp8 = float("nan")
            row["fp8_error"] = f"{type(exc).__name__}: {exc}"[:300]
        fn = lambda: sm90_mx128_k_grouped_gemm(a, sa, b, sb, offs, torch.float32, check_offsets=False,  # noqa: E731
                                               config=CONFIG)
        o1, o2 = fn(), fn()
        row["bitwise_rerun"] = bool(torch.equal(o1.view(torch.int32), o2.view(torch.int32)))
        row["rel_err"] = B.k_grouped_rel_err(o1, a, sa, b, sb, counts, gen)
        row["empty_experts_zero"] = bool(all((o1[e] == 0).all().item() for e, c in enumerate(counts) if c == 0))
        del o1, o2
        ms = bench(fn)
        ms16 = bench(lambda: sm90_mx128_k_grouped_gemm(a, sa, b, sb, offs, torch.bfloat16, check_offsets=False,
                                                       config=CONFIG))
        row.update(ms=ms, tflops=tfl(ms), tflops_bf16_out=tfl(ms16), bf16_tflops=tfl(ms_bf16),
                   fp8_rowwise_tflops=tfl(ms_fp8), out_dtype="float32")
        row["vs_bf16"] = row["tflops"] / row["bf16_tflops"]
        row["pass_ok"] = bool(row["rel_err"] <= 5e-4 and row["bitwise_rerun"] and row["empty_experts_zero"])
        del a, b, sa, sb
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"[:400]
    rows.append(row)
    print_row(row)
    torch.cuda.empty_cache()
    return rows


def run_sweep(cases, configs, quick, rounds=2, save=None):
    """Tile/chain A/B: per case and pass, every configuration timed ``rounds`` times, interleaved
    (a b c a b c) so drift hits all arms alike; BF16 ``torch._grouped_mm`` once per case for scale.
    ``save(rows)`` (if given) runs after every row, so a run cut short keeps what it measured."""
    import dataclasses

    from mxmoe.kernels.sm90_tile_config import sm90_mx128_tile_config
    rows = []
    gen = torch.Generator().manual_seed(0)
    for shape, proj in cases:
        E, M, hidden, ffn = SHAPES[shape]
        N, K = (2 * ffn, hidden) if proj == "up" else (hidden, ffn)
        offs = torch.tensor(token_counts(M, E, "balanced", gen)).cumsum(0).to(torch.int32).cuda()
        tfl = lambda ms: 2.0 * M * N * K / (ms * 1e-3) / 1e12  # noqa: E731
        for pas in ("fprop", "dgrad", "wgrad"):
            if pas == "wgrad":
                a, sa, b, sb = B.rand_fp8(N, M), scale_1x128(N, M), B.rand_fp8(K, M), scale_1x128(K, M)
                mk = lambda cfg: (lambda: sm90_mx128_k_grouped_gemm(  # noqa: E731
                    a, sa, b, sb, offs, torch.float32, check_offsets=False, config=cfg))
                a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
                ms_bf16 = B.bench(lambda: torch._grouped_mm(a16, b16.transpose(0, 1), offs=offs), quick)
            else:
                n_out, k_red = (N, K) if pas == "fprop" else (K, N)
                a, sa, b = B.rand_fp8(M, k_red), scale_1x128(M, k_red), B.rand_fp8(E, n_out, k_red)
                sb, _ = scale_128x128(E, n_out, k_red)
                mk = lambda cfg: (lambda: sm90_mx128_m_grouped_gemm(  # noqa: E731
                    a, sa, b, sb, offs, torch.bfloat16, config=cfg))
                a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
                ms_bf16 = B.bench(lambda: torch._grouped_mm(a16, b16.transpose(-2, -1), offs=offs), quick)
            del a16, b16
            times = {c: [] for c in configs}
            for _ in range(rounds):
                for c in configs:
                    cfg = dataclasses.replace(sm90_mx128_tile_config(M, N, K, E), **dict(
                        (kv.split("=")[0], int(kv.split("=")[1])) for kv in c.split(",") if kv))
                    try:
                        times[c].append(B.bench(mk(cfg), quick))
                    except Exception as exc:
                        times[c].append(float("nan"))
                        print(f"  {c}: {type(exc).__name__}: {exc}"[:300], flush=True)
            row = dict(shape=shape, proj=proj, balance="balanced", **{"pass": pas}, bf16_tflops=tfl(ms_bf16),
                       tflops={c: [tfl(t) for t in ts] for c, ts in times.items()})
            print(f"sweep {shape:<14}{proj:<5}{pas:<6} bf16 {row['bf16_tflops']:5.0f} " + "  ".join(
                f"[{c}] {'/'.join(f'{v:.0f}' for v in vs)}" for c, vs in row["tflops"].items()), flush=True)
            rows.append(row)
            if save is not None:
                save(rows)
            del a, b, sa, sb
            torch.cuda.empty_cache()
    return rows


def print_row(r):
    head = f"{r['shape']:<14}{r['proj']:<5}{r['pass']:<6}{r['balance']:<9}"
    if "error" in r:
        print(head + " ERROR " + r["error"], flush=True)
        return
    extra = (f" cublas-loop {r['cublas_block_loop_tflops']:6.0f} ({r['vs_cublas_block_loop']:.2f}x)"
             if "cublas_block_loop_tflops" in r else f" (bf16 out {r['tflops_bf16_out']:6.0f})")
    print(head + f"{r['tflops']:7.0f} bf16 {r['bf16_tflops']:6.0f} ({r['vs_bf16']:.2f}x) fp8rw "
          f"{r['fp8_rowwise_tflops']:6.0f}{extra} err {r['rel_err']:.1e} ok {r['pass_ok']}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results/h200/grouped_gemm_128.json"))
    ap.add_argument("--quick", action="store_true", help="fewer timing repetitions")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset of shapes")
    ap.add_argument("--projs", default="up,down")
    ap.add_argument("--balances", default="balanced,skewed")
    ap.add_argument("--sweep", default=None, help="A/B of tile fields instead of the table: ';'-separated "
                    "configurations, each ','-separated field=value on sm90_mx128_tile_config, e.g. "
                    "'chain=2;chain=4;chain=4,stages=5' (cases: --shapes x --projs, balanced)")
    ap.add_argument("--cudagraph", action="store_true", help="time CUDA-graph replays (the kernels' GPU time; "
                    "without it each call is timed alone and small products are timed by their host work)")
    ap.add_argument("--rounds", type=int, default=2, help="--sweep: timings per configuration, interleaved")
    ap.add_argument("--chain", type=int, default=None, help="override of the tile config's chain (stages per drain)")
    args = ap.parse_args()
    import triton
    B.CUDA_GRAPH = args.cudagraph
    global CONFIG
    if args.chain is not None:
        from mxmoe.kernels.sm90_tile_config import Sm90TileConfig
        CONFIG = Sm90TileConfig(chain=args.chain)
    if args.sweep is not None:
        cases = [(s, p) for s in args.shapes.split(",") for p in args.projs.split(",")]
        head = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    timing="do_bench_cudagraph" if args.cudagraph else "do_bench", rounds=args.rounds,
                    date=datetime.datetime.now(datetime.timezone.utc).isoformat())

        def save(rows):
            with open(args.out, "w") as f:
                json.dump(dict(head, sweep=rows), f, indent=1)
        run_sweep(cases, args.sweep.split(";"), args.quick, args.rounds, save)
        return
    gen = torch.Generator().manual_seed(0)
    rows = []
    result = dict(gpu=torch.cuda.get_device_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
                  tflops_formula="2*M*N*K/time", timing="triton.testing." + ("do_bench_cudagraph" if args.cudagraph else "do_bench") + " median",
                  quick=args.quick,
                  tile=f"sm90_mx128_tile_config (128x128x128, 4 stages, TMA-store epilogue), config {CONFIG or 'default'}",
                  rows=rows)
    cases = [(s, p, b) for s in args.shapes.split(",") for p in args.projs.split(",") for b in args.balances.split(",")]
    B.run_cases(args.out, result, cases,
                lambda shape, proj, balance: run_case(shape, proj, balance, args.quick, gen))


if __name__ == "__main__":
    main()
