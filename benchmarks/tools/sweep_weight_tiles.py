"""Gluon tiles of the 128x128 both-ways weight quantizer (``quantize_128x128``) on FP32 weights, the master
weights the MoE layer and torchtitan quantize every forward: each tile that fits the kernel's layout rules,
checked byte for byte against the default tile, then timed (``triton.testing.do_bench``, against a device
copy of the same bytes).

    PYTHONPATH=. python benchmarks/tools/sweep_weight_tiles.py --out OUT.json        # GPU
    PYTHONPATH=. python benchmarks/tools/sweep_weight_tiles.py --offline             # CPU: registers, spills

The tile is 128x128 (MB 4, BK 128: one 128x128 scale tile per program); what varies is the warps and how the
column layout spreads a tile over them (WM, WK, TM, RS; ``quantize_tile_config._gluon_tile_fits``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

# appended, not prepended: an older mxmoe first on PYTHONPATH stays the one imported
sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mxmoe.kernels import quantize as Q, quantize_tile_config as QT  # noqa: E402

# FP32 [E, N, K]: Qwen3-30B-A3B's w13 and w2 as the layer holds them, one of torchtitan Llama 4's w1 / w3
SHAPES = [(128, 1536, 2048), (128, 2048, 768), (16, 8192, 5120)]


# timed on the GPU (the default first): one or two of each warp count and layout family, none spilling offline
SHORTLIST = [(1, 8, 4, 16), (2, 4, 2, 32), (1, 16, 4, 16), (1, 16, 4, 32), (2, 8, 2, 32), (1, 4, 4, 16)]


def candidates(every: bool = False) -> list[dict]:
    """The default tile, then the shortlist (``every``: each fitting tile over 4-16 warps) with MB 4, BK 128."""
    default = dict(QT._GLUON_TILES[("dual", 4)])
    out = [default]
    grid = itertools.product((1, 2), (2, 4, 8, 16), (1, 2, 4, 8), (16, 32)) if every else SHORTLIST
    for wm, wk, tm, rs in grid:
        g = dict(MB=4, BK=128, WM=wm, WK=wk, TM=tm, RS=rs)
        if 4 <= wm * wk <= 16 and QT._gluon_tile_fits(**g) and g != default:
            out.append(g)
    return out


def name(g: dict) -> str:
    return f"w{g['WM'] * g['WK']} WM{g['WM']} WK{g['WK']} TM{g['TM']} RS{g['RS']}"


def with_tile(g: dict, fn):
    """fn() with the FP32 dual tile replaced by g."""
    old = QT._GLUON_TILES[("dual", 4)]
    QT._GLUON_TILES[("dual", 4)] = g
    try:
        return fn()
    finally:
        QT._GLUON_TILES[("dual", 4)] = old


def offline() -> None:
    """Compile each fitting tile for sm_90 on CPU tensors (``bench_quantize.py --offline-sm90``'s harness); print
    registers, spills and SASS size."""
    from benchmarks import bench_quantize

    bench_quantize.DEV = "cpu"
    bench_quantize.offline_sm90(lambda x, is_weight: [(name(g), None, lambda g=g: with_tile(g, lambda: Q.quantize_128x128(x.float())))
                                       for g in candidates(every=True)], [((2, 256, 256), True)], None)


def gpu(out_path: str | None) -> None:
    from triton.testing import do_bench

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for shape in SHAPES:
        w = torch.randn(shape, device="cuda", generator=gen) * 0.02
        want = [t.view(torch.uint8).clone() for t in Q.quantize_128x128(w)]
        moved = w.numel() * 4 + sum(t.numel() for t in want)  # FP32 read + both FP8 copies and scales written
        src = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        copy_ms = do_bench(lambda: dst.copy_(src), rep=100)  # the same bytes moved (half read, half written)
        for g in candidates():
            try:
                got = with_tile(g, lambda: Q.quantize_128x128(w))
            except Exception as e:  # noqa: BLE001 - a tile the compiler refuses is a result, not a crash
                rows.append(dict(shape=list(shape), tile=name(g), error=str(e)[:200]))
                continue
            same = all(torch.equal(a.view(torch.uint8), b) for a, b in zip(got, want))
            ms = with_tile(g, lambda: do_bench(lambda: Q.quantize_128x128(w), rep=100)) if same else None
            row = dict(shape=list(shape), tile=name(g), **g, same_bytes=same, ms=ms,
                       pct_copy=round(copy_ms / ms, 4) if ms else None, copy_ms=copy_ms)
            rows.append(row)
            print(f"{'x'.join(map(str, shape)):14s} {name(g):28s} same {same} "
                  f"{'' if ms is None else f'{ms * 1e3:8.1f} us {100 * copy_ms / ms:5.1f}% of copy'}", flush=True)
    if out_path:
        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                    commit=os.environ.get("MXMOE_COMMIT"), what=__doc__.split("\n\n")[0])
        with open(out_path, "w") as f:
            json.dump({"header": meta, "rows": rows}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--offline", action="store_true", help="CPU: compile each tile for sm_90, print registers")
    ap.add_argument("--out", default=None, help="JSON of the GPU sweep")
    args = ap.parse_args()
    if args.offline:
        offline()
    else:
        gpu(args.out)


if __name__ == "__main__":
    main()
