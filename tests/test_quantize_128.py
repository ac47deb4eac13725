"""Quantization kernels of the Hopper-fast recipe (DESIGN §9: 1x128 / 128x1 groups, 128x128 tiles) against
the reference :func:`mxmoe.formats.quantize` with ``block=128`` / ``(128, 128)``, bit for bit (data and scale
bytes, every scale layout).

* CPU (CI): the Triton kernels under ``TRITON_INTERPRET=1``, all cases in ONE subprocess (the flag must be set
  before triton is imported), each reported as its own test.
* GPU (``-m gpu``): the same cases on CUDA (on sm_90 the column family runs the Gluon kernel), real shapes, and
  the Gluon kernel against the Triton one (``MXMOE_QUANT_GLUON=0``).

Inputs: ``wide_randn`` (random, never zero) with special 32-blocks (zero, subnormal, NaN, +-Inf, rceil mantissa
boundary, FP32 max, huge/tiny; a NaN or Inf block makes its whole 128-group NaN) plus whole zero groups and
tiles, odd row counts (partial row tiles), 3D weights, both rules, non-contiguous views.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (REPO, os.path.join(REPO, "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

from mxmoe.formats import quantize  # noqa: E402
from test_quantize_kernels import (_ref_input, patch_launchers, run_cases, run_interpreted_cases,  # noqa: E402
                                   same_bytes, scale_ref, sm90_ref, wide_randn, with_special_blocks)

RULES = ("rceil", "floor")
LAYOUTS = ("row_major", "blocked", "sm90")
DTYPES = (torch.bfloat16, torch.float32)


def zero_groups(x: torch.Tensor, axis: int) -> torch.Tensor:
    """x with a few whole 128-groups along ``axis`` zeroed (the zero-group rule: scale byte 0, data 0)."""
    xm = x.movedim(axis, -1).clone()
    flat = xm.reshape(-1, xm.shape[-1])
    ng = flat.shape[1] // 128
    for i in range(min(3, flat.shape[0])):
        r = (11 * i + 2) % flat.shape[0]
        flat[r, ((3 * i) % ng) * 128:((3 * i) % ng + 1) * 128] = 0
    return flat.reshape(xm.shape).movedim(-1, axis).contiguous()


def special(x: torch.Tensor, *axes: int) -> torch.Tensor:
    """x with special 32-blocks and zero groups along each of ``axes``."""
    for a in axes:
        x = zero_groups(with_special_blocks(x, a), a)
    return x


def ref(x, axis, rule, block=128):
    return quantize(_ref_input(x), axis=axis, scale_rule=rule, block=block)


def check_rowwise(Q, x, rule, layout, tag):
    r = ref(x, -1, rule)
    data, scale = Q.quantize_rowwise_128(x, rule, layout)
    same_bytes(data, r.data, f"{tag} rowwise_128 data")
    same_bytes(scale, scale_ref(r.scale, layout), f"{tag} rowwise_128 {layout} scale")
    if layout == "row_major":
        mx = Q.rowwise_mxtensor(data, scale, rule, (1, 128))
        got, want = mx.dequantize().cpu(), r.dequantize().cpu()  # NaN blocks: compared as NaN (CUDA's NaN payload differs)
        assert torch.equal(got.isnan(), want.isnan()), f"{tag} rowwise_128 values: NaN positions differ"
        same_bytes(torch.where(got.isnan(), 0, got).view(torch.int32), torch.where(want.isnan(), 0, want).view(torch.int32),
                   f"{tag} rowwise_128 values")


def check_columnwise(Q, x, rule, layout, tag):
    c = ref(x, -2, rule)
    data_t, scale_t = Q.quantize_columnwise_128(x, rule, layout)
    same_bytes(data_t, c.data.mT, f"{tag} columnwise_128 data")
    same_bytes(scale_t, scale_ref(c.scale.mT.contiguous(), layout), f"{tag} columnwise_128 {layout} scale")
    if layout == "row_major":  # wraps as the logical [.., M, K] tensor, as today's columnwise storage
        mx = Q.columnwise_mxtensor(data_t, scale_t, rule, (1, 128))
        assert mx.axis == x.dim() - 2 and mx.block == (1, 128) and tuple(mx.shape) == tuple(x.shape)
        same_bytes(mx.data.contiguous(), c.data, f"{tag} columnwise_128 MXTensor data")
        same_bytes(mx.scale.contiguous(), c.scale, f"{tag} columnwise_128 MXTensor scale")


def check_dual(Q, x, rule, layout, tag, out=None):
    r, c = ref(x, -1, rule), ref(x, -2, rule)
    d, s, dt, st = Q.quantize_dual_128(x, rule, layout) if out is None else out
    same_bytes(d, r.data, f"{tag} dual_128 row data")
    same_bytes(s, scale_ref(r.scale, layout), f"{tag} dual_128 row {layout} scale")
    same_bytes(dt, c.data.mT, f"{tag} dual_128 col data")
    same_bytes(st, scale_ref(c.scale.mT.contiguous(), layout), f"{tag} dual_128 col {layout} scale")


def check_128x128(Q, w, rule, layout, tag, transposed=True):
    r = ref(w, -1, rule, (128, 128))
    out = Q.quantize_128x128(w, rule, layout, transposed)
    assert len(out) == (4 if transposed else 2), tag
    d, s = out[:2]
    want_s = sm90_ref(r.scale[..., ::32, :]) if layout == "sm90" else scale_ref(r.scale, layout)
    same_bytes(d, r.data, f"{tag} 128x128 data")
    same_bytes(s, want_s, f"{tag} 128x128 {layout} scale")
    if transposed:
        c = ref(w, -2, rule, (128, 128))
        st_ref = c.scale.mT.contiguous()  # [.., K, N/32]
        want_st = sm90_ref(st_ref[..., ::32, :]) if layout == "sm90" else scale_ref(st_ref, layout)
        same_bytes(out[2], c.data.mT, f"{tag} 128x128 transposed data")
        same_bytes(out[2], d.mT, f"{tag} 128x128 transposed data == data.mT")
        same_bytes(out[3], want_st, f"{tag} 128x128 transposed {layout} scale")


# ------------------------------------------------------------------------------------------------
# Cases: name -> fn(Q, device, gen). Small shapes: cheap under the interpreter.
# ------------------------------------------------------------------------------------------------

def _case_rowwise(Q, dev, gen):
    for dt in DTYPES + (torch.float16,):
        for rule in RULES:
            x = wide_randn((100, 384), dt, "cpu", gen)  # 100 rows: a partial row tile
            if dt != torch.float16:
                x = special(x, -1)
            for layout in LAYOUTS:
                check_rowwise(Q, x.to(dev), rule, layout, f"{dt} {rule}")
    w = special(wide_randn((3, 37, 256), torch.bfloat16, "cpu", gen), -1).to(dev)  # 3D, odd rows
    for rule in RULES:
        check_rowwise(Q, w, rule, "row_major", f"3D {rule}")
        check_rowwise(Q, w, rule, "blocked", f"3D {rule}")


def _case_columnwise(Q, dev, gen):
    for dt in DTYPES:
        for rule in RULES:
            x = special(wide_randn((256, 96), dt, "cpu", gen), 0).to(dev)
            for layout in LAYOUTS:
                check_columnwise(Q, x, rule, layout, f"{dt} {rule}")
    w = special(wide_randn((2, 128, 72), torch.bfloat16, "cpu", gen), 1).to(dev)
    check_columnwise(Q, w, "floor", "row_major", "3D")


def _case_dual(Q, dev, gen):
    for dt in DTYPES:
        for rule in RULES:
            x = special(wide_randn((256, 384), dt, "cpu", gen), -1, 0).to(dev)
            for layout in LAYOUTS:
                check_dual(Q, x, rule, layout, f"{dt} {rule}")
    w = wide_randn((2, 128, 256), torch.bfloat16, "cpu", gen)
    w[1] = special(w[1], -1, 0)
    check_dual(Q, w.to(dev), "rceil", "row_major", "3D")
    check_dual(Q, w.to(dev), "floor", "blocked", "3D")


def _case_128x128(Q, dev, gen):
    for dt in DTYPES:
        for rule in RULES:
            w = wide_randn((2, 256, 384), dt, "cpu", gen)
            w[0] = special(w[0], -1)
            w[1, 128:, 256:] = 0  # a zero tile
            w = w.to(dev)
            for layout in LAYOUTS:
                check_128x128(Q, w, rule, layout, f"{dt} {rule}")
            check_128x128(Q, w[1], rule, "row_major", f"{dt} {rule} 2D")
    # without the transposed copy N may end in a partial tile
    w = special(wide_randn((2, 160, 256), torch.bfloat16, "cpu", gen), -1).to(dev)
    for rule in RULES:
        check_128x128(Q, w, rule, "row_major", f"N=160 {rule}", transposed=False)
    check_128x128(Q, w[:, :128], "rceil", "blocked", "rows only", transposed=False)
    check_128x128(Q, w, "floor", "sm90", "N=160 compact scales", transposed=False)


def _case_noncontiguous(Q, dev, gen):
    base = special(wide_randn((256, 512), torch.bfloat16, "cpu", gen), -1, 0).to(dev)
    xt = base.t()  # [512, 256], strides (1, 512)
    check_rowwise(Q, xt, "rceil", "row_major", "transposed input")
    check_columnwise(Q, xt, "floor", "row_major", "transposed input")
    check_dual(Q, xt, "rceil", "row_major", "transposed input")
    xs = base[:, ::2]  # [256, 256], stride 2 along K
    check_dual(Q, xs, "floor", "row_major", "strided input")
    check_128x128(Q, xs, "rceil", "row_major", "strided input")
    check_rowwise(Q, base[:, 128:384], "rceil", "row_major", "column slice")
    w = wide_randn((2, 256, 128), torch.float32, "cpu", gen).to(dev).transpose(1, 2)  # [2, 128, 256] K-strided
    check_128x128(Q, w, "floor", "row_major", "transposed 3D weights")


def _case_permute_128(Q, dev, gen):
    """permute_quantize_128 = quantize_dual_128 of the gathered buffer x[src] (zero rows for src -1)."""
    from mxmoe.kernels import quantize_fused as QF

    T, K, M = 150, 256, 384
    for dt, rule in ((torch.bfloat16, "rceil"), (torch.float32, "floor"), (torch.bfloat16, "floor")):
        x = special(wide_randn((T, K), dt, "cpu", gen), -1)
        src = torch.randint(0, T, (M,), generator=gen)
        src[torch.randperm(M, generator=gen)[:40]] = -1  # padding rows
        src[256:] = -1  # a whole 128-row group of padding: zero groups along M
        src[5] = T + 3  # outside [0, T): a zero row too
        xp = torch.where(((src >= 0) & (src < T))[:, None], x[src.clamp(0, T - 1)], 0)
        for s_dt in (torch.int32, torch.int64):
            out = QF.permute_quantize_128(x.to(dev), src.to(s_dt).to(dev), rule)
            check_dual(Q, xp, rule, "row_major", f"permute {dt} {rule} {s_dt}", out=out)
    xt = wide_randn((K, T), torch.bfloat16, "cpu", gen).t()  # [T, K], strides (1, T)
    src = torch.randint(-1, T, (128,), generator=gen, dtype=torch.int32)
    xp = torch.where((src >= 0)[:, None], xt[src.clamp(0)], 0)
    check_dual(Q, xp, "rceil", "row_major", "permute strided x", out=QF.permute_quantize_128(xt.to(dev), src.to(dev)))
    out = QF.permute_quantize_128(xt[:0].to(dev), torch.full((128,), -1, dtype=torch.int32).to(dev))  # no tokens
    check_dual(Q, torch.zeros(128, K, dtype=xt.dtype), "rceil", "row_major", "permute no tokens", out=out)


def _case_combine_backward_128(Q, dev, gen):
    """combine_backward_quantize_128 = quantize_dual_128 of the combine's expert-row gradient dyp[r] = w[s] * dy[s // k]
    (the FP32 product rounded to BF16; zero on padding rows, s = slot[r] = -1), and each row's router-weight gradient
    <dy[t], yp[r]> against FP64 (0 on padding rows)."""
    from mxmoe.kernels import quantize_fused as QF

    for T, k, D, M, special_dy in ((37, 3, 256, 384, False), (37, 3, 256, 384, True), (5, 8, 128, 128, False)):
        dy = wide_randn((T, D), torch.bfloat16, "cpu", gen)
        if special_dy:
            dy = special(dy, -1)
        yp = wide_randn((M, D), torch.bfloat16, "cpu", gen)
        w = torch.rand(T * k, generator=gen) + 0.01
        slot = torch.full((M,), -1, dtype=torch.int32)
        rows = torch.randperm(M, generator=gen)[:min(T * k, M)]
        slot[rows] = torch.randperm(T * k, generator=gen)[:rows.numel()].to(torch.int32)  # distinct slots, gaps
        live = slot >= 0
        tok = torch.where(live, slot // k, 0).long()
        dyp = torch.where(live[:, None], (dy[tok].float() * w[slot.clamp(min=0).long()][:, None]).to(torch.bfloat16), 0)
        for rule in RULES:
            out = QF.combine_backward_quantize_128(dy.to(dev), w.to(dev), yp.to(dev), slot.to(dev), k, rule)
            tag = f"combine backward T={T} k={k} {rule}{' special' if special_dy else ''}"
            check_dual(Q, dyp, rule, "row_major", tag, out=out[:4])
            dw = out[4].cpu()
            assert dw.dtype == torch.float32 and dw.shape == (M,), tag
            assert bool((dw[~live] == 0).all()), f"{tag}: padding rows' weight gradient"
            if not special_dy:
                prod = torch.where(live[:, None], dy[tok].double() * yp.double(), 0)
                err = ((dw.double() - prod.sum(1)).abs() / (prod.abs().sum(1) + 1e-30)).max()
                assert err <= 1e-5, f"{tag}: weight gradient off by {err:.3e} (relative to sum |dy * yp|)"
    out = QF.combine_backward_quantize_128(torch.randn(0, 128, dtype=torch.bfloat16).to(dev), torch.zeros(0).to(dev),
                                           torch.randn(128, 128, dtype=torch.bfloat16).to(dev),
                                           torch.full((128,), -1, dtype=torch.int32).to(dev), 2)  # no tokens
    check_dual(Q, torch.zeros(128, 128, dtype=torch.bfloat16), "rceil", "row_major", "combine no tokens", out=out[:4])
    assert not out[4].any()


def _swiglu_dh(da: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """dh [M, 2F] of a = F.silu(h[:, :F]) * h[:, F:] for da, on their device: torch's autograd there (on the GPU the
    fused kernel must match it bit for bit), the layer kernel under the interpreter (whose soft math is within an
    ulp of the CPU's torch; the fused kernel's fallback is that kernel)."""
    if da.is_cuda:
        import torch.nn.functional as F

        hh = h.clone().requires_grad_()
        gate, up = hh.split(h.shape[1] // 2, -1)
        return torch.autograd.grad(F.silu(gate) * up, hh, da)[0]
    from mxmoe.kernels import layer

    return layer.swiglu_backward(da, h)


def _case_swiglu_backward_128(Q, dev, gen):
    """swiglu_backward_quantize_128 = quantize_dual_128 of SwiGLU's dh [M, 2F] (torch's BF16 autograd arithmetic),
    from bf16 h and from h's MXFP8 copy along 2F (the gradient at its MX values); special and zero blocks in da."""
    from mxmoe.kernels import quantize_fused as QF

    for M, f in ((256, 256), (128, 384)):
        h = (wide_randn((M, 2 * f), torch.float32, "cpu", gen) * 2.0**-6).to(torch.bfloat16)
        h[7, 3] = float("nan")  # a NaN gate: that row's 128-groups of dh go NaN both halves, as its column groups
        da = special(wide_randn((M, f), torch.bfloat16, "cpu", gen), -1, -2)
        for rule in RULES:
            tag = f"swiglu backward {M}x{f} {rule}"
            out = QF.swiglu_backward_quantize_128(da.to(dev), h.to(dev), None, rule)
            assert len(out) == 4 and out[0].shape == (M, 2 * f) and out[2].shape == (2 * f, M), tag
            check_dual(Q, _swiglu_dh(da.to(dev), h.to(dev)), rule, "row_major", tag, out=out)
            hq = ref(h, -1, rule)  # h kept as MXFP8 in 1x128 groups (the lowmem recipe's save_h)
            out = QF.swiglu_backward_quantize_128(da.to(dev), hq.data.to(dev), hq.scale.to(dev), rule)
            check_dual(Q, _swiglu_dh(da.to(dev), hq.dequantize(torch.bfloat16).to(dev)), rule, "row_major",
                       tag + " MXFP8 h", out=out)
    wide = wide_randn((128, 512), torch.bfloat16, "cpu", gen)
    da = wide[:, 128:256]  # a column slice of a wider tensor: row stride 512
    h = (wide_randn((128, 256), torch.float32, "cpu", gen) * 2.0**-6).to(torch.bfloat16)
    out = QF.swiglu_backward_quantize_128(da.to(dev), h.to(dev))
    check_dual(Q, _swiglu_dh(da.to(dev).contiguous(), h.to(dev)), "rceil", "row_major", "swiglu backward strided da",
               out=out)


def _case_swiglu_128(Q, dev, gen):
    """swiglu_quantize_128 = quantize_dual_128 of F.silu(gate) * up (torch's BF16 math), h's rows 1x128."""
    import torch.nn.functional as F

    from mxmoe.kernels import quantize_fused as QF

    for M, f in ((256, 256), (128, 384)):
        h = (wide_randn((M, 2 * f), torch.float32, "cpu", gen) * 2.0**-6).to(torch.bfloat16)
        h[3, 5] = float("nan")
        h[4, f + 40] = float("inf")
        h[5, :128] = 0  # a zero group of gate -> a zero group of a
        h[6, f:f + 32] = 1e-39
        h[:, 128:256][:128] = 0  # a zero 128x128 corner of gate: zero groups both ways
        gate, up = h.to(dev).split(f, -1)
        a = F.silu(gate) * up  # on the device: the kernel matches torch's math there (CUDA expf on the GPU)
        for rule in RULES:
            for save_h in (False, True):
                out = QF.swiglu_quantize_128(h.to(dev), rule, save_h)
                check_dual(Q, a, rule, "row_major", f"swiglu {M}x{f} {rule}", out=out[:4])
                if save_h:
                    hq = ref(h, -1, rule)
                    same_bytes(out[4], hq.data, f"swiglu h data {rule}")
                    same_bytes(out[5], hq.scale, f"swiglu h scale {rule}")
                else:
                    assert out[4].numel() == out[5].numel() == 0
    wide = (wide_randn((128, 1024), torch.float32, "cpu", gen) * 2.0**-6).to(torch.bfloat16)
    h = wide[:, 256:768]  # a column slice: row stride 1024
    gate, up = h.to(dev).split(256, -1)
    out = QF.swiglu_quantize_128(h.to(dev), "rceil", True)
    check_dual(Q, F.silu(gate) * up, "rceil", "row_major", "swiglu strided h", out=out[:4])
    same_bytes(out[4], ref(h, -1, "rceil").data, "swiglu strided h data")


def _case_128x128_parts(Q, dev, gen):
    """quantize_128x128_parts (the expert layer's [w1; w3]) equals quantize_128x128 of the concatenation, byte for
    byte: 2D and 3D, two and three parts of different heights, both rules and dtypes; on the GPU a part whose rows
    end inside a Gluon tile (1408 = 11 x 128) and one expert's parts as column slices (row stride 2K)."""
    shapes = [((3, 128, 256), (3, 384, 256)), ((256, 128), (128, 128), (384, 128))]
    if dev == "cuda":
        shapes.append(((4, 1408, 2048), (4, 1408, 2048)))
    for dims in shapes:
        for dt in DTYPES:
            parts = [special(wide_randn(d, dt, "cpu", gen), -1, -2).to(dev) for d in dims]
            for rule in RULES:
                got = Q.quantize_128x128_parts(parts, rule)
                want = Q.quantize_128x128(torch.cat(parts, -2), rule)
                for i, name in enumerate(("data", "scale", "data_t", "scale_t")):
                    assert got[i].shape == want[i].shape, (dims, name)
                    same_bytes(got[i], want[i], f"parts {dims} {dt} {rule} {name}")
    wide = wide_randn((2, 256, 512), torch.float32, "cpu", gen).to(dev)
    got = Q.quantize_128x128_parts((wide[..., :256], wide[..., 256:]), "rceil")
    want = Q.quantize_128x128(torch.cat((wide[..., :256], wide[..., 256:]), -2), "rceil")
    for i in range(4):
        same_bytes(got[i], want[i], f"parts of strided views, output {i}")


def _case_random_shapes(Q, dev, gen):
    """A few random shapes (batch, rows not a multiple of the tile, K / M multiples of 128), dtypes and rules."""
    for _ in range(4):
        B = int(torch.randint(1, 3, (1,), generator=gen))
        m_groups, k_groups = (int(v) for v in torch.randint(1, 4, (2,), generator=gen))
        odd = int(torch.randint(1, 128, (1,), generator=gen))
        dt = DTYPES[int(torch.randint(0, 2, (1,), generator=gen))]
        rule = RULES[int(torch.randint(0, 2, (1,), generator=gen))]
        x = special(wide_randn((B, 128 * m_groups, 128 * k_groups), dt, "cpu", gen), -1, -2).to(dev)
        tag = f"random {tuple(x.shape)} {dt} {rule}"
        check_rowwise(Q, x[:, :odd], rule, "row_major", tag + f" rows {odd}")
        check_dual(Q, x, rule, "row_major", tag)
        check_128x128(Q, x, rule, "row_major", tag)


CASES = {
    "rowwise_128": _case_rowwise,
    "columnwise_128": _case_columnwise,
    "dual_128": _case_dual,
    "128x128": _case_128x128,
    "128x128_parts": _case_128x128_parts,
    "noncontiguous_128": _case_noncontiguous,
    "permute_128": _case_permute_128,
    "swiglu_128": _case_swiglu_128,
    "combine_backward_128": _case_combine_backward_128,
    "swiglu_backward_128": _case_swiglu_backward_128,
    "random_shapes_128": _case_random_shapes,
}


@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreted_cases(__file__, timeout=900)


@pytest.mark.parametrize("case", list(CASES))
def test_interpreter(interpreter_results, case):
    err = interpreter_results[case]
    assert err is None, err


def test_input_errors():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("CPU tensors are accepted by the interpreter")
    from mxmoe.kernels import quantize as Q, quantize_fused as QF

    meta = {"device": "meta"}
    with pytest.raises(ValueError, match="CUDA"):
        Q.quantize_rowwise_128(torch.randn(64, 128))
    with pytest.raises(ValueError, match="divisible by 128"):
        Q.quantize_rowwise_128(torch.randn(64, 96, **meta))
    with pytest.raises(ValueError, match="divisible by 128"):
        Q.quantize_columnwise_128(torch.randn(96, 128, **meta))
    with pytest.raises(ValueError, match="divisible by 128"):
        Q.quantize_dual_128(torch.randn(128, 224, **meta))
    with pytest.raises(ValueError, match="divisible by 128"):
        Q.quantize_128x128(torch.randn(2, 160, 256, **meta))  # the transposed copy needs whole tiles along N
    with pytest.raises(ValueError, match="divisible by 128"):
        Q.quantize_128x128(torch.randn(2, 128, 160, **meta), transposed=False)
    with pytest.raises(ValueError, match="divisible by 32"):
        Q.quantize_128x128(torch.randn(2, 100, 128, **meta), transposed=False)
    with pytest.raises(TypeError, match="dtype"):
        Q.quantize_dual_128(torch.randn(128, 128, **meta).to(torch.int32))
    with pytest.raises(ValueError, match="non-empty"):
        Q.quantize_128x128_parts([])
    with pytest.raises(ValueError, match="divisible by 128"):
        Q.quantize_128x128_parts([torch.randn(2, 160, 256, **meta), torch.randn(2, 128, 256, **meta)])
    with pytest.raises(ValueError, match="leading shape and K"):
        Q.quantize_128x128_parts([torch.randn(2, 128, 256, **meta), torch.randn(2, 128, 384, **meta)])
    with pytest.raises(ValueError, match="leading shape and K"):
        Q.quantize_128x128_parts([torch.randn(2, 128, 256, **meta), torch.randn(2, 128, 256, **meta).half()])
    src = torch.zeros(192, dtype=torch.int32, **meta)
    with pytest.raises(ValueError, match="divisible by 128"):
        QF.permute_quantize_128(torch.randn(10, 128, **meta), src)
    with pytest.raises(ValueError, match="divisible by 128"):
        QF.permute_quantize_128(torch.randn(10, 96, **meta), src[:128])
    with pytest.raises(TypeError, match="src"):
        QF.permute_quantize_128(torch.randn(10, 128, **meta), src[:128].float())
    with pytest.raises(ValueError, match="F % 128"):
        QF.swiglu_quantize_128(torch.randn(128, 192, **meta).to(torch.bfloat16))
    with pytest.raises(ValueError, match="divisible by 128"):
        QF.swiglu_quantize_128(torch.randn(96, 256, **meta).to(torch.bfloat16))
    with pytest.raises(TypeError, match="bfloat16"):
        QF.swiglu_quantize_128(torch.randn(128, 256, **meta))
    da, h = torch.randn(128, 128, **meta).to(torch.bfloat16), torch.randn(128, 256, **meta).to(torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16 da"):
        QF.swiglu_backward_quantize_128(da.float(), h)
    with pytest.raises(TypeError, match="float8_e4m3fn h"):
        QF.swiglu_backward_quantize_128(da, h, torch.zeros(128, 8, **meta).to(torch.float8_e8m0fnu))
    with pytest.raises(ValueError, match=r"h \[M, 2F\]"):
        QF.swiglu_backward_quantize_128(da, h[:, :192])
    with pytest.raises(ValueError, match="h_scale"):
        QF.swiglu_backward_quantize_128(da, h.to(torch.float8_e4m3fn), torch.zeros(128, 4, **meta).to(torch.float8_e8m0fnu))
    with pytest.raises(ValueError, match="divisible by 128"):
        QF.swiglu_backward_quantize_128(da[:96], h[:96])


def test_tile_configs_fit_the_groups():
    """Every GROUP 128 launch config holds whole groups: BK % 128 == 0 with a row output, BM % 128 == 0
    with a column output or tiles."""
    from mxmoe.kernels import quantize_tile_config as QT

    for key, cfg in QT._DEFAULT_128.items():
        cfg = QT._TUNED.get(key) or cfg
        row, col = "row" in key, key.startswith("col")
        if row:
            assert cfg.BK % 128 == 0, key
        if col or "128x128" in key:
            assert cfg.BM % 128 == 0, key
    for (fam, width), g in QT._GLUON_TILES.items():  # the Gluon kernel with GROUP 128
        assert g["MB"] % 4 == 0, (fam, width)
        if fam == "dual":
            assert g["BK"] % 128 == 0, (fam, width)
    for save_h, g in QT._GLUON_TILES_SWIGLU.items():  # the SwiGLU input mode: dual outputs, 128 groups
        assert QT._gluon_tile_fits(**g) and g["MB"] % 4 == 0 and g["BK"] % 128 == 0, save_h


def test_gluon_launch_contract_128(monkeypatch):
    """What the sm_90 route hands the Gluon kernel for the 128 forms (recorded, not run: CPU): GROUP 128, the
    outputs it returns, the tile grid, and the fused input modes' arguments."""
    from types import SimpleNamespace

    from mxmoe.kernels import quantize as Q, quantize_fused as QF, quantize_tile_config as QT

    calls = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: calls.append((grid, args, kw))

    patch_launchers(monkeypatch, "_interpreting", lambda: True)  # CPU tensors pass _check
    patch_launchers(monkeypatch, "_use_gluon", lambda x3: True)
    tma_calls = []

    class TmaRecorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: tma_calls.append((grid, args, kw))

    patch_launchers(monkeypatch, "_gluon", lambda: SimpleNamespace(mx_quantize_cols_kernel=Recorder(),
                                                             mx_swiglu_quantize_tma_kernel=TmaRecorder()))

    def launch(fn, *a):
        calls.clear()
        out = fn(*a)
        assert len(calls) == 1, f"{fn.__name__}: {len(calls)} launches"
        grid, args, kw = calls[0]
        assert kw["GROUP"] == 128 and kw["VEC"] == 8, fn.__name__
        return out, grid, args, kw

    x = torch.randn(256, 384, dtype=torch.bfloat16)
    (d, s_, dt, st), grid, args, kw = launch(Q.quantize_dual_128, x)
    assert (kw["ROW"], kw["COL"], kw["LAYOUT"], kw["TILE32"]) == (1, 1, 0, False) and "IN_MODE" not in kw
    assert args[1].data_ptr() == dt.data_ptr() and args[3].data_ptr() == d.data_ptr() and grid == (2 * 3,)
    (dt, st), grid, args, kw = launch(Q.quantize_columnwise_128, x)
    assert (kw["ROW"], kw["COL"]) == (0, 1) and dt.shape == (384, 256) and st.shape == (384, 8)
    w = torch.randn(2, 256, 128, dtype=torch.float32)
    out, grid, args, kw = launch(Q.quantize_128x128, w)
    assert kw["TILE32"] and len(out) == 4 and out[2].shape == (2, 128, 256)

    src = torch.arange(256, dtype=torch.int32)
    (d, s_, dt, st), grid, args, kw = launch(QF.permute_quantize_128, x[:100], src)
    assert kw["IN_MODE"] == 1 and kw["src_ptr"] is not None and kw["T"] == 100 and (args[5], args[6]) == (256, 384)
    assert d.shape == (256, 384) and s_.shape == (256, 12) and dt.shape == (384, 256) and grid == (2 * 3,)
    assert args[3].data_ptr() == d.data_ptr() and args[4].data_ptr() == s_.data_ptr()
    # SwiGLU without save_h: the TMA-fed kernel, h read through a descriptor of [M, 2F] in [128, 128] boxes
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    h = torch.randn(256, 768, dtype=torch.bfloat16)
    tma_calls.clear()
    calls.clear()
    out = QF.swiglu_quantize_128(h, "floor")
    assert len(tma_calls) == 1 and not calls
    grid, args, kw = tma_calls[0]
    desc = args[0]
    assert isinstance(desc, TensorDescriptor) and desc.base is h and list(desc.shape) == [256, 768]
    assert list(desc.block_shape) == [128, 128] and list(desc.strides) == [768, 1]
    assert [a.data_ptr() for a in args[1:5]] == [out[2].data_ptr(), out[3].data_ptr(), out[0].data_ptr(),
                                                 out[1].data_ptr()]
    assert args[5:] == (256, 384, 0) and kw["GROUP"] == 128 and kw["STAGES"] == QT._SWIGLU_TMA_STAGES
    g = QT._GLUON_TILES_SWIGLU[False]
    assert all(kw[k] == v for k, v in g.items()) and kw["num_warps"] == g["WM"] * g["WK"] and 1 <= grid[0] <= 6
    # a base address TMA cannot take (2 bytes off 16) keeps the register-fed kernel
    odd = torch.randn(256, 769, dtype=torch.bfloat16)[:, 1:]
    assert not QF._tma_ready(odd) and QF._tma_ready(h)
    assert not QF._tma_ready(h[:1].expand(256, 768))  # rows that overlap (row pitch 0): not a TMA box grid
    tma_calls.clear()
    launch(QF.swiglu_quantize_128, odd, "rceil", False)
    assert not tma_calls
    for save_h in (False, True):
        if not save_h:
            patch_launchers(monkeypatch, "_tma_ready", lambda h: False)
        else:
            monkeypatch.undo()  # (restores everything; set the recorders again)
            patch_launchers(monkeypatch, "_interpreting", lambda: True)
            patch_launchers(monkeypatch, "_use_gluon", lambda x3: True)
            patch_launchers(monkeypatch, "_gluon", lambda: SimpleNamespace(mx_quantize_cols_kernel=Recorder()))
        out, grid, args, kw = launch(QF.swiglu_quantize_128, h, "rceil", save_h)
        g = QT._GLUON_TILES_SWIGLU[save_h]
        assert kw["IN_MODE"] == 2 and kw["SAVE_H"] == save_h and (args[5], args[6]) == (256, 384)
        assert all(kw[k] == v for k, v in g.items()) and kw["num_warps"] == g["WM"] * g["WK"]
        assert [tuple(t.shape) for t in out] == [(256, 384), (256, 12), (384, 256), (384, 8)] + (
            [(256, 768), (256, 24)] if save_h else [(0,), (0,)])
        if save_h:
            assert kw["qh_ptr"].data_ptr() == out[4].data_ptr() and kw["sh_ptr"].data_ptr() == out[5].data_ptr()


def test_gluon_128_compiles_for_sm90(tmp_path):
    """The Gluon kernel's GROUP 128 and fused input modes (which no CPU run executes) compile for sm_90 without
    spills (bench_quantize.py --offline-sm90: the wrappers' own launches, compiled, not run)."""
    pytest.importorskip("triton")
    out = tmp_path / "offline.json"
    names = "columnwise_128,dual_128,weight_128x128_both,permute_128,swiglu_128,swiglu_128_save_h"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_quantize.py"), "--offline-sm90",
                           "--groups128", "--kernels", names, "--out", str(out)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["kernel"] for r in rows} == set(names.split(","))
    assert all(r["config"].startswith("gluon") for r in rows), rows
    if any(r["registers"] is None for r in rows):  # (Triton 3.9's offline compile reports no resource usage)
        import triton

        pytest.skip(f"triton {triton.__version__} reports no registers/spills offline (checked with 3.6, the GPU's)")
    for r in rows:
        assert r["spill_store_bytes"] == 0 and r["registers"], r


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_cases(case):
    from mxmoe.kernels import quantize as Q
    from test_quantize_kernels import _poison_cuda_cache

    _poison_cuda_cache()
    CASES[case](Q, "cuda", torch.Generator().manual_seed(4321 + len(case)))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_real_shapes(dtype):
    """Activations 4096 x 7168 and weights 4 x 1536 x 2048, every 128 kernel, both rules, bit-exact."""
    from mxmoe.kernels import quantize as Q, quantize_fused as QF

    gen = torch.Generator().manual_seed(8)
    x = special(wide_randn((4096, 7168), dtype, "cpu", gen), -1).cuda()
    w = wide_randn((4, 1536, 2048), dtype, "cpu", gen).cuda()
    for rule in RULES:
        check_rowwise(Q, x, rule, "row_major", "act")
        check_columnwise(Q, x, rule, "row_major", "act")
        check_dual(Q, x, rule, "row_major", "act")
        check_dual(Q, x, rule, "blocked", "act")
        check_128x128(Q, w, rule, "row_major", "weights")
        check_128x128(Q, w, rule, "sm90", "weights")
        check_128x128(Q, w, rule, "row_major", "weights rows only", transposed=False)
        src = torch.randint(-1, 4096, (8192,), generator=gen).cuda()  # top-2 of 4096 tokens
        xp = torch.where((src >= 0)[:, None], x[src.clamp(0)], 0)
        check_dual(Q, xp, rule, "row_major", "permute", out=QF.permute_quantize_128(x, src, rule))
    if dtype != torch.bfloat16:
        return
    import torch.nn.functional as F

    h = (wide_randn((4096, 2 * 2048), torch.float32, "cpu", gen) * 2.0**-6).to(torch.bfloat16).cuda()
    a = F.silu(h[:, :2048]) * h[:, 2048:]
    for rule in RULES:
        out = QF.swiglu_quantize_128(h, rule, False)  # the TMA-fed kernel: 512 tiles, several per program
        check_dual(Q, a, rule, "row_major", "swiglu (TMA)", out=out[:4])
        out = QF.swiglu_quantize_128(h, rule, True)
        check_dual(Q, a, rule, "row_major", "swiglu", out=out[:4])
        same_bytes(out[4], ref(h, -1, rule).data, "swiglu h data")
        same_bytes(out[5], ref(h, -1, rule).scale, "swiglu h scale")
    # the combine's backward fused with dy's dual quantization: 4096 tokens, top-6, rows padded per expert
    T, k, D = 4096, 6, 2048
    dy = wide_randn((T, D), torch.bfloat16, "cpu", gen)
    yp = wide_randn((T * k + 64 * 128, D), torch.bfloat16, "cpu", gen)
    w = torch.rand(T * k, generator=gen)
    slot = torch.full((yp.shape[0],), -1, dtype=torch.int32)
    slot[torch.randperm(yp.shape[0], generator=gen)[:T * k]] = torch.arange(T * k, dtype=torch.int32)
    live = slot >= 0
    tok = torch.where(live, slot // k, 0).long()
    dyp = torch.where(live[:, None], (dy[tok].float() * w[slot.clamp(min=0).long()][:, None]).to(torch.bfloat16), 0)
    prod = torch.where(live[:, None], dy[tok].double() * yp.double(), 0)
    for rule in RULES:
        out = QF.combine_backward_quantize_128(dy.cuda(), w.cuda(), yp.cuda(), slot.cuda(), k, rule)
        check_dual(Q, dyp, rule, "row_major", "combine backward", out=out[:4])
        err = ((out[4].cpu().double() - prod.sum(1)).abs() / (prod.abs().sum(1) + 1e-30)).max()
        assert err <= 1e-5, f"combine backward weight gradient off by {err:.3e} (relative to sum |dy * yp|)"
    # SwiGLU's backward fused with dh's dual quantization at Qwen3-30B-A3B's expert width (F 768): h in BF16
    # and as its MXFP8 copy in 1x128 groups (the lowmem recipe)
    M, f = 4096, 768
    h = (wide_randn((M, 2 * f), torch.float32, "cpu", gen) * 2.0**-6).to(torch.bfloat16).cuda()
    da = special(wide_randn((M, f), torch.bfloat16, "cpu", gen), -1).cuda()
    for rule in RULES:
        out = QF.swiglu_backward_quantize_128(da, h, None, rule)
        check_dual(Q, _swiglu_dh(da, h), rule, "row_major", "swiglu backward", out=out)
        hq = ref(h.cpu(), -1, rule)
        out = QF.swiglu_backward_quantize_128(da, hq.data.cuda(), hq.scale.cuda(), rule)
        check_dual(Q, _swiglu_dh(da, hq.dequantize(torch.bfloat16).cuda()), rule, "row_major",
                   "swiglu backward, MXFP8 h", out=out)


@pytest.mark.gpu
@needs_cuda
def test_gpu_gluon_equals_triton(monkeypatch):
    """On sm_90 the column family runs the Gluon kernel with GROUP 128: the same bytes as the Triton kernel
    (MXMOE_QUANT_GLUON=0) on tile-edge shapes, batches, FP16/FP32 and strided rows."""
    from mxmoe.kernels import quantize as Q, quantize_fused as QF

    gen = torch.Generator().manual_seed(9)
    def both(fn, *args, tag):
        monkeypatch.setenv("MXMOE_QUANT_GLUON", "1")
        got = fn(*args)
        monkeypatch.setenv("MXMOE_QUANT_GLUON", "0")
        want = fn(*args)
        assert len(got) == len(want), tag
        for g, w_ in zip(got, want):
            same_bytes(g, w_, f"{fn.__name__} {tag}: gluon vs triton")

    for shape, dt in (((384, 640), torch.bfloat16), ((2, 256, 384), torch.float16), ((640, 256), torch.float32)):
        x = special(wide_randn(shape, dt, "cpu", gen), -1, -2).cuda()
        for xin in (x, x[..., : shape[-1] // 2] if shape[-1] % 256 == 0 else x):
            for fn in (Q.quantize_columnwise_128, Q.quantize_dual_128, Q.quantize_128x128):
                for rule in RULES:
                    both(fn, xin, rule, tag=f"{tuple(xin.shape)} {dt} {rule}")
        if x.dim() == 2:  # the fused input modes: gathered rows, SwiGLU (bf16)
            src = torch.randint(-1, x.shape[0] + 2, (512,), generator=gen).cuda()
            both(QF.permute_quantize_128, x, src, "rceil", tag=f"{dt}")
            both(QF.permute_quantize_128, x[:, :128], src.int(), "floor", tag=f"{dt} column slice")
    h = (special(wide_randn((384, 1024), torch.float32, "cpu", gen), -1) * 2.0**-6).to(torch.bfloat16).cuda()
    for rule in RULES:
        for save_h in (False, True):
            both(QF.swiglu_quantize_128, h, rule, save_h, tag=f"{rule} save_h={save_h}")
            both(QF.swiglu_quantize_128, h[:, 256:768], rule, save_h, tag=f"{rule} save_h={save_h} column slice")
    # SwiGLU's backward + dh's dual quantization: the fused kernel against layer.swiglu_backward + quantize_dual_128
    da = special(wide_randn((384, 512), torch.bfloat16, "cpu", gen), -1).cuda()
    for rule in RULES:
        both(QF.swiglu_backward_quantize_128, da, h, None, rule, tag=f"{rule}")
        both(QF.swiglu_backward_quantize_128, da[:, 128:384], h[:, 256:768], None, rule, tag=f"{rule} column slice")
        hq = ref(h.cpu(), -1, rule)
        both(QF.swiglu_backward_quantize_128, da, hq.data.cuda(), hq.scale.cuda(), rule, tag=f"{rule} MXFP8 h")
    # the TMA-fed SwiGLU kernel against the register-fed one (same tile, same math): the same bytes
    for hin in (h, h[:, 256:768], h[:128]):
        for rule in RULES:
            got = QF.swiglu_quantize_128(hin, rule)
            want = QF._launch_swiglu(hin, rule, False, fp8_rows=True, group=128, name="swiglu", tma=False)
            for g, w_ in zip(got, want):
                same_bytes(g, w_, f"swiglu {tuple(hin.shape)} {rule}: TMA vs register-fed")


if __name__ == "__main__" and "--cases" in sys.argv:
    results = run_cases("cpu", CASES)
    print("RESULTS " + json.dumps(results))
