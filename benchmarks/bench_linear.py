"""Linear suite: one expert linear layer, forward + backward with quantization included, against its peers.

    python -m benchmarks linear [--quick] [--out benchmarks/results/<gpu>/linear.json]

The step timed: ``y = linear(x, w, offs)`` then ``dx, dw = autograd.grad(y, (x, w), dy)``, x ``[M, K]``
and w ``[E, N, K]`` BF16, rows grouped by expert (DESIGN §5 shapes, ``benchmarks.common.SHAPES``; up:
N = 2 x FFN, K = hidden; down: N = hidden, K = FFN; balanced and skewed token counts in multiples of 128,
so every method takes them unpadded; --quick: dsv3-ep32 up, balanced). Methods:

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

import torch

from benchmarks import common as C
from mxmoe.ops import grouped_linear

SUITE = "linear"
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
    def step():
        y = f(x, w, offs)
        return torch.autograd.grad(y, (x, w), dy)

    step()
    torch.cuda.synchronize()
    out = {"eager_ms": C.bench_ms(step, quick)}
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
        out["graph_ms"] = C.bench_ms(g.replay, quick)
    except Exception as e:  # noqa: BLE001  (a method that cannot be captured: say why)
        out["graph_ms"] = None
        out["graph_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        torch.cuda.synchronize()
    return out


def run_case(shape, proj, balance, quick, gen, ms):
    s = C.SHAPES[shape]
    E, M, (N, K) = s.experts, s.rows, s.proj(proj)
    counts = C.token_counts(M, E, balance, gen, unit=128)
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


def build_parser():
    ap = C.parser(SUITE, __doc__)
    ap.add_argument("--shapes", default=None, help="comma-separated names of benchmarks.common.SHAPES (default all)")
    ap.add_argument("--projs", default=None, help="default up,down (--quick: up)")
    ap.add_argument("--balances", default=None, help="default balanced,skewed (--quick: balanced)")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    shapes = C.shape_list(args.shapes, args.quick)
    projs = (args.projs or ("up" if args.quick else "up,down")).split(",")
    balances = (args.balances or ("balanced" if args.quick else "balanced,skewed")).split(",")
    C.require_cuda(SUITE)
    out = args.out or C.default_out(SUITE)
    ms, notes = methods()
    head = C.header(SUITE, args.quick, notes=notes, methods=list(ms),
                    timing="step = forward + autograd.grad of x and w; eager: do_bench median; graph: CUDA-graph "
                           "replay (do_bench median)")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for shape in shapes:
        for proj in projs:
            for bal in balances:
                rows.append(run_case(shape, proj, bal, args.quick, gen, ms))
                print_row(rows[-1])
                torch.cuda.empty_cache()
                C.write_result(out, head, rows)  # after every case: a run cut short keeps what it measured


if __name__ == "__main__":
    main()
