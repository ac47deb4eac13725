"""Coarse scale groups (DESIGN §9): 1x128 along the quantized axis and 128x128 tiles, stored as MXFP8.

The reference :func:`mxmoe.formats.quantize` is checked against an independent construction: a
group's scale byte is the largest of its 1x32 blocks' bytes (the byte is monotone in amax), and every
element is the E4M3 rounding of ``x / 2^(byte - 127)`` clamped to +-448.
"""

import pytest
import torch

from mxmoe import formats
from mxmoe.formats import MXTensor, quantize


def _expected(x: torch.Tensor, group_bytes: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes of x [..., C] at per-32 scale bytes group_bytes [..., C/32] (finite data)."""
    s = torch.exp2(group_bytes.to(torch.float64) - 127).repeat_interleave(32, dim=-1)
    q = (x.to(torch.float64) / s).to(torch.float32).clamp(-448, 448)
    return q.to(torch.float8_e4m3fn).view(torch.uint8)


def _bytes32(x: torch.Tensor, rule: str) -> torch.Tensor:
    return quantize(x, -1, rule).scale.view(torch.uint8).to(torch.int32)


@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_1x128_rowwise_matches_construction(rule):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 384, generator=g) * torch.exp2(torch.randint(-6, 6, (7, 384), generator=g).float())
    q = quantize(x, -1, rule, block=128)
    assert q.block == (1, 128) and q.scale.shape == (7, 12)
    b32 = _bytes32(x, rule).view(7, 3, 4)
    want = b32.amax(-1, keepdim=True).expand(7, 3, 4).reshape(7, 12)
    assert torch.equal(q.scale.view(torch.uint8).to(torch.int32), want)
    assert torch.equal(q.data.view(torch.uint8), _expected(x, want))
    # a coarser group never clips more under rceil, and its scale is never below the 1x32 ones
    assert bool((want >= _bytes32(x, rule)).all())


def test_1x128_columnwise_and_3d():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 256, 64, generator=g, dtype=torch.float32).to(torch.bfloat16)
    q = quantize(x, 1, block=(1, 128))
    ref = quantize(x.transpose(1, 2), -1, block=128)
    assert q.axis == 1 and q.scale.shape == (2, 8, 64)
    assert torch.equal(q.data.transpose(1, 2).contiguous().view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(q.scale.transpose(1, 2).contiguous().view(torch.uint8), ref.scale.view(torch.uint8))
    assert torch.equal(q.dequantize(), ref.dequantize().transpose(1, 2))


@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_128x128_tiles_match_construction(rule):
    g = torch.Generator().manual_seed(2)
    E, N, K = 2, 160, 256  # N ends in a partial tile (rows 128..159)
    w = torch.randn(E, N, K, generator=g) * torch.exp2(torch.randint(-4, 4, (E, N, 1), generator=g).float())
    q = quantize(w, -1, rule, block=(128, 128))
    b32 = _bytes32(w, rule)  # [E, N, K/32]
    want = torch.empty_like(b32)
    for r0 in range(0, N, 128):
        for c0 in range(0, K // 32, 4):
            t = b32[:, r0:r0 + 128, c0:c0 + 4]
            want[:, r0:r0 + 128, c0:c0 + 4] = t.amax(dim=(1, 2), keepdim=True)
    assert torch.equal(q.scale.view(torch.uint8).to(torch.int32), want)
    assert torch.equal(q.data.view(torch.uint8), _expected(w, want))


def test_128x128_swap_is_quantization_along_the_other_dim():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, 256, 384, generator=g)
    along_k = quantize(w, -1, block=(128, 128))
    along_n = quantize(w, -2, block=(128, 128))
    swapped = along_k.requantize_free_swap()
    assert swapped.axis == 1 and swapped.block == (128, 128)
    assert torch.equal(swapped.data.view(torch.uint8), along_n.data.view(torch.uint8))
    assert torch.equal(swapped.scale.view(torch.uint8), along_n.scale.view(torch.uint8))
    assert torch.equal(swapped.dequantize(), along_k.dequantize())


def test_nan_inf_and_zero_groups():
    x = torch.randn(4, 256)
    x[0, 5] = float("nan")
    x[1, 200] = float("inf")
    x[2, 128:] = 0
    q = quantize(x, -1, block=128)
    s = q.scale.view(torch.uint8)
    assert bool((s[0, :4] == 0xFF).all()) and bool((s[0, 4:] != 0xFF).all())
    assert bool((s[1, 4:] == 0xFF).all()) and bool((s[1, :4] != 0xFF).all())
    assert bool((s[2, 4:] == 0).all()) and bool((q.data[2, 128:].float() == 0).all())
    d = q.dequantize()
    assert bool(d[0, :128].isnan().all()) and bool(d[1, 128:].isnan().all())
    t = torch.randn(1, 128, 128)
    t[0, 100, 3] = float("nan")
    assert bool((quantize(t, -1, block=(128, 128)).scale.view(torch.uint8) == 0xFF).all())


def test_bad_groups_raise():
    with pytest.raises(ValueError, match="scale group 128"):
        quantize(torch.randn(4, 96), -1, block=128)
    with pytest.raises(ValueError, match="block must be one of"):
        quantize(torch.randn(4, 128), -1, block=(64, 64))
    with pytest.raises(ValueError, match="block must be one of"):
        quantize(torch.randn(4, 128), -1, block=True)
    with pytest.raises(ValueError, match="only square-tile"):
        quantize(torch.randn(4, 128), -1, block=128).requantize_free_swap()
    with pytest.raises(ValueError, match="128x128 blocks need"):
        quantize(torch.randn(128, 2, 128), 0, block=(128, 128))


def test_transpose_keeps_group_along_axis():
    q = quantize(torch.randn(2, 128, 128), -1, block=(128, 128))
    moved = q.transpose(0, 2)  # tiles off the last two dims
    assert moved.block == (1, 128)
    assert isinstance(moved, MXTensor) and formats.normalize_block(128) == (1, 128)
