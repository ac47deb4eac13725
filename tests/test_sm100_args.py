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


# ------------------------------------------------------------------------------------------------
# Per-group blocked scales straight from the grouped quantization kernel (MXTensor.grouped)
# ------------------------------------------------------------------------------------------------
# The kernel cases run under TRITON_INTERPRET=1 in ONE subprocess (this file with --cases; the flag must be
# set before triton is imported), each reported as its own test.

import os  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

from mxmoe.backend import Backend  # noqa: E402
from mxmoe.formats import GroupedScale, MXTensor  # noqa: E402
from mxmoe.layouts import to_blocked_grouped  # noqa: E402

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

SM100_CPU = Backend("cpu", "sm100", True)  # the sm_100 route's decisions, products on CPU (reference)
# group sizes: empty first / middle / last experts, odd sizes, one past 128, tail rows past offs[-1]
GROUP_CASES = (([0, 37, 0, 130, 1, 0], 5), ([64], 0), ([0, 0], 3), ([200, 3], 0))


def _offs(sizes):
    return torch.tensor(sizes).cumsum(0).to(torch.int32)


def _case_grouped_scales_equal_to_blocked_grouped(dev, gen):
    from test_quantize_kernels import same_bytes, wide_randn, with_special_blocks

    from mxmoe import formats
    from mxmoe.ops.quantization import quantize_grouped

    for dt in (torch.bfloat16, torch.float32):
        for K in (96, 160):  # 3 and 5 scale columns: padded to 4 and 8
            for rule in ("rceil", "floor"):
                for sizes, tail in GROUP_CASES:
                    offs = _offs(sizes)
                    x = with_special_blocks(wide_randn((sum(sizes) + tail, K), dt, dev, gen), -1)
                    tag = f"{dt} K={K} {rule} {sizes}+{tail}"
                    q = quantize_grouped(x, offs, rule, backend=SM100_CPU)
                    ref = formats.quantize(x, -1, rule)
                    assert q.grouped is not None, f"{tag}: no blocked scales carried"
                    want, want_offs = to_blocked_grouped(ref.scale, offs)
                    same_bytes(q.grouped.scale, want, f"{tag} blocked scale")
                    same_bytes(q.grouped.blocked_offs, want_offs, f"{tag} blocked offsets")
                    assert q.grouped.rows == (int(want_offs[-1]) if sizes else 0), f"{tag}: rows"
                    same_bytes(q.data, ref.data, f"{tag} data")
                    same_bytes(q.scale, ref.scale, f"{tag} row-major scale")
                    assert (q.axis, q.block, q.scale_rule) == (1, (1, 32), rule), tag


def _case_args_take_the_carried_scale(dev, gen):
    from mxmoe.ops.quantization import quantize_grouped

    sizes = [0, 130, 0, 33, 64, 0]
    offs = _offs(sizes)
    M, K, N, E = sum(sizes), 96, 64, len(sizes)
    a = quantize_grouped(torch.randn(M, K, generator=gen), offs, backend=SM100_CPU)
    w = mxmoe.quantize(torch.randn(E, N, K, generator=gen))
    assert a.grouped is not None
    got = sm100_scaled_grouped_mm_args(a, w.mT, offs, torch.bfloat16)
    plain = MXTensor(a.data, a.scale, a.axis, a.scale_rule, a.block)  # no carrier: the torch re-layout
    want = sm100_scaled_grouped_mm_args(plain, w.mT, offs, torch.bfloat16)
    assert got["scale_a"].shape == want["scale_a"].shape
    assert torch.equal(got["scale_a"].view(torch.uint8), want["scale_a"].view(torch.uint8))
    assert got["scale_a"].data_ptr() == a.grouped.scale.data_ptr()  # passed through, not copied
    assert torch.equal(got["scale_b"].view(torch.uint8), want["scale_b"].view(torch.uint8))


def _case_layer_on_the_sm100_route(dev, gen):
    """grouped_linear under the sm_100 route's decisions (products on CPU: the reference): fprop and dgrad
    operands come from the grouped kernel with blocked scales; outputs and gradients equal the CPU route's."""
    from mxmoe.ops import linear

    made = []
    real = linear.quantize_grouped

    def spy(*args, **kw):
        out = real(*args, **kw)
        made.append(out.grouped is not None)
        return out

    sizes = [0, 37, 64, 0, 27]  # padded to 32-row groups below (MX wgrad)
    padded = [-(-n // 32) * 32 for n in sizes]
    offs = _offs(padded)
    x0 = torch.randn(sum(padded), 64, generator=gen)
    w0 = torch.randn(len(sizes), 96, 64, generator=gen)
    dy = torch.randn(sum(padded), 96, generator=gen)
    outs = []
    linear.quantize_grouped = spy
    try:
        for be in (SM100_CPU, Backend("cpu", "cpu", False)):
            x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            y = linear.grouped_linear(x, w, offs, "mxfp8", backend=be)
            y.backward(dy)
            outs.append((y.detach(), x.grad, w.grad))
    finally:
        linear.quantize_grouped = real
    assert made == [True, True], made  # fprop's x and dgrad's dy, each with blocked scales
    for got, want, what in zip(outs[0], outs[1], ("y", "dx", "dw")):
        assert torch.equal(got, want), what


CASES = {
    "grouped_scales_equal_to_blocked_grouped": _case_grouped_scales_equal_to_blocked_grouped,
    "args_take_the_carried_scale": _case_args_take_the_carried_scale,
    "layer_on_the_sm100_route": _case_layer_on_the_sm100_route,
}


@pytest.fixture(scope="module")
def interpreter_results():
    from test_quantize_kernels import run_interpreted_cases

    return run_interpreted_cases(__file__)


@pytest.mark.parametrize("case", list(CASES))
def test_interpreter(interpreter_results, case):
    err = interpreter_results[case]
    assert err is None, err


def _carrying(a: MXTensor, scale, offs) -> MXTensor:
    from mxmoe.layouts import blocked_group_offsets

    bo = blocked_group_offsets(offs)
    return MXTensor(a.data, a.scale, a.axis, a.scale_rule, a.block,
                    GroupedScale(scale, offs, bo, int(bo[-1]) if bo.numel() else 0))


def test_args_take_a_carried_scale_and_refuse_a_mismatching_one():
    sizes = [0, 37, 0, 130]
    offs = _offs(sizes)
    a = mxmoe.quantize(torch.randn(sum(sizes), 96))
    w = mxmoe.quantize(torch.randn(len(sizes), 64, 96))
    blocked, _ = to_blocked_grouped(a.scale, offs)
    want = sm100_scaled_grouped_mm_args(a, w.mT, offs, torch.bfloat16)["scale_a"]
    got = sm100_scaled_grouped_mm_args(_carrying(a, blocked, offs), w.mT, offs.clone(), torch.bfloat16)["scale_a"]
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    other = _offs([0, 40, 0, 127])  # the same padded rows, other groups
    with pytest.raises(ValueError, match="laid out for groups ending at"):
        sm100_scaled_grouped_mm_args(_carrying(a, blocked, other), w.mT, offs, torch.bfloat16)
    with pytest.raises(ValueError, match="do not fit"):
        sm100_scaled_grouped_mm_args(_carrying(a, blocked[:-4], offs), w.mT, offs, torch.bfloat16)
    wide = mxmoe.quantize(torch.randn(sum(sizes), 160))  # 5 scale columns: a wider blocked layout
    with pytest.raises(ValueError, match="do not fit"):
        sm100_scaled_grouped_mm_args(_carrying(wide, blocked, offs), mxmoe.quantize(torch.randn(4, 64, 160)).mT,
                                     offs, torch.bfloat16)


def test_views_drop_the_carried_scale():
    offs = _offs([32, 32])
    a = mxmoe.quantize(torch.randn(64, 64))
    c = _carrying(a, to_blocked_grouped(a.scale, offs)[0], offs)
    assert c.mT.grouped is None and c.mT.mT.grouped is None
    assert torch.equal(c.dequantize(), a.dequantize())


def test_sm100_capability_routes_activations_through_the_grouped_kernel(monkeypatch):
    from mxmoe import backend
    from mxmoe.recipes import RECIPES

    monkeypatch.setattr(backend, "capability", lambda index: (10, 0))
    monkeypatch.setattr(backend, "triton_available", lambda: True)
    be = backend._resolve.__wrapped__("cuda", 0, "auto", True, True, True, False)  # uncached: a simulated GPU
    assert be.arch == "sm100" and be.kernels
    assert be.recipe_routes(RECIPES["mxfp8"])["fprop"] == "sm100"
    assert be.grouped_scales(RECIPES["mxfp8"]) and be.grouped_scales(RECIPES["mxfp8_2d"])
    assert not be.grouped_scales(RECIPES["mxfp8_128"])  # 1x128 groups: the kernel writes 1x32 only
    assert not be.grouped_scales(RECIPES["bf16"])
    monkeypatch.setattr(backend, "triton_available", lambda: False)
    assert not backend._resolve.__wrapped__("cuda", 0, "auto", True, True, True, False).grouped_scales(RECIPES["mxfp8"])
    monkeypatch.setattr(backend, "capability", lambda index: (9, 0))
    monkeypatch.setattr(backend, "triton_available", lambda: True)
    assert not backend._resolve.__wrapped__("cuda", 0, "auto", True, True, True, False).grouped_scales(RECIPES["mxfp8"])


if __name__ == "__main__" and "--cases" in sys.argv:
    import json

    from test_quantize_kernels import run_cases

    results = run_cases("cpu", {name: (lambda Q, dev, gen, fn=fn: fn(dev, gen)) for name, fn in CASES.items()})
    print("RESULTS " + json.dumps(results))
