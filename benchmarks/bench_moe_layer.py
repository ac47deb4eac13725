"""MoE layer forward+backward: mxfp8 (1x32), mxfp8 with 32x32 weights, our bf16, and a plain
per-expert PyTorch loop, on the DESIGN §5 shapes at 16384 tokens per step, same run, same GPU.

    python benchmarks/bench_moe_layer.py [--out benchmarks/results/h200/moe_layer.json] [--routes auto,gluon,mixed]

Per row: median fwd+bwd ms (CUDA events over `--iters` steps after warm-up), peak memory of the
step, memory held for backward (allocated after forward minus before), and, from one profiled
step, the share of GPU kernel time spent in quantization kernels and a per-stage breakdown by
kernel name (gemm / quantize / other). ``--compile cudagraphs`` (or ``inductor``) times the layer under
``torch.compile(fullgraph=True)``: eager steps of small layers are timed by the host's launch work
(benchmarks/NOTES_moe_layer.md, session 13); not yet run on the GPU as of 2026-12-02.
dsv3-ep32 has 8 local experts of 256 with top-8 globally; per GPU that is ~2 routed rows per token
(M = 32768 for 16384 tokens), so the local layer is run with top_k = 2 of 8.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics

import torch
import torch.nn.functional as F

import mxmoe

SHAPES = {  # name: (experts, dim, ffn, top_k) at 16384 tokens
    "mixtral-8x7b": (8, 4096, 14336, 2),
    "llama4-scout": (16, 5120, 8192, 1),
    "dsv3-ep32": (8, 7168, 2048, 2),
    "qwen3-30b-a3b": (128, 2048, 768, 8),
}


class LoopMoE(torch.nn.Module):
    """How common model code writes it: route, then a Python loop over experts (BF16)."""

    def __init__(self, moe: mxmoe.MoE):
        super().__init__()
        self.m = moe

    def forward(self, x):
        m = self.m
        r = m.route(x)
        y = torch.zeros_like(x)
        for e in range(m.num_experts):
            tok, j = torch.where(r.experts == e)
            h = x[tok] @ m.w13[e].to(x.dtype).t()
            g, u = h.split(m.ffn_dim, -1)
            y.index_add_(0, tok, (F.silu(g) * u) @ m.w2[e].to(x.dtype).t() * r.weights[tok, j, None].to(x.dtype))
        return y


def skew_router(moe: mxmoe.MoE, x: torch.Tensor, skew: bool) -> None:
    """Skewed routing: bias the router toward low expert ids (Zipf-like), some experts empty."""
    if not skew:
        return
    with torch.no_grad():
        E = moe.num_experts
        direction = x.float().mean(0)
        direction = direction / direction.norm()
        zipf = torch.log(1.0 / torch.arange(1, E + 1, device=x.device, dtype=torch.float32))
        moe.router.weight.add_(torch.outer(zipf * 4.0, direction))
        moe.router.weight[E - max(1, E // 8):] -= 50.0 * direction  # last eighth of experts empty


def step_time(fn, iters: int) -> float:
    times = []
    for i in range(iters + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_breakdown(fn) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    cats = {"gemm": 0.0, "quantize": 0.0, "other": 0.0}
    kernels = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        kernels.append((t, ev.key[:120]))
        name = ev.key.lower()
        if "quant" in name or "qdq" in name:  # quantize, dequantize, quantize-dequantize (incl. fused SwiGLU/permute)
            cats["quantize"] += t
        elif any(k in name for k in ("gemm", "grouped_mm", "sm90", "cutlass", "nvjet", "matmul", "mma")):
            cats["gemm"] += t
        else:
            cats["other"] += t
    total = sum(cats.values()) or 1.0
    shares = {k: v / total for k, v in cats.items()}
    shares["top_kernels"] = [(name, round(t / total, 4)) for t, name in sorted(kernels, reverse=True)[:15]]
    return shares


def run_case(name, recipe, skew, tokens, iters, dev, compile_backend=""):
    E, D, Fd, k = SHAPES[name]
    torch.manual_seed(0)
    x = torch.randn(tokens, D, device=dev, dtype=torch.bfloat16)
    with torch.device(dev):  # initialize on the GPU: multi-GB expert weights
        moe = mxmoe.MoE(D, Fd, E, k, recipe="bf16" if recipe == "loop" else recipe)
    skew_router(moe, x, skew)
    layer = LoopMoE(moe) if recipe == "loop" else moe
    if compile_backend and recipe != "loop":
        torch._dynamo.reset()  # each case compiles afresh: MoE.forward's cache would hit the recompile limit
        layer = torch.compile(moe, backend=compile_backend, fullgraph=True)
    xg = x.clone().requires_grad_()
    dy = torch.randn_like(x)

    def step():  # one training step's layer work: gradients start empty, as after zero_grad()
        if compile_backend == "cudagraphs":
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's graph outputs are dead
        moe.zero_grad(set_to_none=True)
        xg.grad = None
        y = layer(xg)
        y.backward(dy)

    step()
    torch.cuda.synchronize()
    moe.zero_grad(set_to_none=True)
    ms = step_time(step, iters)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    if compile_backend == "cudagraphs":
        torch.compiler.cudagraph_mark_step_begin()
    y = layer(xg)
    held = torch.cuda.memory_allocated() - base
    y.backward(dy)
    del y
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    shares = kernel_breakdown(step)
    top = shares.pop("top_kernels")
    return {"ms": ms, "peak_mem_gib": peak / 2**30, "saved_for_bwd_gib": held / 2**30,
            "quant_share": shares["quantize"], "breakdown": shares, "top_kernels": top}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/h200/moe_layer.json")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--recipes", default="mxfp8,mxfp8_2d,mxfp8_lowmem,bf16,loop")
    ap.add_argument("--balance", default="balanced,skewed")
    ap.add_argument("--routes", default=os.environ.get("MXMOE_SM90_GEMM", "auto"),
                    help="Hopper routes of the MX recipes (MXMOE_SM90_GEMM values, comma-separated), each "
                         "timed in the same run: auto, bf16 (expansion), gluon, mixed")
    ap.add_argument("--compile", default="", choices=["", "inductor", "cudagraphs"],
                    help="time the layer under torch.compile(fullgraph=True) with this backend (cudagraphs: the "
                         "step's kernels replayed from CUDA graphs, no host launch work, as `mxmoe train` runs "
                         "on CUDA); default eager")
    args = ap.parse_args()
    dev = "cuda"
    rows = []
    meta = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
            "torch": torch.__version__, "python": platform.python_version(), "tokens": args.tokens,
            "timing": f"median of {args.iters} fwd+bwd steps (CUDA events) after 3 warm-up steps; "
                      "parameter gradients set to None before each step (no accumulation)",
            "compile": args.compile or "eager",
            "env": {k: v for k, v in os.environ.items() if k.startswith("MXMOE_") and k != "MXMOE_SM90_GEMM"}}
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        pass
    routes = args.routes.split(",")
    for name in args.shapes.split(","):
        for bal in args.balance.split(","):
            res = {}
            for r in args.recipes.split(","):
                for route in (["auto"] if r in ("bf16", "loop") else routes):  # bf16, loop: no MX products
                    os.environ["MXMOE_SM90_GEMM"] = route
                    res[r, route] = run_case(name, r, bal == "skewed", args.tokens, args.iters, dev, args.compile)
            bf16, loop = res.get(("bf16", "auto"), {}), res.get(("loop", "auto"), {})
            for (r, route), v in res.items():
                if r in ("bf16", "loop"):
                    continue
                row = {"shape": name, "balance": bal, "recipe": r, "route": route, "tokens": args.tokens, **v,
                       "bf16_ms": bf16.get("ms"), "loop_ms": loop.get("ms"),
                       "bf16_peak_mem_gib": bf16.get("peak_mem_gib"),
                       "bf16_saved_for_bwd_gib": bf16.get("saved_for_bwd_gib"),
                       "bf16_top_kernels": bf16.get("top_kernels")}
                row["speedup_vs_bf16"] = row["bf16_ms"] / v["ms"] if row["bf16_ms"] else None
                row["speedup_vs_loop"] = row["loop_ms"] / v["ms"] if row["loop_ms"] else None
                rows.append(row)
                print(f"{name:14s} {bal:8s} {r:9s} {route:6s} {v['ms']:8.2f} ms  bf16 {row['bf16_ms'] or 0:8.2f}"
                      f"  loop {row['loop_ms'] or 0:8.2f}"
                      f"  x{row['speedup_vs_bf16'] or 0:.2f} vs bf16  x{row['speedup_vs_loop'] or 0:.2f} vs loop"
                      f"  peak {v['peak_mem_gib']:.2f} GiB  saved {v['saved_for_bwd_gib']:.2f} (bf16 {row['bf16_saved_for_bwd_gib'] or 0:.2f})"
                      f"  quant {100 * v['quant_share']:.0f}%", flush=True)
            torch.cuda.empty_cache()
            with open(args.out, "w") as f:  # after every shape, so a cut-short run keeps its rows
                json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
