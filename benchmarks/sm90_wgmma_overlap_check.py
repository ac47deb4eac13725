"""Offline check (CPU, no GPU): when does ptxas keep an async FP8 wgmma in flight while the CUDA
cores read another wgmma's result -- the overlap MX promotion needs (NOTES_grouped_gemm.md, session 5)?

Compiles one small Gluon kernel for sm_90a in four loop shapes, each issuing m64n128k32 FP8 wgmmas
into fresh FP32 partials and folding every partial into an accumulator with an FMA ("promotion"):

    0  each step waited to 0 before its promotion (no overlap by construction)
    1  issue step i, retire i-1 with wait(1), promote it; partials swapped -> one in flight at the back-edge
    2  two steps per iteration into fixed partials, wait(1) / wait(0): nothing in flight at the back-edge
    3  like 1 but unrolled by 2 with fixed roles (no swap): one partial in flight at the back-edge

and reports, per shape, ptxas's C7514 note ("wgmma.mma_async instructions are serialized ..."), the
registers, and the SASS: the QGMMA destination registers and the WARPGROUP.DEPBAR thresholds (0x1 =
one wgmma still in flight while the CUDA cores work; only 0x0 = serialized).

    PYTHONPATH=. python benchmarks/sm90_wgmma_overlap_check.py [--ptxas /usr/local/cuda-13.0/bin/ptxas]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait


@gluon.jit
def _mma(a_s, b_s, i, p):
    return warpgroup_mma(a_s.index(i % 4), b_s.index(i % 4).permute((1, 0)), p, use_acc=False, is_async=True)


@gluon.jit
def promote_loop_kernel(a_ptr, b_ptr, c_ptr, s_ptr, KSTEPS, MODE: gl.constexpr):
    BM: gl.constexpr = 64
    BN: gl.constexpr = 128
    BK: gl.constexpr = 32
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
    ld: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [4, 1], [1, 0])
    a_s = gl.allocate_shared_memory(gl.float8e4nv, [4, BM, BK], gl.NVMMASharedLayout.get_default_for([BM, BK], gl.float8e4nv))
    b_s = gl.allocate_shared_memory(gl.float8e4nv, [4, BN, BK], gl.NVMMASharedLayout.get_default_for([BN, BK], gl.float8e4nv))
    ra = gl.arange(0, BM, gl.SliceLayout(1, ld))
    rb = gl.arange(0, BN, gl.SliceLayout(1, ld))
    ck = gl.arange(0, BK, gl.SliceLayout(0, ld))
    for s in gl.static_range(4):
        a_s.index(s).store(gl.load(a_ptr + s * BM * BK + gl.expand_dims(ra, 1) * BK + gl.expand_dims(ck, 0)))
        b_s.index(s).store(gl.load(b_ptr + s * BN * BK + gl.expand_dims(rb, 1) * BK + gl.expand_dims(ck, 0)))
    fence_async_shared()
    sc = gl.expand_dims(gl.load(s_ptr + gl.arange(0, BN, gl.SliceLayout(0, mma))), 0)
    acc = gl.zeros([BM, BN], gl.float32, mma)
    p_a = gl.zeros([BM, BN], gl.float32, mma)
    p_b = gl.zeros([BM, BN], gl.float32, mma)
    if MODE == 0:
        for i in range(KSTEPS):
            p_a = _mma(a_s, b_s, i, p_a)
            p_a = warpgroup_mma_wait(num_outstanding=0, deps=(p_a, ))
            acc = gl.fma(p_a, sc, acc)
    elif MODE == 1:
        p_a = _mma(a_s, b_s, 0, p_a)
        for i in range(1, KSTEPS):
            p_b = _mma(a_s, b_s, i, p_b)
            p_a = warpgroup_mma_wait(num_outstanding=1, deps=(p_a, ))
            acc = gl.fma(p_a, sc, acc)
            p_a, p_b = p_b, p_a
        acc = gl.fma(warpgroup_mma_wait(num_outstanding=0, deps=(p_a, )), sc, acc)
    elif MODE == 2:
        for i in range(0, KSTEPS, 2):
            p_a = _mma(a_s, b_s, i, p_a)
            p_b = _mma(a_s, b_s, i + 1, p_b)
            p_a = warpgroup_mma_wait(num_outstanding=1, deps=(p_a, ))
            acc = gl.fma(p_a, sc, acc)
            p_b = warpgroup_mma_wait(num_outstanding=0, deps=(p_b, ))
            acc = gl.fma(p_b, sc, acc)
    else:
        p_b = _mma(a_s, b_s, 0, p_b)
        for i in range(1, KSTEPS - 1, 2):
            p_a = _mma(a_s, b_s, i, p_a)
            p_b = warpgroup_mma_wait(num_outstanding=1, deps=(p_b, ))
            acc = gl.fma(p_b, sc, acc)
            p_b = _mma(a_s, b_s, i + 1, p_b)
            p_a = warpgroup_mma_wait(num_outstanding=1, deps=(p_a, ))
            acc = gl.fma(p_a, sc, acc)
        acc = gl.fma(warpgroup_mma_wait(num_outstanding=0, deps=(p_b, )), sc, acc)
    rm = gl.arange(0, BM, gl.SliceLayout(1, mma))
    rn = gl.arange(0, BN, gl.SliceLayout(0, mma))
    gl.store(c_ptr + gl.expand_dims(rm, 1) * BN + gl.expand_dims(rn, 0), acc)


def main() -> None:
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ptxas", default=os.path.join(bin_dir, "ptxas"), help="ptxas to assemble with (default: triton's)")
    args = ap.parse_args()
    version = subprocess.run([args.ptxas, "--version"], capture_output=True, text=True).stdout.strip().split("\n")[-1]
    print(f"ptxas: {args.ptxas} ({version}); triton {triton.__version__}")
    sig = dict(a_ptr="*fp8e4nv", b_ptr="*fp8e4nv", c_ptr="*fp32", s_ptr="*fp32", KSTEPS="i32", MODE="constexpr")
    with tempfile.TemporaryDirectory() as tmp:
        for mode in range(4):
            src = GluonASTSource(promote_loop_kernel, sig, dict(MODE=mode), {(i,): [["tt.divisibility", 16]] for i in range(4)})
            ptx = triton.compile(src, target=GPUTarget("cuda", 90, 64), options=dict(num_warps=4)).asm["ptx"]
            ptx_path, cubin = os.path.join(tmp, f"m{mode}.ptx"), os.path.join(tmp, f"m{mode}.cubin")
            open(ptx_path, "w").write(ptx)
            log = subprocess.run([args.ptxas, "-arch=sm_90a", "-v", ptx_path, "-o", cubin], capture_output=True, text=True)
            log = log.stdout + log.stderr
            sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", cubin], capture_output=True, text=True).stdout
            regs = re.search(r"Used (\d+) registers", log)
            dst = sorted(set(re.findall(r"QGMMA\.\S+ (R\d+),", sass)))
            depbar = sorted(set(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x\d)", sass)))
            waits = re.findall(r"wgmma\.wait_group\.sync\.aligned (\d)", ptx)
            print(f"mode {mode}: PTX wait_group {waits}; ptxas C7514 {'yes' if 'C7514' in log else 'no'}; "
                  f"{regs.group(1) if regs else '?'} registers; SASS QGMMA destinations {dst}, DEPBAR thresholds {depbar}")


if __name__ == "__main__":
    main()
