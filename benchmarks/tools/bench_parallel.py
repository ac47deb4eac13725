"""Expert parallelism on two GPUs: dispatch+combine bytes and time with MXFP8 against BF16 tokens,
and MoE layer forward+backward at EP=2 against EP=1, same run, same GPUs.

    torchrun --standalone --nproc-per-node 2 benchmarks/tools/bench_parallel.py \
        [--out benchmarks/results/h200x2/parallel.json] [--tokens 8192] [--shapes mixtral-8x7b,qwen3-30b-a3b] [--tiny]

Every rank routes ``--tokens`` BF16 tokens of its own per step (random data, random router:
roughly balanced; ``--skew``: Zipf-like, the last eighth of the experts (almost) empty).

* comm: the layer's own dispatch (MXFP8: quantize rows once, send E4M3 data + E8M0 scales, D + D/32
  bytes a row; BF16: 2D bytes a row, the receiver quantizes inside grouped_linear) and combine
  (BF16 expert outputs), forward only, then dispatch+combine forward+backward around identity
  experts (gradients travel in BF16 both ways). Also the bare ``all_to_all_single`` of the two
  payloads. Bytes are what this rank sends per step (``remote``: to the other rank).
* layer: forward+backward of the whole MoE layer (router, exchanges, experts): EP=1 is one GPU
  holding all E experts processing its own tokens (both GPUs do so at once, no communication);
  EP=2 is each GPU holding E/2 experts and exchanging tokens. Per GPU the expert FLOPs are the same
  on average, so EP=2 / EP=1 is the cost of the exchanges (what EP buys is memory: half the experts).
* check first: the EP=2 layer's output against the single-process layer run on both ranks'
  tokens at once (relative L2 error; expected ~0: same products on the same rows).

Times: median of ``--iters`` steps (CUDA events, after ``--warmup``), every rank the same fixed
number of steps (collectives keep them in step); the step time reported is the slower rank's.
Rank 0 writes the JSON and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import mxmoe
from mxmoe import parallel
from mxmoe.formats import BLOCK

SHAPES = {  # name: (experts in all, dim, ffn, top_k), as in DESIGN §5 before expert parallelism
    "mixtral-8x7b": (8, 4096, 14336, 2),
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "tiny": (8, 256, 512, 2),
}


DEVICE = torch.device("cuda")  # set in main(); "cpu" (gloo, wall-clock timing) only to smoke-test this script


def timed(fn, iters: int, warmup: int) -> float:
    """Median ms of ``fn`` over ``iters`` calls (CUDA events), the slower rank's value."""
    for _ in range(warmup):
        fn()
    cuda = DEVICE.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return slowest(statistics.median(times))


def slowest(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def gather_ints(values: list[int]) -> list[list[int]]:
    t = torch.tensor(values, dtype=torch.int64, device=DEVICE)
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return [p.tolist() for p in parts]


def skew_router(moe: mxmoe.MoE, skew: bool) -> torch.Tensor | None:
    """Zipf-like preference for low expert ids along a fixed direction, the last eighth of the experts
    (almost) never chosen. Returns the direction (inputs get an offset along it, so the preference acts)."""
    if not skew:
        return None
    g = torch.Generator().manual_seed(7)
    direction = torch.randn(moe.dim, generator=g).to(moe.router.weight.device)
    direction /= direction.norm()
    E = moe.num_experts
    zipf = torch.log(1.0 / torch.arange(1, E + 1, dtype=torch.float32, device=direction.device))
    with torch.no_grad():
        moe.router.weight.add_(torch.outer(zipf * 0.25, direction))  # with x . direction ~ 4: p_e ~ 1/(e+1)
        moe.router.weight[E - max(1, E // 8):] -= 50.0 * direction
    return direction


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def bench_comm(full: mxmoe.MoE, x: torch.Tensor, dispatch: str, args) -> dict:
    """Dispatch and combine of one layer with ``dispatch`` ("mxfp8" or "bf16") tokens."""
    ep = parallel.ExpertParallelMoE.from_full(full, dispatch_dtype=dispatch)
    T, D = x.shape
    with torch.no_grad():
        r = ep.route(x)
        plan = ep.dispatch_plan(r.experts, r.counts)
        xp, _ = ep.dispatch(x, plan)
        ep.combine(xp, plan, T)
        stats = dict(ep.comm_stats)
        out = {"plan_ms": timed(lambda: ep.dispatch_plan(r.experts, r.counts), args.iters, args.warmup),
               "dispatch_ms": timed(lambda: ep.dispatch(x, plan), args.iters, args.warmup),
               "combine_ms": timed(lambda: ep.combine(xp, plan, T), args.iters, args.warmup)}
        S = sum(plan.send_splits)
        row = D + D // BLOCK if dispatch == "mxfp8" else 2 * D
        payload = torch.randint(0, 255, (S, row), dtype=torch.uint8, device=x.device)
        out["bare_all_to_all_ms"] = timed(
            lambda: parallel._all_to_all(payload, plan.recv_splits, plan.send_splits, ep.ep_group),
            args.iters, args.warmup)
    out["dispatch_combine_fwd_ms"] = out["dispatch_ms"] + out["combine_ms"]

    xg = x.detach().requires_grad_()

    def fwd_bwd():  # identity experts: the exchanges and their gradients only
        xp, _ = ep.dispatch(xg, plan)
        ep.combine(xp, plan, T).float().sum().backward()

    out["dispatch_combine_fwd_bwd_ms"] = timed(fwd_bwd, args.iters, args.warmup)
    R = sum(plan.recv_splits)
    me = dist.get_rank()
    grad_bytes = 2 * D  # BF16 gradient rows
    out.update({
        "rows_sent": S, "rows_received": R,
        "dispatch_bytes": stats["dispatch_bytes"], "dispatch_remote_bytes": stats["dispatch_remote_bytes"],
        "combine_bytes": stats["combine_bytes"], "combine_remote_bytes": stats["combine_remote_bytes"],
        "backward_bytes": (S + R) * grad_bytes,
        "backward_remote_bytes": (S - plan.send_splits[me] + R - plan.recv_splits[me]) * grad_bytes,
    })
    out["dispatch_remote_GBps"] = out["dispatch_remote_bytes"] / out["dispatch_ms"] / 1e6
    return out


def bench_layer(full: mxmoe.MoE, x: torch.Tensor, args) -> dict:
    """Forward+backward ms of the whole layer: EP=1 (full layer, own tokens) and EP=2 variants."""
    out = {}
    xg = x.detach().requires_grad_()
    dy = torch.randn_like(x)

    def step(layer):
        def run():
            layer.zero_grad(set_to_none=True)
            xg.grad = None
            layer(xg).backward(dy)
        return run

    for recipe in ("mxfp8", "bf16"):
        full.set_recipe(recipe)
        out[f"ep1_{recipe}_ms"] = timed(step(full), args.iters, args.warmup)
        dispatches = ("mxfp8", "bf16") if recipe == "mxfp8" else ("bf16",)
        for d in dispatches:
            ep = parallel.ExpertParallelMoE.from_full(full, dispatch_dtype=d)
            out[f"ep2_{recipe}_{d}_dispatch_ms"] = timed(step(ep), args.iters, args.warmup)
            del ep
    full.set_recipe("mxfp8")
    out["ep2_over_ep1_mxfp8"] = out["ep2_mxfp8_mxfp8_dispatch_ms"] / out["ep1_mxfp8_ms"]
    out["ep2_over_ep1_bf16"] = out["ep2_bf16_bf16_dispatch_ms"] / out["ep1_bf16_ms"]
    out["mxfp8_dispatch_speedup_vs_bf16_dispatch"] = out["ep2_mxfp8_bf16_dispatch_ms"] / out["ep2_mxfp8_mxfp8_dispatch_ms"]
    return out


def check(full: mxmoe.MoE, x: torch.Tensor) -> dict:
    """EP=2 output against the single-process layer on both ranks' tokens (MXFP8 and BF16 dispatch)."""
    W, me, T = dist.get_world_size(), dist.get_rank(), x.shape[0]
    parts = [torch.empty_like(x) for _ in range(W)]
    dist.all_gather(parts, x)
    with torch.no_grad():
        ref = full(torch.cat(parts))[me * T:(me + 1) * T]
        out = {}
        for d in ("mxfp8", "bf16"):
            ep = parallel.ExpertParallelMoE.from_full(full, dispatch_dtype=d)
            out[f"rel_err_{d}_dispatch"] = slowest(rel(ep(x), ref))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results/h200x2/parallel.json")
    p.add_argument("--shapes", default="mixtral-8x7b,qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per GPU per step")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--skew", action="store_true", help="skewed routing (Zipf-like, last eighth of experts empty)")
    p.add_argument("--tiny", action="store_true", help="smoke run: the tiny shape, 1024 tokens, 3 iterations")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: gloo and wall-clock times, only to smoke-test the script")
    args = p.parse_args()
    if args.tiny:
        args.shapes, args.tokens, args.iters, args.warmup = "tiny", 1024, 3, 1
    global DEVICE
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off (see the device notes)
    group = parallel.maybe_init_distributed(backend="nccl" if args.device == "cuda" else "gloo")
    if group is None or dist.get_world_size() != 2:
        raise SystemExit("launch with: torchrun --standalone --nproc-per-node 2 benchmarks/tools/bench_parallel.py")
    me = dist.get_rank()
    dev = DEVICE = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    nccl = torch.cuda.nccl.version() if dev.type == "cuda" else None
    results = {
        "env": {"gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor(),
                "gpus": dist.get_world_size(), "torch": torch.__version__,
                "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
                "python": platform.python_version(),
                "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"),
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
        "config": {"tokens_per_gpu": args.tokens, "iters": args.iters, "warmup": args.warmup, "skew": args.skew,
                   "activations": "bfloat16", "weights": "float32 master, quantized per recipe"},
        "shapes": {},
    }
    for name in args.shapes.split(","):
        E, D, Fdim, top_k = SHAPES[name]
        torch.manual_seed(0)  # same weights on both ranks
        full = mxmoe.MoE(D, Fdim, E, top_k, recipe="mxfp8").to(dev)
        direction = skew_router(full, args.skew)
        torch.manual_seed(1 + me)  # each rank its own tokens
        x = torch.randn(args.tokens, D, device=dev)
        if direction is not None:
            x += 4.0 * direction  # x . direction ~ 4 +- 1: the preference acts on nearly every token
        x = x.to(torch.bfloat16)
        counts = full.route(x).counts
        res = {"experts": E, "dim": D, "ffn_dim": Fdim, "top_k": top_k,
               "routed_per_expert_per_rank": gather_ints(counts.tolist()),
               "check": check(full, x)}
        res["comm"] = {d: bench_comm(full, x, d, args) for d in ("mxfp8", "bf16")}
        mx, bf = res["comm"]["mxfp8"], res["comm"]["bf16"]
        res["comm"]["dispatch_bytes_mxfp8_over_bf16"] = mx["dispatch_bytes"] / bf["dispatch_bytes"]
        res["comm"]["dispatch_ms_mxfp8_over_bf16"] = mx["dispatch_ms"] / bf["dispatch_ms"]
        res["comm"]["bare_all_to_all_ms_mxfp8_over_bf16"] = mx["bare_all_to_all_ms"] / bf["bare_all_to_all_ms"]
        res["layer"] = bench_layer(full, x, args)
        results["shapes"][name] = res
        del full
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        if me == 0:
            print_shape(name, res)
    if me == 0:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))
        print(f"wrote {out}")
    parallel.shutdown_distributed()


def print_shape(name: str, res: dict) -> None:
    c, l = res["comm"], res["layer"]
    print(f"\n== {name}: E={res['experts']} D={res['dim']} F={res['ffn_dim']} top_k={res['top_k']} | "
          f"check: rel err mxfp8 {res['check']['rel_err_mxfp8_dispatch']:.2e}, bf16 {res['check']['rel_err_bf16_dispatch']:.2e}")
    print(f"{'dispatch':<8}{'MB sent':>10}{'remote MB':>11}{'plan ms':>9}{'disp ms':>9}{'comb ms':>9}"
          f"{'a2a ms':>9}{'fwd+bwd ms':>12}")
    for d in ("mxfp8", "bf16"):
        m = c[d]
        print(f"{d:<8}{m['dispatch_bytes'] / 1e6:>10.2f}{m['dispatch_remote_bytes'] / 1e6:>11.2f}{m['plan_ms']:>9.3f}"
              f"{m['dispatch_ms']:>9.3f}{m['combine_ms']:>9.3f}{m['bare_all_to_all_ms']:>9.3f}"
              f"{m['dispatch_combine_fwd_bwd_ms']:>12.3f}")
    print(f"mxfp8/bf16 dispatch: bytes {c['dispatch_bytes_mxfp8_over_bf16']:.3f}, time {c['dispatch_ms_mxfp8_over_bf16']:.3f}, "
          f"bare a2a time {c['bare_all_to_all_ms_mxfp8_over_bf16']:.3f}")
    print("layer fwd+bwd ms: " + ", ".join(f"{k[:-3]} {v:.2f}" for k, v in l.items() if k.endswith("_ms")))
    print(f"EP=2/EP=1: mxfp8 {l['ep2_over_ep1_mxfp8']:.3f}, bf16 {l['ep2_over_ep1_bf16']:.3f}; "
          f"mxfp8 layer, bf16 dispatch / mxfp8 dispatch {l['mxfp8_dispatch_speedup_vs_bf16_dispatch']:.3f}")


if __name__ == "__main__":
    main()
