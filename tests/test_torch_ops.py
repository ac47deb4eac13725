"""Fake (meta) implementations of the custom ops: shapes and dtypes without running a kernel."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mxmoe.kernels import torch_ops  # noqa: F401  (registers torch.ops.mxmoe.*)
from mxmoe.backend import Backend

E4M3, E8M0 = torch.float8_e4m3fn, torch.float8_e8m0fnu


def test_fake_shapes():
    ops = torch.ops.mxmoe
    with FakeTensorMode():
        x = torch.empty(8, 64, 96, device="cuda", dtype=torch.bfloat16)
        d, s = ops.quantize_rowwise(x, "rceil")
        assert (d.shape, d.dtype, s.shape, s.dtype) == ((8, 64, 96), E4M3, (8, 64, 3), E8M0)
        dt, st = ops.quantize_columnwise(x, "rceil")
        assert (dt.shape, st.shape) == ((8, 96, 64), (8, 96, 2))
        w = torch.empty(5, 160, 96, device="cuda", dtype=torch.bfloat16)  # sm_100 weights: + blocked scales
        assert [(t.shape, t.dtype) for t in ops.quantize_rowwise_blocked(w, "rceil")] == [
            ((5, 160, 96), E4M3), ((5, 160, 3), E8M0), ((5, 256 * 4), E8M0)]
        assert [(t.shape, t.dtype) for t in ops.quantize_columnwise_blocked(w, "floor")] == [
            ((5, 96, 160), E4M3), ((5, 96, 5), E8M0), ((5, 128 * 8), E8M0)]
        x2 = torch.empty(64, 96, device="cuda", dtype=torch.float32)
        assert [t.shape for t in ops.quantize_dual(x2, "floor")] == [(64, 96), (64, 3), (96, 64), (96, 2)]
        assert [t.shape for t in ops.quantize_32x32(x, "rceil")] == [(8, 64, 96), (8, 64, 3), (8, 96, 64), (8, 96, 2)]
        w1, w3 = (torch.empty(4, n, 256, device="cuda", dtype=torch.float32) for n in (128, 384))
        assert [(t.shape, t.dtype) for t in ops.quantize_128x128_parts([w1, w3], "rceil")] == [
            ((4, 512, 256), E4M3), ((4, 512, 8), E8M0), ((4, 256, 512), E4M3), ((4, 256, 16), E8M0)]
        assert ops.dequantize_bf16(d, s).dtype == torch.bfloat16
        offs = torch.empty(8, device="cuda", dtype=torch.int32)
        a, sa = torch.empty(500, 96, device="cuda", dtype=E4M3), torch.empty(500, 3, device="cuda", dtype=E8M0)
        y = ops.sm90_m_grouped_gemm(a, sa, d, s, offs, "bfloat16", 1)
        assert (y.shape, y.dtype) == ((500, 64), torch.bfloat16)
        dy_t, sdy = ops.quantize_columnwise(torch.empty(512, 96, device="cuda"), "rceil")  # [96, 512]
        x_t, sx = ops.quantize_columnwise(torch.empty(512, 40, device="cuda"), "rceil")  # [40, 512]
        w = ops.sm90_k_grouped_gemm(dy_t, sdy, x_t, sx, offs, "float32", False)
        assert (w.shape, w.dtype) == ((8, 96, 40), torch.float32)
        xr, wr, dl = (torch.empty(*s, device="cuda", dtype=t) for s, t in (
            ((300, 96), torch.bfloat16), ((20, 96), torch.float32), ((300, 20), torch.float32)))
        w3, dl3 = ops.split_bf16(wr), ops.split_bf16(dl)
        assert (w3.shape, w3.dtype, dl3.shape) == ((3, 20, 96), torch.bfloat16, (3, 300, 20))
        assert [(t.shape, t.dtype) for t in (ops.router_logits(xr, w3), ops.router_dx(dl, w3), ops.router_dw(dl3, xr))] == [
            ((300, 20), torch.float32), ((300, 96), torch.bfloat16), ((20, 96), torch.float32)]


def test_eager_calls_skip_the_custom_op_dispatch(monkeypatch):
    """dispatch._ops(): the plain functions in eager mode, the registered custom ops under torch.compile;
    every custom op has its plain function and nothing else is in EAGER."""
    from torch._library.custom_ops import CustomOpDef

    from mxmoe.kernels import dispatch

    registered = {n for n, v in vars(torch_ops).items() if isinstance(v, CustomOpDef)}
    assert registered and registered == set(vars(torch_ops.EAGER))
    for name in registered:
        assert callable(getattr(torch_ops.EAGER, name)) and hasattr(torch.ops.mxmoe, name)
        assert not isinstance(getattr(torch_ops.EAGER, name), CustomOpDef)
    assert dispatch._ops() is torch_ops.EAGER
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert dispatch._ops() is torch_ops
    assert dispatch.layer_ops(Backend("cuda:0", "sm90", True, layer_kernels=True)) is torch_ops
    assert dispatch.layer_ops(Backend("cuda:0", "sm90", True, layer_kernels=False)) is None
