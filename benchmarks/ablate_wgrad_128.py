"""Why the mx128 wgrad (K-grouped) product runs at ~850 TFLOP/s where fprop and dgrad run at 1150-1240 on the
training preset's shapes (issue 22/23; the per-launch profile, session 16): its promotion against its tile
pipeline, by ablation, on one H200.

The promotion of each 128-token stage is ``acc += P * (sa[n] * sb[k])``: per element one FMUL and one FFMA,
and the 32 column scales each thread needs are read from shared memory after the stage's wgmma wait. The
ablations replace the library's ``_promote`` in this process only (before anything compiles; the library
is untouched) and give wrong numbers on purpose:

- ``full``: the kernel as it is;
- ``row``: ``acc += P * sa[n]`` (no column scales: no FMUL, no column-scale loads);
- ``none``: ``acc += P`` (no scales at all: the bare pipeline with the same wgmma chain and waits).
- ``uniform``: the K-grouped tile map and operands with the M-grouped promotion (``WB32``: one scale per
  128x128 tile, read before the wait, one FFMA per element), fed a dummy tile-scale tensor: fprop's consumer
  on wgrad's problem (session 17; offline it compiles without spills, as fprop does).

Offline (Triton 3.6, sm_90a) the two ablations spill (1.5-1.7 KB per thread) where the full kernel does not,
so their times are an upper bound of the ablated kernels' (a lower bound of what the promotion costs).

Also the same product with BF16 output, at other tile configurations (``full`` only), and the M-grouped fprop / dgrad of the same layer for reference.
Shapes: the gpu-throughput preset's layer (T = 32768 routed rows, dim 2048, F 4096, 8 experts, balanced):
up projection (N = 2F = 8192, K = 2048) and down projection (N = 2048, K = 4096).

    PYTHONPATH=. python benchmarks/ablate_wgrad_128.py --mode full --out out/wgrad_full.json
"""
import argparse
import json
import time

import torch
import triton

from bench_grouped_gemm import rand_fp8
from bench_grouped_gemm_128 import scale_1x128, scale_128x128
from mxmoe.kernels import sm90_gemm_kernel as GK, sm90_gemm_launch as GL, sm90_gemm_promote128 as G
from mxmoe.kernels.sm90_scales import sm90_scale_layout
from mxmoe.kernels.sm90_tile_config import Sm90TileConfig

T, DIM, F, E = 32768, 2048, 4096, 8


def patch(mode: str) -> None:
    """Replace the promotion the K-grouped path compiles with (WB32 False); the M-grouped path is kept."""
    if mode in ("full", "uniform"):
        return
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    if mode == "row":
        @gluon.jit
        def _promote(acc, p, sa, sb, BMW: gl.constexpr, BN: gl.constexpr, WB32: gl.constexpr):
            if WB32:  # the library's M-grouped promotion, as it is
                s2 = gl.expand_dims(sa, 1) * gl.expand_dims(sb, 0)
                return gl.fma(gl.reshape(p, [BMW, BN // 32, 32]), gl.expand_dims(s2, 2), acc)
            else:
                return gl.fma(p, gl.expand_dims(sa, 1), acc)
    else:
        @gluon.jit
        def _promote(acc, p, sa, sb, BMW: gl.constexpr, BN: gl.constexpr, WB32: gl.constexpr):
            if WB32:
                s2 = gl.expand_dims(sa, 1) * gl.expand_dims(sb, 0)
                return gl.fma(gl.reshape(p, [BMW, BN // 32, 32]), gl.expand_dims(s2, 2), acc)
            else:
                return acc + p
    GK._promote = _promote


def k_grouped_uniform(a, sa, b, offs, out_dtype, cfg=None):
    """The library's K-grouped launch with WB32 promotion and a dummy [T/128, K/32] tile-scale tensor (wrong
    numbers on purpose: timing only)."""
    cfg = cfg or Sm90TileConfig()
    N, T = a.shape
    K = b.shape[0]
    E = offs.shape[0]
    out = torch.empty(E, N, K, dtype=out_dtype, device=a.device)
    BM, BN, BK = cfg.block_m, cfg.block_n, cfg.block_k
    s_a = sm90_scale_layout(sa[:, ::4])
    s_b = torch.ones(triton.cdiv(T, 128), triton.cdiv(triton.cdiv(K, 32), 4) * 4, device=a.device)
    mt, nt = triton.cdiv(N, BM), triton.cdiv(K, BN)
    grid = (min(GL._num_sms(a.device), E * mt * nt), )
    c_desc = GL._out_desc(out.view(E * N, K), cfg, 32)
    GK.sm90_mxfp8_grouped_gemm_kernel[grid](
        GL._desc(a, [BM, BK]), GL._desc(b, [BN, BK]), GL._desc(s_a, [1, BM]), GL._desc(s_b, [1, 32]),
        c_desc, out, offs, offs, E, 0, 0, mt, nt, N, K,
        K_GROUPED=True, WB32=True, STAGES=cfg.stages, GROUP_M=cfg.group_m, SEARCH_STEPS=0,
        SPLIT_WG=cfg.split_wg, TMA_STORE=c_desc is not None, num_warps=4, maxnreg=cfg.maxnreg, SG=4,
        CHAIN=cfg.chain)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("full", "row", "none", "uniform"), default="full")
    ap.add_argument("--out", default="wgrad_ablation.json")
    ap.add_argument("--once", action="store_true",
                    help="one call each of the up projection's wgrad (FP32 out) and fprop (and with --mode uniform the "
                         "uniform-promotion wgrad), no timing (under ncu)")
    args = ap.parse_args()
    patch(args.mode)
    dev = "cuda"
    offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * (T // E)
    rows = []
    if args.once:
        N, K = 2 * F, DIM
        a, sa, b, sb = rand_fp8(N, T), scale_1x128(N, T), rand_fp8(K, T), scale_1x128(K, T)
        G.sm90_mx128_k_grouped_gemm(a, sa, b, sb, offs, torch.float32, check_offsets=False)
        x, sx, w = rand_fp8(T, K), scale_1x128(T, K), rand_fp8(E, N, K)
        G.sm90_mx128_m_grouped_gemm(x, sx, w, scale_128x128(E, N, K)[0], offs)
        if args.mode == "uniform":  # third launch: the same wgrad with fprop's promotion
            k_grouped_uniform(a, sa, b, offs, torch.float32)
        torch.cuda.synchronize()
        return
    for proj, N, K in (("up", 2 * F, DIM), ("down", DIM, F)):
        flop = 2 * T * N * K
        a, sa = rand_fp8(N, T), scale_1x128(N, T)  # dy^T / dh^T: 128x1 groups along tokens
        b, sb = rand_fp8(K, T), scale_1x128(K, T)  # x^T / a^T
        if args.mode == "uniform":
            cases = [("wgrad fp32 out, uniform promotion", lambda: k_grouped_uniform(a, sa, b, offs, torch.float32)),
                     ("wgrad bf16 out, uniform promotion", lambda: k_grouped_uniform(a, sa, b, offs, torch.bfloat16)),
                     ("wgrad fp32 out", lambda: G.sm90_mx128_k_grouped_gemm(a, sa, b, sb, offs, torch.float32,
                                                                             check_offsets=False))]
        else:
            cases = [("wgrad fp32 out", lambda: G.sm90_mx128_k_grouped_gemm(a, sa, b, sb, offs, torch.float32,
                                                                             check_offsets=False)),
                     ("wgrad bf16 out", lambda: G.sm90_mx128_k_grouped_gemm(a, sa, b, sb, offs, torch.bfloat16,
                                                                             check_offsets=False))]
        if args.mode == "full":  # wgrad at other tile configurations
            for cfg in (dict(chain=2), dict(chain=8), dict(group_m=4), dict(group_m=16), dict(group_m=1),
                        dict(stages=3)):
                c = Sm90TileConfig(**cfg)
                cases.append((f"wgrad fp32 out {cfg}", lambda c=c: G.sm90_mx128_k_grouped_gemm(
                    a, sa, b, sb, offs, torch.float32, check_offsets=False, config=c)))
        if args.mode in ("full", "uniform"):  # the M-grouped fprop of the same size, for reference
            x, sx, w = rand_fp8(T, K), scale_1x128(T, K), rand_fp8(E, N, K)
            sw, _ = scale_128x128(E, N, K)
            cases.append(("fprop bf16 out", lambda: G.sm90_mx128_m_grouped_gemm(x, sx, w, sw, offs)))
            if args.mode == "uniform":
                cases.append(("fprop fp32 out", lambda: G.sm90_mx128_m_grouped_gemm(x, sx, w, sw, offs,
                                                                                     torch.float32)))
        for name, fn in cases:
            fn()
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(fn, warmup=25, rep=200)
            rows.append({"mode": args.mode, "proj": proj, "case": name, "ms": round(ms, 4),
                         "tflops": round(flop / ms / 1e9, 1)})
            print(rows[-1], flush=True)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "shape": dict(T=T, dim=DIM, F=F, E=E), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
