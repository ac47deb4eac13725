"""Which kernels run: one :class:`Backend` per device, resolved from the device and the switches.

This is the only module that reads the device's capability, whether Triton is importable, and the
environment switches:

==========================  =========================================================================
``MXMOE_SM90_GEMM``         Hopper route of the 1x32 / 32x32 MX products: ``auto`` (default, the BF16
                            expansion), ``bf16`` (the same), ``gluon`` (our FP8 wgmma kernel for all three
                            products) or ``mixed`` (our kernel for fprop/dgrad, the expansion for wgrad).
                            ``mxfp8_128`` operands take the promote-per-128 kernel whenever it is built.
``MXMOE_LAYER_KERNELS``     ``0``: the torch ops instead of the layer kernels (gather, combine, SwiGLU, cast)
``MXMOE_FUSED_PERMUTE``     ``0``: no fused permutation + quantize-dequantize on the expansion route
``MXMOE_FUSED_COMBINE``     ``0``: the top-k combine's backward and dy's dual FP8 quantization as two kernels
                            (``mxfp8_128`` on sm_90), not one
``MXMOE_FUSED_SWIGLU_BWD``  ``1``: the up projection and SwiGLU as one autograd Function whose backward runs
                            SwiGLU's gradient fused with dh's dual FP8 quantization (``mxfp8_128`` on sm_90);
                            off by default (every other value): bit-identical, but slower than the two
                            kernels at Qwen3-30B-A3B's shape (benchmarks/results/h100/swiglu_backward.json)
``MXMOE_QUANT_GLUON``       ``0``: the Triton columnwise quantization kernels instead of the Gluon ones (sm_90)
``TRITON_INTERPRET``        ``1``: Triton's interpreter (kernels on CPU tensors; tests only)
==========================  =========================================================================

Switches act on CUDA only and are off only for the exact value ``0`` (``MXMOE_FUSED_SWIGLU_BWD``: on only for ``1``). A layer resolves its backend
once per forward (:func:`resolve`, cached per device and switch values) and hands it to every op it
calls; autograd functions keep the forward's backend for their backward, so both see the same routes.
``python -m mxmoe info`` prints the routes of every recipe on this machine (:func:`describe`).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

SM90_GEMM_CHOICES = ("auto", "bf16", "gluon", "mixed")

# Routes of one MX grouped product (``Backend.gemm_route``):
#   "reference"  pure torch: dequantize, FP32 matmul per group (CPU, GPUs without a fast path)
#   "expansion"  exact BF16 expansion of the MX operands + BF16 torch._grouped_mm (Hopper)
#   "sm90"       our Gluon FP8 wgmma kernel, promotion per 32 (Hopper)
#   "sm90_128"   our Gluon FP8 wgmma kernel, promotion per 128 (Hopper, mxfp8_128 operands)
#   "sm100"      PyTorch's block-scaled grouped product (Blackwell; untested on hardware)


@functools.lru_cache(maxsize=None)
def capability(index: int) -> tuple[int, int]:
    """``(major, minor)`` compute capability of CUDA device ``index`` (cached)."""
    return torch.cuda.get_device_capability(index)


SM_COUNT_STAND_IN = 132  # H100 SXM / H200: what sm_count answers where no GPU runs the kernel (CPU, interpreter)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (cached per CUDA device): the persistent kernels' grid size.

    A CPU device (the Triton interpreter) answers :data:`SM_COUNT_STAND_IN`, so interpreted runs take the grids of
    an H100 / H200."""
    if device.type != "cuda":
        return SM_COUNT_STAND_IN
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Whether Triton imports here (the kernels' compiler; optional for ``import mxmoe``)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """Whether Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _switch_on(name: str) -> bool:
    return os.environ.get(name, "1") != "0"


def _sm90_gemm_choice() -> str:
    choice = os.environ.get("MXMOE_SM90_GEMM", "auto")
    if choice not in SM90_GEMM_CHOICES:
        raise ValueError(f"MXMOE_SM90_GEMM must be one of {', '.join(repr(c) for c in SM90_GEMM_CHOICES)}, "
                         f"got {choice!r}")
    return choice


# Device types whose autocast state torch can report (``torch.is_autocast_enabled`` raises for others, e.g.
# ``meta``). A constant, not ``torch.amp.is_autocast_available``: torch 2.11's Dynamo cannot trace that
# builtin, so calling it inside ``MoE.forward`` broke every compiled graph there (tests/test_compile.py).
AUTOCAST_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "maia", "xla")


def autocast_dtype(device_type: str) -> "torch.dtype | None":
    """The autocast dtype when autocast is on for ``device_type`` here, else None (also for device types
    without autocast, e.g. ``meta``). Traceable by torch.compile."""
    if device_type in AUTOCAST_DEVICE_TYPES and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


@dataclass(frozen=True)
class Backend:
    """The kernels that serve tensors on one device (a value: compare, print, keep in autograd ctx).

    Attributes:
        device: ``"cpu"`` or ``"cuda:<index>"``.
        arch: ``"cpu"``, ``"sm90"`` (Hopper), ``"sm100"`` (Blackwell) or ``"cuda"`` (other GPUs).
        kernels: the Triton kernels run (CUDA with Triton importable).
        sm90_gemm: the ``MXMOE_SM90_GEMM`` choice (``auto`` / ``bf16`` / ``gluon`` / ``mixed``).
        layer_kernels: gather / combine / SwiGLU / cast kernels around the products.
        fused_permute: the fused permutation + quantize-dequantize kernel on the expansion route.
        quant_gluon: the Gluon columnwise quantization kernels (sm_90).
        fused_combine: the combine's backward fused with the down projection's dy quantization (``mxfp8_128``).
        fused_swiglu_bwd: SwiGLU's backward fused with the up projection's dy quantization (``mxfp8_128``).
    """

    device: str
    arch: str
    kernels: bool
    sm90_gemm: str = "auto"
    layer_kernels: bool = False
    fused_permute: bool = False
    quant_gluon: bool = False
    fused_combine: bool = False
    fused_swiglu_bwd: bool = False

    def gemm_route(self, k_grouped: bool, a_block: tuple[int, int], b_block: tuple[int, int]) -> str:
        """The route of an MX grouped product (see the module's route list): M-grouped (fprop,
        dgrad: ``a [M, K]`` x ``b [E, K, N]``) or K-grouped (wgrad); the operands' scale groups
        (``MXTensor.block``) pick the Hopper kernel."""
        if self.arch == "sm100":
            return "sm100"
        if self.arch != "sm90" or not self.kernels:
            return "reference"
        if a_block == (1, 128) and b_block == ((1, 128) if k_grouped else (128, 128)):
            return "sm90_128"
        if self.sm90_gemm == "gluon" or (self.sm90_gemm == "mixed" and not k_grouped):
            return "sm90"
        return "expansion"

    def recipe_routes(self, recipe) -> dict[str, str]:
        """``{"fprop": route, "dgrad": route, "wgrad": route}`` of a :class:`~mxmoe.recipes.Recipe`'s
        expert products here (``"bf16"`` / ``"fp32"`` for the plain recipes' torch products)."""
        if not recipe.mxfp8:
            plain = "torch._grouped_mm" if recipe.compute_dtype == "bfloat16" and self.arch != "cpu" else "reference"
            return dict.fromkeys(("fprop", "dgrad", "wgrad"), plain)
        a = (1, recipe.act_block)
        w = recipe.weight_group
        plain = "torch._grouped_mm" if self.arch != "cpu" else "reference"
        wgrad = self.gemm_route(True, a, a) if recipe.wgrad_mxfp8 else f"{plain} ({recipe.compute_dtype})"
        return {"fprop": self.gemm_route(False, a, w), "dgrad": self.gemm_route(False, a, w), "wgrad": wgrad}

    def grouped_scales(self, recipe) -> bool:
        """Whether ``recipe``'s M-grouped products (fprop, dgrad) take their activation operand from the
        grouped quantization kernel, which writes its scales in the per-group blocked layout the sm_100
        product reads (so no re-layout runs in torch): the sm_100 route with the Triton kernels, 1x32
        activation blocks (the kernel's only group)."""
        return self._sm100_kernels(recipe) and recipe.act_block == 32

    def blocked_weight_scales(self, recipe) -> bool:
        """Whether ``recipe``'s expert weights, along K for fprop and along N for dgrad, are quantized with
        their scales also written in the per-expert blocked layout the sm_100 product reads (so no
        re-layout runs in torch): the sm_100 route with the Triton kernels, 1x32 weight blocks (square
        tiles come from the two-orientation kernel, whose dgrad copy is saved for backward without it)."""
        return self._sm100_kernels(recipe) and recipe.weight_block == 1

    def _sm100_kernels(self, recipe) -> bool:
        """An MX recipe whose M-grouped products take the sm_100 route (every MX product does on sm_100,
        :meth:`gemm_route`), with the Triton quantization kernels on."""
        return recipe.mxfp8 and self.kernels and self.arch == "sm100"

    def expansion(self, recipe) -> bool:
        """Whether ``recipe``'s expert products all take the Hopper expansion route, so the QDQ
        kernels may write their BF16 operands directly (1x32 activations, 1x32 / 32x32 weights)."""
        if not (recipe.mxfp8 and self.kernels and recipe.act_block == 32 and recipe.weight_block in (1, 32)):
            return False
        routes = self.recipe_routes(recipe)
        return routes["fprop"] == routes["dgrad"] == "expansion" and routes["wgrad"] != "sm90"


@functools.lru_cache(maxsize=64)
def _resolve(device: str, index: int, sm90_gemm: str, layer_kernels: bool, fused_permute: bool,
             quant_gluon: bool, interp: bool, fused_combine: bool = True, fused_swiglu_bwd: bool = False) -> Backend:
    if device != "cuda":  # (Triton's interpreter runs the kernels on CPU tensors: tests call them directly)
        return Backend("cpu" if device == "cpu" else device, "cpu", interp and triton_available(), sm90_gemm)
    major, minor = capability(index)
    arch = "sm90" if (major, minor) == (9, 0) else "sm100" if major == 10 else "cuda"
    kernels = triton_available()
    return Backend(f"cuda:{index}", arch, kernels, sm90_gemm, kernels and layer_kernels,
                   kernels and fused_permute, kernels and arch == "sm90" and quant_gluon and not interp,
                   kernels and layer_kernels and fused_combine, kernels and layer_kernels and fused_swiglu_bwd)


def resolve(device: "torch.device | str") -> Backend:
    """The :class:`Backend` of ``device`` under the switches as they are now (cached per values).

    Raises:
        ValueError: ``MXMOE_SM90_GEMM`` set to a value other than auto / bf16 / gluon / mixed.
    """
    device = torch.device(device)
    index = (device.index if device.index is not None else torch.cuda.current_device()) if device.type == "cuda" else 0
    # (under torch.compile the function itself is traced: Dynamo does not trace through the cache)
    fn = _resolve.__wrapped__ if torch.compiler.is_compiling() else _resolve
    return fn(device.type, index, _sm90_gemm_choice(), _switch_on("MXMOE_LAYER_KERNELS"),
              _switch_on("MXMOE_FUSED_PERMUTE"), _switch_on("MXMOE_QUANT_GLUON"), interpreting(),
              _switch_on("MXMOE_FUSED_COMBINE"), os.environ.get("MXMOE_FUSED_SWIGLU_BWD", "0") == "1")


def describe(device: "torch.device | str | None" = None) -> str:
    """A table of every named recipe's product routes on ``device`` (default: the first GPU, else CPU)."""
    from mxmoe.recipes import RECIPES

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    be = resolve(device)
    lines = [f"device {be.device} ({be.arch}), Triton kernels: {'yes' if be.kernels else 'no'}, "
             f"MXMOE_SM90_GEMM={be.sm90_gemm}, layer kernels: {'on' if be.layer_kernels else 'off'}",
             f"{'recipe':<18} {'fprop':<12} {'dgrad':<12} {'wgrad':<26} fused BF16 QDQ kernels"]
    for name, r in RECIPES.items():
        routes = be.recipe_routes(r)
        lines.append(f"{name:<18} {routes['fprop']:<12} {routes['dgrad']:<12} {routes['wgrad']:<26} "
                     f"{'yes' if be.expansion(r) else 'no'}")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m mxmoe.backend: the routes on this machine
    print(describe())
