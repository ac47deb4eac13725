"""The ``mxfp8_128`` recipe (DESIGN §9) through the expert linear layer and the MoE layer.

Each of the three products is checked against the FP64 product of its operands quantized with the
reference (:func:`mxmoe.formats.quantize`): fprop x 1x128 along K times W in 128x128 tiles, dgrad dy
1x128 along N times the same W tiles, wgrad dy and x 128x1 along each expert's tokens.
"""

import pytest
import torch

import mxmoe
from mxmoe import formats, ops
from mxmoe.recipes import RECIPES, Recipe, get_recipe


def _ref_products(x, w, offs, dy, rule="rceil"):
    xd = formats.quantize(x, -1, rule, 128).dequantize(torch.float64)
    wd = formats.quantize(w, -1, rule, (128, 128)).dequantize(torch.float64)
    dyd = formats.quantize(dy, -1, rule, 128).dequantize(torch.float64)
    x_t = formats.quantize(x, 0, rule, 128).dequantize(torch.float64)
    dy_t = formats.quantize(dy, 0, rule, 128).dequantize(torch.float64)
    y = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)
    dx = torch.zeros_like(x, dtype=torch.float64)
    dw = torch.zeros(w.shape, dtype=torch.float64)
    start = 0
    for e, end in enumerate(offs.tolist()):
        y[start:end] = xd[start:end] @ wd[e].T
        dx[start:end] = dyd[start:end] @ wd[e]
        dw[e] = dy_t[start:end].T @ x_t[start:end]
        start = end
    return y, dx, dw


def _rel(a, b):
    return float((a.detach().double() - b.detach()).norm() / b.detach().norm())


@pytest.mark.parametrize("counts", [[128, 256, 0, 128], [0, 384, 128, 0], [512]])
def test_grouped_linear_128_matches_fp64_of_reference_quantization(counts):
    g = torch.Generator().manual_seed(sum(counts))
    E, N, K = len(counts), 256, 384
    M = sum(counts)
    x = torch.randn(M, K, generator=g).requires_grad_()
    w = (torch.randn(E, N, K, generator=g) / K ** 0.5).requires_grad_()
    dy = torch.randn(M, N, generator=g)
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    y = ops.grouped_linear(x, w, offs, "mxfp8_128")
    y.backward(dy)
    y_ref, dx_ref, dw_ref = _ref_products(x.detach(), w.detach(), offs, dy)
    # FP32 accumulation of exact FP8 x FP8 products: FP32-rounding close to FP64
    assert _rel(y, y_ref) < 1e-6
    assert _rel(x.grad, dx_ref) < 1e-6
    assert _rel(w.grad, dw_ref) < 1e-6
    for e, n in enumerate(counts):
        if n == 0:
            assert bool((w.grad[e] == 0).all())


def test_128_groups_differ_from_32_blocks():
    """The recipe really uses 128-element groups: its product differs from mxfp8's on data whose
    32-blocks have very different ranges, and matches the construction above."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(128, 256, generator=g) * torch.exp2(torch.randint(-8, 8, (1, 256), generator=g).float())
    w = torch.randn(1, 128, 256, generator=g)
    offs = torch.tensor([128], dtype=torch.int32)
    y128 = ops.grouped_linear(x, w, offs, "mxfp8_128")
    y32 = ops.grouped_linear(x, w, offs, "mxfp8")
    assert not torch.equal(y128, y32)
    assert _rel(y128, _ref_products(x, w, offs, torch.zeros(128, 128))[0]) < 1e-6


def test_recipe_rules():
    r = get_recipe("mxfp8_128")
    assert (r.act_block, r.weight_block, r.align, r.scale_groups) == (128, 128, 128, 128)
    with pytest.raises(ValueError, match="divisible by 128"):
        r.check_dims(256, 96)
    with pytest.raises(ValueError, match="align must be a multiple of 128"):
        Recipe("x", mxfp8=True, act_block=128, align=32)
    with pytest.raises(ValueError, match="act_block must be 32 or 128"):
        Recipe("x", mxfp8=True, act_block=64)
    with pytest.raises(ValueError, match="needs an MXFP8 recipe"):
        Recipe("x", act_block=128)
    with pytest.raises(ValueError, match="weight_block must be"):
        Recipe("x", mxfp8=True, weight_block=64)
    x = torch.randn(128, 256)
    w = torch.randn(2, 96, 256)
    with pytest.raises(ValueError, match="divisible by 128"):
        ops.grouped_linear(x, w, torch.tensor([64, 128], dtype=torch.int32), "mxfp8_128")
    w = torch.randn(2, 128, 256)
    with pytest.raises(ValueError, match="multiple of 128 rows"):
        ops.grouped_linear(x, w, torch.tensor([64, 128], dtype=torch.int32), "mxfp8_128")
    with pytest.raises(ValueError, match="multiple of 128"):
        ops.grouped_mm(mxmoe.quantize(x.t().contiguous(), block=128), mxmoe.quantize(x, axis=0, block=128),
                       torch.tensor([64, 128], dtype=torch.int32))


def test_moe_layer_128_close_to_fp32():
    torch.manual_seed(0)
    moe = mxmoe.MoE(dim=256, ffn_dim=128, num_experts=4, top_k=2, recipe="fp32")
    x = torch.randn(2, 96, 256)
    out_ref = moe(x)
    out_ref.square().mean().backward()
    g_ref = [p.grad.clone() for p in moe.parameters()]
    moe.zero_grad()
    moe.set_recipe("mxfp8_128")
    out = moe(x)
    out.square().mean().backward()
    assert _rel(out, out_ref.double()) < 0.08  # E4M3 rounding of both operands at coarse scales
    for p, gr in zip(moe.parameters(), g_ref):
        assert _rel(p.grad, gr.double()) < 0.15
    assert "mxfp8_128" in RECIPES


def test_fused_fp8_route_plumbing_matches_unfused(monkeypatch):
    """The mxfp8_128 layer's fused FP8 permutation and SwiGLU (zero-stride autograd handles beside
    MXOperands) give the same outputs and gradients as the unfused path. The kernels are replaced by
    their reference composition (formats.quantize of the gathered rows / of silu(gate) * up), so this
    checks the autograd plumbing on CPU; the kernels' bits are tested in test_quantize_128.py."""
    from mxmoe.kernels import dispatch
    from mxmoe.ops import activation, linear, tokens

    def dual(x, rule):
        r, c = formats.quantize(x, -1, rule, 128), formats.quantize(x, 0, rule, 128)
        return r.data, r.scale, c.data.t().contiguous(), c.scale.t().contiguous()

    def permute_q(x, src, rule):
        xp = torch.where((src >= 0)[:, None], x[src.clamp(min=0).long()], 0)
        return dual(xp, rule)

    def swiglu_q(h, rule, save_h):
        f = h.shape[1] // 2
        a = torch.nn.functional.silu(h[:, :f]) * h[:, f:]
        e = h.new_empty(0)
        return (*dual(a, rule), e, e)

    torch.manual_seed(3)
    moe = mxmoe.MoE(dim=128, ffn_dim=128, num_experts=4, top_k=2, recipe="mxfp8_128")
    x = torch.randn(96, 128).to(torch.bfloat16)
    dy = torch.randn(96, 128).to(torch.bfloat16)

    def run():
        xr = x.clone().requires_grad_()
        moe.zero_grad()
        out = moe(xr)
        out.backward(dy)
        return [out.detach().float(), xr.grad.float()] + [p.grad.clone() for p in moe.parameters()]

    want = run()
    used = []
    monkeypatch.setattr(dispatch, "permute_quantize_128", lambda *a: used.append("permute") or permute_q(*a))
    monkeypatch.setattr(dispatch, "swiglu_quantize_128", lambda *a: used.append("swiglu") or swiglu_q(*a))
    force = lambda x, rows, cols, recipe, w_next, be: w_next is not None and rows % 128 == 0 and cols % 128 == 0  # noqa: E731
    monkeypatch.setattr(tokens, "fused_fp8", force)
    monkeypatch.setattr(activation, "fused_fp8", force)
    from mxmoe import moe as moe_module
    from mxmoe.backend import Backend

    monkeypatch.setattr(moe_module, "resolve", lambda device: Backend("cpu", "cpu", False, fused_permute=True))
    got = run()
    assert used == ["permute", "swiglu"]
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert linear.grad_handle(x, 256, 128).stride() == (0, 0)

    # and the down projection + combine as one Function, its backward's dy quantized by the fused kernel
    from mxmoe.kernels import torch_ops

    def combine_backward_q(dy, w, yp, slot, top_k, rule):
        used.append("combine")
        live = slot >= 0
        tok = torch.where(live, slot // top_k, 0).long()
        dyp = torch.where(live[:, None], (dy[tok].float() * w[slot.clamp(min=0).long()][:, None]).to(dy.dtype), 0)
        return (*dual(dyp, rule), torch.where(live, (dy[tok].float() * yp.float()).sum(1), 0))

    monkeypatch.setattr(torch_ops.EAGER, "combine_backward_quantize_128", combine_backward_q)
    monkeypatch.setattr(moe_module, "resolve",
                        lambda device: Backend("cpu", "cpu", False, fused_permute=True, fused_combine=True))
    used.clear()
    got = run()
    assert used == ["permute", "swiglu", "combine"]
    names = ["y", "dx"] + [n for n, _ in moe.named_parameters()]
    for g, w, name in zip(got, want, names):
        if name == "router.weight":  # the router weights' gradient: FP32 sums in another order
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
        else:
            assert torch.equal(g, w), name

    # and the up projection + SwiGLU as one Function, its backward's dh quantized by the fused kernel
    def swiglu_backward_q(da, h, h_scale, rule):
        used.append("swiglu backward")
        assert h_scale is None  # (mxfp8_128 keeps h in BF16)
        gate, up = h.split(h.shape[1] // 2, -1)
        dh = torch.cat([torch.ops.aten.silu_backward(da * up, gate), da * torch.nn.functional.silu(gate)], -1)
        return dual(dh, rule)

    monkeypatch.setattr(torch_ops.EAGER, "swiglu_backward_quantize_128", swiglu_backward_q)
    monkeypatch.setattr(moe_module, "resolve", lambda device: Backend("cpu", "cpu", False, fused_permute=True,
                                                                      fused_combine=True, fused_swiglu_bwd=True))
    used.clear()
    got = run()
    assert used == ["permute", "swiglu", "combine", "swiglu backward"]
    for g, w, name in zip(got, want, names):
        if name == "router.weight":
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
        else:
            assert torch.equal(g, w), name


@pytest.mark.gpu
def test_gpu_grouped_linear_128_products_vs_fp64():
    """On the GPU (Hopper: quantization kernels + the promote-per-128 GEMMs) each product equals the
    FP64 product of the reference-quantized operands to <= 5e-4 (FP32 summation of truncated FP8
    tensor-core sums), empty experts included."""
    from mxmoe.backend import resolve

    be = resolve("cuda")
    if be.arch == "sm90":
        assert set(be.recipe_routes(get_recipe("mxfp8_128")).values()) == {"sm90_128"}
    g = torch.Generator().manual_seed(11)
    counts = [256, 0, 384, 128, 0, 512]
    E, N, K, M = len(counts), 384, 512, sum(counts)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(E, N, K, generator=g) / K ** 0.5
    dy = torch.randn(M, N, generator=g)
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    xc, wc = x.cuda().requires_grad_(), w.cuda().requires_grad_()
    y = ops.grouped_linear(xc, wc, offs.cuda(), "mxfp8_128")
    y.backward(dy.cuda())
    y_ref, dx_ref, dw_ref = _ref_products(x, w, offs, dy)
    for got, ref, name in ((y, y_ref, "y"), (xc.grad, dx_ref, "dx"), (wc.grad, dw_ref, "dw")):
        err = _rel(got.cpu(), ref)
        assert err <= 5e-4, f"{name}: {err:.2e}"
    assert bool((wc.grad[1] == 0).all()) and bool((wc.grad[4] == 0).all())


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["mxfp8_128", "mxfp8_128_lowmem"])
def test_gpu_moe_layer_128_matches_reference_path(recipe):
    """The layer on the GPU (fused FP8 permutation and SwiGLU, promote-per-128 products) against the same
    layer on the CPU's reference path, BF16 activations: outputs and gradients within BF16 rounding
    chains (the products differ only in summation order; BF16 roundings of intermediates can then move
    E4M3 roundings by one step)."""
    torch.manual_seed(0)
    moe = mxmoe.MoE(dim=256, ffn_dim=384, num_experts=6, top_k=2, recipe=recipe)
    x = torch.randn(700, 256).to(torch.bfloat16)
    dy = torch.randn(700, 256).to(torch.bfloat16)

    def run(device):
        m = moe.to(device)
        xr = x.clone().to(device).requires_grad_()
        m.zero_grad(set_to_none=True)
        out = m(xr)
        out.backward(dy.to(device))
        return [t.detach().float().cpu() for t in (out, xr.grad, m.w13.grad, m.w2.grad, m.router.weight.grad)]

    ref = run("cpu")
    got = run("cuda")
    for g_, r_, name in zip(got, ref, ("y", "dx", "dw13", "dw2", "drouter")):
        err = _rel(g_, r_.double())
        assert torch.isfinite(g_).all() and err <= 3e-2, f"{name}: rel err {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("recipe,top_k", [("mxfp8_128", 2), ("mxfp8_128", 6), ("mxfp8_128_lowmem", 8)])
def test_gpu_moe_fused_combine_equals_unfused(recipe, top_k, monkeypatch):
    """The layer with the down projection and the combine as one Function (the combine's backward fused with
    dy's dual FP8 quantization) against MXMOE_FUSED_COMBINE=0 (combine backward kernel, then quantize_dual_128):
    output and the expert-weight gradients bit for bit; the input's and the router's gradient, which take the
    router weights' gradient (FP32 sums in another order), to 1e-3 normwise; an empty expert, a token count off the 128-row tiles; checks the fused kernel ran only when on."""
    from mxmoe.kernels import dispatch

    calls = []
    fused = dispatch.combine_backward_quantize_128
    monkeypatch.setattr(dispatch, "combine_backward_quantize_128", lambda *a: calls.append(1) or fused(*a))
    torch.manual_seed(0)
    m = mxmoe.MoE(256, 384, 12, top_k, recipe=recipe).cuda()
    with torch.no_grad():
        m.router.weight[5] = -0.5  # x has a positive mean: expert 5's logit is far below the rest, it gets no token
    x = (torch.randn(2, 333, 256, device="cuda") + 3.0).to(torch.bfloat16)
    assert int(m.route(x.view(-1, 256)).counts[5]) == 0
    dy = torch.randn(2, 333, 256, device="cuda", dtype=torch.bfloat16)

    def run():
        xx = x.clone().requires_grad_()
        m.zero_grad(set_to_none=True)
        y = m(xx)
        y.backward(dy)
        return [t.detach().clone() for t in (y, xx.grad, m.w13.grad, m.w2.grad, m.router.weight.grad)]

    new = run()
    assert len(calls) == 1
    monkeypatch.setenv("MXMOE_FUSED_COMBINE", "0")
    old = run()
    assert len(calls) == 1
    for a, b, what in zip(new, old, ("y", "dx", "dw13", "dw2", "drouter")):
        assert torch.isfinite(a).all(), f"{recipe} top_k={top_k} {what}"
        if what in ("dx", "drouter"):  # through the router weights' gradient: FP32 sums in another order
            err = float((a.float() - b.float()).norm() / b.float().norm())
            assert err <= 1e-3, f"{recipe} top_k={top_k} {what}: relative error {err:.2e}"
        else:
            assert torch.equal(a, b), f"{recipe} top_k={top_k} {what}"


@pytest.mark.gpu
@pytest.mark.parametrize("recipe,top_k", [("mxfp8_128", 6), ("mxfp8_128_lowmem", 8)])
def test_gpu_moe_fused_swiglu_backward_equals_unfused(recipe, top_k, monkeypatch):
    """The layer with the up projection and SwiGLU as one Function (SwiGLU's backward fused with dh's dual FP8
    quantization, MXMOE_FUSED_SWIGLU_BWD=1) against the default two kernels (SwiGLU backward, then
    quantize_dual_128): output and every gradient bit for bit (the same BF16 dh, the same FP8 bytes), with h
    kept in BF16 (mxfp8_128) and as MXFP8 (lowmem); an empty expert, tokens off the 128-row tiles; checks
    the fused kernel ran only when on."""
    from mxmoe.kernels import dispatch

    calls = []
    fused = dispatch.swiglu_backward_quantize_128
    monkeypatch.setattr(dispatch, "swiglu_backward_quantize_128", lambda *a: calls.append(1) or fused(*a))
    torch.manual_seed(0)
    m = mxmoe.MoE(256, 384, 12, top_k, recipe=recipe).cuda()
    with torch.no_grad():
        m.router.weight[5] = -0.5  # x has a positive mean: expert 5 gets no token
    x = (torch.randn(2, 333, 256, device="cuda") + 3.0).to(torch.bfloat16)
    assert int(m.route(x.view(-1, 256)).counts[5]) == 0
    dy = torch.randn(2, 333, 256, device="cuda", dtype=torch.bfloat16)

    def run():
        xx = x.clone().requires_grad_()
        m.zero_grad(set_to_none=True)
        y = m(xx)
        y.backward(dy)
        return [t.detach().clone() for t in (y, xx.grad, m.w13.grad, m.w2.grad, m.router.weight.grad)]

    monkeypatch.setenv("MXMOE_FUSED_SWIGLU_BWD", "1")
    new = run()
    assert len(calls) == 1
    monkeypatch.setenv("MXMOE_FUSED_SWIGLU_BWD", "0")
    old = run()
    assert len(calls) == 1
    for a, b, what in zip(new, old, ("y", "dx", "dw13", "dw2", "drouter")):
        assert torch.isfinite(a).all(), f"{recipe} top_k={top_k} {what}"
        assert torch.equal(a, b), f"{recipe} top_k={top_k} {what}: max diff {(a.float() - b.float()).abs().max()}"


def test_128_recipe_keeps_swiglu_input_in_1x128_groups():
    """mxfp8_128 with swiglu_input_fp8: h is kept as MXFP8 in the recipe's own 1x128 groups (the fused
    GPU kernel writes the same), and the layer's gradients stay close to the fp32 recipe's."""
    from mxmoe.ops import activation

    r = get_recipe("mxfp8_128_lowmem")
    h = torch.randn(128, 512, requires_grad=True)
    seen = []
    orig = activation.pack

    def spy(t):
        seen.append(t)
        return orig(t)

    activation.pack = spy
    try:
        a, _ = ops.swiglu(h, r)
    finally:
        activation.pack = orig
    assert seen and seen[0].block == (1, 128)
    torch.manual_seed(1)
    moe = mxmoe.MoE(dim=256, ffn_dim=256, num_experts=4, top_k=2, recipe="fp32")
    x = torch.randn(96, 256)
    moe(x).square().mean().backward()
    g_ref = [p.grad.clone() for p in moe.parameters()]
    moe.zero_grad()
    moe.set_recipe(r)
    moe(x).square().mean().backward()
    for p, gr in zip(moe.parameters(), g_ref):
        assert _rel(p.grad, gr.double()) < 0.2
