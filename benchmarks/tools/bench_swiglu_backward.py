"""SwiGLU's backward and the up projection's dh quantization under ``mxfp8_128``: the unfused pair
(``layer.swiglu_backward`` writing BF16 dh ``[M, 2F]``, then ``quantize_dual_128`` of it) against the fused Gluon
kernel (``quantize_fused.swiglu_backward_quantize_128``, dh never written) and its tile variants, with h kept in
BF16 (``mxfp8_128``) and as MXFP8 (``mxfp8_128_lowmem``), beside a device copy of the fused kernel's bytes, at the
layer bench's small-expert shapes (the routed rows of 16384 tokens).

    python benchmarks/tools/bench_swiglu_backward.py [--out benchmarks/results/h200/swiglu_backward.json]

Bytes the fused kernel must move per dh element: da 1 (read: [M, F] BF16 for [M, 2F]), h 2 (BF16; MXFP8: 1 + 1/32),
both FP8 copies 2 + scales 2/32 (written); its ``copy_pct`` is the device-to-device copy of those bytes over the
kernel's time. Times: CUDA-graph replays (median of 5 x 20).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

# appended, not prepended: an older mxmoe first on PYTHONPATH stays the one imported
sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks import common as C  # noqa: E402
from benchmarks.tools.bench_combine_backward import graph_ms  # noqa: E402
from mxmoe import formats  # noqa: E402
from mxmoe.kernels import layer  # noqa: E402
from mxmoe.kernels import quantize as Q  # noqa: E402
from mxmoe.kernels import quantize_fused as QF  # noqa: E402
from mxmoe.kernels.quantize_launch import _launch_gluon  # noqa: E402
from mxmoe.kernels.quantize_tile_config import _GLUON_TILE_SWIGLU_BACKWARD  # noqa: E402

TILES = {"4 warps": dict(MB=4, BK=128, WM=1, WK=4, TM=4, RS=16),
         "8 warps, 1x8": dict(MB=4, BK=128, WM=1, WK=8, TM=4, RS=16),
         "16 warps, 1x16": dict(MB=4, BK=128, WM=1, WK=16, TM=4, RS=16)}


def fused_with_tile(da, h, h_scale, tile):
    """swiglu_backward_quantize_128's Gluon launch with another tile (the four outputs)."""
    M, F = da.shape
    dev = da.device
    rows, srow = (torch.empty(M, 2 * F, dtype=torch.uint8, device=dev),
                  torch.empty(M, 2 * F // 32, dtype=torch.uint8, device=dev))
    qc, sc = torch.empty(2 * F, M, dtype=torch.uint8, device=dev), torch.empty(2 * F, M // 32, dtype=torch.uint8,
                                                                                  device=dev)
    fp8 = h_scale is not None
    hq = h.view(torch.uint8) if fp8 else h
    _launch_gluon(da[None], qc, sc, rows, srow, M, 2 * F, 1, row=1, col=1, layout=0, group=128, shape=(1, M, F),
                  tile=tile, fused=dict(IN_MODE=4, h_ptr=hq, hs_ptr=h_scale.view(torch.uint8) if fp8 else hq,
                                        H_FP8=fp8))
    return rows, srow, qc, sc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", type=int, default=C.LAYER_TOKENS)
    ap.add_argument("--shapes", default="qwen3-30b-a3b,dsv3-16b")
    args = ap.parse_args()
    rows = []
    for name in args.shapes.split(","):
        s = C.SHAPES[name]
        F, k = s.ffn, s.top_k
        M = -(-args.tokens * k // 128) * 128 + 128 * s.experts // 2  # routed rows, each group padded to 128
        g = torch.Generator(device="cuda").manual_seed(0)
        h = (torch.randn(M, 2 * F, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
        da = torch.randn(M, F, device="cuda", generator=g).to(torch.bfloat16)
        hq = formats.quantize(h, -1, "rceil", 128)  # h as the lowmem recipe keeps it
        for h_kind, (hd, hs) in (("bf16 h", (h, None)), ("MXFP8 h", (hq.data, hq.scale))):
            per_elem = 1 + (2 if hs is None else 1 + 1 / 32) + 2 + 2 / 32
            nbytes = int(M * 2 * F * per_elem) // 2
            src, dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda"), torch.empty(nbytes, dtype=torch.uint8,
                                                                                          device="cuda")
            copy = graph_ms(lambda: dst.copy_(src))  # reads and writes half the bytes each: the same traffic
            dh = layer.swiglu_backward(da, hd, hs)
            cases = {"unfused: swiglu_backward": lambda: layer.swiglu_backward(da, hd, hs),
                     "unfused: quantize_dual_128 of dh": lambda: Q.quantize_dual_128(dh),
                     "fused": lambda: QF.swiglu_backward_quantize_128(da, hd, hs)}
            want = QF.swiglu_backward_quantize_128(da, hd, hs)
            for a, b in zip(want, Q.quantize_dual_128(dh)):  # the fused bytes are the unfused pair's
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{name} {h_kind}: fused != unfused"
            for tname, tile in TILES.items():
                try:
                    got = fused_with_tile(da, hd, hs, tile)
                except Exception as e:  # a tile this kernel cannot take (layout or register limits)
                    print(f"{name:14s} {h_kind:8s} fused, {tname}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                assert all(torch.equal(a.view(torch.uint8), b) for a, b in zip(want, got)), tname
                cases[f"fused, {tname}"] = lambda tile=tile: fused_with_tile(da, hd, hs, tile)
            for case, fn in cases.items():
                ms = graph_ms(fn)
                row = {"shape": name, "h": h_kind, "case": case, "rows": M, "ffn": F, "ms": ms,
                       "copy_pct": 100 * copy / ms if case.startswith("fused") else None,
                       "tile": (_GLUON_TILE_SWIGLU_BACKWARD if case == "fused" else TILES.get(case[7:]))}
                rows.append(row)
                print(f"{name:14s} {h_kind:8s} {case:34s} {ms:7.3f} ms" + (
                    f"  {row['copy_pct']:5.1f}% of copy" if row["copy_pct"] else ""), flush=True)
            del dh
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"header": C.header("swiglu_backward", False), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
