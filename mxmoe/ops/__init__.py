"""Torch-level ops, one module per concept; each public op has its pure-torch twin beside it.

Shape letters: M routed rows (tokens x top_k, grouped by expert), K contraction, N output
features, E experts, T tokens of a K-grouped (wgrad) product.

==================  ===================================================================================
``quantization``    :func:`quantize`, :func:`quantize_dual`, :func:`quantize_grouped`, :func:`quantize_weight`,
                    :func:`quantize_weight_both`
``grouped``         :func:`grouped_mm` (``torch._grouped_mm`` contract) and its per-group reference
``linear``          :func:`grouped_linear`: the expert linear layer, fprop / dgrad / wgrad
``activation``      :func:`swiglu`
``tokens``          :func:`permute_tokens`, :func:`combine`, :func:`unpermute`
``router``          :func:`router_logits`: the router's FP32 product
``saved``           what autograd functions keep for backward
==================  ===================================================================================

The fast CUDA paths are the ones the :class:`~mxmoe.backend.Backend` names; their results agree with
the reference (bit for bit for quantization, to FP32 summation order for products).
"""

from mxmoe.ops.activation import swiglu
from mxmoe.ops.grouped import grouped_mm
from mxmoe.ops.linear import grouped_linear
from mxmoe.ops.quantization import (quantize, quantize_dual, quantize_grouped, quantize_weight, quantize_weight_both,
                                    weight_block)
from mxmoe.ops.router import router_logits
from mxmoe.ops.tokens import combine, permute_tokens, unpermute

__all__ = ["quantize", "quantize_dual", "quantize_grouped", "quantize_weight", "quantize_weight_both", "weight_block",
           "grouped_mm", "grouped_linear", "swiglu", "permute_tokens", "combine", "unpermute", "router_logits"]
