"""The ``swiglu_input_fp8`` recipes (``mxfp8_lowmem``): SwiGLU's input h kept for backward as MXFP8
along 2F, the gradient taken at h's MX values. CPU reference path (dtypes, shapes, saved tensors,
no-grad forward) and, under ``TRITON_INTERPRET=1``, the fused kernel's saved copy of h and the SwiGLU
backward kernel on h's FP8 bytes at shapes with partial tiles."""

import pytest
import torch
import torch.nn.functional as F

import mxmoe
from mxmoe import formats, ops
from mxmoe.ops import activation, linear, tokens  # noqa: F401
from test_qdq_kernels import run_interpreted


def _grad_at_mx_values(h, da):
    hq = formats.quantize(h.detach(), -1).dequantize(h.dtype).requires_grad_()
    gate, up = hq.split(hq.shape[-1] // 2, -1)
    return torch.autograd.grad(F.silu(gate) * up, hq, da)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", [(40, 128), (3, 5, 64), (0, 128)])
def test_lowmem_swiglu_gradient_at_mx_values(dtype, shape):
    g = torch.Generator().manual_seed(1)
    h = (torch.randn(*shape, generator=g) * 3).to(dtype).requires_grad_()
    da = torch.randn(*shape[:-1], shape[-1] // 2, generator=g).to(dtype)
    a, a_wgrad = ops.swiglu(h, "mxfp8_lowmem")
    gate, up = h.detach().split(shape[-1] // 2, -1)
    assert a_wgrad is None and torch.equal(a, F.silu(gate) * up)
    (dh,) = torch.autograd.grad(a, h, da)
    assert dh.dtype == dtype and torch.equal(dh, _grad_at_mx_values(h, da))


def test_lowmem_swiglu_f_not_multiple_of_32_keeps_h():
    h = torch.randn(8, 96, requires_grad=True)  # F = 48
    da = torch.randn(8, 48)
    (dh,) = torch.autograd.grad(ops.swiglu(h, "mxfp8_lowmem")[0], h, da)
    (want,) = torch.autograd.grad(ops.swiglu(h, "mxfp8")[0], h, da)
    assert torch.equal(dh, want)


def test_lowmem_swiglu_saved_tensors():
    """h's FP8 copy is a saved tensor: saved_tensors_hooks (offloading) see it, it is freed after
    backward (a second backward raises as usual), retain_graph works; nothing is quantized when no
    backward can follow."""
    seen = []
    h = torch.randn(32, 192, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t.dtype) or t, lambda t: t):
        a, _ = ops.swiglu(h, "mxfp8_lowmem")
    assert seen == [torch.float8_e4m3fn, torch.float8_e8m0fnu]
    da = torch.randn(32, 96)
    d1 = torch.autograd.grad(a, h, da, retain_graph=True)[0]
    assert torch.equal(d1, torch.autograd.grad(a, h, da)[0])
    with pytest.raises(RuntimeError, match="second time"):
        torch.autograd.grad(a, h, da)
    calls = []
    real = formats.quantize
    try:
        formats.quantize = lambda *a, **k: calls.append(1) or real(*a, **k)
        with torch.no_grad():
            a_ng, _ = ops.swiglu(h, "mxfp8_lowmem")
        a_nr, _ = ops.swiglu(h.detach(), "mxfp8_lowmem")
    finally:
        formats.quantize = real
    assert not calls and torch.equal(a_ng, a.detach()) and torch.equal(a_nr, a.detach())


def test_lowmem_moe_matches_mxfp8_but_w13_grad():
    torch.manual_seed(0)
    m, ref = mxmoe.MoE(64, 96, 4, 2, recipe="mxfp8_lowmem"), mxmoe.MoE(64, 96, 4, 2, recipe="mxfp8")
    ref.load_state_dict(m.state_dict())
    x = torch.randn(2, 9, 64)
    for layer in (m, ref):
        (layer(x).square().mean() + layer.aux_loss).backward()
    assert torch.equal(m(x), ref(x)) and torch.equal(m.w2.grad, ref.w2.grad)
    rel = ((m.w13.grad - ref.w13.grad).norm() / ref.w13.grad.norm()).item()
    assert 0 < rel < 0.1, rel
    out = m(torch.zeros(0, 64, requires_grad=True))
    (out.sum() + m.aux_loss).backward()
    assert out.shape == (0, 64)


LOWMEM_SCRIPT = r"""
from mxmoe.backend import resolve
import torch.nn.functional as F
from mxmoe import formats, ops
from mxmoe.ops import activation, linear, tokens  # noqa: F401
from mxmoe.formats import MXTensor
from mxmoe.kernels import layer as L
# fused SwiGLU + QDQ with save_h: M not a multiple of the (128-row interpreter) tile, F = 32 and
# F = 1056 (partial 256-wide column tiles), column-major h, special values
for M, f, colmajor in [(160, 32, False), (32, 1056, False), (96, 288, True)]:
    h = (wide_randn((M, 2 * f), torch.float32, "cpu", gen) * 2.0**-6).to(torch.bfloat16)
    h[3, 5] = float("nan"); h[4, f + 7] = float("inf"); h[5, :32] = 0; h[7, f:f + 32] = -float("inf")
    h[6, 2 * f - 32:] = 1e-39
    if colmajor:
        h = h.mT.contiguous().mT
    for rule in ("rceil", "floor"):
        a16, dt, st, qh, sh = QF.swiglu_qdq(h, rule, True)
        hq = formats.quantize(h, -1, rule)
        same(qh, hq.data, f"h data {M}x{f} {rule}")
        same(sh, hq.scale, f"h scale {M}x{f} {rule}")
        for x, y, what in zip((a16, dt, st), QF.swiglu_qdq(h, rule, False), ("a16", "data_t", "scale_t")):
            same(x, y, f"{what} with and without save_h {M}x{f} {rule}")
# SwiGLU backward on h's FP8 bytes: M not a multiple of the 4-row tile, F with a partial last
# 1024-wide column tile, a zero block, a large block, tiny values
for M, f in [(45, 1056), (3, 32), (6, 2080)]:
    h = (torch.randn(M, 2 * f, generator=gen) * 3).to(torch.bfloat16)
    h[0, :32] = 0; h[1, f:f + 32] = 1e4; h[2, 32:64] = 2.0**-100
    da = torch.randn(M, f, generator=gen).to(torch.bfloat16)
    hq = formats.quantize(h, -1, "rceil")
    got = L.swiglu_backward(da, hq.data, hq.scale)
    same(got, L.swiglu_backward(da, hq.dequantize(torch.bfloat16)), f"swiglu_backward MX {M}x{f}")
    same(L.swiglu_backward(da.mT.contiguous().mT, hq.data, hq.scale), got, "non-contiguous da")
# the fused autograd function under torch.compile: its saved FP8 copy of h, the gradient at its MX values
h = (torch.randn(64, 192, generator=gen) * 3).to(torch.bfloat16).requires_grad_()
da = torch.randn(64, 96, generator=gen).to(torch.bfloat16)
hm = formats.quantize(h.detach(), -1).dequantize(torch.bfloat16).requires_grad_()
(want,) = torch.autograd.grad(F.silu(hm[:, :96]) * hm[:, 96:], hm, da)
be = resolve(h.device)
for fn in (lambda h: activation._SwiGLUQDQ.apply(h, "rceil", True, be)[0],
           torch.compile(lambda h: activation._SwiGLUQDQ.apply(h, "rceil", True, be)[0], backend="aot_eager", fullgraph=True)):
    (dh,) = torch.autograd.grad(fn(h), h, da)
    assert torch.equal(dh, want)
print("ok")
"""


def test_lowmem_kernels_interpreted():
    run_interpreted(LOWMEM_SCRIPT)
