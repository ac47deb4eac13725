"""Arguments our sm_100 path hands torch._scaled_grouped_mm, checked on CPU (no Blackwell GPU here)."""

import torch

import mxmoe
from mxmoe.kernels.sm100 import sm100_scaled_grouped_mm_args
from mxmoe.layouts import blocked_numel, from_blocked


def test_2d3d_args_follow_the_blocked_contract():
    sizes = [0, 130, 0, 32, 64, 0]
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    M, K, N, E = sum(sizes), 96, 64, len(sizes)  # K/32 = 3 scale columns: padded to 4
    a = mxmoe.quantize(torch.randn(M, K))
    w = mxmoe.quantize(torch.randn(E, N, K))
    kw = sm100_scaled_grouped_mm_args(a, w.mT, offs, torch.bfloat16)
    assert kw["mat_a"].shape == (M, K) and kw["mat_a"].is_contiguous()
    assert kw["mat_b"].shape == (E, K, N) and kw["mat_b"].stride(1) == 1  # K contiguous
    assert torch.equal(kw["mat_b"].view(torch.uint8), w.data.mT.view(torch.uint8))
    sa = kw["scale_a"].view(torch.uint8)
    assert sa.shape == ((256 + 128 + 128), 4)  # each non-empty group padded to 128 rows
    flat, start, prow = sa.reshape(-1), 0, 0
    for n in sizes:
        if n:
            rows = -(-n // 128) * 128
            got = from_blocked(flat[prow * 4:(prow + rows) * 4], n, 3)
            assert torch.equal(got, a.scale[start:start + n].view(torch.uint8))
            prow += rows
        start += n
    sb = kw["scale_b"].view(torch.uint8)
    assert sb.shape == (E, blocked_numel(N, 3))
    assert torch.equal(from_blocked(sb[4], N, 3), w.scale[4].view(torch.uint8))


def test_2d2d_wgrad_args_block_each_token_group():
    sizes = [64, 0, 32]
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    T, N, K = 96, 48, 40
    dy = mxmoe.quantize(torch.randn(T, N), axis=0)
    x = mxmoe.quantize(torch.randn(T, K), axis=0)
    kw = sm100_scaled_grouped_mm_args(dy.mT, x, offs, torch.float32)
    assert kw["mat_a"].shape == (N, T) and kw["mat_a"].is_contiguous()
    assert kw["mat_b"].shape == (T, K) and kw["mat_b"].stride(0) == 1  # column-major
    sa = kw["scale_a"].view(torch.uint8)
    first = from_blocked(sa[: blocked_numel(N, 2)], N, 2)  # group 0: tokens 0..63 -> 2 scale columns
    assert torch.equal(first, dy.scale.mT[:, :2].view(torch.uint8))
    assert sa.numel() == blocked_numel(N, 2) + blocked_numel(N, 1)


def test_2d2d_refuses_token_groups_off_32():
    import pytest

    dy = mxmoe.quantize(torch.randn(64, 48), axis=0)
    x = mxmoe.quantize(torch.randn(64, 40), axis=0)
    with pytest.raises(ValueError, match="multiples of 32"):
        sm100_scaled_grouped_mm_args(dy.mT, x, torch.tensor([20, 64], dtype=torch.int32), torch.float32)
