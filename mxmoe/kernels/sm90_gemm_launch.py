"""Launch plumbing shared by the Hopper grouped GEMMs of both promotion modes (:mod:`mxmoe.kernels.sm90_gemm_promote32`,
:mod:`mxmoe.kernels.sm90_gemm_promote128`): the Triton releases the Gluon kernel is written for, the argument
checks, the TMA descriptors and their shared-memory layouts, the SM count."""

from __future__ import annotations

import functools

import torch

from mxmoe.backend import capability
from mxmoe.kernels.sm90_gemm_kernel import HAS_GLUON
from mxmoe.kernels.sm90_tile_config import SMEM_PER_CTA, Sm90TileConfig, smem_bytes

if HAS_GLUON:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

MX_BLOCK = 32


def _nvmma_layout(block, gl_dtype):
    """Shared-memory layout of a TMA box: 128-byte swizzle for FP8 tiles, none for FP32 scale rows."""
    return _box_layout(tuple(block), gl_dtype, gl_dtype != gl.float32)


@functools.lru_cache(maxsize=None)
def _box_layout(block: tuple, gl_dtype, swizzled: bool):
    """The layout object of a TMA box, built once per (box, dtype, swizzle): every product makes four
    to five descriptors, and building their layouts is host time on the step's critical path."""
    if not swizzled:
        return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=len(block))
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)


# Triton releases this kernel's Gluon code compiles under: 3.6 (the GPU machines'). 3.9 renamed or removed
# parts of the Gluon API it uses (shared-memory reinterpretation, the TMA copy names, warp_specialize's
# arguments: offline sm_90 compile, 2026-12-02); 3.7 and 3.8 were not tried.
GLUON_TRITON = ((3, 6),)


@functools.lru_cache(maxsize=None)
def _triton_release() -> tuple[int, int]:
    import re

    import triton

    m = re.match(r"(\d+)\.(\d+)", triton.__version__)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _check_sm90(t: torch.Tensor) -> None:
    if not HAS_GLUON:
        raise RuntimeError("the sm_90 MXFP8 grouped GEMM needs triton >= 3.6 with Gluon")
    if not t.is_cuda:
        raise ValueError("the sm_90 MXFP8 grouped GEMM needs CUDA tensors")
    cap = capability(t.device.index if t.device.index is not None else torch.cuda.current_device())
    if cap != (9, 0):
        raise RuntimeError(f"the sm_90 MXFP8 grouped GEMM runs on Hopper (sm_90) only; this is sm_{cap[0]}{cap[1]}")
    if _triton_release() not in GLUON_TRITON:
        import triton

        raise RuntimeError(f"the sm_90 MXFP8 grouped GEMM is written for triton "
                           f"{', '.join('%d.%d' % v for v in GLUON_TRITON)}; this is triton {triton.__version__}, "
                           "whose Gluon API differs (install triton 3.6, torch 2.11's)")


def _check_operand(name: str, x: torch.Tensor, dim: int) -> None:
    if x.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{name} must be torch.float8_e4m3fn, got {x.dtype}")
    if x.dim() != dim:
        raise ValueError(f"{name} must have {dim} dims, got shape {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous with the contraction dim last (K-major)")
    if x.shape[-1] % MX_BLOCK != 0:
        raise ValueError(f"{name}: contraction dim {x.shape[-1]} is not a multiple of {MX_BLOCK}")


def _check_scale(name: str, s: torch.Tensor, data: torch.Tensor) -> None:
    if s.dtype != torch.float8_e8m0fnu:
        raise TypeError(f"{name} must be torch.float8_e8m0fnu, got {s.dtype}")
    want = (*data.shape[:-1], data.shape[-1] // MX_BLOCK)
    if tuple(s.shape) != want:
        raise ValueError(f"{name} must have shape {want} (row-major, one scale per 32 along the last dim), "
                         f"got {tuple(s.shape)}")


def _check_offs(offs: torch.Tensor, num_groups: int, device: torch.device) -> torch.Tensor:
    """offs, validated, as a contiguous tensor (the kernel reads offs[e] at offs_ptr + e)."""
    if offs.dtype != torch.int32:
        raise TypeError(f"offs must be torch.int32, got {offs.dtype}")
    if offs.dim() != 1 or offs.shape[0] != num_groups:
        raise ValueError(f"offs must have shape ({num_groups},), got {tuple(offs.shape)}")
    if offs.device != device:
        raise ValueError(f"offs must be on {device}, got {offs.device}")
    return offs.contiguous()


def _fit_box(t: torch.Tensor, block: list[int]) -> torch.Tensor:
    """``t`` itself, or a zero-padded copy when a dim is smaller than the TMA box.

    Defensive: keeps every tensor map's box inside its tensor (small operands, e.g. K < 128 or
    N < 128 scale rows; whether sm_90 needs this was not isolated). The padding is never read into
    a valid output element (those steps, rows and columns are skipped or masked). Only small
    tensors are ever copied.
    """
    if all(d >= b for d, b in zip(t.shape, block)):
        return t
    shape = [max(d, b) for d, b in zip(t.shape, block)]
    out = torch.zeros(shape, dtype=torch.uint8 if t.element_size() == 1 else t.dtype, device=t.device)
    out = out.view(t.dtype)
    out[tuple(slice(0, d) for d in t.shape)] = t
    return out


def _desc(t: torch.Tensor, block: list[int]):
    gl_dtype = {torch.float8_e4m3fn: gl.float8e4nv, torch.float32: gl.float32}[t.dtype]
    t = _fit_box(t, block)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, _nvmma_layout(block, gl_dtype))


def _out_desc(out2d: torch.Tensor, cfg: Sm90TileConfig, sb_cols: int):
    """TMA descriptor of the ``[rows, cols]`` output for the TMA-store epilogue (box: one consumer
    partition's rows x BN), or None where the epilogue falls back to masked stores from registers:
    ``cfg.tma_store`` off, a row pitch or base address not 16-byte aligned, a tensor smaller than the
    box, or no room in shared memory for the staging buffer beside the ring (``sb_cols``: columns of
    the B-scale box; ptxas's figures run ~300 bytes above :func:`smem_bytes`, hence the 1 KB margin)."""
    block = [cfg.block_m // 2 if cfg.split_wg else cfg.block_m, cfg.block_n]
    rows, cols = out2d.shape
    elt = out2d.element_size()
    if not (cfg.tma_store and out2d.data_ptr() % 16 == 0 and cols * elt % 16 == 0
            and rows >= block[0] and cols >= block[1] and smem_bytes(cfg, sb_cols, elt) + 1024 <= SMEM_PER_CTA):
        return None
    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}[out2d.dtype]
    return TensorDescriptor(out2d, [rows, cols], [cols, 1], block, _box_layout(tuple(block), gl_dtype, True))


def _search_steps(num_groups: int) -> int:
    return max(0, (num_groups - 1).bit_length())


