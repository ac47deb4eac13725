"""mxmoe: mixture-of-experts training with MXFP8 expert matrix products.

MXFP8 (OCP MX v1.0): FP8 E4M3 elements with one power-of-two E8M0 scale per 32 elements along
each matrix product's contraction dimension.
"""

from mxmoe.convert import convert
from mxmoe.formats import MXTensor, ScaleRule
from mxmoe.layouts import from_blocked, to_blocked, to_blocked_grouped
from mxmoe.moe import MoE
from mxmoe.ops import grouped_linear, grouped_mm, quantize
from mxmoe.parallel import ExpertParallelMoE
from mxmoe.recipes import RECIPES, Recipe

__all__ = [
    "MXTensor", "ScaleRule", "quantize", "to_blocked", "from_blocked", "to_blocked_grouped",
    "grouped_mm", "grouped_linear", "MoE", "Recipe", "RECIPES", "convert", "ExpertParallelMoE",
]
