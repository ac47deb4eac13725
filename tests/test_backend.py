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
        want = "sm90_128" if backend._has_sm90_128() else ("expansion" if choice == "auto" else None)
        if want:
            assert routes["fprop"] == routes["dgrad"] == want


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
