"""Weight-gradient error of the wgrad quantization choices, against the FP64 product of the unquantized
operands (pure torch, CPU): what a 128x128 activation tile would cost in accuracy (issue 22/23, session 17).

Session 17 measured (``ablate_wgrad_128.py --mode uniform``) that the mx128 wgrad reaches fprop's rate
(1003-1040 TFLOP/s against 800-900) when its promotion is "a row scale times a tile scale", i.e. when one of its
two operands has one scale per 128x128 tile (128 tokens x 128 channels) instead of one per 128 tokens of each
channel. This script prices that in numerics: dW = dy^T x for one expert, operands quantized as

- ``bf16``: both operands rounded to BF16 (the bf16 recipe);
- ``1x32``: MXFP8, 32x1 along tokens (the ``mxfp8`` recipe);
- ``128x1``: 128x1 along tokens, both (``mxfp8_128`` today, DESIGN §9);
- ``x tile``: x in 128x128 tiles, dy 128x1 (the design that runs at fprop's rate);
- ``dy tile``: dy in 128x128 tiles, x 128x1 (the other choice; DeepSeek-V3 reports 128x128 activation
  gradients diverging);

(each as [whole-matrix relative error, worst x-channel column, worst dy-channel row]) on synthetic operands
with the spreads that matter: x ~ N(0, 1) times a per-channel gain (log-normal, sigma
``--channel-spread``: outlier channels, as after RMSNorm's learned gains), dy ~ N(0, 1) times a per-token gain
(log-normal, sigma ``--token-spread``: some tokens' gradients far larger than others') and optionally a
per-channel gain (``--dy-channel-spread``). Prints the relative
Frobenius error of each and writes JSON.

    PYTHONPATH=. python benchmarks/wgrad_tile_numerics.py --out benchmarks/results/cpu/wgrad_tile_numerics.json
"""
import argparse
import json
import time

import torch

from mxmoe.formats import quantize


def q(t, block):
    """t [rows, T] quantized along T (the contraction dim) with ``block`` and dequantized, in FP64."""
    return quantize(t, -1, block=block).dequantize(torch.float64)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--channel-spread", type=float, nargs="*", default=[0.0, 1.0, 2.0, 3.0, 4.0])
    ap.add_argument("--token-spread", type=float, default=1.0)
    ap.add_argument("--dy-channel-spread", type=float, default=0.0, help="log-normal sigma of dy's per-channel gain")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--out", default="wgrad_tile_numerics.json")
    args = ap.parse_args()
    T, K, N = args.tokens, args.dim, args.ffn
    rows = []
    for spread in args.channel_spread:
        for seed in range(args.seeds):
            g = torch.Generator().manual_seed(seed)
            xT = torch.randn(K, T, generator=g) * torch.exp(spread * torch.randn(K, 1, generator=g))  # x^T
            dyT = (torch.randn(N, T, generator=g) * torch.exp(args.token_spread * torch.randn(1, T, generator=g))
                   * torch.exp(args.dy_channel_spread * torch.randn(N, 1, generator=g)))
            xT, dyT = xT.bfloat16(), dyT.bfloat16()  # the layer's operands are BF16
            exact = dyT.double() @ xT.double().T

            def err(a, b):
                """(whole-matrix relative error, worst relative error of one x channel's column, of one dy
                channel's row): a small channel's gradient is lost in the Frobenius norm of the outliers'."""
                d = a @ b.T - exact
                cols = (d.norm(dim=0) / exact.norm(dim=0)).max().item()
                rows_ = (d.norm(dim=1) / exact.norm(dim=1)).max().item()
                return (d.norm() / exact.norm()).item(), cols, rows_

            res = {
                "bf16": err(dyT.double(), xT.double()),  # operands already BF16: the product's floor
                "1x32": err(q(dyT, 32), q(xT, 32)),
                "128x1": err(q(dyT, 128), q(xT, 128)),
                "x tile": err(q(dyT, 128), q(xT, (128, 128))),
                "dy tile": err(q(dyT, (128, 128)), q(xT, 128)),
            }
            rows.append({"channel_spread": spread, "token_spread": args.token_spread,
                         "dy_channel_spread": args.dy_channel_spread, "seed": seed,
                         **{k: [float(f"{e:.5e}") for e in v] for k, v in res.items()}})
            print(rows[-1], flush=True)
    out = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "torch": torch.__version__,
           "shape": dict(T=T, dim=K, ffn=N), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
