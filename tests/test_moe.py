"""The MoE layer against a plain per-expert loop with the same weights."""

import pytest
import torch
import torch.nn.functional as F

import mxmoe
from mxmoe.moe import permute_plan


def loop_moe(m: mxmoe.MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The way common model code writes an MoE: route, then loop over experts. float64."""
    x2 = x.reshape(-1, m.dim).double()
    probs = (x2 @ m.router.weight.double().t()).softmax(-1)
    w, idx = probs.topk(m.top_k, dim=-1)
    if m.top_k > 1:
        w = w / w.sum(-1, keepdim=True)
    y = torch.zeros_like(x2)
    for e in range(m.num_experts):
        tok, j = (idx == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h = x2[tok] @ m.w13[e].double().t()
        g, u = h.split(m.ffn_dim, -1)
        y.index_add_(0, tok, (F.silu(g) * u @ m.w2[e].double().t()) * w[tok, j, None])
    f = torch.bincount(idx.reshape(-1), minlength=m.num_experts).double() / idx.numel()
    aux = m.aux_loss_coef * m.num_experts * (f * probs.mean(0)).sum()
    return y.view(x.shape), aux


def grads(module, x, out, aux):
    module.zero_grad()
    x.grad = None
    (out.double().square().sum() + aux).backward()
    return [x.grad.clone()] + [p.grad.clone() for p in (module.router.weight, module.w13, module.w2)]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("top_k", [1, 2])
def test_fp32_layer_equals_loop_outputs_and_gradients(top_k):
    torch.manual_seed(0)
    m = mxmoe.MoE(64, 96, 8, top_k, recipe="fp32")
    x = torch.randn(3, 21, 64, requires_grad=True)
    y = m(x)
    g = grads(m, x, y, m.aux_loss)
    yr, auxr = loop_moe(m, x)
    gr = grads(m, x, yr, auxr)
    assert y.shape == x.shape and rel(y, yr) < 1e-5
    assert abs(m.aux_loss.item() - auxr.item()) < 1e-6
    for a, b in zip(g, gr):
        assert rel(a, b) < 1e-4


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_2d", "bf16"])
def test_low_precision_layer_close_to_loop(recipe):
    torch.manual_seed(1)
    m = mxmoe.MoE(64, 128, 8, 2, recipe=recipe)
    x = torch.randn(100, 64, requires_grad=True)
    y = m(x)
    g = grads(m, x, y, m.aux_loss)
    yr, auxr = loop_moe(m, x)
    gr = grads(m, x, yr, auxr)
    # E4M3 keeps 3 mantissa bits: ~2.4% RMS rounding per operand, two quantized products chained
    # through SwiGLU give ~6-7%; BF16 lands near 1%.
    tol = 0.02 if recipe == "bf16" else 0.08
    assert rel(y, yr) < tol
    for a, b in zip(g, gr):
        assert rel(a, b) < 1.5 * tol


def test_empty_experts_first_middle_last():
    experts = torch.tensor([[1, 2], [2, 4], [1, 4], [5, 6], [6, 1]])  # 0, 3, 7 empty
    rows, offs, M, counts = permute_plan(experts, 8, 32)
    assert counts.tolist() == [0, 3, 2, 0, 2, 1, 2, 0]
    sizes = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
    assert sizes[0] == 0 and sizes[3] == 0 and offs[-1].item() == 5 * 32 <= M  # M: the static bound
    assert sizes[1:3] == [32, 32] and sizes[4:7] == [32, 32, 32]
    assert len(set(rows.tolist())) == rows.numel()  # a distinct row per slot
    starts = (offs - torch.tensor(sizes)).tolist()
    for s, e in zip(rows.tolist(), experts.reshape(-1).tolist()):
        assert starts[e] <= s < starts[e] + counts[e].item()  # inside its expert's group, packed first
    # and the layer itself with most experts empty (4 tokens, 16 experts, top-1)
    torch.manual_seed(2)
    m = mxmoe.MoE(32, 64, 16, 1, recipe="mxfp8")
    x = torch.randn(4, 32, requires_grad=True)
    m(x).sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(m.w13.grad).all()
    used = set(m.route(x.detach()).experts.reshape(-1).tolist())
    for e in set(range(16)) - used:
        assert bool((m.w13.grad[e] == 0).all())


def test_bf16_input_keeps_dtype():
    m = mxmoe.MoE(32, 64, 4, 2)
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    assert m(x).dtype == torch.bfloat16


def test_bad_config():
    with pytest.raises(ValueError, match="top_k"):
        mxmoe.MoE(32, 64, 4, 5)
    with pytest.raises(ValueError, match="divisible by 32"):
        mxmoe.MoE(32, 48, 4, 2, recipe="mxfp8")
    with pytest.raises(ValueError, match="unknown recipe"):
        mxmoe.MoE(32, 64, 4, 2, recipe="fp4")
    with pytest.raises(ValueError, match="positive"):
        mxmoe.MoE(32, 64, 0, 1)
    with pytest.raises(ValueError, match="divisible by 8"):
        mxmoe.MoE(33, 64, 4, 2, recipe="bf16")
    for bad in (dict(weight_block=16), dict(align=0), dict(compute_dtype="int8"), dict(scale_rule="up")):
        with pytest.raises(ValueError):
            mxmoe.Recipe("x", **bad)
    with pytest.raises(ValueError, match=r"expects x of shape \[..., T, 32\] .* got input of shape \(3, 16\)"):
        mxmoe.MoE(32, 64, 4, 2)(torch.randn(3, 16))


@pytest.mark.parametrize("shape", [(), (32,), (4,)])
def test_input_needs_two_dims(shape):
    """A 1-D x (one token or many? even of length D) or a scalar is an error naming the expected shape."""
    with pytest.raises(ValueError, match=r"\[..., T, 32\] \(at least 2-D, last dim 32\)"):
        mxmoe.MoE(32, 64, 4, 2, recipe="bf16")(torch.randn(shape))
    assert mxmoe.MoE(32, 64, 4, 2, recipe="bf16")(torch.randn(1, 32)).shape == (1, 32)  # one token


def test_zero_tokens():
    m = mxmoe.MoE(32, 64, 4, 2)
    x = torch.zeros(0, 32, requires_grad=True)
    y = m(x)
    (y.sum() + m.aux_loss).backward()
    assert y.shape == (0, 32) and m.aux_loss.item() == 0.0


def test_deepcopy_and_pickle_after_a_forward():
    import copy
    import pickle

    m = mxmoe.MoE(32, 64, 4, 2, recipe="fp32")
    x = torch.randn(10, 32, requires_grad=True)
    m(x).sum().backward()
    assert m.aux_loss.requires_grad
    c = copy.deepcopy(m)  # an EMA / best-model copy taken during training
    p = pickle.loads(pickle.dumps(m))
    for other in (c, p):
        assert float(other.aux_loss) == 0.0
        assert torch.equal(other(x.detach()), m(x.detach()))
    assert m.aux_loss.requires_grad  # the original keeps its own


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_lowmem", "bf16", "mxfp8_128", "mxfp8_128_lowmem"])
def test_gpu_torch_compile_layer(recipe):
    """torch.compile(fullgraph=True) of the layer on CUDA: one graph (custom ops, no host sync) and
    the eager numbers. Inductor fuses the ops around the custom ops (SwiGLU backward, combine) in
    other orders, so BF16 roundings and then E4M3 roundings can differ: relative error <= 3e-2."""
    torch.manual_seed(0)
    moe = mxmoe.MoE(256, 512, 8, 2, recipe=recipe).cuda()
    x = torch.randn(640, 256, device="cuda", dtype=torch.bfloat16)

    def run(layer):
        xg = x.clone().requires_grad_()
        moe.zero_grad(set_to_none=True)
        y = layer(xg)
        y.float().square().mean().backward()
        return [y.float(), xg.grad.float(), moe.w13.grad.float(), moe.w2.grad.float()]

    eager = run(moe)
    compiled = run(torch.compile(moe, fullgraph=True))
    for e, c, name in zip(eager, compiled, ("y", "dx", "dw13", "dw2")):
        err = ((c - e).norm() / e.norm()).item()
        assert torch.isfinite(c).all() and err <= 3e-2, f"{recipe} {name}: rel err {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_128", "mxfp8_128_lowmem"])
def test_gpu_backward_makes_no_fp8_zero_gradients(recipe):
    """The fused permutation / SwiGLU quantizers return FP8 outputs that take no gradient; autograd
    must not fill a zero FP8 tensor of each one's size in backward (it does unless the functions
    turn off materialized gradients: ~0.3 ms of a Qwen3-sized layer step on an H200)."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    moe = mxmoe.MoE(256, 512, 8, 2, recipe=recipe).cuda()
    x = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    moe(x).float().square().mean().backward()  # compile and warm up outside the profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        moe(x).float().square().mean().backward()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if str(e.device_type).endswith("CUDA")]  # the kernels
    assert any("gemm" in n.lower() for n in names), names[:20]
    fills = [n for n in names if "FillFunctor" in n and "Float8" in n]
    assert not fills, f"{recipe}: {len(fills)} FP8 fills in forward + backward: {fills[:3]}"


def test_unpermute_gather_rows_matches_index_select_grad():
    """MoE.unpermute's backward (index_copy into zeros) equals autograd's index_select backward
    (index_add into zeros) for slot rows without repeats, padding rows included (zero)."""
    from mxmoe.ops.tokens import _GatherRows

    gen = torch.Generator().manual_seed(3)
    experts = torch.randint(0, 6, (50, 2), generator=gen)
    slot_rows, offs, M, _ = permute_plan(experts, 6, 32)
    yp = torch.randn(M, 24, generator=gen, dtype=torch.float64, requires_grad=True)
    g = torch.randn(slot_rows.numel(), 24, generator=gen, dtype=torch.float64)
    (want,) = torch.autograd.grad(yp.index_select(0, slot_rows), yp, g)
    out = _GatherRows.apply(yp, slot_rows)
    (got,) = torch.autograd.grad(out, yp, g)
    assert torch.equal(out, yp.index_select(0, slot_rows)) and torch.equal(got, want)
    assert M > slot_rows.numel() and (got.abs().sum(1) == 0).sum() == M - slot_rows.numel()


def test_combine_matches_weighted_sum_and_rejects_bad_rows():
    """ops.combine: the FP32 weighted sum of each token's top_k rows with its gradients (float64
    gradcheck); clear errors for rows out of range, repeated rows, wrong dtypes and shapes."""
    from mxmoe.ops import combine

    gen = torch.Generator().manual_seed(5)
    experts = torch.randint(0, 5, (13, 3), generator=gen)
    slot_rows, _, M, _ = permute_plan(experts, 5, 32)
    yp = torch.randn(M, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.rand(13, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    want = (yp[slot_rows].view(13, 3, 16) * w[..., None]).sum(1)
    torch.testing.assert_close(combine(yp, slot_rows, w), want)
    assert torch.autograd.gradcheck(lambda a, b: combine(a, slot_rows, b), (yp, w))
    with pytest.raises(ValueError, match="rows of yp"):
        combine(yp, torch.where(slot_rows == slot_rows.max(), M, slot_rows), w)
    with pytest.raises(ValueError, match="repeats"):
        combine(yp, torch.zeros_like(slot_rows), w)
    with pytest.raises(TypeError, match="int64"):
        combine(yp, slot_rows.int(), w)
    with pytest.raises(ValueError, match="combine expects"):
        combine(yp, slot_rows[:-1], w)


def test_unpermute_is_index_select_with_a_copy_backward_and_rejects_bad_input():
    """ops.unpermute: yp[slot_rows] and index_select's gradient (zero on padding rows), float64 gradcheck;
    clear errors for wrong shapes and dtypes."""
    from mxmoe.ops import unpermute

    gen = torch.Generator().manual_seed(6)
    experts = torch.randint(0, 5, (21, 1), generator=gen)
    experts[experts == 2] = 3  # an empty expert
    slot_rows, _, M, _ = permute_plan(experts, 5, 32)
    yp = torch.randn(M, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    g = torch.randn(21, 16, generator=gen, dtype=torch.float64)
    out = unpermute(yp, slot_rows)
    (got,) = torch.autograd.grad(out, yp, g)
    (want,) = torch.autograd.grad(yp.index_select(0, slot_rows), yp, g)
    assert torch.equal(out, yp[slot_rows]) and torch.equal(got, want)
    assert torch.autograd.gradcheck(lambda a: unpermute(a, slot_rows), (yp,))
    with pytest.raises(TypeError, match="int64"):
        unpermute(yp, slot_rows.int())
    with pytest.raises(ValueError, match="unpermute expects"):
        unpermute(yp[0], slot_rows)


@pytest.mark.parametrize("recipe", ["fp32", "bf16", "mxfp8"])
def test_zero_tokens_give_zero_expert_gradients(recipe):
    """An empty batch still connects the expert weights to autograd: zero gradients, not None."""
    moe = mxmoe.MoE(64, 64, 4, 2, recipe=recipe)
    y = moe(torch.randn(0, 64))
    (y.sum() + moe.aux_loss).backward()
    for p in (moe.w13, moe.w2):
        assert p.grad is not None and bool((p.grad == 0).all())


def test_router_sees_fp32_input_under_autocast():
    """Under autocast the experts get BF16 activations but the router routes on x itself: the same
    routing (and load-balancing loss, bit for bit) as without autocast."""
    torch.manual_seed(0)
    moe = mxmoe.MoE(64, 64, 8, 2, recipe="bf16")
    x = torch.randn(300, 64)
    moe(x)
    aux = moe.aux_loss.clone()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe(x)
    assert y.dtype == torch.float32 and torch.equal(moe.aux_loss, aux)
