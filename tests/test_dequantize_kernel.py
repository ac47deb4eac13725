"""The Triton MXFP8 -> BF16 expansion under TRITON_INTERPRET=1 (CPU), in a subprocess so the
interpreter flag is set before triton is imported."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHECK = r"""
import torch, mxmoe
from mxmoe.kernels.dequantize import dequantize_bf16
g = torch.Generator().manual_seed(0)
x = torch.randn(3, 40, 96, generator=g) * torch.exp2(torch.randint(-20, 20, (3, 40, 1), generator=g).float())
x[0, 1, 5] = float("nan"); x[1, :, :32] = 0.0; x[2, 3, 32:64] = float("-inf")
q = mxmoe.quantize(x)
got = dequantize_bf16(q.data, q.scale)
ref = q.dequantize(torch.float32).to(torch.bfloat16)
assert got.shape == x.shape and got.dtype == torch.bfloat16
assert torch.equal(got.isnan(), ref.isnan()), "NaN blocks"
# normal range only: the interpreter's numpy FP32 path differs from the GPU for FP32-subnormal
# products (below 2^-126), which the GPU test checks
assert torch.equal(got.nan_to_num(), ref.nan_to_num()), "values"
print("ok")
"""


def test_dequantize_bf16_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", CHECK], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]
