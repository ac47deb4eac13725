"""Grouped products and the expert linear layer against FP64 references (CPU)."""

import pytest
import torch

import mxmoe
from mxmoe.backend import Backend, resolve
from mxmoe.kernels import dispatch
from mxmoe.ops import grouped_linear, grouped_mm


def offsets(sizes):
    return torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)


def loop_2d3d(a, b, sizes):
    out, s = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64), 0
    for e, n in enumerate(sizes):
        out[s:s + n] = a[s:s + n].double() @ b[e].double()
        s += n
    return out


def loop_2d2d(a, b, sizes):
    out, s = torch.zeros(len(sizes), a.shape[0], b.shape[1], dtype=torch.float64), 0
    for e, n in enumerate(sizes):
        out[e] = a[:, s:s + n].double() @ b[s:s + n].double()
        s += n
    return out


def rel(x, y):
    return ((x.double() - y.double()).norm() / y.double().norm()).item()


SIZES = [0, 37, 0, 64, 5, 0]  # empty first, middle, last; odd sizes


def test_mx_2d3d_matches_fp64_of_dequantized():
    M, K, N = sum(SIZES), 96, 40
    a, w = torch.randn(M, K), torch.randn(len(SIZES), N, K)
    aq, wq = mxmoe.quantize(a), mxmoe.quantize(w)  # both along K
    out = grouped_mm(aq, wq.mT, offsets(SIZES), out_dtype=torch.float32)
    ref = loop_2d3d(aq.dequantize(torch.float64), wq.mT.dequantize(torch.float64), SIZES)
    assert out.shape == (M, N) and rel(out, ref) < 1e-6
    assert rel(grouped_mm(aq, wq.mT, offsets(SIZES)), ref) < 4e-3  # default BF16 output


def test_mx_2d2d_wgrad_form_with_empty_groups():
    sizes = [0, 64, 0, 32, 96, 0]
    T, N, K = sum(sizes), 48, 80
    dy, x = torch.randn(T, N), torch.randn(T, K)
    dyq, xq = mxmoe.quantize(dy, axis=0), mxmoe.quantize(x, axis=0)
    out = grouped_mm(dyq.mT, xq, offsets(sizes), out_dtype=torch.float32)
    ref = loop_2d2d(dyq.mT.dequantize(torch.float64), xq.dequantize(torch.float64), sizes)
    assert out.shape == (6, N, K) and rel(out, ref) < 1e-6
    assert bool((out[[0, 2, 5]] == 0).all())


def test_bf16_matches_torch_grouped_contract():
    M, K, N = sum(SIZES), 64, 48
    a = torch.randn(M, K, dtype=torch.bfloat16)
    b = torch.randn(len(SIZES), K, N, dtype=torch.bfloat16)
    out = grouped_mm(a, b, offsets(SIZES))
    assert out.dtype == torch.bfloat16 and rel(out, loop_2d3d(a, b, SIZES)) < 1e-2


def test_single_group_and_many_experts():
    K, N = 64, 32
    a, w = torch.randn(50, K), torch.randn(1, N, K)
    out = grouped_mm(a, w.mT, offsets([50]), out_dtype=torch.float32)
    assert rel(out, a.double() @ w[0].double().t()) < 1e-6
    sizes = [3 * (e % 3) for e in range(40)]  # > 32 experts, a third of them empty
    a, w = torch.randn(sum(sizes), K), torch.randn(40, N, K)
    aq, wq = mxmoe.quantize(a), mxmoe.quantize(w)
    out = grouped_mm(aq, wq.mT, offsets(sizes), out_dtype=torch.float32)
    assert rel(out, loop_2d3d(aq.dequantize(), wq.mT.dequantize(), sizes)) < 1e-6


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_2d", "mxfp8_bf16_wgrad"])
def test_grouped_linear_three_gemms_are_the_quantized_products(recipe):
    r = mxmoe.RECIPES[recipe]
    sizes = [32, 0, 64, 32]  # token groups aligned to 32, as the MoE layer pads them
    M, K, N = sum(sizes), 64, 96
    x = torch.randn(M, K, requires_grad=True)
    w = torch.randn(4, N, K, requires_grad=True)
    dy = torch.randn(M, N)
    y = grouped_linear(x, w, offsets(sizes), recipe)
    y.backward(dy)
    blk = (32, 32) if r.weight_block == 32 else 32
    xd, wd = mxmoe.quantize(x.detach()).dequantize(torch.float64), mxmoe.quantize(w.detach(), block=blk).dequantize(torch.float64)
    assert rel(y, loop_2d3d(xd, wd.mT, sizes)) < 1e-6  # fprop: x, W along K
    dyd = mxmoe.quantize(dy).dequantize(torch.float64)
    wn = mxmoe.quantize(w.detach(), axis=-2, block=blk).dequantize(torch.float64)
    assert rel(x.grad, loop_2d3d(dyd, wn, sizes)) < 1e-6  # dgrad: dy, W along N
    if r.wgrad_mxfp8:  # wgrad: dy, x along tokens
        ref_dw = loop_2d2d(mxmoe.quantize(dy, axis=0).dequantize(torch.float64).t(),
                           mxmoe.quantize(x.detach(), axis=0).dequantize(torch.float64), sizes)
        assert rel(w.grad, ref_dw) < 1e-6
    else:
        ref_dw = loop_2d2d(dy.to(torch.bfloat16).t(), x.detach().to(torch.bfloat16), sizes)
        assert rel(w.grad, ref_dw) < 1e-2
    assert bool((w.grad[1] == 0).all())  # empty expert: zero gradient


def test_unaligned_groups_refused_under_mx_wgrad_allowed_elsewhere():
    sizes = [5, 40, 0, 19]  # 32-token wgrad blocks would mix experts
    M, K, N = sum(sizes), 32, 64
    x, w = torch.randn(M, K), torch.randn(4, N, K)
    with pytest.raises(ValueError, match="multiple of 32"):
        grouped_linear(x, w, offsets(sizes), "mxfp8")
    for recipe in ("mxfp8_bf16_wgrad", "fp32", "bf16"):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        grouped_linear(xr, wr, offsets(sizes), recipe).sum().backward()
        assert torch.isfinite(wr.grad).all() and bool((wr.grad[2] == 0).all())


@pytest.mark.parametrize("recipe", ["bf16", "fp32", "mxfp8"])
def test_rows_past_the_last_group_give_zero_output_and_gradient(recipe):
    M, K, N = 96, 64, 32
    x = torch.randn(M, K)
    x[64:] = float("nan")  # rows outside every group must not leak into anything
    x.requires_grad_()
    w = torch.randn(2, N, K, requires_grad=True)
    y = grouped_linear(x, w, offsets([32, 32]), recipe)  # rows 64..95 belong to no expert
    (y[:64].square().sum() + y[64:].sum()).backward()
    assert bool((y[64:] == 0).all()) and bool((x.grad[64:] == 0).all())
    assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()


def test_zero_rows():
    x = torch.zeros(0, 64, requires_grad=True)
    w = torch.randn(2, 32, 64, requires_grad=True)
    for recipe in ("bf16", "fp32", "mxfp8"):
        y = grouped_linear(x, w, offsets([0, 0]), recipe)
        y.sum().backward()
        assert y.shape == (0, 32) and bool((w.grad == 0).all())


def test_transposing_a_32x32_tensor_off_its_tile_dims_drops_the_tile_label():
    q = mxmoe.quantize(torch.randn(4, 64, 32), block=(32, 32))
    assert q.mT.block == (32, 32)  # tiles still on the last two dims
    t = q.transpose(0, 1)
    assert t.block == (1, 32)
    with pytest.raises(ValueError, match="32x32"):
        t.requantize_free_swap()


@pytest.mark.parametrize("call,exc,msg", [
    (lambda: grouped_mm(torch.randn(8, 32), torch.randn(2, 32, 8), torch.tensor([4, 2], dtype=torch.int32)), ValueError, "non-decreasing"),
    (lambda: grouped_mm(torch.randn(8, 32), torch.randn(2, 32, 8), torch.tensor([4, 9], dtype=torch.int32)), ValueError, "past"),
    (lambda: grouped_mm(torch.randn(8, 32), torch.randn(2, 32, 8), torch.tensor([4, 8])), TypeError, "int32"),
    (lambda: grouped_mm(torch.randn(8, 32), torch.randn(3, 32, 8), torch.tensor([4, 8], dtype=torch.int32)), ValueError, "groups"),
    (lambda: grouped_mm(torch.randn(8, 32), torch.randn(2, 16, 8), torch.tensor([4, 8], dtype=torch.int32)), ValueError, "contraction"),
    (lambda: grouped_mm(torch.randn(8, 32), torch.randn(2, 32, 8, dtype=torch.float64), torch.tensor([4, 8], dtype=torch.int32)), TypeError, "dtypes differ"),
    (lambda: grouped_mm(mxmoe.quantize(torch.randn(8, 32)), torch.randn(2, 32, 8), torch.tensor([4, 8], dtype=torch.int32)), TypeError, "both"),
    (lambda: grouped_mm(mxmoe.quantize(torch.randn(32, 32), axis=0), mxmoe.quantize(torch.randn(2, 32, 32), axis=1),
                        torch.tensor([4, 8], dtype=torch.int32)), ValueError, "contraction dim"),
    (lambda: grouped_linear(torch.randn(8, 48), torch.randn(2, 32, 48), torch.tensor([4, 8], dtype=torch.int32)), ValueError, "divisible by 32"),
    (lambda: grouped_linear(torch.randn(8, 64), torch.randn(2, 32, 64, device="meta"), torch.tensor([4, 8], dtype=torch.int32),
                            recipe="bf16"), ValueError, "one device, got cpu and meta"),
])
def test_bad_input(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()


def test_prequantized_input_is_used_as_is_and_requantizing_is_lossless():
    sizes = [32, 64]
    x = torch.randn(96, 64)
    w = torch.randn(2, 32, 64)
    xq = mxmoe.quantize(x)
    xd = xq.dequantize().requires_grad_()
    y1 = grouped_linear(xd, w, offsets(sizes), "mxfp8", x_mx=xq)
    y2 = grouped_linear(xd, w, offsets(sizes), "mxfp8")  # rceil re-quantization of MX values is exact
    assert torch.equal(y1, y2)
    y1.sum().backward()
    assert xd.grad is not None and xd.grad.shape == x.shape
    with pytest.raises(ValueError, match="x_mx"):
        grouped_linear(xd, w, offsets(sizes), "mxfp8", x_mx=mxmoe.quantize(x, axis=0))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("parts", [1, 2])
def test_prequantized_weight_operands_give_the_same_numbers(parts, device):
    """``w_mx`` (quantize_weight_both's pair, as the torchtitan experts keep it for a checkpoint's recompute): the
    product's output and dx, dW bitwise those of quantizing w itself, weight parts included (on CUDA the 128x128
    parts kernel and the promote-per-128 products), empty expert included; each wrong operand named in a clear
    error, and under validate a stale one (w changed since)."""
    from mxmoe.ops.linear import weight_operands_apply
    from mxmoe.ops.quantization import quantize_weight_both
    from mxmoe.recipes import get_recipe

    g = torch.Generator().manual_seed(11)
    sizes = [128, 0, 256]
    x = torch.randn(384, 256, generator=g).bfloat16().to(device)
    ws = tuple(torch.randn(3, 256 // parts, 256, generator=g).to(device) for _ in range(parts))
    w = ws if parts > 1 else ws[0]
    w_mx = quantize_weight_both(w, get_recipe("mxfp8_128"))
    assert weight_operands_apply("mxfp8_128", x, ws[0]) and not weight_operands_apply("mxfp8", x, ws[0])

    def run(**kw):
        xx = x.clone().requires_grad_()
        pp = [p.clone().requires_grad_() for p in ws]
        y = grouped_linear(xx, tuple(pp) if parts > 1 else pp[0], offsets(sizes).to(device), "mxfp8_128", **kw)
        y.float().square().sum().backward()
        return [y, xx.grad] + [p.grad for p in pp]

    for a, b in zip(run(w_mx=w_mx), run()):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(run(w_mx=w_mx, validate=False), run()))
    offs = offsets(sizes).to(device)
    with pytest.raises(TypeError, match="pair of MXTensors"):
        grouped_linear(x, w, offs, "mxfp8_128", w_mx=w_mx[0])
    with pytest.raises(ValueError, match="does not"):
        grouped_linear(x, w, offs, "mxfp8", w_mx=w_mx)
    with pytest.raises(ValueError, match="along axis 1"):
        grouped_linear(x, w, offs, "mxfp8_128", w_mx=(w_mx[0], w_mx[0]))
    from mxmoe.formats import MXTensor

    e5m2 = MXTensor(w_mx[0].data.to(torch.float8_e5m2), w_mx[0].scale, 2, w_mx[0].scale_rule, w_mx[0].block)
    with pytest.raises(ValueError, match="float8_e4m3fn data"):
        grouped_linear(x, w, offs, "mxfp8_128", validate=False, w_mx=(e5m2, w_mx[1]))
    cut = MXTensor(w_mx[1].data, w_mx[1].scale[:, :2], 1, w_mx[1].scale_rule, w_mx[1].block)
    with pytest.raises(ValueError, match="scales"):
        grouped_linear(x, w, offs, "mxfp8_128", validate=False, w_mx=(w_mx[0], cut))
    with pytest.raises(ValueError, match=r"expects w \[E, N, K\]"):
        grouped_linear(x, ws[0][0], offs, "mxfp8_128", w_mx=w_mx)
    with pytest.raises(ValueError, match=r"expects w \[E, N, K\]"):
        grouped_linear(x, (), offs, "mxfp8_128", validate=False, w_mx=w_mx)  # no weight parts at all
    with pytest.raises(ValueError, match="bytes differ"):
        stale = tuple(p * 2 for p in ws)
        grouped_linear(x, stale if parts > 1 else stale[0], offs, "mxfp8_128", w_mx=w_mx)


def test_bf16_odd_shapes_fall_back_to_the_reference():
    a, b = torch.randn(10, 33, dtype=torch.bfloat16), torch.randn(2, 33, 7, dtype=torch.bfloat16)
    out = grouped_mm(a, b, offsets([4, 6]))  # 16-byte strides impossible: torch._grouped_mm would refuse
    assert out.shape == (10, 7) and rel(out, loop_2d3d(a, b, [4, 6])) < 1e-2


def test_bad_inputs_give_clear_errors(monkeypatch):
    """Errors found by the session-2 review: each names the problem instead of failing deep inside."""
    from mxmoe import ops

    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 64, generator=g)
    w = torch.randn(2, 32, 64, generator=g)
    offs = offsets([32, 32])
    xq = mxmoe.quantize(x, axis=0)
    with pytest.raises(TypeError, match="x_wgrad must be an MXTensor"):
        grouped_linear(x, w, offs, "mxfp8", x_wgrad=x)
    with pytest.raises(TypeError, match="must be bfloat16"):
        grouped_linear(x, w, offs, "mxfp8", x_wgrad=xq)
    with pytest.raises(ValueError, match="own MX values"):
        grouped_linear(x.bfloat16(), w, offs, "mxfp8", x_wgrad=mxmoe.quantize(x.bfloat16(), axis=0))
    with pytest.raises(ValueError, match="does not quantize"):
        grouped_linear(x, w, offs, "bf16", x_mx=mxmoe.quantize(x))
    with pytest.raises(ValueError, match="'rceil' rule"):
        grouped_linear(x, w, offs, "mxfp8", x_mx=mxmoe.quantize(x, scale_rule="floor"))
    with pytest.raises(TypeError, match="out_dtype"):
        grouped_mm(mxmoe.quantize(x), mxmoe.quantize(w).mT, offs, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of 32"):
        grouped_mm(mxmoe.quantize(x.t().contiguous()), mxmoe.quantize(x, axis=0), offsets([16, 48]))
    with pytest.raises(ValueError, match="slot_rows"):
        ops.permute_tokens(x, torch.arange(64), 128, top_k=2)  # 64 tokens x top_k 2 need 128 slots
    with pytest.raises(ValueError, match="gate and up"):
        ops.swiglu(torch.randn(4, 33))
    with pytest.raises(TypeError, match="axis must be an int"):
        mxmoe.quantize(x, axis=1.0)
    with pytest.raises(TypeError, match="top_k must be an int"):
        mxmoe.MoE(64, 64, 4, 1.5)
    with pytest.raises(TypeError, match="top_k must be an int"):
        mxmoe.MoE(64, 64, 4, True)
    assert type(mxmoe.MoE(64, 64, 4, torch.tensor(3)).top_k) is int  # integer scalars (torch, numpy) are ints
    with pytest.raises(ValueError, match="last dim"):
        mxmoe.MoE(64, 64, 4, 2)(torch.tensor(1.0))
    monkeypatch.setenv("MXMOE_SM90_GEMM", "GLUON")
    with pytest.raises(ValueError, match="MXMOE_SM90_GEMM"):
        resolve("cpu")


@pytest.mark.parametrize("route", ["bf16", "gluon", "mixed"])
def test_sm90_routes_pick_kernels(route, monkeypatch):
    """Which kernel serves each product on an sm_90 GPU (capability and kernels stubbed on CPU):
    mixed takes our kernel for the M-grouped products (fprop, dgrad) and the BF16 expansion for
    the K-grouped one (wgrad). An FP32 result is never the expansion's BF16 product: those calls take our
    (FP32-summing) kernel on every route."""
    from types import SimpleNamespace

    calls = []
    be = Backend("cuda:0", "sm90", True, route)
    monkeypatch.setattr(dispatch, "_ops", lambda: SimpleNamespace(
        sm90_m_grouped_gemm=lambda *a: calls.append("gluon_m"), sm90_k_grouped_gemm=lambda *a: calls.append("gluon_k")))
    monkeypatch.setattr(dispatch, "expand_bf16", lambda t: t)
    monkeypatch.setattr(dispatch, "bf16_grouped_mm", lambda *a: calls.append("bf16"))
    g = torch.Generator().manual_seed(7)
    for block in (32, (32, 32)):
        a, w = mxmoe.quantize(torch.randn(64, 64, generator=g)), mxmoe.quantize(torch.randn(2, 32, 64, generator=g),
                                                                                block=block)
        dispatch.mx_grouped_mm_cuda(a, w.mT, offsets([32, 32]), torch.bfloat16, be)  # M-grouped
        dy, x = mxmoe.quantize(torch.randn(64, 32, generator=g), axis=0), mxmoe.quantize(a.dequantize(), axis=0)
        dispatch.mx_grouped_mm_cuda(dy.mT, x, offsets([32, 32]), torch.bfloat16, be)  # K-grouped
        dispatch.mx_grouped_mm_cuda(a, w.mT, offsets([32, 32]), torch.float32, be)  # FP32 results
        dispatch.mx_grouped_mm_cuda(dy.mT, x, offsets([32, 32]), torch.float32, be)
    m_kernel, k_kernel = {"bf16": ("bf16", "bf16"), "gluon": ("gluon_m", "gluon_k"), "mixed": ("gluon_m", "bf16")}[route]
    assert calls == [m_kernel, k_kernel, "gluon_m", "gluon_k"] * 2


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_2d", "mxfp8_128"])
def test_requantize_weights_same_numbers(recipe):
    """requantize_weights (weights quantized again in backward, not kept in FP8): the same output
    and gradients bit for bit, and the parameter, not an FP8 copy, held for backward."""
    from mxmoe.recipes import get_recipe

    g = torch.Generator().manual_seed(8)
    n = 128 if recipe == "mxfp8_128" else 32  # whole scale groups: 1x128 / 128x128 under mxfp8_128
    x, w = torch.randn(3 * n, 2 * n, generator=g), torch.randn(3, 4 * n, 2 * n, generator=g)
    with torch.no_grad():  # rows and columns a power of two apart: every tile holds several scales' worth
        w.mul_(torch.exp2(torch.randint(-6, 7, (3, 4 * n, 1), generator=g).float())
               * torch.exp2(torch.randint(-6, 7, (3, 1, 2 * n), generator=g).float()))
    outs = []
    for rq in (False, True):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = grouped_linear(xx, ww, offsets([n, 0, 2 * n]), get_recipe(recipe).with_(requantize_weights=rq))
        # (on the CPU 1x32 weights are requantized either way: only the Hopper expansion route keeps them)
        assert any(t is ww for t in y.grad_fn.saved_tensors) == (rq or recipe == "mxfp8")
        y.square().sum().backward()
        outs.append((y, xx.grad, ww.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_session11_trial_findings():
    """Found by the session-11 fresh-user trial: recipe fields and sizes of the wrong type, a recipe
    that is neither a name nor a Recipe, a dtype given as a string: each a clear error."""
    from mxmoe.recipes import Recipe, get_recipe

    with pytest.raises(TypeError, match="mxfp8 must be True or False"):
        get_recipe("mxfp8").with_(mxfp8="no")
    with pytest.raises(TypeError, match="requantize_weights must be True or False"):
        get_recipe("mxfp8").with_(requantize_weights="yes")
    with pytest.raises(TypeError, match="name must be a string"):
        Recipe(None)
    with pytest.raises(ValueError, match="weight_block must be 1"):
        get_recipe("mxfp8").with_(weight_block=32.0)
    with pytest.raises(ValueError, match="weight_block sets the MX scale blocks"):
        get_recipe("bf16").with_(weight_block=32)
    with pytest.raises(TypeError, match="recipe must be a name or a Recipe"):
        get_recipe({"name": "mxfp8"})
    with pytest.raises(TypeError, match="dim must be an int"):
        mxmoe.MoE(64.0, 64, 4, 2)
    x = torch.randn(64, 64)
    with pytest.raises(TypeError, match="out_dtype"):
        grouped_mm(mxmoe.quantize(x), mxmoe.quantize(torch.randn(2, 32, 64)).mT, offsets([32, 32]), out_dtype="bfloat16")


def test_bf16_wgrad_recipe_takes_compute_dtype():
    """mxfp8_bf16_wgrad's plain wgrad runs in recipe.compute_dtype (BF16 by default)."""
    from mxmoe.recipes import get_recipe

    g = torch.Generator().manual_seed(9)
    x, w, dy = torch.randn(96, 64, generator=g), torch.randn(3, 32, 64, generator=g), torch.randn(96, 32, generator=g)
    offs = offsets([32, 0, 64])
    ref = torch.stack([dy[s:e].double().t() @ x[s:e].double() for s, e in ((0, 32), (32, 32), (32, 96))])
    err = {}
    for dt in ("bfloat16", "float32"):
        ww = w.clone().requires_grad_()
        grouped_linear(x, ww, offs, get_recipe("mxfp8_bf16_wgrad").with_(compute_dtype=dt)).backward(dy)
        err[dt] = rel(ww.grad, ref)
    assert err["float32"] < 1e-6 < 1e-4 < err["bfloat16"]


def test_x_wgrad_with_mx_values_equals_plain_call():
    """grouped_linear(x_wgrad=...) on x that holds its MX values: the same product and gradients
    as the plain call (which quantizes x itself)."""
    g = torch.Generator().manual_seed(6)
    xv = mxmoe.quantize(torch.randn(96, 64, generator=g).bfloat16()).dequantize(torch.float32).bfloat16()
    w = torch.randn(3, 32, 64, generator=g)
    offs = offsets([32, 0, 64])
    outs = []
    for pre in (False, True):
        x = xv.clone().requires_grad_()
        wg = w.clone().requires_grad_()
        y = grouped_linear(x, wg, offs, "mxfp8", x_wgrad=mxmoe.quantize(xv, axis=0) if pre else None)
        y.float().square().sum().backward()
        outs.append((y, x.grad, wg.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_session3_trial_findings():
    """Found by the session-3 fresh-user trial: each bad input names the problem; no group gives zeros."""
    from mxmoe import ops

    g = torch.Generator().manual_seed(6)
    out = grouped_mm(torch.randn(64, 64, generator=g).bfloat16(), torch.randn(0, 64, 32).bfloat16(),
                     torch.zeros(0, dtype=torch.int32))
    assert out.shape == (64, 32) and bool((out == 0).all())  # torch._grouped_mm would leave memory unset
    x = torch.randn(64, 64, generator=g)
    w = torch.randn(2, 32, 64, generator=g)
    offs = offsets([32, 32])
    other = torch.randn(64, 64, generator=g)
    with pytest.raises(ValueError, match="x_mx must be x quantized"):
        grouped_linear(mxmoe.quantize(x).dequantize(), w, offs, "mxfp8", x_mx=mxmoe.quantize(other))
    xb = mxmoe.quantize(x.bfloat16()).dequantize(torch.float32).bfloat16()  # holds its own MX values
    with pytest.raises(ValueError, match="far from x"):
        grouped_linear(xb, w, offs, "mxfp8", x_wgrad=mxmoe.quantize(other.bfloat16(), axis=0))
    y = grouped_linear(xb, w, offs, "mxfp8", x_wgrad=mxmoe.quantize(xb, axis=0))  # the consistent pair passes
    assert torch.equal(y, grouped_linear(xb, w, offs, "mxfp8"))
    with pytest.raises(TypeError, match="floating dtype"):
        mxmoe.quantize(x).dequantize(torch.int32)
    with pytest.raises(ValueError, match=r"scale_rule must be one of \['rceil', 'floor'\]"):
        mxmoe.quantize(x, scale_rule="nearest")
    with pytest.raises(TypeError, match="floating-point input"):
        mxmoe.MoE(64, 64, 4, 2, recipe="bf16")(torch.ones(3, 64, dtype=torch.int64))


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8"])
def test_fp8_input_is_refused_by_name(recipe):
    """A bare FP8 tensor into the layer or the expert product: mxmoe's TypeError naming the dtype and the
    accepted ones (torch's own error was ``"index_copy_cpu" not implemented for 'Float8_e4m3fn'``)."""
    x = torch.randn(32, 64).to(torch.float8_e4m3fn)
    want = r"expects a floating-point input x in float16, bfloat16, float32 or float64, got torch.float8_e4m3fn"
    with pytest.raises(TypeError, match=want + r" \(an FP8 tensor has no MX scales"):
        mxmoe.MoE(64, 64, 4, 2, recipe=recipe)(x)
    with pytest.raises(TypeError, match="grouped_linear " + want):
        grouped_linear(x, torch.randn(2, 32, 64), offsets([16, 16]), recipe)
    with pytest.raises(TypeError, match="input w in .* got torch.float8_e5m2"):
        grouped_linear(torch.randn(32, 64), torch.randn(2, 32, 64).to(torch.float8_e5m2), offsets([16, 16]), recipe)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_input_fp8_keeps_mx_h_and_takes_the_gradient_there(dtype):
    """Under ``swiglu_input_fp8`` the forward is exact SwiGLU and the gradient is torch's SwiGLU
    gradient at h's MX values (h quantized along 2F); without it, at h itself (they differ)."""
    from mxmoe import ops
    from mxmoe.recipes import get_recipe

    g = torch.Generator().manual_seed(8)
    h = (torch.randn(40, 2 * 64, generator=g) * 3).to(dtype).requires_grad_()
    da = torch.randn(40, 64, generator=g).to(dtype)
    gate, up = h.split(64, -1)
    a_ref = torch.nn.functional.silu(gate) * up
    (dh_exact,) = torch.autograd.grad(a_ref, h, da)
    hq = mxmoe.quantize(h.detach(), -1).dequantize(dtype).requires_grad_()
    gq, uq = hq.split(64, -1)
    (dh_mx,) = torch.autograd.grad(torch.nn.functional.silu(gq) * uq, hq, da)
    recipe = get_recipe("mxfp8").with_(swiglu_input_fp8=True)
    a, a_wgrad = ops.swiglu(h, recipe)
    (dh,) = torch.autograd.grad(a, h, da)
    assert a_wgrad is None and torch.equal(a, a_ref.detach())
    assert torch.equal(dh, dh_mx) and not torch.equal(dh, dh_exact)
    rel = ((dh.float() - dh_exact.float()).norm() / dh_exact.float().norm()).item()
    assert 1e-4 < rel < 0.1, rel  # MXFP8's rounding of h, seen through SwiGLU's derivative
    (dh_off,) = torch.autograd.grad(ops.swiglu(h, recipe.with_(swiglu_input_fp8=False))[0], h, da)
    assert torch.equal(dh_off, dh_exact)
    with pytest.raises(ValueError, match="needs an MXFP8 recipe"):
        get_recipe("bf16").with_(swiglu_input_fp8=True)


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_2d", "mxfp8_bf16_wgrad"])
def test_grouped_linear_saves_fp8_as_saved_tensors(recipe):
    """What grouped_linear keeps for backward (FP8 x along tokens, FP8 weights along N) goes
    through save_for_backward: saved_tensors_hooks see it (offloading works) and it is released
    after backward (not held by the graph until the next step)."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(96, 64, generator=g, requires_grad=True)
    w = torch.randn(3, 32, 64, generator=g, requires_grad=True)
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t.dtype) or t, lambda t: t):
        y = grouped_linear(x, w, offsets([32, 0, 64]), recipe)
    # FP8 x along tokens under MX wgrad (else BF16 x); FP8 W along N for 32x32 tiles (off the
    # expansion route 1x32 weights keep the parameter and requantize it in backward)
    want = {"mxfp8": 1, "mxfp8_2d": 2, "mxfp8_bf16_wgrad": 0}[recipe]
    assert seen.count(torch.float8_e4m3fn) == seen.count(torch.float8_e8m0fnu) == want, seen
    assert (torch.bfloat16 in seen) == (recipe == "mxfp8_bf16_wgrad"), seen
    y.square().sum().backward()
    with pytest.raises(RuntimeError, match="second time"):
        y.square().sum().backward()


def test_cpu_bf16_grouped_mm_gradients_of_empty_groups_are_zero():
    """BF16 grouped products on the CPU: FP32 sums of the BF16 values, one rounding; the gradients of an
    empty expert and of rows past offs[-1] are zeros (torch's CPU _grouped_mm kernel leaves them unset)."""
    g = torch.Generator().manual_seed(5)
    a = torch.randn(300, 64, generator=g).bfloat16().requires_grad_()
    b = torch.randn(4, 64, 96, generator=g).bfloat16().requires_grad_()
    offs = offsets([50, 0, 150, 80])  # ends 50, 50, 200, 280
    y = grouped_mm(a, b, offs)
    want = torch.cat([(a[s:t].float() @ b[e].float()).bfloat16() for e, (s, t) in
                      enumerate(zip([0, 50, 50, 200], [50, 50, 200, 280]))])
    assert torch.equal(y[:280], want) and not y[280:].any()
    da, db = torch.autograd.grad(y, (a, b), torch.randn(300, 96, generator=g).bfloat16())
    assert not db[1].any() and not da[280:].any() and db[0].any()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("recipe", ["bf16", "fp32", "mxfp8", "mxfp8_2d", "mxfp8_128", "mxfp8_128_lowmem",
                                    "mxfp8_bf16_wgrad"])
def test_weight_parts_are_the_concatenated_weight(recipe, device):
    """grouped_linear with w = (w1, w3): the output and x's gradient of the concatenated weight, and each
    part's gradient that gradient's slice, a contiguous tensor of the part's shape (its own wgrad output on
    the MX routes, not a copy of a slice); bit for bit on the CPU, within FP32 summation order on CUDA
    (one product per part may tile differently). Parts that do not match are refused."""
    g = torch.Generator().manual_seed(11)
    n = 128 if "128" in recipe else 32
    E, K, sizes = 3, 2 * n, [n, 0, 2 * n]
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    x = torch.randn(3 * n, K, generator=g).to(device, dt)
    w1, w3 = (torch.randn(E, s, K, generator=g).to(device) for s in (2 * n, n))
    dy = torch.randn(3 * n, 3 * n, generator=g).to(device, dt)
    offs = offsets(sizes).to(device)
    outs = []
    for parts in (False, True):
        xx, a, b = x.clone().requires_grad_(), w1.clone().requires_grad_(), w3.clone().requires_grad_()
        w = (a, b) if parts else torch.cat([a, b], 1)
        y = grouped_linear(xx, w, offs, recipe)
        y.backward(dy)
        outs.append((y, xx.grad, a.grad, b.grad))
    for got, want in zip(outs[1], outs[0]):
        assert got.shape == want.shape and got.is_contiguous()
        if device == "cpu":
            assert torch.equal(got, want)
        else:
            assert torch.isfinite(got).all() and rel(got, want) < 1e-5
    with pytest.raises(ValueError, match="share E, K and dtype"):
        grouped_linear(x, (w1, w3.double()), offs, recipe)
    with pytest.raises(ValueError, match="empty tuple"):
        grouped_linear(x, (), offs, recipe)


def test_requantized_weight_parts_are_saved_as_themselves():
    """Under requantize_weights (mxfp8_128_lowmem) backward keeps the weight parts themselves (the parameters, no
    new memory), not their FP32 concatenation: every saved tensor of w's shape family is one of the parts."""
    g = torch.Generator().manual_seed(12)
    E, K, n = 2, 256, 128
    x = torch.randn(2 * n, K, generator=g).requires_grad_()
    w1, w3 = (torch.randn(E, n, K, generator=g).requires_grad_() for _ in range(2))
    offs = offsets([n, n])
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = grouped_linear(x, (w1, w3), offs, "mxfp8_128_lowmem")
    weights = [t for t in saved if t.dim() == 3 and t.dtype == torch.float32]
    assert weights and all(t.data_ptr() in (w1.data_ptr(), w3.data_ptr()) for t in weights), \
        [tuple(t.shape) for t in weights]
    y.sum().backward()
    assert w1.grad.shape == w1.shape and w3.grad.shape == w3.shape
