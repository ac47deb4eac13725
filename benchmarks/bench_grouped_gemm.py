"""Benchmark the Hopper MXFP8 grouped GEMMs against BF16 and FP8-rowwise grouped GEMMs, same run.

    python benchmarks/bench_grouped_gemm.py [--out benchmarks/results/h200/grouped_gemm.json] [--quick]

For every DESIGN §5 shape, both expert projections (up: N = 2 x FFN, K = hidden; down: N = hidden,
K = FFN), balanced and skewed (Zipf-like, some experts empty) token counts, and the three passes:

    fprop  y[M, N]  = x[M, K] @ W[e]^T          (ours: M-grouped, weight_block 1 and 32)
    dgrad  dx[M, K] = dy[M, N] @ W[e]           (ours: M-grouped on W^T [E, K, N], same weight variants)
    wgrad  dW[e]    = dy[:, g_e]^T @ x[g_e]     (ours: K-grouped, 1x32 both operands)

TFLOP/s = 2 * M * N * K / time (M = routed rows). Peers on the same shapes and operand bytes:
BF16 ``torch._grouped_mm`` and FP8 rowwise ``torch._scaled_grouped_mm`` (default accumulation).
``dense_tflops``: our kernel on one group of all M rows with one weight (fprop, balanced only).
``rel_err``: ||ours - ref|| / ||ref|| on a sample of output rows, ref = FP64 product of the
dequantized operands; ours is the BF16 output (fprop/dgrad, rounding floor ~1.7e-3) or FP32 (wgrad).
Timing: ``triton.testing.do_bench`` median after warm-up. Token counts are multiples of 32 (the
MoE layer pads groups to 32), as the wgrad kernel and the peers require.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mxmoe.formats import MXTensor  # noqa: E402
from mxmoe.kernels.dequantize import dequantize_bf16  # noqa: E402
from mxmoe.kernels.sm90_gemm_promote32 import (  # noqa: E402
    sm90_mxfp8_k_grouped_gemm,
    sm90_mxfp8_m_grouped_gemm,
)
from mxmoe.kernels.sm90_tile_config import Sm90TileConfig, sm90_tile_config  # noqa: E402

# tile fields set on the command line (--split, --block-k/m/n, --stages, --tma-store), on top of the heuristic
OVERRIDE: dict = {}

# name: (local experts E, routed rows M, hidden, expert FFN)
SHAPES = {
    "mixtral-8x7b": (8, 32768, 4096, 14336),
    "llama4-scout": (16, 16384, 5120, 8192),
    "dsv3-ep32": (8, 32768, 7168, 2048),
    "qwen3-30b-a3b": (128, 131072, 2048, 768),
}


def token_counts(M: int, E: int, balance: str, gen: torch.Generator, unit: int = 32) -> list[int]:
    """Rows per expert, multiples of ``unit`` summing to M. Skewed: Zipf(1.2) over a random expert order,
    with the last eighth of that order (at least one expert) empty."""
    units = M // unit
    if balance == "balanced":
        w = torch.ones(E, dtype=torch.float64)
    else:
        ranks = torch.randperm(E, generator=gen).double() + 1
        w = ranks ** -1.2
        n_empty = max(1, E // 8)
        w[torch.argsort(ranks)[-n_empty:]] = 0
    q = torch.floor(w / w.sum() * units).long()
    q[int(torch.argmax(w))] += units - int(q.sum())
    return [int(v) * unit for v in q]


def rand_fp8(*shape, device="cuda"):
    return torch.randn(*shape, device=device, dtype=torch.bfloat16).to(torch.float8_e4m3fn)


def rand_scale(*shape, device="cuda"):
    return torch.randint(120, 135, shape, device=device, dtype=torch.uint8).view(torch.float8_e8m0fnu)


def rand_scale_32x32(E, N, KB, device="cuda"):
    s = torch.randint(120, 135, (E, N // 32, KB), device=device, dtype=torch.uint8)
    return s.repeat_interleave(32, dim=1).contiguous().view(torch.float8_e8m0fnu)


CUDA_GRAPH = False  # set by --cudagraph: time replays of a CUDA graph of the call (GPU time, no host launch work)


def bench(fn, quick: bool) -> float:
    """Median ms of ``fn``: do_bench (each call timed alone, so a call whose host work outlasts its kernels
    is timed by its host work), or with CUDA_GRAPH do_bench_cudagraph (the kernels' own time)."""
    import triton
    if CUDA_GRAPH:
        return triton.testing.do_bench_cudagraph(fn, rep=30 if quick else 100, return_mode="median")
    return triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=30 if quick else 100, return_mode="median")


def deq(data, scale, rows=None):
    if rows is not None:
        data, scale = data[rows], scale[rows]
    return MXTensor(data, scale, axis=data.dim() - 1).dequantize(torch.float64)


def m_grouped_rel_err(out, a, sa, b, sb, counts, gen, n_sample=256):
    """Error of an M-grouped output on a sample of rows (reference in FP64)."""
    M = sum(counts)
    rows = torch.randperm(M, generator=gen)[:n_sample].sort().values
    ends = torch.tensor(counts).cumsum(0)
    experts = torch.searchsorted(ends, rows, right=True)
    num, den = 0.0, 0.0
    for e in experts.unique().tolist():
        r = rows[experts == e].to(a.device)
        ref = deq(a, sa, r) @ deq(b[e], sb[e]).T
        num += (out[r].double() - ref).pow(2).sum().item()
        den += ref.pow(2).sum().item()
    return math.sqrt(num / den)


def k_grouped_rel_err(out, a, sa, b, sb, counts, gen, n_sample=64):
    """Error of a K-grouped (wgrad) output on a sample of output rows of every non-empty expert."""
    N = a.shape[0]
    rows = torch.randperm(N, generator=gen)[:n_sample].sort().values.to(a.device)
    ad = deq(a, sa, rows)  # [n, T]
    bd = deq(b, sb)  # [K, T]
    num, den, start = 0.0, 0.0, 0
    for e, n in enumerate(counts):
        if n:
            ref = ad[:, start:start + n] @ bd[:, start:start + n].T
            num += (out[e][rows].double() - ref).pow(2).sum().item()
            den += ref.pow(2).sum().item()
        start += n
    del bd
    return math.sqrt(num / den)


def check_and_time(fn, rel_err, quick: bool) -> tuple[float, float]:
    """Run ``fn`` once, compare with the FP64 reference (``rel_err(out)``), then time it: (rel_err, ms)."""
    out = fn()
    torch.cuda.synchronize()
    err = rel_err(out)
    del out
    return err, bench(fn, quick)


def tile_for(m: int, n: int, k: int, num_groups: int, weight_block: int = 1, k_grouped: bool = False) -> Sm90TileConfig:
    """The tile a case runs with: the library's heuristic (sm90_tile_config), with OVERRIDE's fields on top."""
    return dataclasses.replace(sm90_tile_config(m, n, k, num_groups, k_grouped=k_grouped, weight_block=weight_block),
                               **OVERRIDE)


def tile_name(cfg: Sm90TileConfig) -> str:
    """BMxBNxBK/stages of the tile configuration a row ran with."""
    return f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}/s{cfg.stages}"


def run_case(shape, proj, balance, quick, gen):
    E, M, hidden, ffn = SHAPES[shape]
    N, K = (2 * ffn, hidden) if proj == "up" else (hidden, ffn)
    counts = token_counts(M, E, balance, gen)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    rows = []
    tfl = lambda ms: 2.0 * M * N * K / (ms * 1e-3) / 1e12  # noqa: E731
    base = dict(shape=shape, proj=proj, balance=balance, E=E, M=M, N=N, K=K, counts_max=max(counts),
                empty_experts=sum(c == 0 for c in counts))

    for pas in ("fprop", "dgrad"):
        # fprop: a = x [M, K], b = W [E, N, K]; dgrad: a = dy [M, N], b = W^T [E, K, N] (contraction last)
        n_out, k_red = (N, K) if pas == "fprop" else (K, N)
        a = rand_fp8(M, k_red)
        sa = rand_scale(M, k_red // 32)
        b = rand_fp8(E, n_out, k_red)
        a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
        ms_bf16 = bench(lambda: torch._grouped_mm(a16, b16.transpose(-2, -1), offs=offs), quick)
        row_scale = torch.rand(M, device="cuda") + 0.5
        col_scale = torch.rand(E, n_out, device="cuda") + 0.5
        ms_fp8 = bench(lambda: torch._scaled_grouped_mm(a, b.transpose(-2, -1), row_scale, col_scale, offs=offs,
                                                        out_dtype=torch.bfloat16), quick)
        del a16, b16
        for wb in (1, 32):
            sb = rand_scale_32x32(E, n_out, k_red // 32) if wb == 32 else rand_scale(E, n_out, k_red // 32)
            row = dict(base, **{"pass": pas, "weights": "1x32" if wb == 1 else "32x32"})
            cfg = tile_for(M, n_out, k_red, E, weight_block=wb)
            row["tile"] = tile_name(cfg)
            try:
                fn = lambda: sm90_mxfp8_m_grouped_gemm(a, sa, b, sb, offs, weight_block=wb, config=cfg)  # noqa: E731
                err = lambda out: m_grouped_rel_err(out, a, sa, b, sb, counts, gen)  # noqa: E731
                row["rel_err"], ms = check_and_time(fn, err, quick)
                row.update(ms=ms, tflops=tfl(ms), bf16_tflops=tfl(ms_bf16), fp8_rowwise_tflops=tfl(ms_fp8))
                row["vs_bf16"] = row["tflops"] / row["bf16_tflops"]
                if pas == "fprop" and balance == "balanced":
                    # One dense GEMM of the same total size: all M rows against expert 0's weight.
                    one = torch.tensor([M], dtype=torch.int32, device="cuda")
                    ms_d = bench(lambda: sm90_mxfp8_m_grouped_gemm(a, sa, b[:1], sb[:1], one, weight_block=wb,
                                                                       config=cfg),
                                 quick)
                    row["dense_tflops"] = tfl(ms_d)
                    row["grouped_over_dense"] = ms_d / ms
                # the other Hopper route: exact expansion to BF16, then BF16 torch._grouped_mm
                fx = lambda: torch._grouped_mm(dequantize_bf16(a, sa), dequantize_bf16(b, sb).mT, offs=offs)  # noqa: E731
                row["bf16x_rel_err"], ms_x = check_and_time(fx, err, quick)
                row["bf16x_tflops"] = tfl(ms_x)
                row["bf16x_vs_bf16"] = row["bf16x_tflops"] / row["bf16_tflops"]
                row["pass_ok"] = bool(row["rel_err"] <= 4e-3)
            except Exception as exc:  # keep going: one failing case must not hide the others
                row["error"] = f"{type(exc).__name__}: {exc}"[:400]
            rows.append(row)
            print_row(row)
        del a, b, sa

    # wgrad: a = dy^T [N, T], b = x^T [K, T]; T = M tokens, quantized along T.
    a = rand_fp8(N, M)
    sa = rand_scale(N, M // 32)
    b = rand_fp8(K, M)
    sb = rand_scale(K, M // 32)
    row = dict(base, **{"pass": "wgrad", "weights": "1x32"})
    cfg = tile_for(N, K, M, E, k_grouped=True)
    row["tile"] = tile_name(cfg)
    try:
        a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
        ms_bf16 = bench(lambda: torch._grouped_mm(a16, b16.transpose(0, 1), offs=offs), quick)
        del a16, b16
        ra = torch.rand(E * N, device="cuda") + 0.5
        rb = torch.rand(E * K, device="cuda") + 0.5
        try:
            ms_fp8 = bench(lambda: torch._scaled_grouped_mm(a, b.transpose(0, 1), ra, rb, offs=offs,
                                                            out_dtype=torch.bfloat16), quick)
        except Exception as exc:
            ms_fp8 = float("nan")
            row["fp8_error"] = f"{type(exc).__name__}: {exc}"[:300]
        fn = lambda: sm90_mxfp8_k_grouped_gemm(a, sa, b, sb, offs, check_offsets=False, config=cfg)  # noqa: E731
        err = lambda out: k_grouped_rel_err(out, a, sa, b, sb, counts, gen)  # noqa: E731
        row["rel_err"], ms = check_and_time(fn, err, quick)
        row.update(ms=ms, tflops=tfl(ms), bf16_tflops=tfl(ms_bf16), fp8_rowwise_tflops=tfl(ms_fp8))
        row["vs_bf16"] = row["tflops"] / row["bf16_tflops"]
        fx = lambda: torch._grouped_mm(dequantize_bf16(a, sa), dequantize_bf16(b, sb).mT, offs=offs)  # noqa: E731
        row["bf16x_rel_err"], ms_x = check_and_time(fx, err, quick)
        row["bf16x_tflops"] = tfl(ms_x)
        row["bf16x_vs_bf16"] = row["bf16x_tflops"] / row["bf16_tflops"]
        row["pass_ok"] = bool(row["rel_err"] <= 1e-3)
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"[:400]
    rows.append(row)
    print_row(row)
    del a, b, sa, sb
    torch.cuda.empty_cache()
    return rows


HEADER = f"{'shape':<14}{'proj':<5}{'pass':<6}{'wts':<6}{'balance':<9}{'ours':>7}{'bf16':>7}{'fp8rw':>7}" \
         f"{'x bf16':>8}{'dense':>7}{'rel_err':>9}"


def print_row(r):
    if "error" in r:
        print(f"{r['shape']:<14}{r['proj']:<5}{r['pass']:<6}{r['weights']:<6}{r['balance']:<9} ERROR {r['error']}",
              flush=True)
        return
    dense = f"{r['dense_tflops']:7.0f}" if "dense_tflops" in r else " " * 7
    print(f"{r['shape']:<14}{r['proj']:<5}{r['pass']:<6}{r['weights']:<6}{r['balance']:<9}{r['tflops']:7.0f}"
          f"{r['bf16_tflops']:7.0f}{r['fp8_rowwise_tflops']:7.0f}{r['vs_bf16']:8.2f}{dense}{r['rel_err']:9.1e}"
          f"  bf16x {r.get('bf16x_tflops', float('nan')):6.0f} ({r.get('bf16x_vs_bf16', float('nan')):.2f}x,"
          f" err {r.get('bf16x_rel_err', float('nan')):.1e})", flush=True)


def run_cases(out: str, result: dict, cases, run) -> None:
    """``run(*case)`` for every case, its rows appended to ``result["rows"]``; the JSON is written to ``out``
    after every case, so a cut-short run still leaves its rows."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    for case in cases:
        result["rows"] += run(*case)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"wrote {len(result['rows'])} rows to {out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results/h200/grouped_gemm.json"))
    ap.add_argument("--quick", action="store_true", help="fewer timing repetitions")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset of shapes")
    ap.add_argument("--balances", default="balanced,skewed")
    ap.add_argument("--split", type=int, choices=(0, 1), default=None,
                    help="override: 1 = one partition per consumer warpgroup, 0 = one 8-warp consumer partition")
    ap.add_argument("--block-k", type=int, default=None,
                    help="override of the heuristic's contraction depth per shared-memory stage (multiple of 32; "
                         "the heuristic gives 32x32 256 x 2 stages, the rest 128 x 4; 256 needs --stages 2 or 3)")
    ap.add_argument("--stages", type=int, default=None, help="override of the heuristic's shared-memory ring depth")
    ap.add_argument("--block-m", type=int, default=None, help="override of the tile's rows (2 consumer warpgroups)")
    ap.add_argument("--block-n", type=int, default=None, help="override of the tile's columns (wgmma n)")
    ap.add_argument("--tma-store", type=int, choices=(0, 1), default=None,
                    help="override: 1 = TMA-store epilogue where it fits, 0 = masked stores from registers")
    args = ap.parse_args()
    global OVERRIDE
    OVERRIDE = {k: v for k, v in (("split_wg", None if args.split is None else bool(args.split)),
                                  ("block_k", args.block_k), ("stages", args.stages),
                                  ("block_m", args.block_m), ("block_n", args.block_n),
                                  ("tma_store", None if args.tma_store is None else bool(args.tma_store)))
                if v is not None}
    import triton
    gen = torch.Generator().manual_seed(0)
    print(HEADER, flush=True)
    rows = []
    result = dict(gpu=torch.cuda.get_device_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  torch=torch.__version__, triton=triton.__version__, tflops_formula="2*M*N*K/time",
                  timing="triton.testing.do_bench median", fp8_rowwise="torch._scaled_grouped_mm, use_fast_accum=False",
                  quick=args.quick, config=f"sm90_tile_config, overrides {OVERRIDE} (per row: tile)", rows=rows)
    cases = [(s, p, b) for s in args.shapes.split(",") for p in ("up", "down") for b in args.balances.split(",")]
    run_cases(args.out, result, cases, lambda shape, proj, balance: run_case(shape, proj, balance, args.quick, gen))


if __name__ == "__main__":
    main()
