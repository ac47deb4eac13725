"""Where a training step's GPU time goes, per recipe: the main job's model (a preset of `mxmoe train`,
default `gpu-throughput`) on random tokens, eager steps or ``--compile BACKEND`` (kernel times are those of the CUDA-graph
steps `mxmoe train` runs; the host's launch work is not in them), one torch profile of a few steps,
each CUDA kernel's total time per step. Written to explain the end-to-end figures of
``train_gpu_throughput.json`` (issue 23): which kernels grow or shrink from bf16 to the MX recipes.

    PYTHONPATH=. python benchmarks/tools/profile_train_step.py --out out/train_step_profile.json   # one CUDA GPU

JSON: per recipe, ``ms_per_step`` (GPU kernel time summed, all streams), ``categories`` (ms per step:
attention, dense products, expert products, quantization, the layer's other kernels, the optimizer, the rest) and ``kernels`` (name, ms per step, launches per
step), largest first; ``layer_sequence``: one step's MoE-layer kernels (expert products, quantization, SwiGLU /
permutation / combine) in launch order with each launch's time. The categories come from kernel names (:func:`category`), so read the kernel
list before trusting them.
"""
import argparse
import json
import os
import re
import sys
import time

import torch
import torch._dynamo
from torch.profiler import ProfilerActivity, profile

# appended, not prepended: an older mxmoe first on PYTHONPATH stays the one imported
sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks import common as C  # noqa: E402
from mxmoe import train as T  # noqa: E402

CATEGORIES = [  # first match wins; patterns on CUDA kernel names (nvjet and cuDNN's names hold "sm90" too)
    ("attention", r"flash|fmha|attention|sdpa"),
    ("dense products", r"nvjet|cublas|xmma|sgemm|cutlass_80"),
    ("expert products", r"sm90_mxfp8|grouped|groupproblemshape"),
    ("quantization", r"quant|qdq|mx_|e8m0|scale_layout"),
    ("swiglu, permutation, combine", r"swiglu|silu|permut|combine|gather|scatter|to_float32"),
    ("optimizer", r"fusedoptimizer|multi_tensor_apply"),
]


def category(name: str) -> str:
    """The category of a CUDA kernel by its name (CATEGORIES; "other" when none matches)."""
    low = name.lower()
    for cat, pat in CATEGORIES:
        if re.search(pat, low):
            return cat
    return "other"


def profile_recipe(cfg, recipe: str, steps: int, dev: torch.device, backend: str = "") -> dict:
    torch.manual_seed(0)
    model = T.MoELM(cfg, recipe).to(dev).train()
    step_fn = T.compiled(model, backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, T.VOCAB, (cfg.batch_size, cfg.seq_len), generator=gen).to(dev)
    y = torch.randint(0, T.VOCAB, (cfg.batch_size, cfg.seq_len), generator=gen).to(dev)

    def step():
        if backend in T.GRAPH_BACKENDS:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ce, aux = step_fn(x, y)
        (ce + aux).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(5 if not backend else 10):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    eager_ms = (time.perf_counter() - t) * 1e3 / steps
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    launches = C.kernel_launches(p)
    kernels = {}
    for name, ms in launches:
        k = kernels.setdefault(name, [0.0, 0])
        k[0] += ms / steps  # ms per step
        k[1] += 1
    rows = sorted(([n, ms, c / steps] for n, (ms, c) in kernels.items()), key=lambda r: -r[1])
    # one step's MoE-layer kernels in launch order, each with its own time (which quantization is which)
    layer_cats = ("expert products", "quantization", "swiglu, permutation, combine")
    seq = [(name, ms) for name, ms in launches if category(name) in layer_cats]
    per_step = len(seq) // steps
    cats = {}
    for n, ms, _ in rows:
        cats[category(n)] = cats.get(category(n), 0.0) + ms
    return {"eager_ms_per_step": eager_ms, "ms_per_step": sum(r[1] for r in rows),
            "categories": dict(sorted(cats.items(), key=lambda kv: -kv[1])),
            "kernels": [{"name": n, "ms": ms, "launches": c} for n, ms, c in rows],
            "layer_sequence": [{"name": n[:60], "ms": round(ms, 4)} for n, ms in seq[:per_step]]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="gpu-throughput")
    ap.add_argument("--recipes", default="bf16,mxfp8,mxfp8_128")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default="train_step_profile.json")
    ap.add_argument("--compile", default="", help="torch.compile backend of the forward, one of mxmoe train's resolved backends "
                    f"({', '.join(T.COMPILE_BACKENDS)}; not auto): inductor profiles its fused kernels; the "
                    "graph backends' kernels may not all reach the profiler")
    args = ap.parse_args()
    dev = torch.device("cuda")
    cfg = T.make_config(args.preset)
    res = {"preset": args.preset, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "tokens_per_step": cfg.batch_size * cfg.seq_len, "compile": args.compile, "recipes": {}}
    for r in T.parse_recipes(args.recipes):
        torch._dynamo.reset()
        res["recipes"][r] = m = profile_recipe(cfg, r, args.steps, dev, args.compile)
        cats = "  ".join(f"{k} {v:.2f}" for k, v in m["categories"].items())
        print(f"{r:10s} kernels {m['ms_per_step']:.2f} ms/step (eager wall {m['eager_ms_per_step']:.2f}): {cats}",
              flush=True)
        for k in m["kernels"][:12]:
            print(f"    {k['ms']:7.3f} ms  x{k['launches']:<4g} [{category(k['name'])}] {k['name'][:110]}")
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
