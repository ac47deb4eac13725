"""One expert linear layer, forward + backward with quantization included, against its peers, same run.

    python benchmarks/bench_linear_peers.py [--out benchmarks/results/h200/linear_peers.json] [--quick]

The step timed: ``y = linear(x, w, offs)`` then ``dx, dw = autograd.grad(y, (x, w), dy)``, x ``[M, K]``
and w ``[E, N, K]`` BF16, rows grouped by expert (DESIGN §5 shapes; up: N = 2 x FFN, K = hidden; down:
N = hidden, K = FFN; balanced and skewed token counts in multiples of 128, so every method takes them
unpadded). Methods:

    bf16          mxmoe.ops.grouped_linear(recipe="bf16"): torch._grouped_mm fprop / dgrad / wgrad
    mxfp8_128     mxmoe.ops.grouped_linear(recipe="mxfp8_128"): our Hopper-fast MXFP8 (1x128 / 128x128)
    mxfp8         mxmoe.ops.grouped_linear(recipe="mxfp8"): exact 1x32 MXFP8 (Hopper: BF16 expansion)
    torchao_fp8   torchao 0.18's FP8 rowwise grouped product (prototype.moe_training.fp8_grouped_mm.
                  _to_fp8_rowwise_then_scaled_grouped_mm, pad_token_groups_for_grouped_mm=False), if it
                  imports (on the H200: its abi3 wheel installed with --no-deps beside torch 2.11)

Times: ``eager_ms`` (triton.testing.do_bench median of the step, host launch work included) and
``graph_ms`` (the step captured once as a CUDA graph and replayed: the kernels' GPU time), where the
method captures. ``rel_err``: ||y - y_bf16|| / ||y_bf16|| of the forward output against the bf16
method's (a check that each method ran the same product, not a numerics figure).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import bench_grouped_gemm as B  # noqa: E402
from mxmoe.ops import grouped_linear  # noqa: E402

SHAPES = B.SHAPES
DEV = "cuda"


def torchao_linear():
    """torchao's FP8 rowwise grouped linear ``f(x, w, offs)`` or (None, why not)."""
    try:
        from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm as f
    except Exception as e:  # noqa: BLE001  (any import failure: report it, time the others)
        return None, f"torchao not importable ({type(e).__name__}: {e})"

    def run(x, w, offs):  # B_t [E, K, N] with strides (K*N, 1, K): w [E, N, K] transposed, as torchao asks
        return f(x, w.transpose(-2, -1), offs, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False)

    import torchao
    return run, f"torchao {torchao.__version__}"


def methods():
    """name -> f(x, w, offs), and notes."""
    ms = {r: (lambda r: lambda x, w, offs: grouped_linear(x, w, offs, r, validate=False))(r)
          for r in ("bf16", "mxfp8_128", "mxfp8")}
    ao, note = torchao_linear()
    if ao is not None:
        ms["torchao_fp8"] = ao
    return ms, [note]


def time_step(f, x, w, offs, dy, quick: bool) -> dict:
    import triton.testing as tt

    def step():
        y = f(x, w, offs)
        return torch.autograd.grad(y, (x, w), dy)

    step()
    torch.cuda.synchronize()
    out = {"eager_ms": tt.do_bench(step, warmup=10 if quick else 25, rep=30 if quick else 100)}
    try:  # warm-up on a side stream, then one capture (torch.cuda.graphs' recipe)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        out["graph_ms"] = tt.do_bench(g.replay, warmup=10 if quick else 25, rep=30 if quick else 100)
    except Exception as e:  # noqa: BLE001  (a method that cannot be captured: say why)
        out["graph_ms"] = None
        out["graph_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        torch.cuda.synchronize()
    return out


def run_case(shape, proj, balance, quick, gen, ms):
    E, M, hidden, ffn = SHAPES[shape]
    N, K = (2 * ffn, hidden) if proj == "up" else (hidden, ffn)
    counts = B.token_counts(M, E, balance, gen, unit=128)
    offs = torch.tensor(counts, device=DEV).cumsum(0).to(torch.int32)
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(E, N, K, device=DEV, dtype=torch.bfloat16) * K ** -0.5).requires_grad_()
    dy = torch.randn(M, N, device=DEV, dtype=torch.bfloat16)
    flops = 3 * 2 * M * N * K  # fprop, dgrad, wgrad
    row = {"shape": shape, "proj": proj, "balance": balance, "M": M, "N": N, "K": K, "E": E,
           "empty_experts": sum(c == 0 for c in counts), "methods": {}}
    with torch.no_grad():
        ref = ms["bf16"](x, w, offs).float()
    for name, f in ms.items():
        try:
            with torch.no_grad():
                y = f(x, w, offs).float()
            r = {"rel_err": ((y - ref).norm() / ref.norm()).item()}
            r.update(time_step(f, x, w, offs, dy, quick))
        except Exception as e:  # noqa: BLE001  (one method failing must not hide the others)
            r = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        for key in ("eager_ms", "graph_ms"):
            if r.get(key):
                r[key.replace("_ms", "_tflops")] = flops / r[key] / 1e9
        row["methods"][name] = r
    for key in ("eager_ms", "graph_ms"):  # ratios against bf16 and torchao, the same timing
        base, ao = row["methods"]["bf16"].get(key), row["methods"].get("torchao_fp8", {}).get(key)
        for name, r in row["methods"].items():
            if r.get(key):
                r[f"{key[:-3]}_vs_bf16"] = base / r[key] if base else None
                r[f"{key[:-3]}_vs_torchao"] = ao / r[key] if ao else None
    return row


def print_row(row):
    parts = []
    for name, r in row["methods"].items():
        if "error" in r:
            parts.append(f"{name} ERROR {r['error'][:60]}")
        else:
            g = f"{r['graph_ms']:.3f}" if r.get("graph_ms") else "-"
            ao = r.get("graph_vs_torchao") or r.get("eager_vs_torchao")
            parts.append(f"{name} {r['eager_ms']:.3f}/{g} ms" + (f" (x{ao:.2f} ao)" if ao else ""))
    print(f"{row['shape']:14s} {row['proj']:4s} {row['balance']:8s} " + " | ".join(parts), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results/h200/linear_peers.json"))
    ap.add_argument("--quick", action="store_true", help="fewer timing repetitions")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--projs", default="up,down")
    ap.add_argument("--balances", default="balanced,skewed")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_linear_peers needs a CUDA GPU")
    import triton
    ms, notes = methods()
    meta = {"gpu": torch.cuda.get_device_name(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "torch": torch.__version__, "triton": triton.__version__, "notes": notes,
            "timing": "step = forward + autograd.grad of x and w; eager: do_bench median; graph: CUDA-graph replay",
            "methods": list(ms)}
    print(meta, flush=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    for shape in args.shapes.split(","):
        for proj in args.projs.split(","):
            for bal in args.balances.split(","):
                rows.append(run_case(shape, proj, bal, args.quick, gen, ms))
                print_row(rows[-1])
                torch.cuda.empty_cache()
                with open(args.out, "w") as f:  # after every case: a run cut short keeps what it measured
                    json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
