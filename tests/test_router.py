"""The router's FP32 product (mxmoe.ops.router): the three-piece BF16 split of the weight, the Triton
kernels against FP64 references (under Triton's interpreter on the CPU, on the device with CUDA), and the
autograd function against ``F.linear`` of FP32 copies."""

import pytest
import torch
import torch.nn.functional as F

from mxmoe.ops.router import router_logits
from test_qdq_kernels import run_interpreted

gpu = pytest.mark.gpu


def split_bf16(w: torch.Tensor) -> torch.Tensor:
    """Reference of the pieces (``mxmoe.kernels.layer.split_bf16``) in torch: each the nearest BF16 of
    what the pieces before it leave."""
    w = w.float()
    hi = w.to(torch.bfloat16)
    rest = w - hi.float()
    mid = rest.to(torch.bfloat16)
    return torch.stack([hi, mid, (rest - mid.float()).to(torch.bfloat16)])


def check_split(device: str) -> None:
    """The split kernel: the reference's pieces bit for bit, their FP32 sum exactly w, each piece below the
    ulp of the one before; BF16 input gives (w, 0, 0). Raises AssertionError."""
    from mxmoe.kernels import layer

    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 300, generator=g) * torch.exp2(torch.randint(-100, 100, (64, 300), generator=g).float())
    w[0, :4] = torch.tensor([0.0, -0.0, 1.0 + 2.0**-23, -(2.0**-126)])
    p = layer.split_bf16(w.to(device)).cpu()
    assert p.shape == (3, 64, 300) and p.dtype == torch.bfloat16
    assert torch.equal(p.view(torch.int16), split_bf16(w).view(torch.int16))
    assert torch.equal((p[0].float() + p[1].float()) + p[2].float(), w)
    assert (p[1].float().abs() <= p[0].float().abs() * 2.0**-8).all()  # each piece below the last one's ulp
    b = w[:, :7].to(torch.bfloat16)
    pb = layer.split_bf16(b.t().to(device)).cpu()  # a transposed view: split in its logical order
    assert torch.equal(pb[0], b.t()) and not pb[1:].float().any()


def test_split_bf16_reference_is_exact():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 300, generator=g) * torch.exp2(torch.randint(-100, 100, (64, 300), generator=g).float())
    p = split_bf16(w)
    assert torch.equal((p[0].float() + p[1].float()) + p[2].float(), w)


def test_cpu_router_is_fp32_linear():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 48, generator=g).to(torch.bfloat16).requires_grad_()
    w = torch.randn(6, 48, generator=g, requires_grad=True)
    out = router_logits(x, w)
    assert out.dtype == torch.float32 and torch.equal(out, F.linear(x.float(), w))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert router_logits(x, w).dtype == torch.float32


@pytest.mark.parametrize("x, w, err, match", [
    (torch.randn(16), torch.randn(4, 16), ValueError, r"x \[T, D\] and w \[E, D\], got x \(16,\)"),
    (torch.randn(8, 16), torch.randn(16), ValueError, r"got x \(8, 16\) and w \(16,\)"),
    (torch.randn(2, 4, 16), torch.randn(4, 16), ValueError, r"got x \(2, 4, 16\)"),
    (torch.randn(8, 16), torch.randn(16, 4), ValueError, r"and w \(16, 4\)"),
    (torch.randn(8, 16).int(), torch.randn(4, 16), TypeError, "x must be a floating-point tensor, got torch.int32"),
    (torch.randn(8, 16), torch.ones(4, 16, dtype=torch.bool), TypeError, "w must be a floating-point tensor"),
    ([[1.0] * 16], torch.randn(4, 16), TypeError, "got list"),
    (torch.randn(8, 16), torch.randn(4, 16, device="meta"), ValueError, "one device, got cpu and meta"),
])
def test_router_logits_rejects_bad_input(x, w, err, match):
    with pytest.raises(err, match=match):
        router_logits(x, w)


def test_router_logits_rejects_a_backend_that_is_not_one():
    with pytest.raises(TypeError, match="backend must be a mxmoe.backend.Backend or None, got str"):
        router_logits(torch.randn(8, 16), torch.randn(4, 16), backend="cuda")


def test_router_logits_traces_on_meta():
    assert router_logits(torch.randn(8, 16, device="meta"), torch.randn(4, 16, device="meta")).shape == (8, 4)


def test_moe_on_another_device_than_its_input_is_an_error():
    import mxmoe

    m = mxmoe.MoE(64, 64, 4, 2, recipe="mxfp8").to("meta")  # e.g. built under torch.device("meta"), never materialized
    with pytest.raises(ValueError, match="one device, got cpu and meta"):
        m(torch.randn(16, 64))


def test_router_kernels_refuse_too_many_experts():
    from mxmoe.kernels import layer

    with pytest.raises(ValueError, match="1 to 128 experts, got 129"):
        layer.router_logits(torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(3, 129, 64, dtype=torch.bfloat16))


def bf16_of_fp32_sum_bound(want: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """How far one BF16 rounding of an FP32-accurate sum may lie from the exact sum ``want``: one BF16 ulp
    (the nearest BF16 or, near a tie, its neighbour) plus the FP32 sum's own error, here 2^-20 of the sum of
    the terms' magnitudes (a generous bound for the tensor cores' coarser FP32 sums; it matters only where
    the terms cancel)."""
    ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-30)))) * 2.0**-7
    return ulp * (1 + 2.0**-6) + magnitude * 2.0**-20


def check_kernels(device: str) -> None:
    """The three kernels; raises AssertionError. Exact cases first: with one-hot tokens (logits, dw) or
    one-hot power-of-two logit gradients (dx) every output is a single product, so any correct FP32 path
    gives it bit for bit, whatever its summation order (a missing BF16 piece shows at once). Then random
    operands against FP64: the tensor cores' FP32 sums round coarser than cuBLAS's SGEMM (H200: a few
    1e-6 relative), so the bound is 1e-5 (a missing third piece is ~1e-5, a missing second ~2e-3)."""
    from mxmoe.kernels import layer

    g = torch.Generator().manual_seed(2)
    for D, E in [(200, 8), (96, 20), (128, 128), (64, 100)]:
        w = torch.randn(E, D, generator=g) * torch.exp2(torch.randint(-30, 30, (E, D), generator=g).float())
        w3 = split_bf16(w).to(device)
        eye = torch.eye(D, dtype=torch.bfloat16)[torch.randperm(D, generator=g)]  # token t: channel perm[t]
        got = layer.router_logits(eye.to(device), w3).cpu()
        assert torch.equal(got, eye.float() @ w.T), f"logits of one-hot tokens {D}x{E}"
        s = torch.exp2(torch.randint(-20, 20, (E,), generator=g).float())
        got = layer.router_dx(torch.diag(s).to(device), w3).cpu()
        assert torch.equal(got, (s[:, None] * w).to(torch.bfloat16)), f"dx of one-hot gradients {D}x{E}"
        dl = torch.randn(D, E, generator=g) * torch.exp2(torch.randint(-20, 20, (D, E), generator=g).float())
        got = layer.router_dw(layer.split_bf16(dl.to(device)), eye.to(device)).cpu()
        assert torch.equal(got, dl.T @ eye.float()), f"dw of one-hot tokens {D}x{E}"
    for T, D, E in [(77, 200, 8), (130, 96, 20), (64, 128, 128), (33, 64, 100), (600, 1024, 16), (0, 64, 8)]:
        x = (torch.randn(T, D, generator=g) * 3).to(torch.bfloat16)
        w = torch.randn(E, D, generator=g) * 0.05
        dl = torch.randn(T, E, generator=g) * torch.exp2(torch.randint(-20, 20, (T, E), generator=g).float())
        w3 = split_bf16(w)
        x_d, w3_d, dl_d = x.to(device), w3.to(device), dl.to(device)
        rel = lambda a, b: ((a.double() - b).norm() / b.norm().clamp_min(1e-300)).item()  # noqa: E731
        got = layer.router_logits(x_d, w3_d).cpu()
        assert got.shape == (T, E) and got.dtype == torch.float32
        err = rel(got, x.double() @ w.double().T)
        assert T == 0 or err < 1e-5, f"logits {T}x{D}x{E}: rel err {err:.1e}"
        dx = layer.router_dx(dl_d, w3_d).cpu()
        want_dx = dl.double() @ w.double()
        assert dx.shape == (T, D) and dx.dtype == torch.bfloat16
        assert ((dx.double() - want_dx).abs() <= bf16_of_fp32_sum_bound(want_dx, dl.double().abs() @ w.double().abs())).all(), \
            f"dx {T}x{D}x{E}"
        dw = layer.router_dw(layer.split_bf16(dl_d), x_d).cpu()
        assert dw.shape == (E, D) and dw.dtype == torch.float32
        err = rel(dw, dl.double().T @ x.double())
        assert (T == 0 and torch.equal(dw, torch.zeros(E, D))) or err < 1e-5, f"dw {T}x{D}x{E}: rel err {err:.1e}"


_SCRIPT = """
from tests.test_router import check_kernels, check_split
check_split("cpu")
check_kernels("cpu")
print("ok")
"""


def test_router_kernels_interpreted():
    run_interpreted(_SCRIPT)


@gpu
def test_gpu_router_kernels():
    check_split("cuda")
    check_kernels("cuda")


@gpu
@pytest.mark.parametrize("T, D, E", [(4096, 1024, 8), (4096, 1024, 128), (16384, 2048, 128),  # Qwen3's router
                                     # Mixtral's and DeepSeek-V3 EP 8's: dw's longest token splits (H100,
                                     # 2026-12-06: 4.5e-6 and 7.7e-6 against FP64; 1.1e-5 and 1.8e-5 at 8ed0f69)
                                     (16384, 4096, 8), (16384, 7168, 32),
                                     (4096, 1024, 160)])  # 160: the F.linear path
def test_gpu_router_autograd_matches_fp32_linear(T, D, E):
    """The fast path against ``F.linear`` of FP32 copies (cuBLAS SGEMM, TF32 off): logits and dw within
    1e-5 (both FP32 sums, the tensor cores' coarser), dx the same BF16 values or, near a tie, neighbours."""
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(T, D, generator=g)).to(torch.bfloat16).cuda().requires_grad_()
    w = (torch.randn(E, D, generator=g) * 0.03).cuda().requires_grad_()
    dl = torch.randn(T, E, generator=g).cuda()
    out = router_logits(x, w)
    (dx, dw) = torch.autograd.grad(out, (x, w), dl)
    ref = F.linear(x.float(), w)
    (rdx, rdw) = torch.autograd.grad(ref, (x, w), dl)
    rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()  # noqa: E731
    assert rel(out, ref) < 1e-5 and rel(dw, rdw) < 1e-5, (rel(out, ref), rel(dw, rdw))
    want = dl.double() @ w.detach().double()
    bound = bf16_of_fp32_sum_bound(want, dl.double().abs() @ w.detach().double().abs())
    assert dx.dtype == torch.bfloat16 and ((dx.double() - want).abs() <= bound).all()
    assert (dx != rdx).float().mean().item() < 1e-2
