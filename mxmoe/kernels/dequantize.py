"""MXFP8 -> BF16 dequantization (Triton), for exact MX products on BF16 tensor cores.

Hopper has no block-scaled tensor cores (docs/DESIGN.md §2). One exact route: expand the MX operands to
BF16 (``e4m3 * 2^(b-127)`` has 4 significant bits, so it is exactly a BF16 value whenever it lies
in FP32's normal range, BF16 having FP32's exponent range) and multiply with BF16 wgmma and FP32
accumulation (``torch._grouped_mm``). The result is the MX product up to FP32 summation order;
elements below 2^-126 keep BF16's subnormal precision, and a NaN scale gives NaN.

``dequantize_bf16(data, scale)``: ``data [..., R, C]`` E4M3 with C contiguous (the contraction
dim) and ``scale [..., R, C/32]`` E8M0 row-major -> BF16 ``[..., R, C]`` contiguous.

:func:`mx_expand_bf16` (a ``triton.jit`` function) is the one definition of the expansion; the
fused quantize-dequantize kernels of :mod:`mxmoe.kernels.quantize_triton` call it too, so their
BF16 output equals ``dequantize_bf16(quantize(x))`` bit for bit. Importing this module works
without triton (the jit function is then absent).
"""

from __future__ import annotations

import torch

from mxmoe.formats import BLOCK

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional
    triton = None

if triton is not None:

    @triton.jit
    def mx_expand_bf16(q, sb):
        """BF16 of ``q * 2^(sb - 127)``: q FP32 E4M3 values, sb int32 scale bytes (broadcast to q).

        2^(b-127) is applied as two normal FP32 powers of two (2^-127 itself is subnormal): the
        first product is exact, the second rounds once, as the FP32 reference does; b = 255 is NaN.
        """
        e = sb - 127
        e1 = e >> 1
        s1 = ((e1 + 127) << 23).to(tl.float32, bitcast=True)
        s2 = ((e - e1 + 127) << 23).to(tl.float32, bitcast=True)
        s2 = tl.where(sb == 255, float("nan"), s2)
        return ((q * s1) * s2).to(tl.bfloat16)

    @triton.jit
    def mx_dequant_bf16_kernel(data_ptr, scale_ptr, out_ptr, R, C, SC, BR: tl.constexpr, BC: tl.constexpr):
        pid_r, pid_c = tl.program_id(0), tl.program_id(1)
        rows = (pid_r * BR + tl.arange(0, BR)).to(tl.int64)
        cols = pid_c * BC + tl.arange(0, BC)
        mask = (rows[:, None] < R) & (cols[None, :] < C)
        q = tl.load(data_ptr + rows[:, None] * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        scols = pid_c * (BC // 32) + tl.arange(0, BC // 32)  # one scale per 32 elements, broadcast below
        smask = (rows[:, None] < R) & (scols[None, :] < SC)
        sb = tl.load(scale_ptr + rows[:, None] * SC + scols[None, :], mask=smask, other=127).to(tl.int32)
        v = mx_expand_bf16(tl.reshape(q, (BR, BC // 32, 32)), sb[:, :, None])
        tl.store(out_ptr + rows[:, None] * C + cols[None, :], tl.reshape(v, (BR, BC)), mask=mask)


def _kernel():
    if triton is None:
        raise RuntimeError("mxmoe.kernels.dequantize needs triton (pip install 'mxmoe[gpu]')")
    return mx_dequant_bf16_kernel


def dequantize_bf16(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """BF16 value of an MX tensor quantized along its (contiguous) last dim.

    Args:
        data: ``float8_e4m3fn`` ``[..., R, C]``; the last dim contiguous, leading dims collapsible.
        scale: ``float8_e8m0fnu`` ``[..., R, C/32]``, same leading layout.
    Returns:
        contiguous ``bfloat16`` ``[..., R, C]``.
    Raises:
        ValueError: dtypes, shapes, or a non-contiguous last dim.
    """
    if data.dtype != torch.float8_e4m3fn or scale.dtype != torch.float8_e8m0fnu:
        raise ValueError(f"dequantize_bf16 expects e4m3 data and e8m0 scales, got {data.dtype}, {scale.dtype}")
    C = data.shape[-1]
    if C % BLOCK or scale.shape[:-1] != data.shape[:-1] or scale.shape[-1] != C // BLOCK:
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match data {tuple(data.shape)} along the last dim")
    d2 = data.reshape(-1, C)  # copies only if the leading dims cannot be collapsed
    s2 = scale.reshape(-1, C // BLOCK)
    d2, s2 = d2.contiguous(), s2.contiguous()
    R = d2.shape[0]
    out = torch.empty(R, C, dtype=torch.bfloat16, device=data.device)
    if R and C:
        BR, BC = 32, 256
        grid = (-(-R // BR), -(-C // BC))
        _kernel()[grid](d2.view(torch.uint8).view(torch.float8_e4m3fn), s2.view(torch.uint8), out, R, C, C // BLOCK,
                        BR=BR, BC=BC, num_warps=8)
    return out.view(data.shape)
