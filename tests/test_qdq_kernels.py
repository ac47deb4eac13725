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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHECK = r"""
import sys, torch
sys.path.insert(0, "tests")
from test_quantize_kernels import wide_randn, with_special_blocks
from mxmoe import formats
from mxmoe.kernels import quantize as Q
from mxmoe.kernels.dequantize import dequantize_bf16

gen = torch.Generator().manual_seed(0)

def same(got, want, what):
    g, w = got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
    assert g.shape == w.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    bad = (g != w).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} bytes differ, first at {bad[0].tolist()}"

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
            same(Q.qdq_rowwise(x, rule), expand(formats.quantize(x, -1, rule)), f"rowwise {dtype} {rule}")
            n += 1
        for x in (inputs((96, 160), dtype, True), inputs((2, 64, 96), dtype, True)):
            r, c = formats.quantize(x, -1, rule), formats.quantize(x, -2, rule)
            # dual: BF16 along K + FP8 along M (quantize_columnwise's layout)
            xb, dt, st = Q.qdq_dual(x, rule)
            same(xb, expand(r), f"dual bf16 {dtype} {rule}")
            same(dt, c.data.mT, f"dual data_t {dtype} {rule}")
            same(st, c.scale.mT, f"dual scale_t {dtype} {rule}")
            # dual BF16: along K and along M (transposed)
            xb, xbt = Q.qdq_dual_bf16(x, rule)
            same(xb, expand(r), f"dual_bf16 row {dtype} {rule}")
            same(xbt, expand(c).mT, f"dual_bf16 col {dtype} {rule}")
            # 32x32 tiles (weights): BF16 along K + the transposed FP8 copy
            r2, c2 = formats.quantize(x, -1, rule, (32, 32)), formats.quantize(x, -2, rule, (32, 32))
            xb, dt, st = Q.qdq_dual(x, rule, tile32=True)
            same(xb, expand(r2), f"32x32 bf16 {dtype} {rule}")
            same(xb, expand(c2), f"32x32 bf16 == along-N values {dtype} {rule}")
            same(dt, c2.data.mT, f"32x32 data_t {dtype} {rule}")
            same(st, c2.scale.mT, f"32x32 scale_t {dtype} {rule}")
            n += 1
# against MXTensor.dequantize where the FP32 products are normal (the interpreter's FP32 -> BF16
# conversion of FP32 subnormals differs from the GPU's; the GPU tests cover them)
x = inputs((64, 96), torch.float32, True)
xb = Q.qdq_rowwise(x)
ref32 = formats.quantize(x).dequantize(torch.float32)
ref = ref32.to(torch.bfloat16)
normal = ref32.isfinite() & ((ref32.abs() >= 2.0**-126) | (ref32 == 0))
assert torch.equal(xb.isnan(), ref.isnan()) and torch.equal(xb[normal], ref[normal]), "vs MXTensor.dequantize"
print("ok", n)
"""


def test_qdq_kernels_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", CHECK], env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
