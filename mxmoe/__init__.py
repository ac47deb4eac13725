"""mxmoe: mixture-of-experts training with MXFP8 expert matrix products."""

from mxmoe.formats import MXTensor, ScaleRule, quantize

__all__ = ["MXTensor", "ScaleRule", "quantize"]
