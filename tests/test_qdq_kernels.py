"""Quantize-dequantize (QDQ) kernels and the fused SwiGLU kernels against the composition they
replace: ``dequantize_bf16(formats.quantize(x))`` (the reference quantizer, then the one MX -> BF16
expansion of mxmoe.kernels.dequantize), bit for bit; FP8 outputs against the reference bytes.

CPU: the kernels run under ``TRITON_INTERPRET=1`` in one subprocess (the flag must be set before
triton is imported). Inputs have a wide dynamic range plus special blocks (zero, subnormal, NaN,
+-Inf, rceil boundary, values whose MX products fall below BF16's normal range), odd row counts
(not a multiple of the tile) and non-contiguous views; both scale rules.
"""

import os
import subprocess
import sys

import pytest

from mxmoe.backend import resolve

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRELUDE = r"""
import sys, torch
sys.path.insert(0, "tests")
from test_quantize_kernels import wide_randn, with_special_blocks
from mxmoe.kernels import qdq as QDQ, quantize as Q, quantize_fused as QF
from mxmoe.backend import resolve

gen = torch.Generator().manual_seed(0)

def same(got, want, what):
    g, w = got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
    assert g.shape == w.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    bad = (g != w).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} bytes differ, first at {bad[0].tolist()}"
"""


def run_interpreted(script: str) -> None:
    """Run PRELUDE + script under TRITON_INTERPRET=1 in a fresh process (the flag must be set before
    triton is imported); it must exit 0 and print "ok"."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", PRELUDE + script], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


CHECK = r"""
from mxmoe import formats
from mxmoe.kernels.dequantize import dequantize_bf16

def expand(mx):  # the composition the QDQ kernels replace, in the logical [.., M, K] orientation
    if mx.axis == mx.data.dim() - 1:
        return dequantize_bf16(mx.data, mx.scale)
    return dequantize_bf16(mx.data.mT.contiguous(), mx.scale.mT.contiguous()).mT

def tiny_block(x):  # MX products below BF16's normal range: amax 2^-118, the rest near 2^-133
    x = x.clone()
    x.view(-1, x.shape[-1])[1, 32:64] = torch.linspace(-1, 1, 32) * 2.0**-133
    x.view(-1, x.shape[-1])[1, 40] = 2.0**-118
    return x

def inputs(shape, dtype, both_axes):
    x = with_special_blocks(wide_randn(shape, dtype, "cpu", gen), -1)
    if both_axes:
        x = with_special_blocks(x, -2)
    return tiny_block(x.float()).to(dtype) if dtype != torch.float16 else x

n = 0
for dtype in (torch.bfloat16, torch.float32, torch.float16):
    for rule in ("rceil", "floor"):
        # rowwise: M not a multiple of the tile or of 32; batched; a non-contiguous view
        for x in (inputs((100, 224), dtype, False), inputs((3, 37, 96), dtype, False),
                  inputs((160, 64), dtype, False).mT):
            same(QDQ.qdq_rowwise(x, rule), expand(formats.quantize(x, -1, rule)), f"rowwise {dtype} {rule}")
            n += 1
        for x in (inputs((96, 160), dtype, True), inputs((2, 64, 96), dtype, True)):
            r, c = formats.quantize(x, -1, rule), formats.quantize(x, -2, rule)
            # dual: BF16 along K + FP8 along M (quantize_columnwise's layout)
            xb, dt, st = QDQ.qdq_dual(x, rule)
            same(xb, expand(r), f"dual bf16 {dtype} {rule}")
            same(dt, c.data.mT, f"dual data_t {dtype} {rule}")
            same(st, c.scale.mT, f"dual scale_t {dtype} {rule}")
            # dual BF16: along K and along M (transposed)
            xb, xbt = QDQ.qdq_dual_bf16(x, rule)
            same(xb, expand(r), f"dual_bf16 row {dtype} {rule}")
            same(xbt, expand(c).mT, f"dual_bf16 col {dtype} {rule}")
            # 32x32 tiles (weights): BF16 along K + the transposed FP8 copy
            r2, c2 = formats.quantize(x, -1, rule, (32, 32)), formats.quantize(x, -2, rule, (32, 32))
            xb, dt, st = QDQ.qdq_dual(x, rule, tile32=True)
            same(xb, expand(r2), f"32x32 bf16 {dtype} {rule}")
            same(xb, expand(c2), f"32x32 bf16 == along-N values {dtype} {rule}")
            same(dt, c2.data.mT, f"32x32 data_t {dtype} {rule}")
            same(st, c2.scale.mT, f"32x32 scale_t {dtype} {rule}")
            # one orientation alone (weights requantized in backward): along M transposed; 32x32 along K
            same(QDQ.qdq_columnwise(x, rule), expand(c).mT, f"columnwise {dtype} {rule}")
            same(QDQ.qdq_rowwise(x, rule, tile32=True), expand(r2), f"rowwise 32x32 {dtype} {rule}")
            n += 1
# SwiGLU fused with the dual QDQ of its output, and its autograd backward
import torch.nn.functional as F
from mxmoe import ops
from mxmoe.ops import activation, linear, tokens as ops_tokens  # noqa: F401
for M, f in ((96, 160), (64, 256)):
    h = (wide_randn((M, 2 * f), torch.float32, "cpu", gen) * 2.0**-6).to(torch.bfloat16)
    h[3, 5] = float("nan"); h[4, f + 40] = float("inf"); h[5, :32] = 0; h[6, f:f + 32] = 1e-39
    gate, up = h.split(f, -1)
    a = F.silu(gate) * up
    for rule in ("rceil", "floor"):
        c = formats.quantize(a, 0, rule)
        for save_h in (False, True):
            a16, dt, st, qh, sh = QF.swiglu_qdq(h, rule, save_h)
            same(a16, expand(formats.quantize(a, -1, rule)), f"swiglu bf16 {rule}")
            same(dt, c.data.mT, f"swiglu data_t {rule}")
            same(st, c.scale.mT, f"swiglu scale_t {rule}")
            if save_h:  # h along 2F from the same read: the reference quantizer's bytes
                hq = formats.quantize(h, -1, rule)
                same(qh, hq.data, f"swiglu h data {rule}")
                same(sh, hq.scale, f"swiglu h scale {rule}")
            else:
                assert qh.numel() == sh.numel() == 0
    h = h.nan_to_num(0.0, 0.0, 0.0).requires_grad_()
    da = torch.randn(M, f, generator=gen).to(torch.bfloat16)
    a16, _, _ = activation._SwiGLUQDQ.apply(h, "rceil", False, resolve(h.device))
    (dh,) = torch.autograd.grad(a16, h, da)
    gate, up = h.split(f, -1)
    (want,) = torch.autograd.grad(F.silu(gate) * up, h, da)
    same(dh, want, "swiglu backward")
    # h kept as MXFP8: the gradient at h's MX values (torch's ops on the dequantized h)
    a16, _, _ = activation._SwiGLUQDQ.apply(h, "rceil", True, resolve(h.device))
    (dh,) = torch.autograd.grad(a16, h, da)
    hq = formats.quantize(h.detach(), -1, "rceil").dequantize(torch.float32).to(torch.bfloat16).requires_grad_()
    gq, uq = hq.split(f, -1)
    (want,) = torch.autograd.grad(F.silu(gq) * uq, hq, da)
    same(dh, want, "swiglu backward at h's MX values")
    # what the autograd function hands to ops.swiglu: columnwise storage that wraps into a's MXTensor
    _, dt, st = activation._SwiGLUQDQ.apply(h, "rceil", False, resolve(h.device))
    c = formats.quantize((F.silu(gate) * up).detach(), 0, "rceil")
    a_t = Q.columnwise_mxtensor(dt, st, "rceil")
    same(a_t.data.contiguous(), c.data, "swiglu autograd a_t data")
    same(a_t.scale.contiguous(), c.scale, "swiglu autograd a_t scale")
    n += 1
# against MXTensor.dequantize where the FP32 products are normal (the interpreter's FP32 -> BF16
# conversion of FP32 subnormals differs from the GPU's; the GPU tests cover them)
x = inputs((64, 96), torch.float32, True)
xb = QDQ.qdq_rowwise(x)
ref32 = formats.quantize(x).dequantize(torch.float32)
ref = ref32.to(torch.bfloat16)
normal = ref32.isfinite() & ((ref32.abs() >= 2.0**-126) | (ref32 == 0))
assert torch.equal(xb.isnan(), ref.isnan()) and torch.equal(xb[normal], ref[normal]), "vs MXTensor.dequantize"
print("ok", n)
"""


def test_qdq_kernels_interpreter():
    run_interpreted(CHECK)


PERMUTE_CHECK = r"""
from mxmoe import ops
from mxmoe.ops import activation, linear, tokens as ops_tokens  # noqa: F401
from mxmoe.moe import permute_plan

def old_permute(x2, slot_rows, M, top_k):  # what MoE.permute built before the fusion
    return x2.new_zeros(M, x2.shape[1]).index_copy(0, slot_rows, x2.repeat_interleave(top_k, dim=0))

def sources(slot_rows, M, top_k):
    src = torch.full((M,), -1, dtype=torch.int64)
    src[slot_rows] = torch.arange(slot_rows.numel()) // top_k
    return src

n = 0
# T not a multiple of 32; experts 1 and 3 empty; D = 288: a partial column tile (interpreter BK = 256)
for T, D, E, top_k in ((45, 288, 5, 1), (45, 288, 5, 2), (70, 96, 6, 4), (0, 64, 3, 2)):
    experts = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(T)]) if T else \
        torch.zeros(0, top_k, dtype=torch.int64)
    experts = torch.where((experts == 1) | (experts == 3), (experts + 1) % E, experts) if E > 4 else experts
    slot_rows, offs, M, counts = permute_plan(experts, E, 32)
    assert T == 0 or (E <= 4 or int(counts[1]) == int(counts[3]) == 0)
    for dtype in (torch.bfloat16, torch.float32):
        x2 = with_special_blocks(wide_randn((T, D), dtype, "cpu", gen), -1) if T else torch.zeros(0, D, dtype=dtype)
        if T:
            x2[(experts[:, 0] == 0)] *= 2.0**-120  # expert 0's column blocks near the bottom of the range
            x2[3, 7] = float("inf"); x2[5, 40] = float("nan")
        views = (x2, torch.cat([x2, x2], 1)[:, D:])  # contiguous, and a row-strided view
        for rule in ("rceil", "floor"):
            for xv, src_dtype in zip(views, (torch.int64, torch.int32)):
                src = sources(slot_rows, M, top_k).to(src_dtype)
                got = QF.permute_qdq(xv, src, rule)
                want = QDQ.qdq_dual(old_permute(xv, slot_rows, M, top_k), rule)
                for g, w, what in zip(got, want, ("bf16", "data_t", "scale_t")):
                    same(g, w, f"permute_qdq {what} T={T} top_k={top_k} {dtype} {rule}")
                n += 1
    # autograd: the fused function against autograd of the old composition (bf16, finite values)
    x2 = wide_randn((T, D), torch.bfloat16, "cpu", gen).requires_grad_()
    dxp = torch.randn(M, D, generator=gen).to(torch.bfloat16)
    xp16, dt, st = ops_tokens._PermuteQDQ.apply(x2, slot_rows, M, top_k, "rceil", resolve(x2.device))
    same(xp16, QDQ.qdq_dual(old_permute(x2.detach(), slot_rows, M, top_k))[0], f"autograd forward top_k={top_k}")
    (got,) = torch.autograd.grad(xp16, x2, dxp)
    (want,) = torch.autograd.grad(old_permute(x2, slot_rows, M, top_k), x2, dxp)
    same(got, want, f"permute backward top_k={top_k}")
    # off the expansion route (CPU) permute_tokens is the old composition
    xp, xp_wgrad = ops.permute_tokens(x2.detach(), slot_rows, M, top_k, "mxfp8", torch.zeros(E, 64, D))
    assert xp_wgrad is None
    same(xp, old_permute(x2.detach(), slot_rows, M, top_k), "permute_tokens fallback")
# the MoE layer (CPU reference products) with the fused function in permute: x_mx along rows goes to
# wgrad, as on CUDA's expansion route; output and gradients equal the unfused layer's
from mxmoe.moe import MoE
torch.manual_seed(0)
m = MoE(64, 96, 6, 2)
x = torch.randn(45, 64).to(torch.bfloat16)

def fused_permute(x2, r):
    xp16, dt, st = ops_tokens._PermuteQDQ.apply(x2, r.slot_rows, r.rows, m.top_k, m.recipe.scale_rule, resolve(x2.device))
    return xp16, r.offs, Q.columnwise_mxtensor(dt, st, m.recipe.scale_rule), r

from test_qdq_kernels import _layer_step
old = _layer_step(m, x)
m.permute = fused_permute
for a, b, what in zip(_layer_step(m, x), old, ("y", "dx", "dw13", "dw2", "drouter")):
    same(a, b, f"MoE with the fused permute: {what}")
print("ok", n)
"""


def test_permute_qdq_interpreter():
    """The fused permute + dual QDQ kernel equals qdq_dual of the buffer MoE.permute built before it,
    bit for bit; its autograd backward equals the old composition's gradient."""
    run_interpreted(PERMUTE_CHECK)


EXPANSION_CHECK = r"""
# The expert linear layer's expansion-route branches (the QDQ kernels feeding torch._grouped_mm),
# forced on the CPU: requantize_weights gives the same bits, and both agree with the reference path.
from mxmoe import ops
from mxmoe.ops import activation, linear, tokens as ops_tokens  # noqa: F401
from mxmoe.kernels import dispatch
from mxmoe.recipes import get_recipe

E, N, K = 3, 64, 96
offs = torch.tensor([32, 32, 96], dtype=torch.int32)
x0 = torch.randn(96, K, generator=gen).to(torch.bfloat16)
# rows and columns a power of two apart: 1x32 and 32x32 weight blocks quantize differently
w0 = (torch.randn(E, N, K, generator=gen) * torch.exp2(torch.randint(-6, 7, (E, N, 1), generator=gen).float())
      * torch.exp2(torch.randint(-6, 7, (E, 1, K), generator=gen).float()))
dy = torch.randn(96, N, generator=gen).to(torch.bfloat16)
reference_route = linear._expansion

def run(recipe, expansion):
    linear._expansion = (lambda x, w, r, be: dispatch) if expansion else reference_route
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    y = ops.grouped_linear(x, w, offs, recipe)
    y.backward(dy)
    linear._expansion = reference_route
    return [y.detach(), x.grad, w.grad]

def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())

for name in ("mxfp8", "mxfp8_2d"):
    base = get_recipe(name)
    ref, kept, requant = run(base, False), run(base, True), run(base.with_(requantize_weights=True), True)
    for what, a, b in zip(("y", "dx", "dw"), kept, requant):
        same(a, b, f"{name} {what}: requantize_weights on the expansion route")
    for what, a, b, tol in zip(("y", "dx", "dw"), kept, ref, (1e-5, 1e-5, 1e-2)):  # dw: BF16 on the route
        assert rel(a, b) < tol, f"{name} {what}: expansion route vs reference {rel(a, b)}"
    other = run(get_recipe("mxfp8_2d" if name == "mxfp8" else "mxfp8"), True)
    # (the other weight block moves y and dx by ~1e-4 here; wgrad has no weight operand)
    assert min(rel(other[0], kept[0]), rel(other[1], kept[1])) > 1e-5, f"{name}: the weight block changes nothing"
print("ok")
"""


def test_expansion_route_layer_interpreter():
    """The layer's expansion-route code (QDQ kernels under the interpreter, forced on the CPU)."""
    run_interpreted(EXPANSION_CHECK)


def test_qdq_fake_shapes():
    """Fake implementations of the QDQ custom ops (torch.compile / CUDA graphs trace them)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mxmoe.kernels import torch_ops  # noqa: F401

    ops = torch.ops.mxmoe
    with FakeTensorMode():
        x = torch.empty(8, 64, 96, device="cuda", dtype=torch.float32)
        y = ops.qdq_rowwise(x, "rceil")
        assert (y.shape, y.dtype) == ((8, 64, 96), torch.bfloat16)
        assert ops.qdq_rowwise(x, "rceil", True).shape == (8, 64, 96)
        y = ops.qdq_columnwise(x, "rceil")
        assert (y.shape, y.dtype) == ((8, 96, 64), torch.bfloat16)
        xb, dt, st = ops.qdq_dual(x, "floor", True)
        assert (xb.shape, xb.dtype, dt.shape, dt.dtype, st.shape, st.dtype) == (
            (8, 64, 96), torch.bfloat16, (8, 96, 64), torch.float8_e4m3fn, (8, 96, 2), torch.float8_e8m0fnu)
        a, at = ops.qdq_dual_bf16(torch.empty(64, 96, device="cuda", dtype=torch.bfloat16), "rceil")
        assert (a.shape, at.shape, at.dtype) == ((64, 96), (96, 64), torch.bfloat16)
        h = torch.empty(64, 192, device="cuda", dtype=torch.bfloat16)
        assert [t.shape for t in ops.swiglu_qdq(h, "rceil", False)] == [(64, 96), (96, 64), (96, 2), (0,), (0,)]
        assert [t.shape for t in ops.swiglu_qdq(h, "rceil", True)][3:] == [(64, 192), (64, 6)]
        src = torch.empty(96, device="cuda", dtype=torch.int32)
        xp, dt, st = ops.permute_qdq(torch.empty(40, 64, device="cuda", dtype=torch.bfloat16), src, "rceil")
        assert (xp.shape, xp.dtype, dt.shape, dt.dtype, st.shape, st.dtype) == (
            (96, 64), torch.bfloat16, (64, 96), torch.float8_e4m3fn, (64, 3), torch.float8_e8m0fnu)


# ------------------------------------------------------------------------------------------------
# GPU: the kernels on CUDA, and the expert linear layer on the expansion route
# ------------------------------------------------------------------------------------------------
def _gpu_inputs(shape, dtype, seed=0):
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_quantize_kernels import wide_randn, with_special_blocks

    gen = torch.Generator().manual_seed(seed)
    x = with_special_blocks(with_special_blocks(wide_randn(shape, dtype, "cpu", gen), -1), -2)
    x.view(-1, shape[-1])[1, :32] = (torch.linspace(-1, 1, 32) * 2.0**-133).to(dtype)  # BF16-subnormal products
    x.view(-1, shape[-1])[1, 7] = 2.0**-118
    return x.cuda()


def _same(got, want, what):
    import torch

    g, w = got.contiguous().view(torch.uint8).cpu(), want.contiguous().view(torch.uint8).cpu()
    assert g.shape == w.shape and torch.equal(g, w), f"{what}: {int((g != w).sum())} bytes differ"


def _same_bf16(got, want, what):  # equal values, NaN where NaN (payload bits may differ)
    import torch

    got, want = got.cpu(), want.cpu()
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: NaN positions"
    _same(got.nan_to_num(), want.nan_to_num(), what)


@pytest.mark.gpu
@pytest.mark.parametrize("rule", ["rceil", "floor"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("shape", [(96, 160), (3, 64, 96), (4096, 2048)])
def test_gpu_qdq_kernels_bit_exact(shape, dtype, rule):
    """Each QDQ output against quantize (CUDA kernels) then dequantize_bf16 on CUDA, and against the
    CPU reference quantizer's FP32 values rounded to BF16 (subnormal products included)."""
    import torch

    from mxmoe import formats
    from mxmoe.kernels import qdq as QDQ, quantize as Q
    from mxmoe.kernels.dequantize import dequantize_bf16

    x = _gpu_inputs(shape, getattr(torch, dtype))
    d, s, dt, st = Q.quantize_dual(x, rule)
    row, col = dequantize_bf16(d, s), dequantize_bf16(dt, st)  # col: [.., K, M]
    _same_bf16(QDQ.qdq_rowwise(x, rule), row, "rowwise")
    _same_bf16(QDQ.qdq_rowwise(x[..., :-32], rule), dequantize_bf16(*Q.quantize_rowwise(x[..., :-32], rule)),
               "rowwise, strided view")
    xb, qt, qst = QDQ.qdq_dual(x, rule)
    _same_bf16(xb, row, "dual bf16")
    _same(qt, dt, "dual data_t")
    _same(qst, st, "dual scale_t")
    xb, xbt = QDQ.qdq_dual_bf16(x, rule)
    _same_bf16(xb, row, "dual_bf16 row")
    _same_bf16(xbt, col, "dual_bf16 col")
    _same_bf16(QDQ.qdq_columnwise(x, rule), col, "columnwise")
    d2, s2, dt2, st2 = Q.quantize_32x32(x, rule)
    _same_bf16(QDQ.qdq_rowwise(x, rule, tile32=True), dequantize_bf16(d2, s2), "rowwise 32x32")
    xb, qt, qst = QDQ.qdq_dual(x, rule, tile32=True)
    _same_bf16(xb, dequantize_bf16(d2, s2), "32x32 bf16")
    _same(qt, dt2, "32x32 data_t")
    _same(qst, st2, "32x32 scale_t")
    ref = formats.quantize(x.cpu(), -1, rule).dequantize(torch.float32).to(torch.bfloat16)
    _same_bf16(QDQ.qdq_rowwise(x, rule), ref, "rowwise vs CPU reference")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("shape", [(96, 160), (3, 64, 96), (4096, 2048), (2, 1536, 2048)])
def test_gpu_gluon_qdq_equals_triton(shape, dtype, monkeypatch):
    """qdq_dual / qdq_columnwise / qdq_dual_bf16 through the Gluon kernel (sm_90; FP32 too, the layer's weights) equal the
    Triton kernel (MXMOE_QUANT_GLUON=0) bit for bit, and the columnwise BF16 values equal the CPU
    reference's."""
    import torch

    from mxmoe import formats
    from mxmoe.kernels import qdq as QDQ, quantize_launch as QL

    x = _gpu_inputs(shape, getattr(torch, dtype))
    if not QL._use_gluon(x if x.dim() == 3 else x[None]):
        pytest.skip("the Gluon kernel is not used on this GPU")
    for rule in ("rceil", "floor"):
        got = QDQ.qdq_dual(x, rule) + (QDQ.qdq_columnwise(x, rule),) + QDQ.qdq_dual_bf16(x, rule)
        monkeypatch.setenv("MXMOE_QUANT_GLUON", "0")
        want = QDQ.qdq_dual(x, rule) + (QDQ.qdq_columnwise(x, rule),) + QDQ.qdq_dual_bf16(x, rule)
        monkeypatch.delenv("MXMOE_QUANT_GLUON")
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            (_same_bf16 if g.dtype == torch.bfloat16 else _same)(g, w, f"output {i} {rule}: Gluon vs Triton")
        col = formats.quantize(x.cpu(), -2, rule).dequantize(torch.float32).to(torch.bfloat16).mT
        _same_bf16(got[-1], col, f"dual_bf16 col vs CPU reference {rule}")


def _layer_run(x, w, offs, recipe, x_mx=None):
    import torch

    from mxmoe.ops import grouped_linear

    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    y = grouped_linear(x, w, offs, recipe, x_mx=x_mx)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).to(y))
    return [t.detach() for t in (y, x.grad, w.grad)]


def _layer_step(m, x):
    """One fwd+bwd of MoE m on x: (y, dx, dw13, dw2, drouter), gradients cleared after."""
    xx = x.detach().requires_grad_()
    y = m(xx)
    y.float().square().sum().backward()
    out = [t.detach().clone() for t in (y, xx.grad, m.w13.grad, m.w2.grad, m.router.weight.grad)]
    m.zero_grad()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_2d", "mxfp8_bf16_wgrad"])
@pytest.mark.parametrize("rows", [448, 430])  # 430: rows past the last group (a row count not a multiple of 32)
def test_gpu_layer_qdq_route_equals_old_composition(recipe, rows, monkeypatch):
    """grouped_linear on the expansion route with the QDQ kernels gives the same bits (y, dx, dW)
    as quantize-then-expand (the same BF16 operands into the same torch._grouped_mm calls)."""
    import torch

    from mxmoe import ops

    from mxmoe.ops import activation, linear, tokens as ops_tokens  # noqa: F401

    monkeypatch.setenv("MXMOE_SM90_GEMM", "bf16")
    sizes = [0, 96, 0, 160, 32, 128, 0]
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32).cuda()
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(rows, 256, generator=g)).to(torch.bfloat16).cuda()
    w = (torch.randn(len(sizes), 192, 256, generator=g) / 16).cuda()
    assert linear._expansion(x, w, mxmoe_recipe(recipe), resolve(x.device)) is not None
    new = _layer_run(x, w, offs, recipe)
    monkeypatch.setattr(linear, "_expansion", lambda *a: None)
    old = _layer_run(x, w, offs, recipe)
    for a, b, what in zip(new, old, ("y", "dx", "dw")):
        _same_bf16(a, b, f"{recipe} {what}")


def mxmoe_recipe(name):
    from mxmoe.recipes import get_recipe

    return get_recipe(name)


@pytest.mark.gpu
def test_gpu_layer_qdq_route_prequantized_input_and_reference(monkeypatch):
    """x_mx given (expert-parallel dispatch), and the route against the CPU reference layer."""
    import torch

    import mxmoe
    from mxmoe import ops
    from mxmoe.ops import activation, linear, tokens as ops_tokens  # noqa: F401

    monkeypatch.setenv("MXMOE_SM90_GEMM", "bf16")
    sizes = [64, 0, 192]
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(256, 128, generator=g)
    w = torch.randn(3, 96, 128, generator=g) / 8
    xq = mxmoe.quantize(x.cuda().to(torch.bfloat16))
    x16 = xq.dequantize(torch.bfloat16)
    new = _layer_run(x16, w.cuda(), offs.cuda(), "mxfp8", x_mx=xq)
    monkeypatch.setattr(linear, "_expansion", lambda *a: None)
    old = _layer_run(x16, w.cuda(), offs.cuda(), "mxfp8", x_mx=xq)
    for a, b, what in zip(new, old, ("y", "dx", "dw")):
        _same_bf16(a, b, f"x_mx {what}")
    ref = _layer_run(x.to(torch.bfloat16), w, offs, "mxfp8")  # CPU reference path
    gpu = _layer_run(x.to(torch.bfloat16).cuda(), w.cuda(), offs.cuda(), "mxfp8")
    for a, b in zip(gpu, ref):
        rel = ((a.cpu().double() - b.double()).norm() / b.double().norm()).item()
        assert rel < 5e-2, rel  # BF16 product outputs on the GPU, FP32 on the CPU (see test_cuda_paths)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(96, 320), (16384, 2 * 768)])
def test_gpu_swiglu_qdq_equals_composition(shape):
    """The fused kernel's a (BF16 MX values) and FP8 copy against qdq_dual(F.silu(gate) * up):
    needs the kernel's silu to round like torch's CUDA silu (expf, IEEE division)."""
    import torch
    import torch.nn.functional as F

    from mxmoe.kernels import qdq as QDQ, quantize as Q, quantize_fused as QF

    g = torch.Generator().manual_seed(3)
    h = (torch.randn(*shape, generator=g) * 4).to(torch.bfloat16).cuda()
    gate, up = h.split(shape[1] // 2, -1)
    a = F.silu(gate) * up
    for rule in ("rceil", "floor"):
        want = QDQ.qdq_dual(a, rule)
        for save_h in (False, True):  # two tile configs (_TUNED "swiglu", "swiglu_save_h")
            got = QF.swiglu_qdq(h, rule, save_h)
            for x, y, what in zip(got, want, ("a bf16", "data_t", "scale_t")):
                _same(x, y, f"swiglu {what} {rule} save_h={save_h}")
        hq_data, hq_scale = Q.quantize_rowwise(h, rule)  # h kept for backward as MXFP8 (swiglu_input_fp8)
        _same(got[3], hq_data, f"swiglu h data {rule}")
        _same(got[4], hq_scale, f"swiglu h scale {rule}")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_2d"])
def test_gpu_moe_qdq_route_equals_old_composition(recipe, monkeypatch):
    """The MoE layer (QDQ kernels + fused SwiGLU) against quantize + expand with torch's SwiGLU:
    output and all gradients bit for bit."""
    import torch

    import mxmoe
    from mxmoe import ops
    from mxmoe.ops import activation, linear, tokens as ops_tokens  # noqa: F401

    monkeypatch.setenv("MXMOE_SM90_GEMM", "bf16")
    torch.manual_seed(0)
    m = mxmoe.MoE(256, 512, 8, 2, recipe=recipe).cuda()
    x = torch.randn(2, 300, 256, device="cuda", dtype=torch.bfloat16)

    new = _layer_step(m, x)
    monkeypatch.setattr(linear, "_expansion", lambda *a: None)
    old = _layer_step(m, x)
    for a, b, what in zip(new, old, ("y", "dx", "dw13", "dw2", "drouter")):
        _same_bf16(a, b, f"{recipe} {what}")


def _old_permute(x2, slot_rows, rows, top_k):
    """The expert-ordered buffer as MoE.permute built it before the fused kernel."""
    return x2.new_zeros(rows, x2.shape[1]).index_copy(0, slot_rows, x2.repeat_interleave(top_k, dim=0))


@pytest.mark.gpu
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("tokens,dim", [(300, 256), (4133, 2048)])
def test_gpu_permute_qdq_equals_composition(tokens, dim, top_k):
    """The fused permute + dual QDQ kernel against qdq_dual of the old permuted buffer (special
    blocks, empty experts, T not a multiple of 32, a row-strided view, fp32 input); the autograd
    function's gradient against autograd of the old permute (top_k 8: CUDA's summation order)."""
    import torch

    from mxmoe import ops

    from mxmoe.ops import activation, linear, tokens as ops_tokens  # noqa: F401
    from mxmoe.kernels import qdq as QDQ, quantize_fused as QF
    from mxmoe.moe import permute_plan

    E = 16
    g = torch.Generator().manual_seed(4)
    experts = torch.stack([torch.randperm(E - 3, generator=g)[:top_k] for _ in range(tokens)]).cuda()  # 3 empty
    slot_rows, _, M, _ = permute_plan(experts, E, 32)
    src = torch.full((M,), -1, dtype=torch.int32, device="cuda")
    src[slot_rows] = (torch.arange(slot_rows.numel(), device="cuda") // top_k).to(torch.int32)
    for dtype in (torch.bfloat16, torch.float32):
        x2 = _gpu_inputs((tokens, dim), dtype)
        for xv in (x2, torch.cat([x2, x2], 1)[:, dim:]):
            for rule in ("rceil", "floor"):
                got, want = QF.permute_qdq(xv, src, rule), QDQ.qdq_dual(_old_permute(xv, slot_rows, M, top_k), rule)
                for a, b, what in zip(got, want, ("bf16", "data_t", "scale_t")):
                    _same(a, b, f"permute_qdq {what} {dtype} {rule}")
    x2 = torch.randn(tokens, dim, generator=g).to(torch.bfloat16).cuda().requires_grad_()
    dxp = torch.randn(M, dim, generator=g).to(torch.bfloat16).cuda()
    xp16, _, _ = ops_tokens._PermuteQDQ.apply(x2, slot_rows, M, top_k, "rceil", resolve(x2.device))
    (got,) = torch.autograd.grad(xp16, x2, dxp)
    (want,) = torch.autograd.grad(_old_permute(x2, slot_rows, M, top_k), x2, dxp)
    _same(got, want, "permute backward")
    empty = QF.permute_qdq(x2[:0].detach(), torch.full((64,), -1, dtype=torch.int32, device="cuda"), "rceil")
    assert not empty[0].any() and not empty[1].view(torch.uint8).any() and not empty[2].view(torch.uint8).any()


@pytest.mark.gpu
@pytest.mark.parametrize("recipe,top_k", [("mxfp8", 2), ("mxfp8_2d", 2), ("mxfp8", 8)])
def test_gpu_moe_fused_permute_equals_unfused(recipe, top_k, monkeypatch):
    """The MoE layer with the fused permute + quantization kernel against the same layer with
    MXMOE_FUSED_PERMUTE=0 (repeat_interleave + index_copy, then qdq_dual in grouped_linear):
    output and all gradients bit for bit; checks the fused kernel ran (and only when enabled)."""
    import torch

    import mxmoe
    from mxmoe.kernels import dispatch

    monkeypatch.setenv("MXMOE_SM90_GEMM", "bf16")
    calls = []
    fused = dispatch.permute_qdq
    monkeypatch.setattr(dispatch, "permute_qdq", lambda *a: calls.append(1) or fused(*a))
    torch.manual_seed(0)
    m = mxmoe.MoE(256, 512, 16, top_k, recipe=recipe).cuda()
    x = torch.randn(2, 300, 256, device="cuda", dtype=torch.bfloat16)

    new = _layer_step(m, x)
    assert len(calls) == 1
    monkeypatch.setenv("MXMOE_FUSED_PERMUTE", "0")
    old = _layer_step(m, x)
    assert len(calls) == 1
    for a, b, what in zip(new, old, ("y", "dx", "dw13", "dw2", "drouter")):
        _same_bf16(a, b, f"{recipe} top_k={top_k} {what}")
