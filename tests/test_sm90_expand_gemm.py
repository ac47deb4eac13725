"""The M-grouped MX GEMM with in-kernel expansion to BF16 (mxmoe.kernels.sm90_expand_gemm) against the
FP64 product of the dequantized operands.

CPU: under ``TRITON_INTERPRET=1`` (one subprocess): random operands with a wide range of scales,
groups empty at the start, middle and end, a single group, more than 32 experts, N and K that are
not multiples of the tile (K a multiple of 32), a NaN scale, BF16 output equal to the FP32 output
rounded, identical reruns, clear errors. GPU: the same checks at larger sizes, and agreement with
the expansion route (``dequantize_bf16`` + ``torch._grouped_mm``).
"""

import pytest
import torch

from test_qdq_kernels import run_interpreted

SCRIPT = r"""
from mxmoe.ops import quantize
from mxmoe.kernels.sm90_expand_gemm import mx_expand_grouped_mm

def operands(groups, N, K, extra_rows=5):
    M = sum(groups) + extra_rows
    a = torch.randn(M, K, generator=gen) * torch.exp2(torch.randint(-10, 10, (M, 1), generator=gen).float())
    b = torch.randn(len(groups), N, K, generator=gen) * torch.exp2(torch.randint(-6, 6, (len(groups), N, 1), generator=gen).float())
    offs = torch.tensor(groups).cumsum(0).to(torch.int32)
    return quantize(a, axis=-1), quantize(b, axis=-1), offs

def reference(aq, bq, offs):
    ad, bd = aq.dequantize(torch.float64), bq.dequantize(torch.float64)
    ref, start = torch.zeros(ad.shape[0], bd.shape[1], dtype=torch.float64), 0
    for e, end in enumerate(offs.tolist()):
        ref[start:end] = ad[start:end] @ bd[e].T
        start = end
    return ref

TILE = dict(BM=32, BN=32, BK=64, GROUP_M=2, num_warps=4)
cases = [([0, 40, 0, 65, 1, 0], 48, 96), ([100], 70, 160), ([3] * 20 + [0] * 10 + [5] * 10, 32, 64)]
for groups, N, K in cases:
    aq, bq, offs = operands(groups, N, K)
    end = int(offs[-1])
    c32 = mx_expand_grouped_mm(aq.data, aq.scale, bq.data, bq.scale, offs, torch.float32, **TILE)
    ref = reference(aq, bq, offs)[:end]
    err = ((c32[:end].double() - ref).norm() / ref.norm()).item()
    assert err <= 1e-5, (groups, err)
    c16 = mx_expand_grouped_mm(aq.data, aq.scale, bq.data, bq.scale, offs, torch.bfloat16, **TILE)
    same(c16[:end], c32[:end].to(torch.bfloat16), f"bf16 output {groups[:4]}")
    again = mx_expand_grouped_mm(aq.data, aq.scale, bq.data, bq.scale, offs, torch.float32, **TILE)
    same(again[:end], c32[:end], "rerun")

aq, bq, offs = operands([40, 24], 32, 64)  # a NaN scale (0xFF) gives NaN in its row only
sa = aq.scale.view(torch.uint8).clone()
sa[3, 1] = 255
c = mx_expand_grouped_mm(aq.data, sa.view(torch.float8_e8m0fnu), bq.data, bq.scale, offs, torch.float32, **TILE)
assert c[3].isnan().all() and not c[:3].isnan().any() and not c[4:64].isnan().any()

for bad, kind in [(lambda: mx_expand_grouped_mm(aq.data.float(), aq.scale, bq.data, bq.scale, offs), TypeError),
                  (lambda: mx_expand_grouped_mm(aq.data, aq.scale, bq.data, bq.scale, offs.long()), TypeError),
                  (lambda: mx_expand_grouped_mm(aq.data[:, :32], aq.scale, bq.data, bq.scale, offs), ValueError),
                  (lambda: mx_expand_grouped_mm(aq.data, aq.scale, bq.data, bq.scale, offs[:1]), ValueError)]:
    try:
        bad()
    except kind:
        pass
    else:
        raise AssertionError(f"expected {kind.__name__}")
print("ok")
"""


def test_expand_gemm_interpreted():
    run_interpreted(SCRIPT)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("groups,N,K", [([0, 1000, 0, 3000, 17, 0], 1536, 2048), ([4096] * 8, 4096, 1024)])
@pytest.mark.parametrize("bf16_scale", [False, True])
def test_gpu_expand_gemm_matches_reference_and_expansion_route(groups, N, K, bf16_scale):
    from mxmoe.kernels.dequantize import dequantize_bf16
    from mxmoe.kernels.sm90_expand_gemm import mx_expand_grouped_mm
    from mxmoe.ops import quantize

    gen = torch.Generator(device="cuda").manual_seed(0)
    M = sum(groups) + 64
    a = torch.randn(M, K, generator=gen, device="cuda") * torch.exp2(torch.randint(-30, 30, (M, 1), generator=gen,
                                                                                     device="cuda").float())
    b = torch.randn(len(groups), N, K, generator=gen, device="cuda")
    aq, bq = quantize(a, axis=-1), quantize(b, axis=-1)
    offs = torch.tensor(groups, device="cuda").cumsum(0).to(torch.int32)
    end = int(offs[-1])
    c32 = mx_expand_grouped_mm(aq.data, aq.scale, bq.data, bq.scale, offs, torch.float32, bf16_scale=bf16_scale)
    ad, bd = aq.dequantize(torch.float64), bq.dequantize(torch.float64)
    num = den = 0.0
    start = 0
    for e, stop in enumerate(offs.tolist()):
        if stop > start:
            ref = ad[start:stop] @ bd[e].T
            num += (c32[start:stop].double() - ref).pow(2).sum().item()
            den += ref.pow(2).sum().item()
        start = stop
    assert (num / den) ** 0.5 <= 1e-5
    c16 = mx_expand_grouped_mm(aq.data, aq.scale, bq.data, bq.scale, offs, torch.bfloat16, bf16_scale=bf16_scale)
    assert torch.equal(c16[:end], c32[:end].bfloat16())
    again = mx_expand_grouped_mm(aq.data, aq.scale, bq.data, bq.scale, offs, torch.bfloat16, bf16_scale=bf16_scale)
    assert torch.equal(again[:end], c16[:end])
    # the expanded operands are the same BF16 values either way: equal to the default expansion's result
    base = mx_expand_grouped_mm(aq.data, aq.scale, bq.data, bq.scale, offs, torch.float32)
    assert torch.equal(c32[:end], base[:end])
    route = torch._grouped_mm(dequantize_bf16(aq.data, aq.scale), dequantize_bf16(bq.data, bq.scale).mT, offs=offs)
    torch.testing.assert_close(c16[:end].float(), route[:end].float(), rtol=1.6e-2, atol=1e-3)
