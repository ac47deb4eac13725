"""Host time against GPU time, for the mx128 grouped GEMM and the MoE layer step: is a case host-bound?

    python benchmarks/probe_host_overhead.py [--out host_overhead.json]

Per case: host ms per call (perf_counter around the call, no sync inside, averaged over a burst that the
GPU queue absorbs), event ms per call as the benchmarks time it (idle GPU at the start of each call), GPU
ms (the same call replayed from a CUDA graph: no host work), and for the layer the sum of kernel times
from the profiler; then cProfile's top functions (own time) for one case of each kind.
"""
import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
import bench_grouped_gemm as B  # noqa: E402
import bench_grouped_gemm_128 as B128  # noqa: E402
import bench_moe_layer as L  # noqa: E402
import mxmoe  # noqa: E402
import mxmoe.kernels.sm90_gemm_promote128 as K  # noqa: E402


def host_ms(fn, n=30):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3 / n


def graph_ms(fn, n=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n


def top(fn, n=10, k=22):
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(k)
    return s.getvalue()


def gemm_case(shape, proj):
    E, M, hidden, ffn = B.SHAPES[shape]
    N, Kd = (hidden, ffn) if proj == "down" else (2 * ffn, hidden)
    counts = B128.token_counts(M, E, "balanced", torch.Generator())
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    a, b = B.rand_fp8(M, Kd), B.rand_fp8(E, N, Kd)
    sa, (sb, _) = B128.scale_1x128(M, Kd), B128.scale_128x128(E, N, Kd)
    return lambda: K.sm90_mx128_m_grouped_gemm(a, sa, b, sb, offs, torch.bfloat16), 2.0 * M * N * Kd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="host_overhead.json")
    args = ap.parse_args()
    rows = []
    for shape, proj in [("qwen3-30b-a3b", "down"), ("qwen3-30b-a3b", "up"), ("dsv3-ep32", "down"),
                        ("mixtral-8x7b", "up")]:
        fn, flop = gemm_case(shape, proj)
        r = {"kind": "gemm_mx128_fprop", "shape": shape, "proj": proj, "host_ms": host_ms(fn),
             "event_ms": L.step_time(fn, 10), "gpu_ms": graph_ms(fn)}
        r["gpu_tflops"] = flop / r["gpu_ms"] / 1e9
        print(r, flush=True)
        rows.append(r)
    prof_gemm = top(gemm_case("qwen3-30b-a3b", "down")[0])
    print(prof_gemm)
    prof_layer = {}
    for shape in ("qwen3-30b-a3b", "dsv3-ep32"):
        for recipe in ("mxfp8_128", "bf16"):
            E, D, Fd, k = L.SHAPES[shape]
            torch.manual_seed(0)
            x = torch.randn(16384, D, device="cuda", dtype=torch.bfloat16)
            with torch.device("cuda"):
                moe = mxmoe.MoE(D, Fd, E, k, recipe=recipe)
            xg, dy = x.clone().requires_grad_(), torch.randn_like(x)

            def step():
                moe.zero_grad(set_to_none=True)
                xg.grad = None
                moe(xg).backward(dy)

            step()
            r = {"kind": "layer_fwd_bwd", "shape": shape, "recipe": recipe, "host_ms": host_ms(step, 10),
                 "event_ms": L.step_time(step, 5)}
            print(r, flush=True)
            rows.append(r)
            if recipe == "mxfp8_128":
                prof_layer[shape] = top(step, 5, 30)
                print(prof_layer[shape])
            del moe
            torch.cuda.empty_cache()
    with open(args.out, "w") as fh:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
                   "cprofile_gemm_qwen3_down": prof_gemm, "cprofile_layer": prof_layer}, fh, indent=1)


if __name__ == "__main__":
    main()
