"""A/B on one H200: the mx128 wgrad reading its column scales four per load (``column_scale_order``, this
tree) against the kernel of commit 2524c40 (two per load), same process, same inputs; outputs bitwise equal.

    git show 2524c40:mxmoe/kernels/sm90_mxfp8_grouped_gemm.py > benchmarks/ab_old/sm90_gg_2524c40.py
    PYTHONPATH=. python benchmarks/ab_wgrad_column_quads.py --out out/ab.json
"""
import argparse
import importlib.util
import json
import os
import time

import torch
import triton

from bench_grouped_gemm import rand_fp8
from bench_grouped_gemm_128 import scale_1x128
from mxmoe.kernels import sm90_mxfp8_grouped_gemm as new

T, DIM, F, E = 32768, 2048, 4096, 8


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", default=os.path.join(os.path.dirname(__file__), "ab_old", "sm90_gg_2524c40.py"))
    ap.add_argument("--out", default="ab_wgrad_column_quads.json")
    ap.add_argument("--reps", type=int, default=3, help="alternating A/B repetitions")
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("sm90_gg_old", args.old)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    rows = []
    for balance in ("balanced", "skewed"):
        if balance == "balanced":
            counts = torch.full((E,), T // E)
        else:
            rest = (T // 2) // (E - 2) // 128 * 128
            counts = torch.tensor([T - rest * (E - 2), 0] + [rest] * (E - 2))
        offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
        for proj, N, K in (("up", 2 * F, DIM), ("down", DIM, F)):
            flop = 2 * T * N * K
            a, sa, b, sb = rand_fp8(N, T), scale_1x128(N, T), rand_fp8(K, T), scale_1x128(K, T)
            for od in (torch.float32, torch.bfloat16):
                fns = {m.__name__: (lambda m=m: m.sm90_mx128_k_grouped_gemm(a, sa, b, sb, offs, od, check_offsets=False))
                       for m in (old, new)}
                outs = {k: f() for k, f in fns.items()}
                torch.cuda.synchronize()
                o_old, o_new = outs.values()
                same = bool(torch.equal(o_old.view(torch.uint8), o_new.view(torch.uint8)))
                ms = {k: [] for k in fns}
                for _ in range(args.reps):
                    for k, f in fns.items():
                        ms[k].append(triton.testing.do_bench(f, warmup=25, rep=200))
                for k in fns:
                    m = sorted(ms[k])[len(ms[k]) // 2]
                    rows.append({"balance": balance, "proj": proj, "out": str(od).split(".")[1], "kernel": k,
                                 "ms": round(m, 4), "tflops": round(flop / m / 1e9, 1), "bitwise_same": same})
                    print(rows[-1], flush=True)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "shape": dict(T=T, dim=DIM, F=F, E=E), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    if not all(r["bitwise_same"] for r in rows):
        raise SystemExit("outputs differ")


if __name__ == "__main__":
    main()
