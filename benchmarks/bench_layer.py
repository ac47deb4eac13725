"""Layer suite: the MoE layer's forward+backward, our MX recipes against our bf16 (and optionally a plain
per-expert PyTorch loop), on the DESIGN §5 shapes at 16384 tokens per step, same run, same GPU.

    python -m benchmarks layer [--quick] [--out benchmarks/results/<gpu>/layer.json] [--timing inductor-cudagraphs,eager]

Per row (``shape``, ``recipe``, ``balance``, ``timing``): median fwd+bwd ``ms`` (CUDA events over ``--iters``
steps after warm-up) beside ``bf16_ms`` (and ``loop_ms``) of the same timing, and from one profiled step the
share of GPU kernel time in quantization kernels (``quant_share``), a per-stage breakdown by kernel name
(gemm / quantize / other) and the step's kernels in launch order with each launch's ms (``launches``). Eager
rows also carry the step's peak memory and the memory held for backward (allocated after forward minus
before), with bf16's.

``timing``: ``inductor-cudagraphs`` times the layer under ``torch.compile(fullgraph=True, mode="reduce-overhead")``
(inductor: torch's elementwise work fused, our kernels as they are; the step replayed from CUDA graphs with no
host launch work), as ``mxmoe train`` runs its steps by default (default here, with ``eager`` beside it; memory
is not measured under CUDA graphs: their pool is allocated once). ``cudagraphs`` is torch.compile's plain
cudagraphs backend, as ``mxmoe train --compile cudagraphs``: it copies every parameter into the graph's input
buffers at each replay (the FP32 expert weights: about 1.2 ms a step at Qwen3-30B-A3B's shape, in every
recipe), since with torch's inlined nn.Module parameters that backend marks none of them static.
``eager`` launches every kernel from Python (small layers are timed by the host's launch work); ``inductor``
compiles with inductor, launched from Python. The local layer of an EP shape runs with top-k = routed rows / tokens of
``benchmarks.common.SHAPES`` (dsv3-ep32: top-2 of 8 local experts; dsv3-671b-ep8: top-8 of 32).
"""

from __future__ import annotations

import os
import statistics

import torch
import torch.nn.functional as F

import mxmoe
from benchmarks import common as C

SUITE = "layer"
TIMINGS = ("inductor-cudagraphs", "cudagraphs", "eager", "inductor")


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
    """Skewed routing: the router biased along the tokens' mean direction, toward low expert ids (Zipf-like), and
    with the opposite sign, 50x, for the last eighth of the experts. Random tokens have no mean along that
    direction, so the tokens on its other side favour the last eighth: no expert ends up empty. In a CPU draw at
    Qwen3-30B-A3B's shape the first experts take ~9x the mean rows, the last eighth ~2.5-3.3x each, the rest
    fewer (the gemm suite's skewed counts, ``common.token_counts``, do leave experts empty)."""
    if not skew:
        return
    with torch.no_grad():
        E = moe.num_experts
        direction = x.float().mean(0)
        direction = direction / direction.norm()
        zipf = torch.log(1.0 / torch.arange(1, E + 1, device=x.device, dtype=torch.float32))
        moe.router.weight.add_(torch.outer(zipf * 4.0, direction))
        moe.router.weight[E - max(1, E // 8):] -= 50.0 * direction  # (meant to empty them; see the docstring)


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
    # the step's kernels in launch order, each launch's own ms (which GEMM or quantizer a difference is in)
    shares["launches"] = [(name[:60], round(ms, 4)) for name, ms in C.kernel_launches(prof)]
    return shares


def run_case(name, recipe, skew, tokens, iters, dev, compile_backend=""):
    shape = C.SHAPES[name]
    E, D, Fd, k = shape.experts, shape.hidden, shape.ffn, shape.top_k
    torch.manual_seed(0)
    x = torch.randn(tokens, D, device=dev, dtype=torch.bfloat16)
    with torch.device(dev):  # initialize on the GPU: multi-GB expert weights
        moe = mxmoe.MoE(D, Fd, E, k, recipe="bf16" if recipe == "loop" else recipe)
    skew_router(moe, x, skew)
    layer = LoopMoE(moe) if recipe == "loop" else moe
    graphs = compile_backend in ("cudagraphs", "inductor-cudagraphs")
    if compile_backend and recipe != "loop":
        torch._dynamo.reset()  # each case compiles afresh: MoE.forward's cache would hit the recompile limit
        layer = (torch.compile(moe, mode="reduce-overhead", fullgraph=True) if compile_backend == "inductor-cudagraphs"
                 else torch.compile(moe, backend=compile_backend, fullgraph=True))
    xg = x.clone().requires_grad_()
    dy = torch.randn_like(x)

    def step():  # one training step's layer work: gradients start empty, as after zero_grad()
        if graphs:
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
    if graphs:
        torch.compiler.cudagraph_mark_step_begin()
    y = layer(xg)
    held = torch.cuda.memory_allocated() - base
    y.backward(dy)
    del y
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    shares = kernel_breakdown(step)
    top, launches = shares.pop("top_kernels"), shares.pop("launches")
    if graphs:  # the graphs' memory pool was allocated before: nothing to measure
        peak = held = None
    gib = lambda b: None if b is None else b / 2**30  # noqa: E731
    return {"ms": ms, "peak_mem_gib": gib(peak), "saved_for_bwd_gib": gib(held),
            "quant_share": shares["quantize"], "breakdown": shares, "top_kernels": top, "launches": launches}


def build_parser():
    ap = C.parser(SUITE, __doc__)
    ap.add_argument("--tokens", type=int, default=C.LAYER_TOKENS)
    ap.add_argument("--iters", type=int, default=None, help="timed steps per case (default 10, --quick 3)")
    ap.add_argument("--shapes", default=None, help="comma-separated names of benchmarks.common.SHAPES (default all)")
    ap.add_argument("--recipes", default="mxfp8_128,mxfp8,bf16",
                    help="MoE recipes, comma-separated (bf16 is always timed as the reference); 'loop' adds a "
                         "per-expert PyTorch loop (BF16)")
    ap.add_argument("--balance", default=None, help="default balanced,skewed (--quick: balanced)")
    ap.add_argument("--timing", default=None,
                    help="comma-separated: inductor-cudagraphs (as `mxmoe train` runs by default), cudagraphs "
                         "(`mxmoe train --compile cudagraphs`), eager, inductor; default inductor-cudagraphs,eager "
                         "(--quick: inductor-cudagraphs)")
    ap.add_argument("--routes", default=os.environ.get("MXMOE_SM90_GEMM", "auto"),
                    help="Hopper routes of the MX recipes (MXMOE_SM90_GEMM values, comma-separated), each "
                         "timed in the same run: auto, bf16 (expansion), gluon, mixed")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    shapes = C.shape_list(args.shapes, args.quick)
    timings = (args.timing or ("inductor-cudagraphs" if args.quick else "inductor-cudagraphs,eager")).split(",")
    bad = [t for t in timings if t not in TIMINGS]
    if bad:
        raise SystemExit(f"--timing: choose from {', '.join(TIMINGS)}; got {', '.join(bad)}")
    balances = (args.balance or ("balanced" if args.quick else "balanced,skewed")).split(",")
    iters = args.iters or (3 if args.quick else 10)
    recipes = list(dict.fromkeys(args.recipes.split(",") + ["bf16"]))
    C.require_cuda(SUITE)
    out = args.out or C.default_out(SUITE)
    head = C.header(SUITE, args.quick, tokens=args.tokens,
                    timing=f"median of {iters} fwd+bwd steps (CUDA events) after 3 warm-up steps; parameter "
                           "gradients set to None before each step (no accumulation)",
                    env={k: v for k, v in os.environ.items() if k.startswith("MXMOE_") and k != "MXMOE_SM90_GEMM"})
    rows = []
    routes = args.routes.split(",")
    for timing in timings:
        backend = "" if timing == "eager" else timing
        for name in shapes:
            for bal in balances:
                res = {}
                for r in recipes:
                    for route in (["auto"] if r in ("bf16", "loop") else routes):  # bf16, loop: no MX products
                        if r == "loop" and backend:
                            continue  # the loop's data-dependent shapes do not compile to one graph
                        os.environ["MXMOE_SM90_GEMM"] = route
                        res[r, route] = run_case(name, r, bal == "skewed", args.tokens, iters, "cuda", backend)
                bf16, loop = res.get(("bf16", "auto"), {}), res.get(("loop", "auto"), {})
                for (r, route), v in res.items():
                    if r in ("bf16", "loop"):  # the references: in every row as bf16_* / loop_ms
                        continue
                    row = {"shape": name, "recipe": r, "balance": bal, "timing": timing, "route": route,
                           "tokens": args.tokens, **v, "bf16_ms": bf16.get("ms"), "loop_ms": loop.get("ms"),
                           "bf16_peak_mem_gib": bf16.get("peak_mem_gib"),
                           "bf16_saved_for_bwd_gib": bf16.get("saved_for_bwd_gib"),
                           "bf16_top_kernels": bf16.get("top_kernels")}
                    row["speedup_vs_bf16"] = row["bf16_ms"] / v["ms"] if row["bf16_ms"] else None
                    row["speedup_vs_loop"] = row["loop_ms"] / v["ms"] if row["loop_ms"] else None
                    rows.append(row)
                    mem = (f"  peak {v['peak_mem_gib']:.2f} GiB  saved {v['saved_for_bwd_gib']:.2f}"
                           if v["peak_mem_gib"] is not None else "")
                    print(f"{timing:10s} {name:14s} {bal:8s} {r:16s} {route:6s} {v['ms']:8.2f} ms  bf16 "
                          f"{row['bf16_ms'] or 0:8.2f}  x{row['speedup_vs_bf16'] or 0:.2f} vs bf16{mem}"
                          f"  quant {100 * v['quant_share']:.0f}%", flush=True)
                torch.cuda.empty_cache()
                C.write_result(out, head, rows)  # after every case, so a cut-short run keeps its rows


if __name__ == "__main__":
    main()
