"""How often a 128-token x 128-channel tile of a real model's expert inputs could carry one scale with no value
changed (session 17; the kernel half of the idea is on branch s17-uniform-tiles): for the wgrad operand whose scales run along the output's columns (x for the
up projection, SwiGLU's a for the down), quantize each tile both with DESIGN §9's per-channel 128x1 scales and
with one tile scale, and count the tiles whose dequantized values are identical (E4M3 rounding is the same under
any power-of-two scale while the values stay normal, so only tiles spanning more than E4M3's range differ).

    PYTHONPATH=. python benchmarks/wgrad_tile_lossless.py --ckpt out/model_bf16.safetensors
"""
import argparse
import json

import torch

import mxmoe.moe as moe_mod
from mxmoe.formats import quantize
from mxmoe.train import load_checkpoint


def lossless_fraction(t: torch.Tensor) -> tuple[int, int]:
    """t [M, C] (tokens x channels) -> (lossless tiles, tiles) over full 128 x 128 tiles."""
    M, C = t.shape[0] // 128 * 128, t.shape[1] // 128 * 128
    if M == 0 or C == 0:
        return 0, 0
    xt = t[:M, :C].T.float().contiguous()  # [C, M]: tokens along the quantized axis
    per_ch = quantize(xt, -1, block=128).dequantize()
    tile = quantize(xt, -1, block=(128, 128)).dequantize()
    same = (per_ch == tile) | (per_ch.isnan() & tile.isnan())
    tiles = same.reshape(C // 128, 128, M // 128, 128).all(3).all(1)
    return int(tiles.sum()), tiles.numel()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    model, cfg, _ = load_checkpoint(args.ckpt, recipe="bf16")
    captured = []
    orig = moe_mod.grouped_linear

    def spy(x, *a, **k):
        captured.append(x.detach())
        return orig(x, *a, **k)

    moe_mod.grouped_linear = spy
    from mxmoe.corpus import load_corpus
    val = load_corpus("stdlib", "cpu").val
    g = torch.Generator().manual_seed(0)
    counts = {"up (x)": [0, 0], "down (a)": [0, 0]}
    with torch.no_grad():
        for _ in range(args.batches):
            i = torch.randint(0, val.numel() - cfg.seq_len - 1, (cfg.batch_size,), generator=g)
            batch = torch.stack([val[j:j + cfg.seq_len] for j in i.tolist()]).long()
            captured.clear()
            model(batch, batch)
            for n, x in enumerate(captured):
                key = "up (x)" if n % 2 == 0 else "down (a)"
                ok, total = lossless_fraction(x)
                counts[key][0] += ok
                counts[key][1] += total
    res = {k: {"lossless_tiles": v[0], "tiles": v[1], "fraction": round(v[0] / max(v[1], 1), 4)}
           for k, v in counts.items()}
    res["model"] = dict(dim=cfg.dim, ffn_dim=cfg.ffn_dim, layers=cfg.layers, experts=cfg.experts, ckpt=args.ckpt)
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
