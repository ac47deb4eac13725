"""The top-k combine's backward and the down projection's dy quantization under ``mxfp8_128``: the unfused pair
(``layer.combine_backward`` writing BF16 dyp, then ``quantize_dual_128`` of it) against the fused Gluon kernel
(``quantize_fused.combine_backward_quantize_128``, dyp never written) and its tile variants, beside a
device copy of the fused kernel's bytes, at the layer bench's small-expert shapes (16384 tokens).

    python benchmarks/tools/bench_combine_backward.py [--out benchmarks/results/h200/combine_backward.json]

Bytes the fused kernel must move per expert row element: yp 2 (read), dy 2 (a gathered read: each token row
is read top_k times, through L2), both FP8 copies 2 + scales 2/32 (written); its ``copy_pct`` is the
device-to-device copy of those bytes over the kernel's time. Times: CUDA-graph replays (median of 5 x 20).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

# appended, not prepended: an older mxmoe first on PYTHONPATH stays the one imported
sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks import common as C  # noqa: E402
from mxmoe.kernels import layer  # noqa: E402
from mxmoe.kernels import quantize as Q  # noqa: E402
from mxmoe.kernels import quantize_fused as QF  # noqa: E402
from mxmoe.kernels.quantize_launch import _launch_gluon  # noqa: E402
from mxmoe.moe import permute_plan  # noqa: E402
from mxmoe.ops.tokens import row_slots  # noqa: E402

TILES = {"8 warps (dual's tile)": dict(MB=4, BK=128, WM=1, WK=8, TM=4, RS=16),
         "4 warps (the default)": dict(MB=4, BK=128, WM=1, WK=4, TM=4, RS=16),
         "16 warps, 256 rows": dict(MB=8, BK=128, WM=2, WK=8, TM=4, RS=16)}


def graph_ms(fn) -> float:
    """Median ms of one call, from CUDA-graph replays of 20 calls (5 timings)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            fn()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 20)
    return statistics.median(times)


def fused_with_tile(dy, w, yp, slot, top_k, tile):
    """combine_backward_quantize_128's Gluon launch with another tile (outputs discarded)."""
    M, D = yp.shape
    rows, srow = torch.empty(M, D, dtype=torch.uint8, device=dy.device), torch.empty(M, D // 32, dtype=torch.uint8,
                                                                                        device=dy.device)
    qc, sc = torch.empty(D, M, dtype=torch.uint8, device=dy.device), torch.empty(D, M // 32, dtype=torch.uint8,
                                                                                  device=dy.device)
    dwp = torch.empty(D // tile["BK"], M, dtype=torch.float32, device=dy.device)
    _launch_gluon(dy[None], qc, sc, rows, srow, M, D, 1, row=1, col=1, layout=0, group=128, shape=(1, M, D),
                  tile=tile, fused=dict(IN_MODE=3, src_ptr=slot, T=dy.shape[0], w_ptr=w, yp_ptr=yp, dwp_ptr=dwp,
                                        TOP_K=top_k))
    return dwp.sum(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", type=int, default=C.LAYER_TOKENS)
    ap.add_argument("--shapes", default="qwen3-30b-a3b,dsv3-16b")
    args = ap.parse_args()
    rows = []
    for name in args.shapes.split(","):
        s = C.SHAPES[name]
        D, E, k, T = s.hidden, s.experts, s.top_k, args.tokens
        g = torch.Generator(device="cuda").manual_seed(0)
        experts = torch.stack([torch.randperm(E, generator=g, device="cuda")[:k] for _ in range(T)])
        slot_rows, offs, M, _ = permute_plan(experts, E, 128)
        slot = row_slots(slot_rows, M)
        dy = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        yp = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(T * k, device="cuda")
        nbytes = M * D * (2 + 2 + 2 + 2 / 32)
        src, dst = torch.empty(int(nbytes) // 2, dtype=torch.uint8, device="cuda"), torch.empty(
            int(nbytes) // 2, dtype=torch.uint8, device="cuda")
        copy = graph_ms(lambda: dst.copy_(src))  # reads and writes half the bytes each: the same traffic
        cases = {"unfused: combine_backward": lambda: layer.combine_backward(dy, w, yp, slot, k),
                 "unfused: quantize_dual_128 of dyp": lambda: Q.quantize_dual_128(yp),
                 "fused": lambda: QF.combine_backward_quantize_128(dy, w, yp, slot, k)}
        for tname, tile in TILES.items():
            cases[f"fused, {tname}"] = lambda tile=tile: fused_with_tile(dy, w, yp, slot, k, tile)
        got = QF.combine_backward_quantize_128(dy, w, yp, slot, k)
        for tname, tile in TILES.items():  # every variant computes the same row gradients
            assert torch.allclose(fused_with_tile(dy, w, yp, slot, k, tile), got[4], rtol=1e-4, atol=1e-3), tname
        for case, fn in cases.items():
            ms = graph_ms(fn)
            row = {"shape": name, "case": case, "rows": M, "dim": D, "top_k": k, "ms": ms,
                   "copy_pct": 100 * copy / ms if case.startswith("fused") else None}
            rows.append(row)
            print(f"{name:14s} {case:36s} {ms:7.3f} ms" + (f"  {row['copy_pct']:5.1f}% of copy" if row["copy_pct"]
                                                             else ""), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"header": C.header("combine_backward", False), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
