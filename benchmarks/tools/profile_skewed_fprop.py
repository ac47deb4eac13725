"""One M-grouped product at the layer suite's own routing, balanced and skewed, for Nsight Compute: why does the
up projection's fprop take longer under the layer's skewed routing when the two routings give the same number of
128-row tiles?

The layer (``mxmoe.MoE``, ``mxfp8_128``) is built as ``bench_layer.run_case`` builds it (same seed, same tokens,
``bench_layer.skew_router``); its router gives the group ends ``offs``; the expert product's forward is then run on
random BF16 rows of the permuted buffer's size with those ends (the fprop kernel plus its operand quantizers). It
prints each routing's rows per expert (min / mean / max), 128-row tiles and the product's median time (CUDA events,
10 runs after 3), then runs each product once more for a profiler to catch:

    ncu -k regex:sm90_mxfp8_grouped_gemm --launch-skip 26 --launch-count 2 --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section SchedulerStats \\
        --section WarpStateStats --csv --page details \\
        python3 benchmarks/tools/profile_skewed_fprop.py --shape qwen3-30b-a3b --proj up

(26 = 2 routings x 13 timed runs; the two profiled launches are balanced, then skewed.)
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import mxmoe  # noqa: E402
from benchmarks import common as C  # noqa: E402
from benchmarks.bench_layer import skew_router, step_time  # noqa: E402
from mxmoe.ops.linear import grouped_linear  # noqa: E402


def layer_offsets(name: str, skew: bool, tokens: int, dev: str) -> tuple[torch.Tensor, int]:
    """The group ends and the buffer rows M of the layer suite's routing at ``name`` (bench_layer's seed and x)."""
    shape = C.SHAPES[name]
    torch.manual_seed(0)
    x = torch.randn(tokens, shape.hidden, device=dev, dtype=torch.bfloat16)
    with torch.device(dev):
        moe = mxmoe.MoE(shape.hidden, shape.ffn, shape.experts, shape.top_k, recipe="mxfp8_128")
    skew_router(moe, x, skew)
    with torch.no_grad():
        r = moe.route(x)
    return r.offs, r.rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=list(C.SHAPES))
    ap.add_argument("--proj", default="up", choices=("up", "down"))
    ap.add_argument("--tokens", type=int, default=C.LAYER_TOKENS)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    dev = args.device
    shape = C.SHAPES[args.shape]
    N, K = shape.proj(args.proj)
    g = torch.Generator(device=dev).manual_seed(1)
    w = torch.randn(shape.experts, N, K, device=dev, generator=g) * K ** -0.5
    cases = []
    for bal in ("balanced", "skewed"):
        offs, M = layer_offsets(args.shape, bal == "skewed", args.tokens, dev)
        rows = torch.diff(offs, prepend=offs.new_zeros(1)).long()
        x = torch.randn(M, K, device=dev, generator=g).bfloat16()
        tiles = int(((rows + 127) // 128).sum())
        cases.append((bal, x, offs))
        with torch.no_grad():  # bench_layer's timing: 3 warm-up runs, then the median of 10
            ms = step_time(lambda: grouped_linear(x, w, offs, "mxfp8_128", validate=False), 10)
        print(f"{args.shape} {args.proj} {bal:8s} rows/expert min {int(rows.min())} mean {float(rows.float().mean()):.0f} "
              f"max {int(rows.max())}  empty {int((rows == 0).sum())}  128-row tiles {tiles}  offs[-1] {int(offs[-1])} "
              f"of M {M}  product + quantizers {ms:.3f} ms", flush=True)
    for bal, x, offs in cases:  # the profiled launches
        with torch.no_grad():
            grouped_linear(x, w, offs, "mxfp8_128", validate=False)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
