"""M-grouped MXFP8 GEMM that expands its operands to BF16 inside the kernel (Triton, BF16 tensor cores).

**Status: built and verified on CPU (``TRITON_INTERPRET=1``) only; not yet run or timed on a GPU,
and not wired into the library's dispatch.** It is the design NOTES_grouped_gemm.md names for the
1x32 targets of issue 4: the exact MX product without per-step promotion.

Why it is exact: ``e4m3 * 2^(b-127)`` has at most 4 significant bits, so it is a BF16 value whenever
it lies in FP32's normal range (:func:`mxmoe.kernels.dequantize.mx_expand_bf16`, the one definition
of the expansion, also used by the QDQ kernels). BF16 x BF16 products are exact in FP32, so
``tl.dot`` of the expanded tiles with FP32 accumulation is the MX product up to FP32 summation
order, the same numbers as the expansion route (``dequantize_bf16`` + ``torch._grouped_mm``) without
the BF16 operands ever being written to memory: the kernel reads 1 byte per operand element plus
1/32 of a scale byte, against 2 (+ the expansion pass) on the expansion route.

Form (fprop and dgrad of an expert linear layer)::

    a [M, K] e4m3 + sa [M, K/32] e8m0   rows grouped by expert: group e is rows offs[e-1] .. offs[e]-1
    b [E, N, K] e4m3 + sb [E, N, K/32]  one matrix per expert, K contiguous
    c [M, N] = a_e @ b_e^T per group (BF16 or FP32); rows past offs[-1] are not written

Tiles: [BM, BN] output tiles numbered expert by expert (the tile counts per expert are computed on the
device: no host synchronization), inside an expert in supergroups of GROUP_M m-tiles (L2 reuse of B);
a program finds its expert by binary search over the cumulative tile counts. The grid is the upper
bound ``(cdiv(M, BM) + E) * cdiv(N, BN)``; programs past the last tile return at once.
"""

from __future__ import annotations

import os

import torch

from mxmoe.formats import BLOCK
from mxmoe.kernels.quantize import _interpreting

_E4M3, _E8M0 = torch.float8_e4m3fn, torch.float8_e8m0fnu

try:
    import triton
    import triton.language as tl

    from mxmoe.kernels.dequantize import mx_expand_bf16
    from mxmoe.kernels.quantize_triton import _to_bf16, _to_f32
except ImportError:  # pragma: no cover - triton is optional
    triton = None

if triton is not None:

    @triton.jit
    def _expanded_tile(q_ptr, s_ptr, rows, k0, row_ok, K, stride_q, stride_s, BR: tl.constexpr, BK: tl.constexpr,
                       BF16_SCALE: tl.constexpr):
        """BF16 values [BR, BK] of rows ``rows`` (int64 [BR]), columns k0 .. k0+BK-1 of an MX matrix
        (zero outside row_ok / K: data 0 with scale byte 127 expands to 0).

        BF16_SCALE (experimental, not yet checked on a GPU): E4M3 -> BF16 (exact) times the scale as a
        BF16 power of two (byte 0: the subnormal 2^-127, 0xFF: NaN): one rounding of the exact
        product, the same value as :func:`mx_expand_bf16`'s two FP32 factors, in fewer instructions
        (the offline SASS of ``sass_report`` compares the two)."""
        k = k0 + tl.arange(0, BK)
        kb = k0 // 32 + tl.arange(0, BK // 32)
        q = tl.load(q_ptr + rows[:, None] * stride_q + k[None, :], mask=row_ok[:, None] & (k < K)[None, :], other=0)
        sb = tl.load(s_ptr + rows[:, None] * stride_s + kb[None, :], mask=row_ok[:, None] & (kb < K // 32)[None, :],
                     other=127).to(tl.int32)
        q8 = tl.reshape(q.to(tl.float8e4nv, bitcast=True), (BR, BK // 32, 32))
        if BF16_SCALE:
            s16 = tl.where(sb == 0, 0x40, tl.where(sb == 255, 0x7FC0, sb << 7)).to(tl.int16).to(tl.bfloat16, bitcast=True)
            v = q8.to(tl.bfloat16) * s16[:, :, None]
        else:
            v = mx_expand_bf16(q8.to(tl.float32), sb[:, :, None])
        return tl.reshape(v, (BR, BK))

    @triton.jit
    def mx_expand_grouped_gemm_kernel(
        a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, offs_ptr, tile_end_ptr,
        N, E, stride_am, stride_sam, stride_be, stride_bn, stride_sbe, stride_sbn, stride_cm,
        K: tl.constexpr, LOG2_E: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
        SOFT: tl.constexpr, BF16_SCALE: tl.constexpr,
    ):
        pid = tl.program_id(0)
        if pid >= tl.load(tile_end_ptr + E - 1):
            return
        # expert e: the first with tile_end[e] > pid (binary search over [0, E))
        lo = pid * 0
        hi = lo + E
        for _ in tl.static_range(LOG2_E + 1):
            mid = (lo + hi) // 2
            right = tl.load(tile_end_ptr + mid, mask=mid < E, other=2**30) <= pid  # e lies right of mid
            lo = tl.where(right, mid + 1, lo)
            hi = tl.where(right, hi, mid)
        e = lo
        first_tile = tl.load(tile_end_ptr + e - 1, mask=e > 0, other=0)
        row_start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
        row_end = tl.load(offs_ptr + e)
        n_n = tl.cdiv(N, BN)
        n_m = tl.cdiv(row_end - row_start, BM)
        local = pid - first_tile
        per_group = GROUP_M * n_n
        first_m = (local // per_group) * GROUP_M
        group_rows = tl.minimum(n_m - first_m, GROUP_M)
        pid_m = first_m + (local % per_group) % group_rows
        pid_n = (local % per_group) // group_rows

        rows = row_start + pid_m * BM + tl.arange(0, BM)
        row_ok = rows < row_end
        cols = pid_n * BN + tl.arange(0, BN)
        col_ok = cols < N
        rows64 = rows.to(tl.int64)
        a_base = a_ptr
        b_base = b_ptr + e.to(tl.int64) * stride_be
        sb_base = sb_ptr + e.to(tl.int64) * stride_sbe
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in tl.range(0, K, BK):  # K constexpr (a model dim): a static trip count, software-pipelined
            a16 = _expanded_tile(a_base, sa_ptr, rows64, k0, row_ok, K, stride_am, stride_sam, BM, BK, BF16_SCALE)
            b16 = _expanded_tile(b_base, sb_base, cols.to(tl.int64), k0, col_ok, K, stride_bn, stride_sbn, BN, BK,
                                 BF16_SCALE)
            if SOFT:  # the interpreter's dot does not take BF16: the same exact values in FP32
                acc = tl.dot(_to_f32(a16), tl.trans(_to_f32(b16)), acc, input_precision="ieee")
            else:
                acc = tl.dot(a16, tl.trans(b16), acc)
        c = c_ptr + rows64[:, None] * stride_cm + cols[None, :]
        out = _to_bf16(acc, SOFT) if c_ptr.dtype.element_ty == tl.bfloat16 else acc
        tl.store(c, out, mask=row_ok[:, None] & col_ok[None, :])


def mx_expand_grouped_mm(a_data: torch.Tensor, a_scale: torch.Tensor, b_data: torch.Tensor, b_scale: torch.Tensor,
                         offs: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                         BM: int = 128, BN: int = 128, BK: int = 64, GROUP_M: int = 8, num_warps: int = 8,
                         num_stages: int = 3, bf16_scale: bool = False) -> torch.Tensor:
    """M-grouped MX product with the operands expanded to BF16 in the kernel (see the module doc).

    Args:
        a_data: ``float8_e4m3fn [M, K]``, K contiguous; a_scale: ``float8_e8m0fnu [M, K/32]``.
        b_data: ``float8_e4m3fn [E, N, K]``, K contiguous; b_scale: ``float8_e8m0fnu [E, N, K/32]``.
        offs: int32 ``[E]`` cumulative group ends (non-decreasing, ``offs[-1] <= M``; not checked:
            that would synchronize).
        out_dtype: ``torch.bfloat16`` or ``torch.float32``.
        bf16_scale: the experimental expansion (E4M3 -> BF16 times a BF16 power of two; see
            ``_expanded_tile``), not yet checked on a GPU; ignored under the interpreter.
    Returns:
        ``[M, N]`` out_dtype; rows past ``offs[-1]`` are left unwritten (uninitialized).
    Raises:
        TypeError / ValueError: dtypes, shapes, K not a multiple of 32, a non-contiguous K dim.
    """
    if triton is None:  # pragma: no cover
        raise RuntimeError("mx_expand_grouped_mm needs triton")
    if (a_data.dtype, b_data.dtype, a_scale.dtype, b_scale.dtype) != (_E4M3, _E4M3, _E8M0, _E8M0):
        raise TypeError("mx_expand_grouped_mm expects e4m3 data and e8m0 scales")
    if out_dtype not in (torch.bfloat16, torch.float32) or offs.dtype != torch.int32:
        raise TypeError(f"out_dtype must be bfloat16 or float32 and offs int32, got {out_dtype}, {offs.dtype}")
    if a_data.dim() != 2 or b_data.dim() != 3 or a_data.shape[1] != b_data.shape[2] or offs.shape != (b_data.shape[0],):
        raise ValueError(f"expects a [M, K], b [E, N, K], offs [E]; got {tuple(a_data.shape)}, {tuple(b_data.shape)}, "
                         f"{tuple(offs.shape)}")
    (M, K), (E, N, _) = a_data.shape, b_data.shape
    if K % BLOCK or a_scale.shape != (M, K // BLOCK) or b_scale.shape != (E, N, K // BLOCK):
        raise ValueError(f"K must be a multiple of 32 with scales [M, K/32] and [E, N, K/32]; got K={K}, "
                         f"{tuple(a_scale.shape)}, {tuple(b_scale.shape)}")
    if a_data.stride(-1) != 1 or b_data.stride(-1) != 1 or a_scale.stride(-1) != 1 or b_scale.stride(-1) != 1:
        raise ValueError("mx_expand_grouped_mm needs the K dim of data and scales contiguous")
    c = torch.empty(M, N, dtype=out_dtype, device=a_data.device)
    if M == 0 or N == 0 or E == 0:
        return c
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    tile_end = torch.cumsum((counts + BM - 1) // BM * triton.cdiv(N, BN), 0).to(torch.int32)
    grid = ((triton.cdiv(M, BM) + E) * triton.cdiv(N, BN),)
    soft = _interpreting()
    u8 = lambda t: t.view(torch.uint8)  # noqa: E731 (loaded as bytes, bitcast in the kernel)
    mx_expand_grouped_gemm_kernel[grid](
        u8(a_data), u8(a_scale), u8(b_data), u8(b_scale), c, offs, tile_end,
        N, E, a_data.stride(0), a_scale.stride(0), b_data.stride(0), b_data.stride(1),
        b_scale.stride(0), b_scale.stride(1), c.stride(0), K=K,
        LOG2_E=max(E - 1, 1).bit_length(), BM=BM, BN=BN, BK=BK, GROUP_M=GROUP_M,
        SOFT=soft, BF16_SCALE=bf16_scale and not soft, num_warps=num_warps, num_stages=num_stages)
    return c


def sass_report(BM: int = 128, BN: int = 128, BK: int = 64, num_warps: int = 8, num_stages: int = 3,
                K: int = 4096, bf16_scale: bool = False) -> str:
    """Compile the kernel for sm_90 without a GPU (Triton's bundled ptxas) and summarize the cubin:
    registers, stack (spills), wgmma (HGMMA) and cp.async (LDGSTS) counts, the instruction mix."""
    import collections
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    k = mx_expand_grouped_gemm_kernel
    names = list(k.arg_names)
    ptrs = {"a_ptr": "*u8", "sa_ptr": "*u8", "b_ptr": "*u8", "sb_ptr": "*u8", "c_ptr": "*bf16", "offs_ptr": "*i32",
            "tile_end_ptr": "*i32"}
    cons = {"K": K, "LOG2_E": 3, "BM": BM, "BN": BN, "BK": BK, "GROUP_M": 8, "SOFT": False, "BF16_SCALE": bf16_scale}
    sig = {n: ptrs.get(n, "constexpr" if n in cons else "i32") for n in names}
    aligned = [n for n in names if n in ptrs or n in ("stride_am", "stride_be", "stride_bn", "stride_cm")]
    src = ASTSource(k, sig, {(names.index(c),): v for c, v in cons.items()},
                    {(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(ck.asm["cubin"])
    dump = lambda flag: subprocess.run([os.path.join(bindir, "cuobjdump"), flag, f.name],  # noqa: E731
                                       capture_output=True, text=True).stdout
    sass = dump("-sass")
    ops = collections.Counter(o.split(".")[0] for o in re.findall(r"^\s+/\*[0-9a-f]+\*/\s+([A-Z0-9_.]+)", sass, re.M))
    res = " ".join(re.findall(r"REG:\d+|STACK:\d+", dump("-res-usage")))
    return (f"BM={BM} BN={BN} BK={BK} warps={num_warps} stages={num_stages} bf16_scale={bf16_scale}: {res}, shared {ck.metadata.shared} B, "
            f"{sum(ops.values())} instructions, HGMMA {ops['HGMMA']}, LDGSTS {ops['LDGSTS']}; top: "
            + ", ".join(f"{o} {n}" for o, n in ops.most_common(10)))


if __name__ == "__main__":  # pragma: no cover - offline tool: python -m mxmoe.kernels.sm90_expand_gemm
    for cfg in ((128, 128, 64), (128, 256, 64), (128, 128, 128)):
        for fast in (False, True):
            print(sass_report(*cfg, bf16_scale=fast))
