"""MoE layer numerics per recipe against the `fp32` recipe on the same weights and inputs: relative error
(Frobenius norm of the difference over the norm of the fp32 value) of the output and of every gradient.

    python benchmarks/tools/layer_numerics.py [--device cpu|cuda] [--out benchmarks/results/cpu/layer_numerics.json]

The DESIGN §5 shapes' hidden and FFN dims with fewer experts and tokens (so the CPU reference runs in
minutes); inputs and output gradients hold BF16 values in every recipe and the router runs in FP32 in
every recipe, so the same experts are picked. On the CPU every MX recipe runs mxmoe's reference (quantize, dequantize, FP32
products): the numbers the GPU kernels produce up to FP32 summation order.
"""
import argparse
import datetime
import json
import platform

import torch

import mxmoe

SHAPES = {  # name: (experts, dim, ffn, top_k, tokens)
    "mixtral-8x7b": (2, 4096, 14336, 2, 256),
    "llama4-scout": (2, 5120, 8192, 1, 256),
    "dsv3-ep32": (4, 7168, 2048, 2, 512),
    "qwen3-30b-a3b": (16, 2048, 768, 8, 512),
}


def run(recipe, shape, device, seed=0):
    E, D, Fd, k, T = SHAPES[shape]
    torch.manual_seed(seed)
    moe = mxmoe.MoE(D, Fd, E, k, recipe="fp32").to(device)
    # BF16 values in every recipe (the MX and bf16 recipes take BF16 activations): the same routing
    x = torch.randn(T, D, device=device).to(torch.bfloat16).float()
    dy = torch.randn(T, D, device=device).to(torch.bfloat16).float()
    out = {}
    for r in (["fp32", recipe] if recipe != "fp32" else ["fp32"]):
        moe.set_recipe(r)
        moe.zero_grad(set_to_none=True)
        xin = (x.to(torch.bfloat16) if r != "fp32" else x).clone().requires_grad_()
        y = moe(xin)
        y.backward(dy.to(y.dtype))
        out[r] = {"y": y.detach().double(), "dx": xin.grad.double(),
                  **{"d" + n: p.grad.double() for n, p in moe.named_parameters()}}
    ref, got = out["fp32"], out[recipe]
    return {key: float((got[key] - ref[key]).norm() / ref[key].norm()) for key in ref}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--recipes", default="bf16,mxfp8,mxfp8_128")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--out", default="benchmarks/results/cpu/layer_numerics.json")
    args = ap.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        for recipe in args.recipes.split(","):
            errs = run(recipe, shape, args.device)
            rows.append({"shape": shape, "recipe": recipe, **dict(zip(("experts", "dim", "ffn", "top_k", "tokens"),
                                                                      SHAPES[shape])), "rel_err": errs})
            print(f"{shape:14s} {recipe:10s} " + "  ".join(f"{k} {v:.2e}" for k, v in errs.items()), flush=True)
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "device": args.device,
            "python": platform.python_version(),
            "metric": "||recipe - fp32|| / ||fp32|| per tensor (Frobenius), same weights, inputs and routing"}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
