"""The M-grouped products' tile lookup: the vector group search (``Sm90TileConfig.vec_search``; the tile-config
heuristic's default for 33-128 experts) against the binary search of dependent loads, on the four M-grouped products
(fprop and dgrad of the up and down projections) of the layer bench's shapes, balanced and skewed, ``mxfp8_128``.

    python benchmarks/tools/bench_group_search.py [--shapes qwen3-30b-a3b,dsv3-16b,mixtral-8x7b]
        [--out benchmarks/results/<gpu>/group_search.json]

Why: over the gemm suite's rows (H200, 2026-12-04) the per-tile cost of these products grew with log2(E),
~0.16 us per binary-search step (SEARCH_STEPS dependent loads per tile in the producer and the consumers).
Each case is timed twice per variant, alternating, the best of each kept. Each row asserts that both searches give the same output bytes. Times: CUDA-graph replays (``common.bench_ms``).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

import torch

# appended, not prepended: an older mxmoe first on PYTHONPATH stays the one imported
sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks import common as C  # noqa: E402
from benchmarks.bench_gemm import scale_1x128, scale_tiles  # noqa: E402
from mxmoe.kernels.sm90_gemm_promote128 import sm90_mx128_m_grouped_gemm  # noqa: E402
from mxmoe.kernels.sm90_tile_config import sm90_mx128_tile_config  # noqa: E402


def rows_of(shape: str, balance: str, gen) -> list[dict]:
    s = C.SHAPES[shape]
    E, M = s.experts, s.rows
    counts = C.token_counts(M, E, balance, gen, unit=128)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    rows = []
    for proj in ("up", "down"):
        N, K = s.proj(proj)
        for pas in ("fprop", "dgrad"):
            n_out, k_red = (N, K) if pas == "fprop" else (K, N)
            a, sa, b = C.rand_fp8(M, k_red), scale_1x128(M, k_red), C.rand_fp8(E, n_out, k_red)
            sb, _ = scale_tiles(E, n_out, k_red, 128)
            cfg = sm90_mx128_tile_config(M, n_out, k_red, E)
            row = dict(shape=shape, balance=balance, proj=proj, **{"pass": pas}, E=E, M=M, N=n_out, K=k_red,
                       empty_experts=sum(c == 0 for c in counts))
            outs = {}
            for name, vec in (("binary", False), ("vector", True)) * 2:  # twice, alternating: the best of each
                fn = lambda c=replace(cfg, vec_search=vec): sm90_mx128_m_grouped_gemm(  # noqa: E731
                    a, sa, b, sb, offs, torch.bfloat16, config=c)
                outs[name] = fn()[:sum(counts)].view(torch.int16).clone()
                ms = C.bench_ms(fn, False, graph=True)
                row[f"{name}_ms"] = min(ms, row.get(f"{name}_ms", ms))
            row["same_bytes"] = bool(torch.equal(outs["binary"], outs["vector"]))
            row["speedup"] = row["binary_ms"] / row["vector_ms"]
            row["tflops_vector"] = 2.0 * M * n_out * k_red / (row["vector_ms"] * 1e-3) / 1e12
            print(f"{shape:<14}{balance:<9}{proj:<5}{pas:<6} binary {row['binary_ms']:.3f} ms  vector "
                  f"{row['vector_ms']:.3f} ms  ({row['speedup']:.3f}x, {row['tflops_vector']:.0f} TFLOP/s)  "
                  f"same bytes {row['same_bytes']}", flush=True)
            rows.append(row)
            del a, sa, b, sb, outs
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3-30b-a3b,dsv3-16b,mixtral-8x7b")
    ap.add_argument("--balances", default="balanced,skewed")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    head = C.header("group_search", False)
    gen = torch.Generator().manual_seed(0)
    rows, out = [], a.out or C.default_out("group_search")
    for shape in a.shapes.split(","):
        for balance in a.balances.split(","):
            rows += rows_of(shape, balance, gen)
            C.write_result(out, head, rows)  # after every case: a call cut short keeps what it measured
    print("wrote", out)
    if not all(r["same_bytes"] for r in rows):
        raise SystemExit("the two searches gave different outputs")


if __name__ == "__main__":
    main()
