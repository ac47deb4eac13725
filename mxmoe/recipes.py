"""Named precision recipes for the expert matrix products."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Recipe:
    """How the three GEMMs of an expert linear layer (fprop, dgrad, wgrad) are computed.

    Raises:
        TypeError: a flag that is not a bool, a name that is not a string.
        ValueError: a value outside its choices (``weight_block`` other than the int 1, 32 or 128, ``align``
            not a positive int, ...), or a field that needs an MXFP8 recipe on one that is not
            (``weight_block`` 32 or 128, ``requantize_weights``, ``swiglu_input_fp8``).
    """

    name: str
    mxfp8: bool = False  # quantize operands to MXFP8 along each GEMM's contraction dim
    weight_block: int = 1  # 1: standard 1x32 weight blocks; 32 / 128: one scale per 32x32 / 128x128 weight tile
    # elements per scale of activations and gradients along each product's contraction dim (K, N, or
    # tokens for wgrad): 32 (OCP MX blocks) or 128 (docs/DESIGN.md §9, the Hopper-fast groups; stored as MXFP8
    # with each scale replicated over its four 32-blocks)
    act_block: int = 32
    wgrad_mxfp8: bool = True  # False: wgrad in BF16 even under mxfp8
    scale_rule: str = "rceil"  # E8M0 scale rule, "rceil" or "floor" (mxmoe.formats.ScaleRule)
    compute_dtype: str = "bfloat16"  # operand dtype of the non-MX products (the plain recipes', and the wgrad of
    # wgrad_mxfp8=False); "float32" for the exact test recipe
    align: int = 32  # rows of each expert group are padded to a multiple of this (32 = one MX block of tokens)
    # keep the SwiGLU input h [M, 2F] for backward as MXFP8 along 2F (1x32, E4M3 + E8M0: about half
    # of BF16's bytes) instead of BF16; SwiGLU's gradient is then taken at h's MX values (DeepSeek-V3
    # caches this input in FP8 similarly, with 1x128 tiles). Applies where F % 32 == 0; needs an MXFP8 recipe.
    swiglu_input_fp8: bool = False
    # quantize the weights again in backward (dgrad's operand, along N) from the parameter instead of
    # keeping the FP8 copy made in forward: about 1 byte less held per weight element until backward
    # (FP8 data + scales), about 2 more moved per element (FP32 parameters: 4 read + 2 written, against
    # 1 written in forward + 1 read + 2 written in backward on the Hopper expansion route).
    requantize_weights: bool = False

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a string, got {self.name!r}")
        for flag in ("mxfp8", "wgrad_mxfp8", "swiglu_input_fp8", "requantize_weights"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        if type(self.weight_block) is not int or self.weight_block not in (1, 32, 128):
            raise ValueError(f"weight_block must be 1 (1x32 blocks), 32 (32x32 tiles) or 128 (128x128 tiles), "
                             f"got {self.weight_block!r}")
        if type(self.act_block) is not int or self.act_block not in (32, 128):
            raise ValueError(f"act_block must be 32 or 128 elements per scale, got {self.act_block!r}")
        if self.scale_rule not in ("rceil", "floor"):
            raise ValueError(f"scale_rule must be 'rceil' or 'floor', got {self.scale_rule!r}")
        if self.compute_dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"compute_dtype must be bfloat16, float16 or float32, got {self.compute_dtype!r}")
        if type(self.align) is not int or self.align < 1:
            raise ValueError(f"align must be a positive number of rows, got {self.align!r}")
        if self.weight_block != 1 and not self.mxfp8:
            raise ValueError("weight_block sets the MX scale blocks of the weights: it needs an MXFP8 recipe (mxfp8=True)")
        if self.act_block != 32 and not self.mxfp8:
            raise ValueError("act_block sets the MX scale groups of activations: it needs an MXFP8 recipe (mxfp8=True)")
        if self.requantize_weights and not self.mxfp8:
            raise ValueError("requantize_weights applies to the FP8 weight copies of MXFP8 recipes (mxfp8=True)")
        if self.swiglu_input_fp8 and not self.mxfp8:
            raise ValueError("swiglu_input_fp8 keeps the SwiGLU input as MXFP8: it needs an MXFP8 recipe (mxfp8=True)")
        if self.mxfp8 and self.wgrad_mxfp8 and self.align % self.act_block:
            raise ValueError(f"MXFP8 wgrad quantizes along tokens in groups of {self.act_block}: expert groups are padded "
                             f"to whole groups, so align must be a multiple of {self.act_block}, got {self.align}")
        if self.mxfp8 and self.align % 32:
            raise ValueError(f"MXFP8 recipes pad expert groups to whole 32-token blocks: align must be a multiple of 32, got {self.align}")

    @property
    def weight_group(self) -> tuple[int, int]:
        """The MX scale group of the expert weights, as :class:`~mxmoe.formats.MXTensor`'s ``block``:
        ``(1, 32)`` (``weight_block`` 1), ``(32, 32)`` or ``(128, 128)`` (square tiles)."""
        return (self.weight_block, self.weight_block) if self.weight_block > 1 else (1, 32)

    @property
    def scale_groups(self) -> int:
        """Elements per scale the layer's dims must be whole multiples of: the largest of the
        activation group and the weight tile (32 for the OCP MX recipes, 128 for ``mxfp8_128``)."""
        return max(self.act_block, self.weight_block, 32) if self.mxfp8 else 1

    def check_dims(self, dim: int, ffn_dim: int) -> None:
        """Raise ValueError unless an MoE layer of width ``dim`` and expert width ``ffn_dim`` can run this
        recipe: MXFP8 quantizes along both in 32-element blocks (128-element groups and tiles under
        ``mxfp8_128``); BF16 operands need 16-byte rows."""
        g = self.scale_groups
        if self.mxfp8 and (dim % g or ffn_dim % g):
            raise ValueError(f"the {self.name} recipe needs dim and ffn_dim divisible by {g} (MXFP8 scale groups), "
                             f"got {dim} and {ffn_dim}")
        if self.compute_dtype == "bfloat16" and (dim % 8 or ffn_dim % 8):
            raise ValueError(f"the {self.name} recipe needs dim and ffn_dim divisible by 8 (16-byte BF16 rows), "
                             f"got {dim} and {ffn_dim}")

    def with_(self, **kw) -> "Recipe":
        """A copy with the given fields changed (``dataclasses.replace``); raises as :class:`Recipe`."""
        return replace(self, **kw)


RECIPES: dict[str, Recipe] = {
    "fp32": Recipe("fp32", compute_dtype="float32", align=1),  # exact reference, for tests
    "bf16": Recipe("bf16", align=16),  # torch._grouped_mm, the baseline
    "mxfp8": Recipe("mxfp8", mxfp8=True),  # 1x32 everywhere (OCP MX)
    "mxfp8_2d": Recipe("mxfp8_2d", mxfp8=True, weight_block=32),  # 32x32 weight tiles
    # mxfp8 holding less for backward: the SwiGLU input kept in MXFP8, the weights requantized in backward
    "mxfp8_lowmem": Recipe("mxfp8_lowmem", mxfp8=True, swiglu_input_fp8=True, requantize_weights=True),
    "mxfp8_bf16_wgrad": Recipe("mxfp8_bf16_wgrad", mxfp8=True, wgrad_mxfp8=False),
    # the Hopper-fast MX recipe (docs/DESIGN.md §9): activations and gradients 1x128 along each contraction dim
    # (128x1 along tokens for wgrad; expert groups padded to 128 rows), weights 128x128 tiles; every
    # tensor still MXFP8 (scales replicated per 32), promoted once per 128 of K on Hopper
    "mxfp8_128": Recipe("mxfp8_128", mxfp8=True, act_block=128, weight_block=128, align=128),
    # mxfp8_128 holding less for backward, as mxfp8_lowmem: h kept in MXFP8 (1x128), weights requantized in backward
    "mxfp8_128_lowmem": Recipe("mxfp8_128_lowmem", mxfp8=True, act_block=128, weight_block=128, align=128,
                               swiglu_input_fp8=True, requantize_weights=True),
}


def get_recipe(recipe: "str | Recipe") -> Recipe:
    """Look up a named recipe (``"bf16"``, ``"mxfp8"``, ``"mxfp8_2d"``, ...) or pass a Recipe through.

    Raises:
        TypeError: neither a string nor a Recipe. ValueError: unknown name.
    """
    if isinstance(recipe, Recipe):
        return recipe
    if not isinstance(recipe, str):
        raise TypeError(f"recipe must be a name or a Recipe, got {type(recipe).__name__}")
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; choose one of {sorted(RECIPES)}")
    return RECIPES[recipe]
