"""SwiGLU + 1x128 / 128x1 quantization (``swiglu_quantize_128`` without save_h): launch variants of the two
Gluon kernels on one H200, each checked byte for byte against the default route, timed with do_bench
in the same run, % of a device copy of the same bytes. Session 15's question: is the fused kernel
(33-35% of copy with one 16-warp CTA per SM, register-fed or TMA-fed) bound by memory latency or by
one CTA's barriers? (Session 15 ran it on bench_quantize.wide_randn rows, where IEEE division took its slow
path; it now times N(0, 1) h: NOTES_quantize.md, session 16.) Variants: warps per CTA, ``maxnreg`` (two 8-warp CTAs per SM at 128 registers),
TMA ring depth.

    PYTHONPATH=. python benchmarks/bench_swiglu_variants.py --out out/swiglu_variants.json
"""
import argparse
import json
import time

import torch
import triton

from mxmoe.kernels import quantize_fused as QF, quantize_launch as QL
from bench_quantize import DEV, copy_tbps, nbytes

SHAPES = [(32768, 7168), (131072, 2048), (16384, 5120)]  # h [M, 2F]

# (name, kernel, tile, STAGES (TMA only), maxnreg)
VARIANTS = [
    ("regfed w16", "regfed", dict(MB=4, BK=128, WM=1, WK=16, TM=4, RS=16), None, None),
    ("regfed w8", "regfed", dict(MB=4, BK=128, WM=1, WK=8, TM=4, RS=16), None, None),
    ("regfed w8 maxnreg128", "regfed", dict(MB=4, BK=128, WM=1, WK=8, TM=4, RS=16), None, 128),
    ("tma w16 s2", "tma", dict(MB=4, BK=128, WM=1, WK=16, TM=4, RS=16), 2, None),
    ("tma w16 s1", "tma", dict(MB=4, BK=128, WM=1, WK=16, TM=4, RS=16), 1, None),
    ("tma w8 s1 maxnreg128", "tma", dict(MB=4, BK=128, WM=1, WK=8, TM=4, RS=16), 1, 128),
    ("tma w8 s1", "tma", dict(MB=4, BK=128, WM=1, WK=8, TM=4, RS=16), 1, None),
]


def run(h, kind, tile, stages, maxnreg):
    M, F = h.shape[0], h.shape[1] // 2
    dev = h.device
    rows = torch.empty(M, F, dtype=torch.uint8, device=dev)
    srow = torch.empty(M, F // 32, dtype=torch.uint8, device=dev)
    qc = torch.empty(F, M, dtype=torch.uint8, device=dev)
    sc = torch.empty(F, M // 32, dtype=torch.uint8, device=dev)
    extra = dict(maxnreg=maxnreg) if maxnreg else {}
    if kind == "regfed":
        fused = dict(IN_MODE=2, SAVE_H=False, qh_ptr=qc, sh_ptr=sc, **extra)
        fn = lambda: QL._launch_gluon(h[None], qc, sc, rows, srow, M, F, 1, row=1, col=1, layout=0, group=128,
                                      shape=(1, M, F), fused=fused, tile=tile)
    else:
        fn = lambda: QF._launch_swiglu_tma(h, qc, sc, rows, srow, 1, tile=tile, stages=stages, **extra)
    return fn, (rows, srow, qc, sc)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="swiglu_variants.json")
    args = ap.parse_args()
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "rows": []}
    for shape in SHAPES:
        h = torch.randn(shape, device=DEV).to(torch.bfloat16)  # activation-like h (NOTES_quantize.md, session 16)
        want = QF.swiglu_quantize_128(h)[:4]
        for name, kind, tile, stages, maxnreg in VARIANTS:
            try:
                fn, outs = run(h, kind, tile, stages, maxnreg)
                fn()
                torch.cuda.synchronize()
                same = all(torch.equal(o, w.view(torch.uint8)) for o, w in zip(outs, want))
                ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                b = nbytes(h, *outs)
                cp = copy_tbps(b)
                row = {"variant": name, "shape": "x".join(map(str, shape)), "ms": ms, "tbps": b / ms / 1e9,
                       "copy_tbps": cp, "ratio": b / ms / 1e9 / cp, "bit_exact": same}
            except Exception as e:  # a variant that does not compile or launch: say so, go on
                row = {"variant": name, "shape": "x".join(map(str, shape)), "error": repr(e)[:300]}
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
