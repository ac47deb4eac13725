"""Our grouped GEMM variants beside cuBLAS/CUTLASS on one shape: do_bench TFLOP/s, or one launch each for ncu.

    python benchmarks/profile_grouped_gemm.py time [shape] [up|down] [case,case,...]
    ncu --clock-control none --nvtx --nvtx-include "prof/" --section SpeedOfLight --section SchedulerStats \\
        --metrics sm__pipe_tensor_op_hmma_type_hmma_hgmma_qgmma_cycles_active.avg.pct_of_peak_sustained_elapsed \\
        --csv --page details python benchmarks/profile_grouped_gemm.py prof [shape] [up|down]

fprop of the up projection (N = 2 x FFN, K = hidden; ``down``: N = hidden, K = FFN), balanced token counts
(default shape mixtral-8x7b; or ``E:M:hidden:ffn``); an optional comma list keeps only those cases. The mx128 kernel (recipe mxfp8_128) is timed in its default configuration and
with the fields the next A/B needs (chain, stages, group_m), beside a per-expert cuBLAS block-scaled loop.
Variants: the real kernel (1x32; 32x32 at 256 x 2, its default, at 256 x 3 with register stores, and at
128 x 4), CUTLASS FP8 rowwise and BF16 grouped (``torch._scaled_grouped_mm`` / ``torch._grouped_mm``),
and cuBLAS FP8 rowwise and BF16 dense products of the same total size (all rows against expert 0's
weight). The ablation cases of earlier sessions (bare_128x128, bare_128x256, noprom_32x32_128x128) left
with the kernel's ablation modes; their measurements stay in benchmarks/NOTES_grouped_gemm.md.
Session 10's run (before the TMA-store epilogue, so every variant of ours with register stores and no
256 x 2 case) is in benchmarks/results/h200/grouped_gemm_ncu_s10.csv.
"""
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
import bench_grouped_gemm as B  # noqa: E402
import mxmoe.kernels.sm90_gemm_promote128 as K  # noqa: E402
import mxmoe.kernels.sm90_gemm_promote32 as K32  # noqa: E402
from mxmoe.kernels.sm90_tile_config import Sm90TileConfig as C  # noqa: E402


def main():
    mode = sys.argv[1]
    shape = sys.argv[2] if len(sys.argv) > 2 else "mixtral-8x7b"
    E, M, hidden, ffn = B.SHAPES[shape] if shape in B.SHAPES else map(int, shape.split(":"))
    only = sys.argv[4].split(",") if len(sys.argv) > 4 else None
    N, Kd = (hidden, ffn) if len(sys.argv) > 3 and sys.argv[3] == "down" else (2 * ffn, hidden)
    offs = torch.tensor(B.token_counts(M, E, "balanced", torch.Generator().manual_seed(1))).cumsum(0)
    offs = offs.to(torch.int32).cuda()
    a, sa, b = B.rand_fp8(M, Kd), B.rand_scale(M, Kd // 32), B.rand_fp8(E, N, Kd)
    sb1, sb32 = B.rand_scale(E, N, Kd // 32), B.rand_scale_32x32(E, N, Kd // 32)
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
    rs, cs = torch.rand(M, device="cuda") + .5, torch.rand(E, N, device="cuda") + .5
    rs1, cs1 = rs[:, None], cs[:1]
    import bench_grouped_gemm_128 as B128  # noqa: E402
    counts = B128.token_counts(M, E, "balanced", torch.Generator())
    offs128 = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    sa128 = B128.scale_1x128(M, Kd)
    sb128, tiles = B128.scale_128x128(E, N, Kd)
    loop128, _ = B128.cublas_block_loop(a, sa128.view(torch.uint8), b, tiles, counts)

    def mx128(**fields):
        cfg = C(**fields)
        return lambda: K.sm90_mx128_m_grouped_gemm(a, sa128, b, sb128, offs128, torch.bfloat16, config=cfg)

    def ours(wb, cfg):
        return lambda: K32.sm90_mxfp8_m_grouped_gemm(a, sa, b, sb32 if wb == 32 else sb1, offs, weight_block=wb,
                                                   config=cfg)

    cases = {
        "ours_1x32": ours(1, C()),
        "ours_32x32_bk256": ours(32, C(block_k=256, stages=2)),
        "ours_32x32_bk256_s3": ours(32, C(block_k=256, stages=3)),
        "ours_32x32_bk128": ours(32, C()),
        "mx128": mx128(),
        "mx128_chain2": mx128(chain=2),
        "mx128_stages5": mx128(stages=5),
        "mx128_group_m16": mx128(group_m=16),
        "mx128_group_m32": mx128(group_m=32),
        "cublas_block_loop_mx128": loop128,
        "cutlass_fp8rw_grouped": lambda: torch._scaled_grouped_mm(a, b.transpose(-2, -1), rs, cs, offs=offs,
                                                                  out_dtype=torch.bfloat16),
        "cutlass_bf16_grouped": lambda: torch._grouped_mm(a16, b16.transpose(-2, -1), offs=offs),
        "cublas_fp8rw_dense": lambda: torch._scaled_mm(a, b[0].T, rs1, cs1, out_dtype=torch.bfloat16),
        "cublas_bf16_dense": lambda: a16 @ b16[0].T,
    }
    flop = 2.0 * M * N * Kd
    for name, fn in cases.items():
        if only is not None and name not in only:
            continue
        fn()
        torch.cuda.synchronize()
        if mode == "time":
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            print(f"{name:<24} {flop / ms / 1e9:7.0f} TFLOP/s  {ms:.3f} ms", flush=True)
        else:
            torch.cuda.nvtx.range_push("prof")
            fn()
            torch.cuda.nvtx.range_pop()
            torch.cuda.synchronize()


if __name__ == "__main__":
    main()
