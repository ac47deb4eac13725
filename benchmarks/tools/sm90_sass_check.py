"""Offline sm_90 compile of the Hopper grouped GEMM kernels (CPU only, no GPU): registers, spills,
shared memory, ptxas's C7514 (wgmma serialization) note and the SASS instruction mix.

The wrappers run on CPU tensors with the launch replaced by a compile (Triton's driver is faked to
report an sm_90 target), so the kernel compiled is exactly the one the wrapper would launch, with the
same descriptors and constexprs. For each configuration it prints one line and, with ``--sass DIR``,
writes the SASS.

    PYTHONPATH=. python benchmarks/tools/sm90_sass_check.py [--sass /tmp/sass] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offline_sm90 import install_compile_only, ptxas_and_sass  # noqa: E402


def _install_compile_only():
    """Make every kernel[grid](...) launch a compile-only warmup; returns the list the kernels land in."""
    import mxmoe.kernels.sm90_gemm_promote32 as G32
    import mxmoe.kernels.sm90_gemm_promote128 as G128
    for G in (G32, G128):  # (the launchers' own references to the check; CPU tensors size grids for 132 SMs)
        G._check_sm90 = lambda t: None
    return install_compile_only()


def _cases():
    """(name, thunk) pairs: each thunk calls a wrapper once on CPU tensors."""
    import mxmoe.kernels.sm90_gemm_promote32 as G
    import mxmoe.kernels.sm90_gemm_promote128 as G128
    from mxmoe.kernels.sm90_tile_config import Sm90TileConfig
    f8, e8 = torch.float8_e4m3fn, torch.float8_e8m0fnu
    M, N, K, E, T = 1024, 512, 1024, 4, 1024

    def data(*s):
        return torch.zeros(*s, dtype=f8)

    def sc(*s):
        return torch.full(s, 127, dtype=torch.uint8).view(e8)

    offs = torch.tensor([256, 512, 768, 1024], dtype=torch.int32)
    a, asc, b, bsc = data(M, K), sc(M, K // 32), data(E, N, K), sc(E, N, K // 32)
    ka, kas, kb, kbs = data(N, T), sc(N, T // 32), data(K, T), sc(K, T // 32)
    cases = [
        ("m1x32_bf16", lambda: G.sm90_mxfp8_m_grouped_gemm(a, asc, b, bsc, offs, torch.bfloat16, 1)),
        ("m32x32_bf16", lambda: G.sm90_mxfp8_m_grouped_gemm(a, asc, b, bsc, offs, torch.bfloat16, 32)),
        ("m32x32_256x3", lambda: G.sm90_mxfp8_m_grouped_gemm(a, asc, b, bsc, offs, torch.bfloat16, 32,
                                                             config=Sm90TileConfig(block_k=256, stages=3))),
        ("k1x32_fp32", lambda: G.sm90_mxfp8_k_grouped_gemm(ka, kas, kb, kbs, offs, torch.float32)),
        ("m1x32_8warp", lambda: G.sm90_mxfp8_m_grouped_gemm(a, asc, b, bsc, offs, torch.bfloat16, 1,
                                                            config=Sm90TileConfig(split_wg=False))),
    ]
    if hasattr(G128, "sm90_mx128_m_grouped_gemm"):
        cases += [
            ("m128_bf16", lambda: G128.sm90_mx128_m_grouped_gemm(a, asc, b, bsc, offs, torch.bfloat16)),
            ("m128_fp32", lambda: G128.sm90_mx128_m_grouped_gemm(a, asc, b, bsc, offs, torch.float32)),
            ("k128_fp32", lambda: G128.sm90_mx128_k_grouped_gemm(ka, kas, kb, kbs, offs, torch.float32,
                                                                 check_offsets=False)),
            ("k128_bf16", lambda: G128.sm90_mx128_k_grouped_gemm(ka, kas, kb, kbs, offs, torch.bfloat16,
                                                                 check_offsets=False)),
        ]
        # many experts: the launch default at 128 (vector search), and the binary search past it (256, 512)
        for e in (128, 256, 512):
            offs_e = torch.arange(1, e + 1, dtype=torch.int32) * (M // e)
            b_e, bs_e = data(e, N, K), sc(e, N, K // 32)
            cases.append((f"m128_bf16_e{e}", lambda o=offs_e, b=b_e, s=bs_e: G128.sm90_mx128_m_grouped_gemm(
                a, asc, b, s, o, torch.bfloat16)))
    return cases


def _mix(sass: str) -> collections.Counter:
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.\S+)?", line)
        if m:
            ops[m.group(1)] += 1
    return ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sass", help="directory to write each case's SASS and PTX into")
    ap.add_argument("--only", nargs="*", help="case names to compile (default: all)")
    args = ap.parse_args()
    compiled = _install_compile_only()
    for name, thunk in _cases():
        if args.only and name not in args.only:
            continue
        compiled.clear()
        thunk()
        k = compiled[-1]
        log, sass = ptxas_and_sass(k)
        ops = _mix(sass)
        total = sum(ops.values())
        stack = re.search(r"(\d+) bytes stack frame", log)
        spill = re.search(r"(\d+) bytes spill stores", log)
        regs = re.search(r"Used (\d+) registers", log)
        print(f"{name:14s} regs {regs.group(1) if regs else '?'} stack {stack.group(1) if stack else '?'} "
              f"spill-st {spill.group(1) if spill else '?'} smem {k.metadata.shared:6d} C7514 "
              f"{'YES' if 'C7514' in log else 'no'} | SASS {total}: QGMMA {ops['QGMMA']} FFMA {ops['FFMA']} "
              f"FMUL {ops['FMUL']} LDS {ops['LDS']} STS {ops['STS']} BAR {ops['BAR']} "
              f"DEPBAR {ops['WARPGROUP']}")
        if args.sass:
            os.makedirs(args.sass, exist_ok=True)
            open(os.path.join(args.sass, f"{name}.sass"), "w").write(sass)
            open(os.path.join(args.sass, f"{name}.ptx"), "w").write(k.asm["ptx"])


if __name__ == "__main__":
    main()
