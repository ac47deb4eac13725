"""MX quantization against an independent scalar implementation (exact rationals, element by element)."""

import bisect
import math
from fractions import Fraction

import pytest
import torch

import mxmoe
from mxmoe import formats


# ---- independent scalar MXFP8 (OCP MX v1.0 + DESIGN §3), written without torch's fp8 casts ----
def e4m3_decode(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    e, m = (byte >> 3) & 0xF, byte & 0x7
    if e == 15 and m == 7:
        return math.nan
    return sign * ((m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


_POS = sorted((Fraction(e4m3_decode(b)), b) for b in range(0x7F))  # 0 .. 448, bytes 0x00..0x7E
_POS_VALS = [v for v, _ in _POS]


def e4m3_encode(q: Fraction) -> int:
    """Round-to-nearest-even onto E4M3 (|q| <= 448 assumed)."""
    sign = 0x80 if q < 0 or (q == 0 and False) else 0
    a = abs(q)
    i = bisect.bisect_left(_POS_VALS, a)
    if i < len(_POS_VALS) and _POS_VALS[i] == a:
        return sign | _POS[i][1]
    lo, hi = _POS[i - 1], _POS[i]
    dlo, dhi = a - lo[0], hi[0] - a
    pick = lo if dlo < dhi else hi if dhi < dlo else (lo if lo[1] % 2 == 0 else hi)
    return sign | pick[1]


def scalar_block(vals: list[float], rule: str) -> tuple[int, list[int]]:
    if any(not math.isfinite(v) for v in vals):
        return 0xFF, [0x7F] * len(vals)
    amax = Fraction(max(abs(v) for v in vals))
    if amax == 0:
        byte = 0
    elif rule == "rceil":  # smallest e with 2^e >= amax / 448
        r = amax / 448
        e = math.frexp(float(amax))[1] - 9 - 2  # a lower start, then walk up exactly
        while Fraction(2) ** e < r:
            e += 1
        byte = min(max(e + 127, 0), 254)
    else:  # floor(log2 amax) - 8
        e = math.frexp(float(amax))[1] - 1
        while Fraction(2) ** e > amax:
            e -= 1
        while Fraction(2) ** (e + 1) <= amax:
            e += 1
        byte = min(max(e - 8 + 127, 0), 254)
    mult = Fraction(2) ** (127 - byte)
    out = []
    for v in vals:
        q = Fraction(v) * mult
        q = max(min(q, Fraction(448)), Fraction(-448))
        b = e4m3_encode(q)
        if v < 0 or (v == 0 and math.copysign(1.0, v) < 0):
            b |= 0x80
        out.append(b)
    return byte, out


def scalar_quantize_rows(x: torch.Tensor, rule: str):
    """x: 2D, quantized along dim 1."""
    rows = x.to(torch.float32).tolist()
    data, scale = [], []
    for row in rows:
        drow, srow = [], []
        for j in range(0, len(row), 32):
            s, d = scalar_block(row[j:j + 32], rule)
            srow.append(s)
            drow.extend(d)
        data.append(drow)
        scale.append(srow)
    return torch.tensor(data, dtype=torch.uint8), torch.tensor(scale, dtype=torch.uint8)


def wide_range(rows, cols, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-40, 40, (rows, 1), generator=g).float())
    x = x * torch.exp2(torch.randint(-6, 6, (rows, cols), generator=g).float())  # dynamic range inside blocks
    return x.to(dtype)


def special_values():
    x = wide_range(12, 64)
    x[0, :32] = 0.0  # zero block
    x[0, 32:] = -0.0
    x[1, 5] = float("nan")
    x[2, 40] = float("inf")
    x[3, 7] = -float("inf")
    x[4, :32] = torch.tensor(1e-42)  # fp32 subnormals
    x[5, :32] = 448.0  # exactly the E4M3 max
    x[5, 32:] = 449.0
    x[6, :] = torch.linspace(-3e38, 3e38, 64)  # near fp32 max
    x[7, :32] = torch.tensor([2.0 ** -140] + [0.0] * 31)
    x[8, :32] = 1.75 * 2.0 ** 120
    x[9, :] = torch.tensor([0.5 + 1 / 64 * i for i in range(64)]) * 2.0 ** -9  # E4M3 subnormal range
    return x


@pytest.mark.parametrize("rule", ["rceil", "floor"])
@pytest.mark.parametrize("case", ["wide", "special", "bf16"])
def test_quantize_matches_scalar(rule, case):
    x = {"wide": lambda: wide_range(16, 96), "special": special_values,
         "bf16": lambda: wide_range(8, 64, torch.bfloat16, seed=3)}[case]()
    q = mxmoe.quantize(x, scale_rule=rule)
    d_ref, s_ref = scalar_quantize_rows(x, rule)
    assert q.data.dtype == torch.float8_e4m3fn and q.scale.dtype == torch.float8_e8m0fnu
    assert q.scale.shape == (x.shape[0], x.shape[1] // 32)
    assert torch.equal(q.scale.view(torch.uint8), s_ref)
    assert torch.equal(q.data.view(torch.uint8), d_ref)


def test_rule_formulas_on_edges():
    amax = torch.tensor([448.0, 449.0, 896.0, 1.0, 0.0, 1e-40, float("inf"), float("nan"), 3.4e38])
    assert formats.scale_byte_from_amax(amax, "rceil").tolist() == [127, 128, 128, 119, 0, 0, 255, 255, 247]
    assert formats.scale_byte_from_amax(amax, "floor").tolist() == [127, 127, 128, 119, 0, 0, 255, 255, 246]


def test_rceil_never_clips_floor_saturates():
    x = wide_range(32, 128)
    qr = mxmoe.quantize(x, scale_rule="rceil")
    deq = qr.dequantize()
    # rceil: relative error per element bounded by E4M3 rounding (2^-4 relative) or the subnormal step
    err = (deq - x).abs()
    step = formats.e8m0_to_float(qr.scale).repeat_interleave(32, 1) * 2.0 ** -9
    assert bool((err <= x.abs() * 2.0 ** -4 + step).all())
    xf = torch.full((1, 32), 1.0)
    xf[0, 0] = 1.99  # floor: scale 2^-8, 1.99 * 256 = 509 -> saturates to 448
    qf = mxmoe.quantize(xf, scale_rule="floor")
    assert qf.data.view(torch.uint8)[0, 0].item() == 0x7E


def test_nan_block_dequantizes_to_nan_only_in_its_block():
    x = wide_range(2, 64)
    x[0, 3] = float("nan")
    deq = mxmoe.quantize(x).dequantize()
    assert bool(deq[0, :32].isnan().all()) and not bool(deq[0, 32:].isnan().any()) and not bool(deq[1].isnan().any())


def test_columnwise_is_rowwise_of_transpose_and_noncontiguous_input():
    x = wide_range(64, 96)
    qc = mxmoe.quantize(x, axis=0)
    qt = mxmoe.quantize(x.t().contiguous(), axis=-1)
    assert qc.axis == 0 and qc.scale.shape == (2, 96)
    assert torch.equal(qc.data.view(torch.uint8), qt.data.view(torch.uint8).t())
    assert torch.equal(qc.scale.view(torch.uint8), qt.scale.view(torch.uint8).t())
    qn = mxmoe.quantize(x.t(), axis=-1)  # non-contiguous input
    assert torch.equal(qn.data.view(torch.uint8), qt.data.view(torch.uint8))


def test_2d_blocks_valid_in_both_orientations():
    w = wide_range(3 * 96, 64).view(3, 96, 64)
    qk = mxmoe.quantize(w, axis=-1, block=(32, 32))
    qn = mxmoe.quantize(w, axis=-2, block=(32, 32))
    assert torch.equal(qk.data.view(torch.uint8), qn.data.view(torch.uint8))  # one weight, both passes
    s = qk.scale.view(torch.uint8)  # [3, 96, 2]: equal within each 32-row group
    assert torch.equal(s, s[:, ::32].repeat_interleave(32, 1))
    # tile scale = scale of the tile's amax, checked against the scalar rule
    tile = w[1, 32:64, 32:64].reshape(-1).tolist()
    assert s[1, 40, 1].item() == scalar_block(tile, "rceil")[0]
    sw = qk.requantize_free_swap()
    assert sw.axis == 1 and torch.equal(sw.scale.view(torch.uint8), qn.scale.view(torch.uint8))
    with pytest.raises(ValueError, match="32x32"):
        mxmoe.quantize(w, axis=-1).requantize_free_swap()


def test_transpose_view_dequantizes_consistently():
    x = wide_range(64, 64)
    q = mxmoe.quantize(x, axis=0)
    assert torch.equal(q.mT.dequantize(), q.dequantize().t())


@pytest.mark.parametrize("bad,exc,msg", [
    (lambda: mxmoe.quantize(torch.randn(4, 33)), ValueError, "not divisible by the MX block size 32"),
    (lambda: mxmoe.quantize(torch.randint(0, 5, (4, 32))), TypeError, "dtype"),
    (lambda: mxmoe.quantize(torch.randn(4, 32), scale_rule="round"), ValueError, "round"),
    (lambda: mxmoe.quantize(torch.randn(4, 32), block=(16, 32)), ValueError, "block"),
    (lambda: mxmoe.quantize(torch.randn(64, 32, 4), axis=0, block=(32, 32)), ValueError, "last two"),
    (lambda: mxmoe.quantize(torch.randn(32, 32), axis=2), ValueError, "out of range"),
    (lambda: mxmoe.quantize([[1.0] * 32]), TypeError, "torch.Tensor"),
])
def test_bad_input(bad, exc, msg):
    with pytest.raises(exc, match=msg):
        bad()


def test_zero_rows():
    q = mxmoe.quantize(torch.ones(0, 64))
    assert q.data.shape == (0, 64) and q.scale.shape == (0, 2)
