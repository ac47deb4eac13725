"""SwiGLU's exact BF16 arithmetic on its whole domain, and what it costs (one GPU).

The SwiGLU kernels reproduce torch's BF16 results bit for bit: ``F.silu(gate) * up`` forward and autograd's
``(silu_backward(da * up, gate), da * silu(gate))`` backward. Both depend on the gate through FP32 functions
of one BF16 value, so every case is enumerable:

- forward: every one of the 65,536 BF16 gate bit patterns (up = 1: a is silu's BF16 value itself), through
  the elementwise kernel (``layer.swiglu``) and the fused SwiGLU + 1x128 quantization (its bytes against
  ``quantize_dual_128`` of torch's a);
- backward: every (gate, t) pair of BF16 bit patterns, 2^32 of them (up = 1, da = t), through
  ``layer.swiglu_backward``, against torch's two gradients.

NaN outputs match where torch's are NaN (payloads aside); every other output matches bit for bit.
Then the kernels are timed (do_bench medians, % of a device copy of the same bytes, same run) on the training
preset's h [32768, 8192] and Mixtral's [32768, 7168], N(0, 1) values (as the up projection gives them), with
``--sweep`` also the elementwise kernels at other tiles.

Session 16 (H200) ran this against a branch-free division (an approximate reciprocal, one Newton step and
one FMA correction, no slow path): 1 of the 65,536 gate values came out wrong (forward; every t with it in
d_up), and it was no faster on N(0, 1) data; IEEE division kept (``results/h200/silu_exhaustive_s16_fastdiv.json``; this script as it is: ``silu_exhaustive_s16.json``).

    PYTHONPATH=. python benchmarks/check_silu_exhaustive.py --out out/silu.json
"""
import argparse
import json
import time

import torch
import triton

from bench_quantize import copy_tbps
from mxmoe.kernels import layer, layer_triton, quantize as Q, quantize_fused as QF

ALL_BF16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def mismatches(got: torch.Tensor, want: torch.Tensor) -> int:
    """Elements where got and want differ: bits, or NaN-ness where want is NaN."""
    gn, wn = got.isnan(), want.isnan()
    same = torch.where(wn, gn, got.view(torch.int16) == want.view(torch.int16))
    return int((~same).sum())


def check_forward(dev) -> dict:
    gate = ALL_BF16.to(dev).view(256, 256)
    h = torch.cat([gate, torch.ones_like(gate)], dim=1)
    want = torch.nn.functional.silu(gate) * torch.ones_like(gate)
    out = {"swiglu_kernel": mismatches(layer.swiglu(h), want)}
    got = QF.swiglu_quantize_128(h)[:4]
    ref = Q.quantize_dual_128(want)
    out["swiglu_quantize_128"] = sum(int((g.view(torch.uint8) != r.view(torch.uint8)).sum())
                                     for g, r in zip(got, ref))
    return out


def check_backward(dev, rows: int = 4096) -> dict:
    gate = ALL_BF16.to(dev)[None, :].expand(rows, -1)
    h = torch.cat([gate, torch.ones_like(gate)], dim=1)  # the same gates (and up = 1) for every chunk of t
    bad_gate = bad_up = 0
    for t0 in range(0, 65536, rows):
        da = ALL_BF16[t0:t0 + rows].to(dev)[:, None].expand(-1, 65536).contiguous()
        dh = layer.swiglu_backward(da, h)
        want_gate = torch.ops.aten.silu_backward(da, gate)  # da * up with up = 1 is da
        want_up = da * torch.nn.functional.silu(gate)
        bad_gate += mismatches(dh[:, :65536], want_gate)
        bad_up += mismatches(dh[:, 65536:], want_up)
        del da, dh, want_gate, want_up
    return {"d_gate": bad_gate, "d_up": bad_up, "pairs": 65536 * 65536}


def timed(fn, nbytes: int) -> dict:
    ms = triton.testing.do_bench(fn, warmup=25, rep=200)
    tbps = nbytes / ms / 1e9
    return {"ms": round(ms, 5), "tbps": round(tbps, 4), "ratio": round(tbps / copy_tbps(nbytes), 4)}


def time_kernels(dev, sweep: bool) -> list:
    rows = []
    for M, F2 in [(32768, 8192), (32768, 7168)]:
        F = F2 // 2
        # activation-like values (N(0, 1)): h's wide rows (2^+-20) would put IEEE division on its slow path
        h = torch.randn(M, F2, device=dev).to(torch.bfloat16)
        da = torch.randn(M, F, device=dev).to(torch.bfloat16)
        a = torch.empty(M, F, dtype=torch.bfloat16, device=dev)
        dh = torch.empty_like(h)
        fwd_bytes, bwd_bytes = 3 * M * F * 2, 5 * M * F * 2
        q_bytes = 2 * M * F2 + 2 * M * F + 2 * M * F // 32  # h in, a's FP8 both ways + scales out
        cases = [("swiglu_128 (fused)", lambda: QF.swiglu_quantize_128(h), q_bytes),
                 ("swiglu + dual_128 (pair)", lambda: Q.quantize_dual_128(layer.swiglu(h)), q_bytes),
                 ("swiglu", lambda: layer.swiglu(h), fwd_bytes),
                 ("swiglu_backward", lambda: layer.swiglu_backward(da, h), bwd_bytes)]
        tiles = [(4, 1024, 4), (8, 1024, 8), (2, 1024, 4), (8, 512, 4), (16, 512, 8), (4, 2048, 8), (1, 1024, 4),
                 (16, 256, 4)]
        for br, bf, w in tiles if sweep else []:
            cfg = dict(BR=br, BF=bf, SOFT=False, num_warps=w)
            grid = (triton.cdiv(M, br), triton.cdiv(F, bf))
            cases.append((f"swiglu BR{br} BF{bf} w{w}", lambda g=grid, c=cfg: layer_triton.swiglu_kernel[g](
                h, a, M, F, h.stride(0), a.stride(0), **c), fwd_bytes))
            cases.append((f"swiglu_backward BR{br} BF{bf} w{w}", lambda g=grid, c=cfg: layer_triton.swiglu_backward_kernel[g](
                da, h, h, dh, M, F, da.stride(0), h.stride(0), h.stride(0), dh.stride(0), MX=False, **c), bwd_bytes))
        for name, fn, nbytes in cases:
            rows.append({"kernel": name, "shape": f"{M}x{F2}", **timed(fn, nbytes)})
            print(rows[-1], flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="silu_exhaustive.json")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time the elementwise kernels at other tiles")
    args = ap.parse_args()
    dev = torch.device("cuda")
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "date": time.strftime("%Y-%m-%dT%H:%M:%S")}
    res["forward_mismatches"] = check_forward(dev)
    print("forward", res["forward_mismatches"], flush=True)
    res["backward_mismatches"] = check_backward(dev)
    print("backward", res["backward_mismatches"], flush=True)
    if not args.no_timing:
        res["rows"] = time_kernels(dev, args.sweep)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
