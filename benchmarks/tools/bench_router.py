"""The router's kernels (``mxmoe.kernels.layer``: ``router_logits``, and backward ``router_dx`` + ``router_dw``
as ``_RouterLogits.backward`` launches them) at the layer bench's router sizes (16384 tokens), with their
error against FP64. Run it once per library tree and compare the labelled rows, e.g. HEAD's against a copy of
an earlier tree (``git archive OLD mxmoe | tar -x -C /tmp/old``):

    PYTHONPATH=/tmp/old:. python benchmarks/tools/bench_router.py --label old --out router.json
    PYTHONPATH=. python benchmarks/tools/bench_router.py --label new --out router.json   # appends

A tree without ``layer.split_bf16`` (before the pieces of the logits' gradient were a kernel of their own) is
timed the way its backward ran: both kernels on the FP32 gradient. Times: triton's ``do_bench_cudagraph``
(CUDA-graph replays, L2 not flushed), microseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

# appended, not prepended: an older mxmoe first on PYTHONPATH stays the one imported
sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks import common as C  # noqa: E402

SHAPES = {  # name: (tokens T, model dim D, experts E) of the router
    "qwen3-30b-a3b": (16384, 2048, 128), "dsv3-16b": (16384, 2048, 64), "mixtral-8x7b": (16384, 4096, 8),
    "llama4-scout": (16384, 5120, 16), "dsv3-671b-ep8": (16384, 7168, 32)}


def measure(label: str, shapes: list[str]) -> list[dict]:
    from triton.testing import do_bench_cudagraph

    from mxmoe.kernels import layer

    def us(fn):
        return 1e3 * do_bench_cudagraph(fn, rep=200)

    pieces = hasattr(layer, "split_bf16")
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name in shapes:
        T, D, E = SHAPES[name]
        x = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
        w = torch.randn(E, D, device="cuda", generator=g) * 0.03
        dl = torch.randn(T, E, device="cuda", generator=g) * 1e-3
        if pieces:
            w3, dl3 = layer.split_bf16(w), layer.split_bf16(dl)
            dw_fn = lambda: layer.router_dw(dl3, x)  # noqa: E731
            bwd = lambda: (layer.router_dx(dl, w3), layer.router_dw(layer.split_bf16(dl), x))  # noqa: E731
        else:
            from mxmoe.ops.router import split_bf16

            w3 = split_bf16(w)
            dw_fn = lambda: layer.router_dw(dl, x)  # noqa: E731
            bwd = lambda: (layer.router_dx(dl, w3), layer.router_dw(dl, x))  # noqa: E731
        r = {"label": label, "shape": name, "T": T, "D": D, "E": E,
             "logits_us": us(lambda: layer.router_logits(x, w3)), "backward_us": us(bwd),
             "dx_us": us(lambda: layer.router_dx(dl, w3)), "dw_us": us(dw_fn),
             "split_us": us(lambda: layer.split_bf16(dl)) if pieces else None}
        (dx, dw), logits = bwd(), layer.router_logits(x, w3)
        rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
        r.update(logits_rel_fp64=rel(logits, x.double() @ w.double().T), dx_rel_fp64=rel(dx, dl.double() @ w.double()),
                 dw_rel_fp64=rel(dw, dl.double().T @ x.double()))
        print(json.dumps(r), flush=True)
        rows.append(r)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", required=True, help="the rows' label (which tree)")
    ap.add_argument("--out", required=True, help="result file; rows of other labels already there are kept")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    a = ap.parse_args(argv)
    now = C.header("router", False)
    old = json.load(open(a.out)) if os.path.exists(a.out) else {"header": now, "rows": []}
    rows = [r for r in old["rows"] if r["label"] != a.label] + measure(a.label, a.shapes.split(","))
    head = old["header"]
    head.setdefault("labels", {})[a.label] = {**now["git"], "mxmoe": now["mxmoe_tree"]}  # the tree timed
    C.write_result(a.out, head, rows)


if __name__ == "__main__":
    main()
