"""MXFP8 numerics: FP8 E4M3 elements with one E8M0 power-of-two scale per 32 elements.

Source: OCP Microscaling Formats (MX) Specification v1.0, section 5 (MXFP8 = E4M3 elements,
E8M0 shared scale, block size 32). This module is the pure-torch reference ("twin") of every
quantization kernel in :mod:`mxmoe.kernels`: kernels must match it bit for bit.

Exact semantics (docs/DESIGN.md §3), stated on the FP32 bit pattern of ``amax``, the largest ``|x|`` of
a block (biased exponent field ``E``, 23-bit mantissa field ``m``):

* ``rceil`` (default): the smallest power of two ``s`` with ``s >= amax / 448``, so no element
  clips. In bits: ``scale_byte = E - 8 + (m > 0x600000)`` (448 = 1.75 * 2^8).
  TransformerEngine, cuBLAS, torchao's MoE training and the source team use this rule.
* ``floor`` (OCP MX v1.0): ``s = 2^(floor(log2 amax) - 8)`` (8 = emax of E4M3), elements that
  land above 448 saturate to ±448. In bits: ``scale_byte = E - 8``.

In both rules the byte is clamped to ``[0, 254]``; an all-zero block gets byte 0x00 (2^-127)
and zero data. A block holding any NaN or ±Inf gets scale byte 0xFF (NaN) and all its data bytes
are 0x7F (E4M3 NaN), so it dequantizes to NaN. Elements are ``x * 2^(127 - scale_byte)``
rounded to nearest-even into E4M3 (subnormals kept), after clamping to ±448.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

import torch

E4M3_MAX = 448.0  # largest finite torch.float8_e4m3fn
E4M3_EMAX = 8  # exponent of the largest E4M3 binade (448 = 1.75 * 2^8)
E8M0_BIAS = 127  # E8M0 byte b means 2^(b - 127)
E8M0_NAN = 0xFF
E4M3_NAN = 0x7F
BLOCK = 32  # elements per scale along the quantized axis (OCP MX v1.0)
# Scale groups (docs/DESIGN.md §9): how many elements share one E8M0 scale. Scales are always stored per
# 32-element block (so every tensor is standard MXFP8); coarser groups replicate their scale.
#   (1, 32)    standard 1x32 blocks along the quantized axis
#   (1, 128)   one scale per 128 consecutive elements along the quantized axis (Hopper-fast activations)
#   (32, 32)   one scale per 32x32 tile of the last two dims (weights: one quantization for fprop and dgrad)
#   (128, 128) one scale per 128x128 tile of the last two dims (Hopper-fast weights)
BLOCKS = ((1, 32), (1, 128), (32, 32), (128, 128))


class ScaleRule(str, enum.Enum):
    """How a block's E8M0 scale is chosen from its ``amax``.

    RCEIL: ``2^ceil(log2(amax / 448))``, nothing clips (default; TE / cuBLAS / torchao MoE).
    FLOOR: ``2^(floor(log2 amax) - 8)``, OCP MX v1.0; elements above 448 saturate.
    """

    RCEIL = "rceil"
    FLOOR = "floor"

    @classmethod
    def _missing_(cls, value):
        raise ValueError(f"scale_rule must be one of {[r.value for r in cls]}, got {value!r}")


def scale_byte_from_amax(amax: torch.Tensor, rule: ScaleRule | str = ScaleRule.RCEIL) -> torch.Tensor:
    """E8M0 scale bytes for block maxima.

    Args:
        amax: float32 tensor of block maxima ``max |x|`` (any shape; NaN/Inf allowed).
        rule: ``"rceil"`` or ``"floor"``.
    Returns:
        int32 tensor of the same shape, values in ``[0, 255]`` (255 = NaN for non-finite amax).
    """
    rule = ScaleRule(rule)
    bits = amax.to(torch.float32).contiguous().view(torch.int32)
    exp_field = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    byte = exp_field - E4M3_EMAX
    if rule is ScaleRule.RCEIL:
        byte = byte + (mant > 0x600000).to(torch.int32)
    byte = byte.clamp(0, 254)
    return torch.where(exp_field == 0xFF, torch.full_like(byte, E8M0_NAN), byte)


def e8m0_to_float(scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values ``2^(b - 127)`` of E8M0 scales (``torch.float8_e8m0fnu`` or uint8 bytes); 0xFF -> NaN."""
    b = scale.view(torch.uint8).to(torch.int32)
    val = torch.exp2((b - E8M0_BIAS).to(torch.float64))
    val = torch.where(b == E8M0_NAN, torch.full_like(val, float("nan")), val)
    return val.to(dtype)


def _check_input(x: torch.Tensor, axis: int, group: int = BLOCK) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize expects a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point() or x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu):
        raise TypeError(f"quantize expects a float16/bfloat16/float32/float64 tensor, got dtype {x.dtype}")
    if x.dim() == 0:
        raise ValueError("quantize expects at least one dimension")
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"axis must be an int, got {axis!r}")
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis {axis} is out of range for a {x.dim()}-dimensional tensor")
    axis = axis % x.dim()
    if x.shape[axis] % group != 0:
        what = "the MX block size" if group == BLOCK else "the scale group"
        raise ValueError(
            f"the quantized axis {axis} has size {x.shape[axis]}, which is not divisible by {what} {group}"
        )
    return axis


def normalize_block(block) -> tuple[int, int]:
    """``block`` as one of :data:`BLOCKS`: an int ``n`` means ``(1, n)``.

    Raises:
        ValueError: any other value.
    """
    b = (1, block) if isinstance(block, int) and not isinstance(block, bool) else block
    try:
        b = tuple(int(v) for v in b)
    except TypeError:
        b = None
    if b not in BLOCKS:
        raise ValueError(f"block must be one of 32, 128, {', '.join(str(x) for x in BLOCKS)}; got {block!r}")
    return b


class GroupedScale(NamedTuple):
    """An MXTensor's scales in the 128x4 blocked layout the sm_100 grouped product reads
    (:mod:`mxmoe.layouts`), laid out from the scale matrix with the quantized axis last. Two forms:

    * per group (``offs`` a tensor): a 2D tensor ``[M, K]`` quantized along K, rows grouped by expert,
      each group blocked from a 128-row boundary (:func:`mxmoe.layouts.to_blocked_grouped`);
    * per expert (``offs`` None): a 3D tensor ``[E, R, C]`` (expert weights) quantized along one of its
      last two dims, each expert's scale matrix (``[R, C/32]`` along C, ``[C, R/32]`` along R) blocked
      on its own and stacked: ``torch.stack([to_blocked(s_e) for each expert])``.

    Attributes:
        scale: ``float8_e8m0fnu``, zero padding included. Per group: flat, ``rows * ceil(K/128)*4``
            entries. Per expert: ``[E, blocked_numel(r, c)]`` for each expert's ``[r, c]`` scale matrix.
        offs: per group, int32 ``[E]`` cumulative end rows of the groups the layout was made for; else None.
        blocked_offs: per group, int32 ``[E]`` padded end rows (:func:`mxmoe.layouts.blocked_group_offsets`
            of ``offs``); else None.
        rows: host int, so consumers check sizes without a sync. Per group: ``blocked_offs[-1]`` (0
            without groups); per expert: the padded rows of each expert's matrix, ``ceil(r/128)*128``.
    """

    scale: torch.Tensor
    offs: torch.Tensor | None
    blocked_offs: torch.Tensor | None
    rows: int


@dataclass
class MXTensor:
    """An MXFP8 tensor (OCP MX v1.0): E4M3 data and one E8M0 scale per 32 elements along ``axis``.

    Attributes:
        data: ``torch.float8_e4m3fn``, the shape of the original tensor.
        scale: ``torch.float8_e8m0fnu``, row-major, the original shape with ``axis`` divided by 32.
        axis: the quantized (contraction) axis, non-negative.
        scale_rule: ``"rceil"`` or ``"floor"``.
        block: the scale group the scales were chosen over (:data:`BLOCKS`): ``(1, 32)`` for
            standard blocks, ``(1, 128)`` for one scale per 128 elements along ``axis``, ``(32, 32)`` or
            ``(128, 128)`` when one scale was chosen per square tile of the last two dims. Scales are
            always stored per 32 elements (replicated over coarser groups), so the tensor is a
            standard 1x32 MX tensor along ``axis``; for square tiles :meth:`requantize_free_swap`
            gives the other orientation with no new rounding.
        grouped: optional :class:`GroupedScale`, the same scales in the blocked layout the sm_100 product
            reads: per group (a 2D tensor quantized along its last dim, from the grouped quantization
            kernel) or per expert (3D expert weights, from the quantization kernels' blocked copy);
            ``scale`` stays the row-major copy, valid for every other use. It describes the scales with
            the quantized axis last, so swapping the last two dims (:meth:`transpose`, ``mT``) keeps it;
            other transposes, derived tensors (:meth:`requantize_free_swap`) and tensors saved for
            backward do not.
    """

    data: torch.Tensor
    scale: torch.Tensor
    axis: int
    scale_rule: str = "rceil"
    block: tuple[int, int] = (1, BLOCK)
    grouped: GroupedScale | None = None

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dim(self) -> int:
        return self.data.dim()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Return ``data * 2^(scale - 127)`` in ``dtype`` (NaN where the scale is NaN); TypeError
        for a non-floating ``dtype``.

        The product is formed in float32 (float64 if asked for): an E4M3 value times a power of
        two is exact there, or correctly rounded where it falls into FP32 subnormals.
        """
        if not dtype.is_floating_point:
            raise TypeError(f"dequantize needs a floating dtype, got {dtype}")
        work = torch.float64 if dtype == torch.float64 else torch.float32
        s = e8m0_to_float(self.scale, work).repeat_interleave(BLOCK, dim=self.axis)
        return (self.data.to(work) * s).to(dtype)

    def transpose(self, dim0: int, dim1: int) -> "MXTensor":
        """A view with two dims swapped (data and scale alike); the quantized axis follows, and
        :attr:`grouped` is kept where the last two dims are swapped (dropped otherwise)."""
        nd = self.data.dim()
        dim0, dim1 = dim0 % nd, dim1 % nd
        axis = {dim0: dim1, dim1: dim0}.get(self.axis, self.axis)
        block = self.block
        last_two = dim0 == dim1 or {dim0, dim1} == {nd - 2, nd - 1}
        if block[0] > 1 and not last_two:
            block = (1, block[1])  # the tiles no longer lie on the last two dims: groups along the axis only
        return MXTensor(self.data.transpose(dim0, dim1), self.scale.transpose(dim0, dim1), axis,
                        self.scale_rule, block, self.grouped if last_two else None)

    @property
    def mT(self) -> "MXTensor":
        return self.transpose(-2, -1)

    def requantize_free_swap(self) -> "MXTensor":
        """For square-tile tensors (32x32, 128x128): the same data quantized along the other of the
        last two dims.

        The scales of a tile are equal, so the data bytes are unchanged; only the scale storage is
        re-replicated. Raises ValueError for 1x32 / 1x128 tensors (they need a new rounding) and where
        the other dim is not a whole number of tiles.
        """
        if self.block[0] == 1:
            raise ValueError("only square-tile MX tensors (32x32, 128x128) can change orientation without "
                             "requantizing")
        nd = self.data.dim()
        if self.axis == nd - 1:  # scale [..., R, C/32] -> [..., ceil(R/32), C]
            s = self.scale[..., ::BLOCK, :].repeat_interleave(BLOCK, dim=-1)
            other = nd - 2
        elif self.axis == nd - 2:  # scale [..., R/32, C] -> [..., R, ceil(C/32)]
            s = self.scale[..., :, ::BLOCK].repeat_interleave(BLOCK, dim=-2)
            other = nd - 1
        else:
            raise ValueError("square tiles live on the last two dims")
        if self.data.shape[other] % BLOCK != 0:
            raise ValueError(f"dim {other} has size {self.data.shape[other]}, not divisible by {BLOCK}")
        return MXTensor(self.data, s.contiguous(), other, self.scale_rule, self.block)

    def __repr__(self) -> str:
        return (f"MXTensor(shape={tuple(self.data.shape)}, axis={self.axis}, scale_rule={self.scale_rule!r}, "
                f"block={self.block}, device={self.data.device})")


def _quantize_blocks(xb: torch.Tensor, amax: torch.Tensor, rule: ScaleRule) -> tuple[torch.Tensor, torch.Tensor]:
    """xb: [..., n] float32 elements; amax: [...] or broadcastable float32 block maxima (NaN/Inf marks bad)."""
    byte = scale_byte_from_amax(amax, rule)
    bad = byte == E8M0_NAN
    # x * 2^(127 - byte) as two normal FP32 powers of two (2^-127 alone is subnormal): the first
    # product is exact, and the second is exact wherever the result can be a nonzero E4M3 value.
    e = (E8M0_BIAS - byte).unsqueeze(-1)
    e1 = e >> 1
    s1 = ((e1 + E8M0_BIAS) << 23).view(torch.float32)
    s2 = ((e - e1 + E8M0_BIAS) << 23).view(torch.float32)
    q = ((xb * s1) * s2).clamp(-E4M3_MAX, E4M3_MAX)
    data = q.to(torch.float8_e4m3fn).view(torch.uint8)
    data = torch.where(bad.unsqueeze(-1), torch.full_like(data, E4M3_NAN), data)
    return data.view(torch.float8_e4m3fn), byte.to(torch.uint8).view(torch.float8_e8m0fnu)


def _block_amax(xf: torch.Tensor) -> torch.Tensor:
    """max |x| over the last dim: NaN or Inf when the block holds one (amax propagates both), and
    both carry exponent field 0xFF, which :func:`scale_byte_from_amax` turns into the NaN scale."""
    return xf.abs().amax(dim=-1)


def quantize(
    x: torch.Tensor,
    axis: int = -1,
    scale_rule: ScaleRule | str = ScaleRule.RCEIL,
    block: tuple[int, int] | int = BLOCK,
) -> MXTensor:
    """Quantize ``x`` to MXFP8 along ``axis`` (pure-torch reference, CPU or CUDA).

    Args:
        x: floating tensor (float32, bfloat16, float16 or float64), any shape with ``x.shape[axis]``
            divisible by the scale group along it (32 or 128). Need not be contiguous. Quantization
            works on FP32 values: float64 input is first rounded to float32 (as torch's own float8
            casts do), so magnitudes beyond FP32's range become Inf and their blocks NaN.
        axis: the quantized (contraction) axis; ``-1`` is rowwise, ``0`` of a 2D tensor columnwise.
        scale_rule: ``"rceil"`` (default) or ``"floor"``; see :class:`ScaleRule`.
        block: the scale group (:data:`BLOCKS`): ``32`` / ``(1, 32)`` standard 1x32 blocks; ``128`` /
            ``(1, 128)`` one scale per 128 elements along ``axis``; ``(32, 32)`` or ``(128, 128)`` one
            scale per square tile of the last two dims (``axis`` must then be one of them, its size a
            multiple of the tile; the other dim may end in a partial tile). The group's scale is the
            one its amax gives (same rules as for 32 elements), stored replicated per 32 elements.
    Returns:
        :class:`MXTensor` with contiguous ``data`` (``float8_e4m3fn``, shape of ``x``) and
        ``scale`` (``float8_e8m0fnu``, shape of ``x`` with ``axis`` divided by 32).
    Raises:
        TypeError: ``x`` is not a float16/bfloat16/float32/float64 tensor.
        ValueError: ``x.shape[axis]`` is not divisible by the scale group, or a bad ``block``.
    """
    block = normalize_block(block)
    tile, group = block
    axis = _check_input(x, axis, group)
    rule = ScaleRule(scale_rule)
    nd = x.dim()
    xf = x.to(torch.float32)
    if tile == 1:
        xm = xf.movedim(axis, -1)  # [..., L]
        xg = xm.reshape(*xm.shape[:-1], xm.shape[-1] // group, group)  # [..., L/G, G]
        amax = _block_amax(xg).repeat_interleave(group // BLOCK, dim=-1)  # [..., L/32], per 32-block
        xb = xm.reshape(*xm.shape[:-1], xm.shape[-1] // BLOCK, BLOCK)  # [..., L/32, 32]
        data, scale = _quantize_blocks(xb, amax, rule)
        data = data.reshape(xm.shape).movedim(-1, axis).contiguous()
        scale = scale.movedim(-1, axis).contiguous()
        return MXTensor(data, scale, axis, rule.value, block)

    if nd < 2 or axis not in (nd - 2, nd - 1):
        raise ValueError(f"{tile}x{tile} blocks need a tensor of >= 2 dims quantized along one of its last two; "
                         f"got axis {axis} of {nd}")
    # Move the quantized axis last: [..., R, C] with C % tile == 0; pad R up to a multiple of the
    # tile with zeros (they never raise a tile's amax) for the tile reduction.
    xm = xf if axis == nd - 1 else xf.transpose(-2, -1)
    R, C = xm.shape[-2], xm.shape[-1]
    Rp = -(-R // tile) * tile
    xp = torch.nn.functional.pad(xm, (0, 0, 0, Rp - R)) if Rp != R else xm
    tiles = xp.reshape(*xp.shape[:-2], Rp // tile, tile, C // tile, tile).transpose(-3, -2)  # [.., R/T, C/T, T, T]
    tile_amax = _block_amax(tiles.reshape(*tiles.shape[:-2], tile * tile))  # [..., R/T, C/T]
    amax_rows = tile_amax.repeat_interleave(tile, dim=-2)[..., :R, :]  # [..., R, C/T]
    amax_rows = amax_rows.repeat_interleave(tile // BLOCK, dim=-1)  # [..., R, C/32]
    xb = xm.reshape(*xm.shape[:-1], C // BLOCK, BLOCK)
    data, scale = _quantize_blocks(xb, amax_rows, rule)
    data = data.reshape(xm.shape)
    if axis == nd - 2:
        data, scale = data.transpose(-2, -1), scale.transpose(-2, -1)
    return MXTensor(data.contiguous(), scale.contiguous(), axis, rule.value, block)
