"""Bit-identity check across two versions of the library: MoE forward + backward on fixed seeds, per recipe,
eager and with the whole-layer kernels, hashed (SHA-256 of the raw bytes of the output, the input gradient
and every parameter gradient). Run it once per tree (PYTHONPATH picks the tree) and compare the JSON.

Usage: PYTHONPATH=<tree> python benchmarks/tools/check_same_outputs.py --out hashes.json [--device cuda]
"""
import argparse
import hashlib
import json

import torch

import mxmoe
from mxmoe.moe import MoE


def _digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()[:16]


def run(recipe: str, device: str, seed: int, tokens: int, dim: int, ffn: int, experts: int, top_k: int) -> dict:
    torch.manual_seed(seed)
    layer = MoE(dim, ffn, experts, top_k, recipe=recipe).to(device)
    x = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    if isinstance(y, tuple):
        y = y[0]
    g = torch.randn_like(y)
    y.backward(g)
    out = {"y": _digest(y), "dx": _digest(x.grad)}
    for name, p in layer.named_parameters():
        out["d" + name] = _digest(p.grad)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--recipes", default="bf16,mxfp8,mxfp8_2d,mxfp8_lowmem,mxfp8_bf16_wgrad")
    args = ap.parse_args()
    shapes = [(4096, 1024, 512, 8, 2), (3000, 512, 256, 16, 4)]  # odd token count: ragged groups
    res = {"mxmoe_file": mxmoe.__file__, "torch": torch.__version__}
    for recipe in args.recipes.split(","):
        for i, (t, d, f, e, k) in enumerate(shapes):
            res[f"{recipe}/shape{i}"] = run(recipe, args.device, 1234 + i, t, d, f, e, k)
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)
    print(json.dumps(res)[:400])


if __name__ == "__main__":
    main()
