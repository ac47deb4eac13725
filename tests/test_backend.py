"""mxmoe.backend: the routes each recipe takes, decided in one place from the device and the switches."""

import pytest

from mxmoe import backend
from mxmoe.backend import Backend, resolve
from mxmoe.recipes import RECIPES

SM90 = dict(device="cuda:0", arch="sm90", kernels=True)


@pytest.mark.parametrize("choice, want", [
    ("auto", ("expansion", "expansion", "expansion")),
    ("bf16", ("expansion", "expansion", "expansion")),
    ("gluon", ("sm90", "sm90", "sm90")),
    ("mixed", ("sm90", "sm90", "expansion")),
])
def test_sm90_routes_of_the_1x32_recipes(choice, want):
    be = Backend(**SM90, sm90_gemm=choice)
    for name in ("mxfp8", "mxfp8_2d", "mxfp8_lowmem"):
        r = be.recipe_routes(RECIPES[name])
        assert (r["fprop"], r["dgrad"], r["wgrad"]) == want, name
        assert be.expansion(RECIPES[name]) == (choice in ("auto", "bf16")), name
    assert be.recipe_routes(RECIPES["mxfp8_bf16_wgrad"])["wgrad"] == "torch._grouped_mm (bfloat16)"


def test_128_recipe_never_takes_the_expansion_qdq_kernels():
    """mxfp8_128's operands are FP8 for its own kernel where it is built; the 1x32 QDQ kernels
    (BF16-writing, 32-element groups) never serve it."""
    for choice in ("auto", "gluon", "mixed"):
        be = Backend(**SM90, sm90_gemm=choice)
        assert not be.expansion(RECIPES["mxfp8_128"])
        routes = be.recipe_routes(RECIPES["mxfp8_128"])
        assert routes == dict.fromkeys(("fprop", "dgrad", "wgrad"), "sm90_128")


def test_other_devices():
    cpu = resolve("cpu")
    assert cpu.arch == "cpu" and all(v == "reference" for v in cpu.recipe_routes(RECIPES["mxfp8"]).values())
    assert Backend("cuda:0", "sm100", True).gemm_route(False, (1, 32), (1, 32)) == "sm100"
    assert Backend("cuda:0", "cuda", True).gemm_route(True, (1, 32), (1, 32)) == "reference"
    assert "mxfp8_128" in backend.describe("cpu")


def test_switches_are_read_by_resolve(monkeypatch):
    monkeypatch.setenv("MXMOE_SM90_GEMM", "mixed")
    assert resolve("cpu").sm90_gemm == "mixed"
    monkeypatch.setenv("MXMOE_SM90_GEMM", "fast")
    with pytest.raises(ValueError, match="MXMOE_SM90_GEMM must be one of"):
        resolve("cpu")


def test_fused_kernel_switches_on_sm90(monkeypatch):
    """On an sm_90 GPU (capability stubbed) the fused combine backward is on unless MXMOE_FUSED_COMBINE=0, and
    the fused SwiGLU backward is opt-in: on for MXMOE_FUSED_SWIGLU_BWD=1 alone."""
    monkeypatch.setattr(backend, "capability", lambda index: (9, 0))
    monkeypatch.setattr(backend, "triton_available", lambda: True)
    backend._resolve.cache_clear()
    try:
        for env, combine, swiglu_bwd in (({}, True, False), ({"MXMOE_FUSED_SWIGLU_BWD": "1"}, True, True),
                                         ({"MXMOE_FUSED_SWIGLU_BWD": "yes", "MXMOE_FUSED_COMBINE": "0"}, False, False)):
            for name in ("MXMOE_FUSED_SWIGLU_BWD", "MXMOE_FUSED_COMBINE"):
                monkeypatch.delenv(name, raising=False)
            for name, value in env.items():
                monkeypatch.setenv(name, value)
            be = resolve("cuda:0")
            assert be.arch == "sm90" and (be.fused_combine, be.fused_swiglu_bwd) == (combine, swiglu_bwd), env
    finally:
        backend._resolve.cache_clear()


def test_dispatch_sends_128_operands_to_the_promote_per_128_kernel(monkeypatch):
    """On sm_90, 1x128 x 128x128 (M-grouped) and 128x1 x 128x1 (K-grouped) operands go to the mx128
    ops whatever MXMOE_SM90_GEMM says; 1x32 operands keep their route (kernels stubbed, CPU)."""
    from types import SimpleNamespace

    import torch

    import mxmoe
    from mxmoe.kernels import dispatch

    calls = []
    rec = lambda name: (lambda *a: calls.append(name))  # noqa: E731
    monkeypatch.setattr(dispatch, "_ops", lambda: SimpleNamespace(
        sm90_m_grouped_gemm=rec("m32"), sm90_k_grouped_gemm=rec("k32"),
        sm90_mx128_m_grouped_gemm=rec("m128"), sm90_mx128_k_grouped_gemm=rec("k128")))
    monkeypatch.setattr(dispatch, "bf16_grouped_mm", rec("expansion"))
    offs = torch.tensor([128, 256], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    x, w, dy = torch.randn(256, 128, generator=g), torch.randn(2, 128, 128, generator=g), torch.randn(256, 128, generator=g)
    for choice in ("auto", "gluon"):
        be = Backend(**SM90, sm90_gemm=choice)
        dispatch.mx_grouped_mm_cuda(mxmoe.quantize(x, block=128), mxmoe.quantize(w, block=(128, 128)).mT, offs,
                                    torch.bfloat16, be)
        dispatch.mx_grouped_mm_cuda(mxmoe.quantize(dy, 0, block=128).mT, mxmoe.quantize(x, 0, block=128), offs,
                                    torch.float32, be)
        dispatch.mx_grouped_mm_cuda(mxmoe.quantize(x), mxmoe.quantize(w).mT, offs, torch.bfloat16, be)
    assert calls == ["m128", "k128", "expansion", "m128", "k128", "m32"]


def test_cli_info_prints_every_recipe(capsys):
    from mxmoe.cli import main

    assert main(["info", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in RECIPES) and "device cpu" in out
    with pytest.raises(SystemExit) as e:
        main(["info", "--device", "nope"])
    assert e.value.code == 2


def test_sm_count_stands_in_for_an_h100_without_a_gpu():
    """The persistent grids' SM count: 132 (H100 SXM / H200) where no GPU runs the kernel (the interpreter)."""
    import torch
    assert backend.sm_count(torch.device("cpu")) == backend.SM_COUNT_STAND_IN == 132


@pytest.mark.gpu
def test_gpu_sm_count_is_the_device_s():
    import torch
    want = torch.cuda.get_device_properties(0).multi_processor_count
    assert backend.sm_count(torch.device("cuda")) == backend.sm_count(torch.device("cuda", 0)) == want
