"""Grouped GEMM suite: our Hopper MXFP8 grouped products against BF16, FP8 rowwise and cuBLAS block-scaled ones.

    python -m benchmarks gemm [--quick] [--out benchmarks/results/<gpu>/gemm.json] [--recipes mxfp8_128,mxfp8]

Shapes: DESIGN §5 (``benchmarks.common.SHAPES``), up (N = 2 x FFN, K = hidden) and down (N = hidden, K = FFN)
projections, balanced and skewed (Zipf-like, some experts empty) token counts. Passes:

    fprop  y[M, N]  = x[M, K] @ W[e]^T       M-grouped, BF16 out
    dgrad  dx[M, K] = dy[M, N] @ W[e]        M-grouped on W^T [E, K, N]
    wgrad  dW[e]    = dy[:, g_e]^T x[g_e]    K-grouped, FP32 out

Recipes (rows' ``recipe``):

- ``mxfp8_128`` (default): ``sm90_mx128_m_grouped_gemm`` / ``sm90_mx128_k_grouped_gemm``, scales shared in 1x128
  groups (activations, gradients; along tokens for wgrad) and 128x128 tiles (weights); token counts in
  multiples of 128. Peers: ``bf16_tflops`` (``torch._grouped_mm`` on BF16 copies), ``fp8_rowwise_tflops``
  (``torch._scaled_grouped_mm``, rowwise scales), ``cublas_block_loop_tflops`` (fprop/dgrad: a per-expert
  loop of cuBLAS block-scaled ``torch._scaled_mm``, 1x128 x 128x128 FP32 scales, in the same CUDA graph).
- ``mxfp8`` (exact 1x32; ``--recipes mxfp8_128,mxfp8``): ``sm90_mxfp8_m_grouped_gemm`` with 1x32 and 32x32
  weights (``weights``), ``sm90_mxfp8_k_grouped_gemm``; ``bf16x_tflops`` the expansion route (dequantize to
  BF16, then ``torch._grouped_mm``), the Hopper default of that recipe; token counts in multiples of 32.

Timing (quantization excluded everywhere): CUDA-graph replays by default (``do_bench_cudagraph``: the kernels'
GPU time; ``--no-graph``: ``do_bench``, each call alone, so small products are timed by their host work).
TFLOP/s = 2 M N K / time. ``rel_err``: ||ours - ref|| / ||ref|| on sampled rows, ref = FP64 product of the
dequantized operands (FP32 output for mxfp8_128, BF16 for mxfp8 fprop/dgrad).
"""

from __future__ import annotations

import math

import torch

from benchmarks import common as C

SUITE = "gemm"
GRAPH = True  # set from --no-graph


def bench(fn, quick: bool) -> float:
    return C.bench_ms(fn, quick, graph=GRAPH)


def _deq(data, scale, rows=None):
    from mxmoe.formats import MXTensor

    if rows is not None:
        data, scale = data[rows], scale[rows]
    return MXTensor(data, scale, axis=data.dim() - 1).dequantize(torch.float64)


def m_grouped_rel_err(out, a, sa, b, sb, counts, gen, n_sample=256) -> float:
    """Error of an M-grouped output on a sample of rows (reference in FP64)."""
    rows = torch.randperm(sum(counts), generator=gen)[:n_sample].sort().values
    experts = torch.searchsorted(torch.tensor(counts).cumsum(0), rows, right=True)
    num = den = 0.0
    for e in experts.unique().tolist():
        r = rows[experts == e].to(a.device)
        ref = _deq(a, sa, r) @ _deq(b[e], sb[e]).T
        num += (out[r].double() - ref).pow(2).sum().item()
        den += ref.pow(2).sum().item()
    return math.sqrt(num / den)


def k_grouped_rel_err(out, a, sa, b, sb, counts, gen, n_sample=64) -> float:
    """Error of a K-grouped (wgrad) output on a sample of output rows of every non-empty expert."""
    rows = torch.randperm(a.shape[0], generator=gen)[:n_sample].sort().values.to(a.device)
    ad, bd = _deq(a, sa, rows), _deq(b, sb)
    num = den = 0.0
    start = 0
    for e, n in enumerate(counts):
        if n:
            ref = ad[:, start:start + n] @ bd[:, start:start + n].T
            num += (out[e][rows].double() - ref).pow(2).sum().item()
            den += ref.pow(2).sum().item()
        start += n
    return math.sqrt(num / den)


def scale_1x128(rows, k, device="cuda"):
    """Per-32 E8M0 scales [rows, k/32] of 1x128 groups (each group's byte replicated 4 times)."""
    s = torch.randint(120, 135, (rows, k // 128), device=device, dtype=torch.uint8)
    return s.repeat_interleave(4, dim=1).contiguous().view(torch.float8_e8m0fnu)


def scale_tiles(E, n, k, tile, device="cuda"):
    """Per-32 E8M0 scales [E, n, k/32] of ``tile`` x ``tile`` blocks (tile 32 or 128); also the tile bytes."""
    t = torch.randint(120, 135, (E, n // tile, k // tile), device=device, dtype=torch.uint8)
    s = t.repeat_interleave(tile, dim=1).repeat_interleave(tile // 32, dim=2).contiguous()
    return s.view(torch.float8_e8m0fnu), t


def cublas_block_loop(a, sa_bytes, b, tiles, counts):
    """A per-expert loop of cuBLAS block-scaled ``torch._scaled_mm`` (BF16 out), each expert's scales prepared
    beforehand: scale_a [M_e, K/128] outer-dim-major, scale_b the [K/128, N/128] view of [N/128, K/128]."""
    from mxmoe.formats import e8m0_to_float

    jobs, start = [], 0
    for e, n in enumerate(counts):
        if n:
            s_a = e8m0_to_float(sa_bytes[start:start + n, ::4]).t().contiguous().t()
            jobs.append((a[start:start + n], b[e].t(), s_a, e8m0_to_float(tiles[e]).contiguous().t()))
        start += n

    def run():
        return [torch._scaled_mm(x, w, scale_a=s1, scale_b=s2, out_dtype=torch.bfloat16) for x, w, s1, s2 in jobs]

    run()
    torch.cuda.synchronize()
    if GRAPH:  # bench captures the loop in its own graph
        return run, "cuda graph"
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        keep = run()  # noqa: F841 (the graph's outputs stay allocated)
    return g.replay, "cuda graph"


def _peers_m(a, b, offs, M, n_out, E, quick):
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
    ms_bf16 = bench(lambda: torch._grouped_mm(a16, b16.transpose(-2, -1), offs=offs), quick)
    del a16, b16
    rs, cs = torch.rand(M, device="cuda") + 0.5, torch.rand(E, n_out, device="cuda") + 0.5
    ms_fp8 = bench(lambda: torch._scaled_grouped_mm(a, b.transpose(-2, -1), rs, cs, offs=offs,
                                                    out_dtype=torch.bfloat16), quick)
    return ms_bf16, ms_fp8


def _peers_k(a, b, offs, E, N, K, quick, row):
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
    ms_bf16 = bench(lambda: torch._grouped_mm(a16, b16.transpose(0, 1), offs=offs), quick)
    del a16, b16
    ra, rb = torch.rand(E * N, device="cuda") + 0.5, torch.rand(E * K, device="cuda") + 0.5
    try:
        ms_fp8 = bench(lambda: torch._scaled_grouped_mm(a, b.transpose(0, 1), ra, rb, offs=offs,
                                                        out_dtype=torch.bfloat16), quick)
    except Exception as exc:  # noqa: BLE001
        ms_fp8 = float("nan")
        row["fp8_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return ms_bf16, ms_fp8


def case_mx128(shape, proj, balance, quick, gen) -> list[dict]:
    """Rows of recipe mxfp8_128: fprop, dgrad, wgrad of one (shape, projection, balance)."""
    from mxmoe.kernels.sm90_gemm_promote128 import sm90_mx128_k_grouped_gemm, sm90_mx128_m_grouped_gemm

    s = C.SHAPES[shape]
    E, M, (N, K) = s.experts, s.rows, s.proj(proj)
    counts = C.token_counts(M, E, balance, gen, unit=128)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    tfl = lambda ms: 2.0 * M * N * K / (ms * 1e-3) / 1e12  # noqa: E731
    base = dict(shape=shape, proj=proj, balance=balance, recipe="mxfp8_128", weights="128x128", E=E, M=M, N=N, K=K,
                empty_experts=sum(c == 0 for c in counts))
    rows = []
    for pas in ("fprop", "dgrad"):
        n_out, k_red = (N, K) if pas == "fprop" else (K, N)
        row = dict(base, **{"pass": pas})
        try:
            a, sa, b = C.rand_fp8(M, k_red), scale_1x128(M, k_red), C.rand_fp8(E, n_out, k_red)
            sb, tiles = scale_tiles(E, n_out, k_red, 128)
            ms_bf16, ms_fp8 = _peers_m(a, b, offs, M, n_out, E, quick)
            try:
                loop, how = cublas_block_loop(a, sa.view(torch.uint8), b, tiles, counts)
                ms_loop = bench(loop, quick)
                del loop
            except Exception as exc:  # noqa: BLE001
                ms_loop, how = float("nan"), "failed"
                row["cublas_error"] = f"{type(exc).__name__}: {exc}"[:300]
            out32 = sm90_mx128_m_grouped_gemm(a, sa, b, sb, offs, torch.float32)
            row["rel_err"] = m_grouped_rel_err(out32, a, sa, b, sb, counts, gen)
            del out32
            fn = lambda: sm90_mx128_m_grouped_gemm(a, sa, b, sb, offs, torch.bfloat16)  # noqa: E731
            o1, o2 = fn(), fn()
            row["bitwise_rerun"] = bool(torch.equal(o1[:M].view(torch.int16), o2[:M].view(torch.int16)))
            del o1, o2
            ms = bench(fn, quick)
            row.update(ms=ms, tflops=tfl(ms), bf16_tflops=tfl(ms_bf16), fp8_rowwise_tflops=tfl(ms_fp8),
                       cublas_block_loop_tflops=tfl(ms_loop), cublas_block_loop_mode=how)
            row["vs_bf16"] = row["tflops"] / row["bf16_tflops"]
            row["vs_cublas_block_loop"] = row["tflops"] / row["cublas_block_loop_tflops"]
            row["pass_ok"] = bool(row["rel_err"] <= 5e-4 and row["bitwise_rerun"])
            del a, b, sa, sb
        except Exception as exc:  # noqa: BLE001  (one failing case must not hide the others)
            row["error"] = f"{type(exc).__name__}: {exc}"[:400]
        rows.append(row)
        torch.cuda.empty_cache()
    row = dict(base, **{"pass": "wgrad"})
    try:
        a, sa = C.rand_fp8(N, M), scale_1x128(N, M)  # dy^T, 128x1 groups along tokens
        b, sb = C.rand_fp8(K, M), scale_1x128(K, M)  # x^T
        ms_bf16, ms_fp8 = _peers_k(a, b, offs, E, N, K, quick, row)
        fn = lambda: sm90_mx128_k_grouped_gemm(a, sa, b, sb, offs, torch.float32, check_offsets=False)  # noqa: E731
        o1, o2 = fn(), fn()
        row["bitwise_rerun"] = bool(torch.equal(o1.view(torch.int32), o2.view(torch.int32)))
        row["rel_err"] = k_grouped_rel_err(o1, a, sa, b, sb, counts, gen)
        row["empty_experts_zero"] = bool(all((o1[e] == 0).all().item() for e, c in enumerate(counts) if c == 0))
        del o1, o2
        ms = bench(fn, quick)
        row.update(ms=ms, tflops=tfl(ms), bf16_tflops=tfl(ms_bf16), fp8_rowwise_tflops=tfl(ms_fp8))
        row["vs_bf16"] = row["tflops"] / row["bf16_tflops"]
        row["pass_ok"] = bool(row["rel_err"] <= 5e-4 and row["bitwise_rerun"] and row["empty_experts_zero"])
        del a, b, sa, sb
    except Exception as exc:  # noqa: BLE001
        row["error"] = f"{type(exc).__name__}: {exc}"[:400]
    rows.append(row)
    torch.cuda.empty_cache()
    return rows


def case_mx32(shape, proj, balance, quick, gen) -> list[dict]:
    """Rows of recipe mxfp8 (exact 1x32): fprop and dgrad with 1x32 and 32x32 weights, wgrad; each beside the
    expansion route (``bf16x``)."""
    from mxmoe.kernels.dequantize import dequantize_bf16
    from mxmoe.kernels.sm90_gemm_promote32 import sm90_mxfp8_k_grouped_gemm, sm90_mxfp8_m_grouped_gemm

    s = C.SHAPES[shape]
    E, M, (N, K) = s.experts, s.rows, s.proj(proj)
    counts = C.token_counts(M, E, balance, gen, unit=32)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    tfl = lambda ms: 2.0 * M * N * K / (ms * 1e-3) / 1e12  # noqa: E731
    base = dict(shape=shape, proj=proj, balance=balance, recipe="mxfp8", E=E, M=M, N=N, K=K,
                empty_experts=sum(c == 0 for c in counts))
    rows = []

    def timed(row, fn, fx, err, ms_bf16, ms_fp8, bound):
        out = fn()
        row["rel_err"] = err(out)
        del out
        ms = bench(fn, quick)
        row.update(ms=ms, tflops=tfl(ms), bf16_tflops=tfl(ms_bf16), fp8_rowwise_tflops=tfl(ms_fp8))
        row["vs_bf16"] = row["tflops"] / row["bf16_tflops"]
        row["bf16x_tflops"] = tfl(bench(fx, quick))
        row["bf16x_vs_bf16"] = row["bf16x_tflops"] / row["bf16_tflops"]
        row["pass_ok"] = bool(row["rel_err"] <= bound)

    for pas in ("fprop", "dgrad"):
        n_out, k_red = (N, K) if pas == "fprop" else (K, N)
        a, sa, b = C.rand_fp8(M, k_red), C.rand_scale(M, k_red // 32), C.rand_fp8(E, n_out, k_red)
        ms_bf16, ms_fp8 = _peers_m(a, b, offs, M, n_out, E, quick)
        for wb in (1, 32):
            sb = scale_tiles(E, n_out, k_red, 32)[0] if wb == 32 else C.rand_scale(E, n_out, k_red // 32)
            row = dict(base, **{"pass": pas, "weights": "1x32" if wb == 1 else "32x32"})
            try:
                timed(row, lambda: sm90_mxfp8_m_grouped_gemm(a, sa, b, sb, offs, weight_block=wb),
                      lambda: torch._grouped_mm(dequantize_bf16(a, sa), dequantize_bf16(b, sb).mT, offs=offs),
                      lambda out: m_grouped_rel_err(out, a, sa, b, sb, counts, gen), ms_bf16, ms_fp8, 4e-3)
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {exc}"[:400]
            rows.append(row)
        del a, b, sa
        torch.cuda.empty_cache()
    row = dict(base, **{"pass": "wgrad", "weights": "1x32"})
    try:
        a, sa, b, sb = C.rand_fp8(N, M), C.rand_scale(N, M // 32), C.rand_fp8(K, M), C.rand_scale(K, M // 32)
        ms_bf16, ms_fp8 = _peers_k(a, b, offs, E, N, K, quick, row)
        timed(row, lambda: sm90_mxfp8_k_grouped_gemm(a, sa, b, sb, offs, check_offsets=False),
              lambda: torch._grouped_mm(dequantize_bf16(a, sa), dequantize_bf16(b, sb).mT, offs=offs),
              lambda out: k_grouped_rel_err(out, a, sa, b, sb, counts, gen), ms_bf16, ms_fp8, 1e-3)
        del a, b, sa, sb
    except Exception as exc:  # noqa: BLE001
        row["error"] = f"{type(exc).__name__}: {exc}"[:400]
    rows.append(row)
    torch.cuda.empty_cache()
    return rows


CASES = {"mxfp8_128": case_mx128, "mxfp8": case_mx32}


def print_row(r: dict) -> None:
    head = f"{r['shape']:<14}{r['proj']:<5}{r['pass']:<6}{r['balance']:<9}{r['recipe']:<10}{r.get('weights', ''):<8}"
    if "error" in r:
        print(head + " ERROR " + r["error"], flush=True)
        return
    peers = "".join(f" {k[:-7]} {r[k]:6.0f}" for k in ("bf16_tflops", "fp8_rowwise_tflops",
                                                        "cublas_block_loop_tflops", "bf16x_tflops") if k in r)
    print(head + f"{r['tflops']:7.0f} TFLOP/s ({r['vs_bf16']:.2f}x bf16){peers} err {r['rel_err']:.1e}", flush=True)


def build_parser():
    ap = C.parser(SUITE, __doc__)
    ap.add_argument("--shapes", default=None, help="comma-separated names of benchmarks.common.SHAPES (default all)")
    ap.add_argument("--projs", default="up,down")
    ap.add_argument("--balances", default=None, help="default balanced,skewed (--quick: balanced)")
    ap.add_argument("--recipes", default="mxfp8_128", help="mxfp8_128 and/or mxfp8 (exact 1x32), comma-separated")
    ap.add_argument("--no-graph", action="store_true", help="time with do_bench instead of CUDA-graph replays")
    return ap


def main(argv: list[str] | None = None) -> None:
    global GRAPH
    args = build_parser().parse_args(argv)
    recipes = args.recipes.split(",")
    if any(r not in CASES for r in recipes):
        raise SystemExit(f"--recipes: choose from {', '.join(CASES)}, got {args.recipes}")
    shapes = C.shape_list(args.shapes, args.quick)
    balances = (args.balances or ("balanced" if args.quick else "balanced,skewed")).split(",")
    C.require_cuda(SUITE)
    GRAPH = not args.no_graph
    out = args.out or C.default_out(SUITE)
    head = C.header(SUITE, args.quick, timing="triton.testing." + ("do_bench_cudagraph" if GRAPH else "do_bench")
                    + " median", tflops_formula="2*M*N*K/time", quantization="excluded")
    gen = torch.Generator().manual_seed(0)
    rows: list[dict] = []
    for shape in shapes:
        for proj in args.projs.split(","):
            for bal in balances:
                for r in recipes:
                    for row in CASES[r](shape, proj, bal, args.quick, gen):
                        print_row(row)
                        rows.append(row)
                    C.write_result(out, head, rows)
    print(f"wrote {len(rows)} rows to {out}")


if __name__ == "__main__":
    main()
