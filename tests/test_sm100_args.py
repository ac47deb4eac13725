"""Arguments our sm_100 path hands torch._scaled_grouped_mm, checked on CPU (no Blackwell GPU here)."""

import torch

import mxmoe
from mxmoe.kernels.sm100 import sm100_scaled_grouped_mm_args
from mxmoe.layouts import blocked_numel, from_blocked, to_blocked


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


def _plain(t: MXTensor) -> MXTensor:
    """``t`` without its carried blocked scales (the sm_100 arguments then re-lay them in torch)."""
    return MXTensor(t.data, t.scale, t.axis, t.scale_rule, t.block)


def _case_weight_scales_equal_to_the_fallback(dev, gen):
    """1x32 expert weights quantized along K (fprop) and along N (dgrad) with the blocked copy: data and
    row-major scales equal the reference, and the carried per-expert scales equal the fallback's scale_b."""
    from test_quantize_kernels import same_bytes, wide_randn, with_special_blocks

    from mxmoe import formats
    from mxmoe.ops.quantization import quantize_weight
    from mxmoe.recipes import RECIPES

    sizes = [40, 0, 33]
    offs = _offs(sizes)
    for dt in (torch.bfloat16, torch.float32):
        for E, N, K in ((3, 96, 160), (5, 160, 96)):  # odd E; N, K multiples of 32, not of 128
            for rule in ("rceil", "floor"):
                recipe = RECIPES["mxfp8"].with_(scale_rule=rule)
                w = with_special_blocks(wide_randn((E, N, K), dt, dev, gen), -1)
                for axis, a_cols in ((-1, K), (-2, N)):  # fprop: b = w.mT [E, K, N]; dgrad: b = w [E, N, K]
                    tag = f"{dt} E={E} N={N} K={K} {rule} axis {axis}"
                    q = quantize_weight(w, recipe, axis, SM100_CPU, blocked=True)
                    ref = formats.quantize(w, axis, rule)
                    assert q.grouped is not None and q.grouped.offs is None, f"{tag}: no per-expert scales"
                    same_bytes(q.data.contiguous(), ref.data, f"{tag} data")
                    same_bytes(q.scale.contiguous(), ref.scale, f"{tag} row-major scale")
                    assert (q.axis, q.block, q.scale_rule) == (ref.axis, (1, 32), rule), tag
                    b = q.mT if axis == -1 else q
                    a = formats.quantize(torch.randn(sum(sizes), a_cols, generator=gen), -1, rule)
                    got = sm100_scaled_grouped_mm_args(a, b, offs, torch.bfloat16)["scale_b"]
                    want = sm100_scaled_grouped_mm_args(a, _plain(b), offs, torch.bfloat16)["scale_b"]
                    same_bytes(got, want, f"{tag} scale_b")
                    assert got.data_ptr() == q.grouped.scale.data_ptr(), f"{tag}: scale_b copied"
                    plain = quantize_weight(w, recipe, axis, SM100_CPU)
                    assert plain.grouped is None, f"{tag}: blocked copy without blocked=True"


def _case_layer_weights_on_the_sm100_route(dev, gen):
    """grouped_linear under the sm_100 route's decisions: fprop's and dgrad's weights carry per-expert
    blocked scales; the sm_100 arguments built from every M-grouped product's operands equal the fallback's
    bit for bit, and y, dx, dw equal the CPU route's."""
    from mxmoe.ops import linear

    made, checked = [], []
    real_q, real_mm = linear.quantize_weight, linear.grouped_mm

    def spy_q(*args, **kw):
        out = real_q(*args, **kw)
        made.append(out.grouped is not None)
        return out

    def spy_mm(a, b, offs, **kw):
        if isinstance(b, MXTensor) and b.dim() == 3:
            got = sm100_scaled_grouped_mm_args(a, b, offs, torch.float32)
            want = sm100_scaled_grouped_mm_args(_plain(a), _plain(b), offs, torch.float32)
            for k in ("scale_a", "scale_b", "mat_a", "mat_b"):
                assert torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k
            checked.append(b.grouped is not None)
        return real_mm(a, b, offs, **kw)

    for rule in ("rceil", "floor"):
        sizes = [0, 37, 64, 0, 27]  # odd E; padded to 32-row groups below (MX wgrad)
        padded = [-(-n // 32) * 32 for n in sizes]
        offs = _offs(padded)
        x0 = torch.randn(sum(padded), 96, generator=gen)
        w0 = torch.randn(len(sizes), 160, 96, generator=gen)  # N = 160, K = 96: not multiples of 128
        dy = torch.randn(sum(padded), 160, generator=gen)
        recipe = linear.get_recipe("mxfp8").with_(scale_rule=rule)
        outs = []
        made.clear(), checked.clear()
        linear.quantize_weight, linear.grouped_mm = spy_q, spy_mm
        try:
            for be in (SM100_CPU, Backend("cpu", "cpu", False)):
                x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
                y = linear.grouped_linear(x, w, offs, recipe, backend=be)
                y.backward(dy)
                outs.append((y.detach(), x.grad, w.grad))
        finally:
            linear.quantize_weight, linear.grouped_mm = real_q, real_mm
        assert made == [True, True, False, False], (rule, made)  # sm_100: fprop's and dgrad's weights carry them
        assert checked == [True, True, False, False], (rule, checked)
        for got, want, what in zip(outs[0], outs[1], ("y", "dx", "dw")):
            assert torch.equal(got, want), (rule, what)


CASES = {
    "grouped_scales_equal_to_blocked_grouped": _case_grouped_scales_equal_to_blocked_grouped,
    "args_take_the_carried_scale": _case_args_take_the_carried_scale,
    "layer_on_the_sm100_route": _case_layer_on_the_sm100_route,
    "weight_scales_equal_to_the_fallback": _case_weight_scales_equal_to_the_fallback,
    "layer_weights_on_the_sm100_route": _case_layer_weights_on_the_sm100_route,
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


def _carrying_per_expert(w: MXTensor, scale) -> MXTensor:
    return MXTensor(w.data, w.scale, w.axis, w.scale_rule, w.block, GroupedScale(scale, None, None, 0))


def _per_expert_blocked(w: MXTensor) -> torch.Tensor:
    """Each expert's scale matrix with the quantized axis last, blocked and stacked."""
    s = w.scale if w.axis == 2 else w.scale.mT
    return torch.stack([to_blocked(s[e].contiguous()) for e in range(w.shape[0])])


def test_swaps_of_the_last_two_dims_keep_the_carried_scale():
    offs = _offs([32, 32])
    a = mxmoe.quantize(torch.randn(64, 64))
    c = _carrying(a, to_blocked_grouped(a.scale, offs)[0], offs)
    assert c.mT.grouped is c.grouped and c.mT.mT.grouped is c.grouped
    assert torch.equal(c.dequantize(), a.dequantize())
    w = mxmoe.quantize(torch.randn(3, 64, 96))
    cw = _carrying_per_expert(w, _per_expert_blocked(w))
    assert cw.mT.grouped is cw.grouped and cw.transpose(2, 1).grouped is cw.grouped
    assert cw.transpose(0, 1).grouped is None  # the experts' matrices no longer lie on the last two dims


def test_args_take_carried_weight_scales_and_refuse_mismatching_ones():
    sizes = [0, 37, 64]
    offs = _offs(sizes)
    E, N, K = 3, 96, 160
    a = mxmoe.quantize(torch.randn(sum(sizes), K))
    w = mxmoe.quantize(torch.randn(E, N, K))
    blocked = _per_expert_blocked(w)
    want = sm100_scaled_grouped_mm_args(a, w.mT, offs, torch.bfloat16)["scale_b"]
    got = sm100_scaled_grouped_mm_args(a, _carrying_per_expert(w, blocked).mT, offs, torch.bfloat16)["scale_b"]
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)) and got.data_ptr() == blocked.data_ptr()
    wn = mxmoe.quantize(torch.randn(E, N, K), axis=-2)  # dgrad's operand, along N
    dy = mxmoe.quantize(torch.randn(sum(sizes), N))
    want = sm100_scaled_grouped_mm_args(dy, wn, offs, torch.bfloat16)["scale_b"]
    got = sm100_scaled_grouped_mm_args(dy, _carrying_per_expert(wn, _per_expert_blocked(wn)), offs,
                                       torch.bfloat16)["scale_b"]
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    with pytest.raises(ValueError, match="do not fit"):
        sm100_scaled_grouped_mm_args(a, _carrying_per_expert(w, blocked[:, :-4]).mT, offs, torch.bfloat16)
    with pytest.raises(ValueError, match="do not fit"):  # one expert short
        sm100_scaled_grouped_mm_args(a, _carrying_per_expert(w, blocked[1:]).mT, offs, torch.bfloat16)
    with pytest.raises(ValueError, match="per-expert blocked scales belong"):  # a per-group carrier on b
        bad = MXTensor(w.data, w.scale, w.axis, w.scale_rule, w.block, GroupedScale(blocked, offs, offs, 0))
        sm100_scaled_grouped_mm_args(a, bad.mT, offs, torch.bfloat16)
    with pytest.raises(ValueError, match="per-group blocked scales belong"):  # a per-expert carrier on a
        sm100_scaled_grouped_mm_args(_carrying_per_expert(a, blocked), w.mT, offs, torch.bfloat16)


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
    assert be.blocked_weight_scales(RECIPES["mxfp8"]) and be.blocked_weight_scales(RECIPES["mxfp8_lowmem"])
    assert not be.blocked_weight_scales(RECIPES["mxfp8_2d"])  # square tiles: the two-orientation kernel
    assert not be.blocked_weight_scales(RECIPES["mxfp8_128"]) and not be.blocked_weight_scales(RECIPES["bf16"])
    monkeypatch.setattr(backend, "triton_available", lambda: False)
    no_triton = backend._resolve.__wrapped__("cuda", 0, "auto", True, True, True, False)
    assert not no_triton.grouped_scales(RECIPES["mxfp8"]) and not no_triton.blocked_weight_scales(RECIPES["mxfp8"])
    monkeypatch.setattr(backend, "capability", lambda index: (9, 0))
    monkeypatch.setattr(backend, "triton_available", lambda: True)
    hopper = backend._resolve.__wrapped__("cuda", 0, "auto", True, True, True, False)
    assert not hopper.grouped_scales(RECIPES["mxfp8"]) and not hopper.blocked_weight_scales(RECIPES["mxfp8"])


if __name__ == "__main__" and "--cases" in sys.argv:
    import json

    from test_quantize_kernels import run_cases

    results = run_cases("cpu", {name: (lambda Q, dev, gen, fn=fn: fn(dev, gen)) for name, fn in CASES.items()})
    print("RESULTS " + json.dumps(results))
