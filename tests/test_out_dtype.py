"""``grouped_mm(..., out_dtype=torch.float32)`` of MX operands on Hopper's expansion route (the default,
``MXMOE_SM90_GEMM`` unset, ``auto`` or ``bf16``; ``mixed`` for the 2D x 2D wgrad form): the MX operands are
expanded exactly to BF16 and multiplied by BF16 ``torch._grouped_mm``, which sums in FP32 and writes BF16;
the FP32 result is that BF16 product cast to FP32. So every element is a BF16 value, within half a BF16
ulp (2^-9 relative) of the exact product of the dequantized operands, plus FP32 summation order."""

import pytest
import torch

import mxmoe
from mxmoe.formats import BLOCK


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _check_bf16_rounded(got: torch.Tensor, exact: torch.Tensor):
    assert got.dtype == torch.float32
    assert torch.equal(got, got.bfloat16().float()), "some FP32 outputs are not BF16 values"
    err = (got.double() - exact).abs()
    scale = exact.abs()
    # half a BF16 ulp of the exact value, plus FP32 summation's own error (far smaller at these sizes)
    assert bool((err <= scale * 2.0**-8 + 1e-30 + scale.max() * 2.0**-20).all())
    rel = (err / scale.clamp_min(scale.max() * 1e-3)).max().item()
    assert 1e-4 < rel <= 2.0**-8, rel  # BF16 rounding visible: not FP32 accuracy


@pytest.mark.gpu
@pytest.mark.parametrize("route", [None, "bf16"])
def test_fp32_out_dtype_is_bf16_rounded_on_the_expansion_route(route, monkeypatch):
    if not _sm90():
        pytest.skip("the expansion route is Hopper's (sm_90)")
    if route is None:
        monkeypatch.delenv("MXMOE_SM90_GEMM", raising=False)
    else:
        monkeypatch.setenv("MXMOE_SM90_GEMM", route)
    gen = torch.Generator().manual_seed(0)
    E, K, N = 4, 256, 192
    offs = torch.tensor([64, 64, 320, 512], dtype=torch.int32)
    M = int(offs[-1])
    a = torch.randn(M, K, generator=gen).cuda()
    w = torch.randn(E, N, K, generator=gen).cuda()
    aq, wq = mxmoe.quantize(a), mxmoe.quantize(w)  # along K
    got = mxmoe.grouped_mm(aq, wq.mT, offs.cuda(), out_dtype=torch.float32)  # fprop form: [M, N]
    ad, wd = aq.dequantize(torch.float64), wq.dequantize(torch.float64)
    exact = torch.cat([ad[s:t] @ wd[e].mT for e, (s, t) in enumerate(zip([0] + offs.tolist()[:-1], offs.tolist()))])
    _check_bf16_rounded(got, exact)

    # wgrad form [N, T] x [T, K] -> [E, N, K], contraction over tokens in 32-row blocks
    dy = torch.randn(M, N, generator=gen).cuda()
    dyq = mxmoe.quantize(dy, axis=0).mT  # [N, M] along tokens
    xq = mxmoe.quantize(a, axis=0)  # [M, K] along tokens
    got = mxmoe.grouped_mm(dyq, xq, offs.cuda(), out_dtype=torch.float32)
    dyd, xd = dyq.dequantize(torch.float64), xq.dequantize(torch.float64)
    ends = offs.tolist()
    exact = torch.stack([dyd[:, s:t] @ xd[s:t] for s, t in zip([0] + ends[:-1], ends)])
    assert M % BLOCK == 0
    _check_bf16_rounded(got[[0, 2, 3]], exact[[0, 2, 3]])  # group 1 is empty: zeros
    assert not got[1].any()
