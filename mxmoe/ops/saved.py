"""What autograd functions keep for backward: MXTensors, tensors or nothing, as saved tensors plus
metadata (so ``saved_tensors_hooks`` see every byte kept and everything is freed after backward)."""

from __future__ import annotations

from mxmoe.formats import MXTensor


def pack(t) -> tuple[tuple, tuple | None]:
    """An MXTensor, tensor or None as (tensors for ``ctx.save_for_backward``, metadata)."""
    if t is None:
        return (), None
    if isinstance(t, MXTensor):
        return (t.data, t.scale), (t.axis, t.scale_rule, t.block)
    return (t,), ()


def unpack(tensors: tuple, meta: tuple | None):
    """Inverse of :func:`_pack`."""
    if meta is None:
        return None
    return MXTensor(*tensors, *meta) if meta else tensors[0]
