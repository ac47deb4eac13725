"""The mx128 grouped GEMMs at pipeline variants, on one H200: wgrad (K-grouped) column-scale formats, wgmma
chain lengths and the staggered chains of the two consumer warpgroups (``Sm90TileConfig.stagger``); fprop
(M-grouped) at chain lengths and stagger.

Session 16's ncu profile put the wgrad consumer's gap to fprop in shared-memory load wavefronts: per 128-token
stage each consumer thread reads 32 FP32 column scales (16 LDS.64 per warp, two wavefronts each), about 60%
on top of the wgmma operand reads per unit of tensor work. BF16 holds every E8M0 value exactly (2^-127 and NaN
included), halves those bytes, and unpacks with one integer op per value. This benchmark times the same
product with each column-scale format (``_COLUMN_VEC``: 0 = FP32, else BF16 words per thread per load: 1, 2 or
4, see ``sm90_scales.column_scale_order``), wgmma chain and stagger, checks that every variant's output is
bitwise the first variant's (the arithmetic is the same), and writes JSON. ``--set columns`` is session 17's
first call (column-scale formats), ``--set stagger`` its second, ``--set early`` its fourth (BF16 column scales read before the wait).

Shapes: the gpu-throughput preset's layer (T = 32768 routed rows, dim 2048, F 4096, 8 experts, balanced): up
projection (N = 2F = 8192, K = 2048) and down (N = 2048, K = 4096); FP32 output (the layer's).

    PYTHONPATH=. python benchmarks/bench_mx128_variants.py --set stagger --out out/mx128_variants.json
"""
import argparse
import json
import time

import torch
import triton

from bench_grouped_gemm import rand_fp8
from bench_grouped_gemm_128 import scale_1x128, scale_128x128
from mxmoe.kernels import sm90_mxfp8_grouped_gemm as G
from mxmoe.kernels.sm90_tile_config import Sm90TileConfig

T, DIM, F, E = 32768, 2048, 4096, 8
# (column vec, chain, stagger) of the wgrad; (chain, stagger) of the fprop. The first of each is the library's
# configuration before session 17.
SETS = {
    "columns": (((0, 4, False), (0, 2, False), (1, 2, False), (2, 2, False), (4, 2, False), (4, 4, False)),
                ((4, False),)),
    "stagger": (((0, 4, False), (0, 4, True), (0, 2, True), (0, 8, True), (4, 2, True), (4, 4, True)),
                ((4, False), (4, True), (8, False), (8, True), (2, True))),
    # BF16 column scales read before each stage's wait (16 packed words live across it, not 32 FP32 values)
    "early": (((0, 4, False), (4, 2, False), (4, 2, True), (2, 2, False), (1, 2, False), (4, 4, False),
               (4, 4, True)),
              ((4, False),)),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="mx128_variants.json")
    ap.add_argument("--balance", choices=("balanced", "skewed"), default="balanced")
    ap.add_argument("--set", choices=tuple(SETS), default="stagger")
    args = ap.parse_args()
    dev = "cuda"
    if args.balance == "balanced":
        counts = torch.full((E,), T // E)
    else:  # half the tokens to one expert, one expert empty, the rest even (multiples of 128)
        rest = (T // 2) // (E - 2) // 128 * 128
        counts = torch.tensor([T - rest * (E - 2), 0] + [rest] * (E - 2))
    offs = torch.cumsum(counts, 0).to(torch.int32).to(dev)
    rows = []
    for proj, N, K in (("up", 2 * F, DIM), ("down", DIM, F)):
        flop = 2 * T * N * K
        a, sa = rand_fp8(N, T), scale_1x128(N, T)  # dy^T / dh^T: 128x1 groups along tokens
        b, sb = rand_fp8(K, T), scale_1x128(K, T)  # x^T / a^T
        ref = None
        wgrad_variants, fprop_variants = SETS[args.set]
        for vec, chain, stagger in wgrad_variants:
            G._COLUMN_VEC = vec
            cfg = Sm90TileConfig(chain=chain, stagger=stagger)

            def fn():
                return G.sm90_mx128_k_grouped_gemm(a, sa, b, sb, offs, torch.float32, check_offsets=False, config=cfg)

            out = fn()
            torch.cuda.synchronize()
            if ref is None:
                ref = out.clone()
            same = bool(torch.equal(out.view(torch.int32), ref.view(torch.int32)))
            ms = triton.testing.do_bench(fn, warmup=25, rep=200)
            rows.append({"proj": proj, "balance": args.balance, "pass": "wgrad", "out": "fp32", "column_vec": vec,
                         "chain": chain, "stagger": stagger, "ms": round(ms, 4), "tflops": round(flop / ms / 1e9, 1),
                         "bitwise_same": same})
            print(rows[-1], flush=True)
        G._COLUMN_VEC = 0
        x, sx, w = rand_fp8(T, K), scale_1x128(T, K), rand_fp8(E, N, K)
        sw, _ = scale_128x128(E, N, K)
        ref = None
        for chain, stagger in fprop_variants:
            cfg = Sm90TileConfig(chain=chain, stagger=stagger)

            def fn():
                return G.sm90_mx128_m_grouped_gemm(x, sx, w, sw, offs, config=cfg)

            out = fn()
            torch.cuda.synchronize()
            if ref is None:
                ref = out.clone()
            same = bool(torch.equal(out.view(torch.int16), ref.view(torch.int16)))
            ms = triton.testing.do_bench(fn, warmup=25, rep=200)
            rows.append({"proj": proj, "balance": args.balance, "pass": "fprop", "out": "bf16", "chain": chain,
                         "stagger": stagger, "ms": round(ms, 4), "tflops": round(flop / ms / 1e9, 1),
                         "bitwise_same": same})
            print(rows[-1], flush=True)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "shape": dict(T=T, dim=DIM, F=F, E=E), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    if not all(r["bitwise_same"] for r in rows):
        raise SystemExit("a variant's output differs from the first variant's")


if __name__ == "__main__":
    main()
