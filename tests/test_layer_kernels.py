"""The layer kernels around the expert products (mxmoe.kernels.layer: gather, gather-sum / combine
and its backward, SwiGLU and its backward) against the torch ops they replace.

CPU: the kernels under ``TRITON_INTERPRET=1`` (one subprocess). GPU: against torch's CUDA ops, bit for
bit where the arithmetic is the same (gather, combine rows, SwiGLU), to FP32 summation order for the
router-weight gradient; and the whole layer with the kernels on and off (``MXMOE_LAYER_KERNELS``).
Inputs are random (never zeros), row counts odd, padding rows present, poison in the outputs' memory.
"""

import pytest
import torch

from test_qdq_kernels import run_interpreted

LAYER_SCRIPT = r"""
import torch.nn.functional as F
from mxmoe import formats
from mxmoe.kernels import layer as L
from mxmoe.moe import permute_plan
from mxmoe.ops.tokens import row_slots as _row_slots, row_tokens as _row_tokens

def bf16_ulps(a, b):  # distance in BF16 units in the last place (same-sign values)
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max().item()

for T, D, E, k, dtype in [(37, 96, 5, 2, torch.bfloat16), (20, 1056, 4, 3, torch.float32), (9, 64, 3, 1, torch.bfloat16)]:
    experts = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    slot_rows, offs, M, _ = permute_plan(experts, E, 32)
    x = torch.randn(T, D, generator=gen).to(dtype)
    xp = L.gather_rows(x, _row_tokens(slot_rows, M, k), M)
    want = x.new_zeros(M, D).index_copy(0, slot_rows, x.repeat_interleave(k, 0))
    same(xp, want, f"gather_rows {T}x{D} k{k}")
    yp = torch.randn(M, D, generator=gen).to(dtype)
    w = torch.rand(T, k, generator=gen)
    y = L.gather_sum(yp, slot_rows, k, w.reshape(-1))
    ref = (yp[slot_rows].view(T, k, D).float() * w[..., None]).sum(1)
    if k <= 2:  # the same two-term FP32 sum
        same(y, ref.to(dtype), "gather_sum")
    torch.testing.assert_close(y.float(), ref.to(dtype).float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-6)
    dxsum = L.gather_sum(yp, slot_rows, k)
    torch.testing.assert_close(dxsum.float(), yp[slot_rows].view(T, k, D).float().sum(1).to(dtype).float(),
                               rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-6)
    dy = torch.randn(T, D, generator=gen).to(dtype)
    dyp, dw = L.combine_backward(dy, w.reshape(-1), yp, _row_slots(slot_rows, M), k)
    want = torch.zeros(M, D, dtype=dtype).index_copy(0, slot_rows, (dy.float()[:, None] * w[..., None]).to(dtype).view(T * k, D))
    same(dyp, want, "combine_backward dyp (padding rows zero)")
    dw_ref = (dy.float()[:, None] * yp[slot_rows].view(T, k, D).float()).sum(-1)
    torch.testing.assert_close(dw.view(T, k), dw_ref, rtol=1e-4, atol=1e-4)

for M, F_ in [(45, 96), (8, 1056)]:
    h = (torch.randn(M, 2 * F_, generator=gen) * 3).to(torch.bfloat16)
    gate, up = h.split(F_, -1)
    a = L.swiglu(h)
    assert bf16_ulps(a, F.silu(gate) * up) <= 1
    da = torch.randn(M, F_, generator=gen).to(torch.bfloat16)
    dh = L.swiglu_backward(da, h)
    hh = h.clone().requires_grad_()
    g2, u2 = hh.split(F_, -1)
    (want,) = torch.autograd.grad(F.silu(g2) * u2, hh, da)
    assert bf16_ulps(dh, want) <= 1, bf16_ulps(dh, want)
    if F_ % 32 == 0:  # h as MXFP8 along 2F: the gradient at its BF16 MX values, expanded in the kernel
        hq = formats.quantize(h, -1, "rceil")
        same(L.swiglu_backward(da, hq.data, hq.scale), L.swiglu_backward(da, hq.dequantize(torch.bfloat16)),
             "swiglu_backward of MXFP8 h")
for dt in (torch.bfloat16, torch.float16):
    v = (torch.randn(3, 4099, generator=gen) * 1e3).to(dt)
    same(L.to_float32(v), v.float(), f"to_float32 {dt}")
print("ok")
"""


def test_layer_kernels_interpreted():
    run_interpreted(LAYER_SCRIPT)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tokens,dim,experts,top_k", [(1000, 2048, 8, 2), (517, 7168, 16, 4), (300, 96, 4, 1)])
def test_gpu_layer_kernels_equal_torch(tokens, dim, experts, top_k):
    import torch.nn.functional as F

    from mxmoe import ops
    from mxmoe.kernels import layer as L
    from mxmoe.moe import permute_plan
    from mxmoe.ops.tokens import row_slots as _row_slots, row_tokens as _row_tokens

    gen = torch.Generator(device="cuda").manual_seed(0)
    dev = "cuda"
    scores = torch.rand(tokens, experts, generator=gen, device=dev)
    ids = scores.topk(top_k, dim=-1).indices
    slot_rows, _, M, _ = permute_plan(ids, experts, 128)
    x = torch.randn(tokens, dim, generator=gen, device=dev, dtype=torch.bfloat16)
    want = x.new_zeros(M, dim).index_copy(0, slot_rows, x.repeat_interleave(top_k, 0))
    assert torch.equal(L.gather_rows(x, _row_tokens(slot_rows, M, top_k), M), want)
    yp = torch.randn(M, dim, generator=gen, device=dev, dtype=torch.bfloat16)
    w = torch.rand(tokens, top_k, generator=gen, device=dev)
    ref = (yp[slot_rows].view(tokens, top_k, dim).double() * w[..., None].double()).sum(1)
    y = L.gather_sum(yp, slot_rows, top_k, w.reshape(-1))
    # FP32 sums (the kernel fuses multiply-adds), one BF16 rounding: within one BF16 ulp of FP64
    assert ((y.double() - ref).abs() <= ref.abs() * 2.0**-8 + 1e-6).all()
    dy = torch.randn(tokens, dim, generator=gen, device=dev, dtype=torch.bfloat16)
    dyp, dw = L.combine_backward(dy, w.reshape(-1), yp, _row_slots(slot_rows, M), top_k)
    rows = (dy.float()[:, None] * w[..., None]).bfloat16().view(-1, dim)
    assert torch.equal(dyp, torch.zeros_like(yp).index_copy(0, slot_rows, rows))
    dw_ref = (dy.double()[:, None] * yp[slot_rows].view(tokens, top_k, dim).double()).sum(-1)
    torch.testing.assert_close(dw.view(tokens, top_k).double(), dw_ref, rtol=1e-5, atol=1e-4)
    # SwiGLU: the same bits as torch's BF16 ops, forward and backward
    h = (torch.randn(M, 2 * dim, generator=gen, device=dev) * 4).bfloat16()
    gate, up = h.split(dim, -1)
    assert torch.equal(L.swiglu(h), F.silu(gate) * up)
    da = torch.randn(M, dim, generator=gen, device=dev, dtype=torch.bfloat16)
    hh = h.clone().requires_grad_()
    g2, u2 = hh.split(dim, -1)
    (dh_ref,) = torch.autograd.grad(F.silu(g2) * u2, hh, da)
    dh = L.swiglu_backward(da, h)
    assert torch.equal(dh[:, dim:], dh_ref[:, dim:])
    ulps = (dh[:, :dim].view(torch.int16).int() - dh_ref[:, :dim].view(torch.int16).int()).abs().max().item()
    assert ulps == 0, f"d_gate differs from torch's silu_backward by up to {ulps} BF16 ulps"
    assert torch.equal(L.to_float32(dh), dh.float())
    # h kept as MXFP8 along 2F (swiglu_input_fp8): the kernel expands it itself, same bits
    hq = ops.quantize(h, -1, "rceil")
    assert torch.equal(L.swiglu_backward(da, hq.data, hq.scale), L.swiglu_backward(da, hq.dequantize(torch.bfloat16)))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("recipe", ["bf16", "mxfp8", "mxfp8_lowmem"])
def test_gpu_layer_with_and_without_layer_kernels(recipe, monkeypatch):
    """The MoE layer with the layer kernels equals the torch-op layer: expert weight gradients bit
    for bit (the combine's row gradients and SwiGLU are the same arithmetic); the output to one BF16
    rounding (the kernel's combine fuses multiply-adds), input and router gradients to FP32
    summation order (the router-weight gradient's dot products). The router's product is held to
    ``F.linear`` in both runs: its kernels sum in another order (tests/test_router.py), which moves the
    routing weights' last bits and so every gradient's."""
    import torch.nn.functional as F

    import mxmoe
    import mxmoe.moe

    monkeypatch.setattr(mxmoe.moe, "router_logits", lambda x, w, backend=None: F.linear(x.float(), w.float()))

    def run(flag):
        monkeypatch.setenv("MXMOE_LAYER_KERNELS", flag)
        torch.manual_seed(0)
        moe = mxmoe.MoE(256, 512, 8, 2, recipe=recipe).cuda()
        x = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16)  # not from y: y differs in rounding
        y = moe(x)
        ((y.float() * dy.float()).sum() + moe.aux_loss).backward()
        return y, x.grad, moe.w13.grad, moe.w2.grad, moe.router.weight.grad

    on, off = run("1"), run("0")
    for name, a, b in zip(("y", "dx", "dw13", "dw2", "drouter"), on, off):
        assert torch.isfinite(a).all(), name
        if name in ("dw13", "dw2"):
            assert torch.equal(a, b), f"{recipe} {name} differs"
        else:
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=1e-4, msg=f"{recipe} {name}")
