"""torchtitan's MoE experts on mxmoe's expert products (any mxmoe recipe), for torchtitan 0.3.0.

torchtitan builds its MoE layers from a config tree: each ``RoutedExperts.Config`` holds the experts
(``GroupedExperts.Config``: ``w1_EFD [E, F, D]``, ``w2_EDF [E, D, F]``, ``w3_EFD [E, F, D]``; its forward
is ``silu(x W1^T) * (x W3^T)`` then ``W2``, three ``torch._grouped_mm`` in BF16 through the
``_grouped_mm(A, B_t, offs)`` seam) and the token dispatcher (local reorder, or all-to-all under expert
parallelism). This module rewrites that subtree before the model is built:

- the experts become :class:`MXMoEGroupedExperts`: the same three parameters (plain ``nn.Parameter``
  of the same names, shapes and initialization, so FSDP2 sharding, tensor / expert parallel
  placements, distributed checkpoints and the Hugging Face state-dict adapters are untouched), whose
  forward runs :func:`mxmoe.grouped_linear` under the chosen recipe;
- the dispatcher becomes :class:`MXMoETokenDispatcher`, which pads every expert's row group to
  ``Recipe.align`` rows (32, or 128 under ``mxfp8_128``), without a host synchronization when expert
  parallelism is off; its expert parallelism is torchtitan's own all-to-all, the padding applied
  after it. (torchtitan's padding dispatchers, ``TorchAOTokenDispatcher`` and HybridEP, keep their
  own and get ``pad_multiple`` set to the recipe's alignment.)

Experts modules that subclass ``GroupedExperts`` with a forward of their own (gpt-oss's, with biases and
a clamped SwiGLU) keep it: only their ``_grouped_mm`` seam runs mxmoe's products (no fused SwiGLU there).
Expert parallelism is torchtitan's all-to-all; its padding step (:meth:`MXMoETokenDispatcher._permute`) is
tested on the CPU against torchtitan's own permutation, not yet in a multi-GPU run.

Fused and unfused. With ``fused_swiglu`` (the default) the gate and up weights are concatenated per
forward into ``w13 = cat(w1, w3) [E, 2F, D]`` (a copy of both weights each step and its gradient split
in backward), so x is quantized once for one product ``x w13^T -> h [M, 2F]``, and mxmoe's SwiGLU
(:func:`mxmoe.ops.swiglu`) is fused with the quantization of its output for the W2 product where the
GPU route allows (Hopper: the expansion route under ``mxfp8`` / ``mxfp8_2d``, the promote-per-128
route under ``mxfp8_128``). Without the EP all-to-all the permutation and the top-k combine are
mxmoe's (one kernel each way on CUDA). What remains unfused: the permutation is not fused with x's
quantization (torchtitan hands the experts a BF16 buffer), and under expert parallelism the padding
is a separate gather after torchtitan's all-to-all and its combine is torchtitan's. With
``fused_swiglu=False`` the three products run as torchtitan writes them (x quantized twice, torch's
SwiGLU), each an MX :func:`~mxmoe.grouped_linear`.

Selecting it. From the command line of torchtitan's trainer (``torchtitan.train``), as an override::

    --override.imports 'mxmoe.integrations.torchtitan.mxmoe_experts={"recipe": "mxfp8_128"}'

or in a Python config (a ``config_registry`` function), as a model converter::

    from mxmoe.integrations.torchtitan import MXMoEConverter
    model_registry("debugmodel", converters=[MXMoEConverter.Config(recipe="mxfp8")])

Dims: the experts' ``dim`` and ``hidden_dim`` (per tensor-parallel shard) must be multiples of the
recipe's scale groups (32; 128 under ``mxfp8_128``). Activations enter the products in BF16 (FP32 under
mxmoe's exact ``fp32`` test recipe), as torchtitan's own experts cast them; the weights are quantized
from the parameters' own dtype. On the CPU every recipe runs mxmoe's pure-torch reference.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:
    import torchtitan
    from torch.distributed.tensor import DTensor
    from torchtitan.components.quantization import QuantizationConverter
    from torchtitan.config import override
    from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
    from torchtitan.models.common.token_dispatcher import (
        AllToAllDispatchMetadata,
        AllToAllTokenDispatcher,
        LocalTokenDispatcher,
    )
except ImportError as e:  # torchtitan absent, or a release without these seams
    raise ImportError(f"mxmoe.integrations.torchtitan needs torchtitan {'0.3.0'} (from a clone: pip install -e '.[torchtitan]'); "
                      f"importing it failed: {e}") from e

from mxmoe.moe import _prequantized, permute_plan
from mxmoe.ops import combine, grouped_linear, permute_tokens, swiglu
from mxmoe.recipes import RECIPES, Recipe, get_recipe

TORCHTITAN_VERSION = "0.3.0"  # the release whose seams this module is written against (pyproject's extra)

__all__ = ["MXMoEGroupedExperts", "MXMoETokenDispatcher", "MXMoEConverter", "convert_routed_experts",
           "mxmoe_experts", "TORCHTITAN_VERSION"]


def _local(w: torch.Tensor) -> torch.Tensor:
    """A parameter's local tensor: DTensors (tensor / expert parallel placements) to their shard, as
    torchtitan's experts do; plain tensors (FSDP2's unsharded parameters in forward) as they are."""
    return w.to_local() if isinstance(w, DTensor) else w


class MXMoEGroupedExperts(GroupedExperts):
    """torchtitan's ``GroupedExperts`` with its products run by :func:`mxmoe.grouped_linear`.

    Config fields (besides ``GroupedExperts.Config``'s ``dim``, ``hidden_dim``, ``num_experts``):
        recipe: an mxmoe recipe name (``"mxfp8"``, ``"mxfp8_2d"``, ``"mxfp8_128"``, ``"mxfp8_lowmem"``,
            ``"bf16"``, ``"fp32"``, ...; :data:`mxmoe.RECIPES`).
        fused_swiglu: one product with ``cat(w1, w3)`` and mxmoe's SwiGLU (default), or torchtitan's three
            products (see the module docstring).
        validate: check shapes and group offsets in every product (synchronizes with the GPU; for debugging).
    Parameters: ``w1_EFD [E, F, D]`` (gate), ``w2_EDF [E, D, F]``, ``w3_EFD [E, F, D]`` (up), as torchtitan's.
    Raises:
        ValueError: an unknown recipe, or ``dim`` / ``hidden_dim`` the recipe cannot take (at build; in
            forward for a tensor-parallel shard of ``hidden_dim``).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        recipe: str = "mxfp8_128"
        fused_swiglu: bool = True
        validate: bool = False

    def __init__(self, config: Config):
        super().__init__(config)
        self.recipe: Recipe = get_recipe(config.recipe)
        self.recipe.check_dims(config.dim, config.hidden_dim)
        self.fused_swiglu, self.validate = bool(config.fused_swiglu), bool(config.validate)

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """Experts on the expert-ordered rows ``x_RD [R, D]`` (any float dtype) -> ``[R, D]`` in x's dtype.

        ``num_tokens_per_expert_E`` ``[E]`` (integer): rows of each expert's group, in order; every group
        a multiple of ``recipe.align`` rows under MX recipes (:class:`MXMoETokenDispatcher` pads them),
        their sum ``R``.
        """
        w1, w2, w3 = _local(self.w1_EFD), _local(self.w2_EDF), _local(self.w3_EFD)
        self.recipe.check_dims(w2.shape[1], w2.shape[2])  # python ints: the shard this rank holds
        offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        x = x_RD.float() if self.recipe.compute_dtype == "float32" else x_RD.bfloat16()
        if not self.fused_swiglu:
            h = F.silu(self._grouped_mm(A=x, B_t=w1.mT, offs=offs)) * self._grouped_mm(A=x, B_t=w3.mT, offs=offs)
            return self._grouped_mm(A=h, B_t=w2.mT, offs=offs).type_as(x_RD)
        w13 = torch.cat([w1, w3], dim=1)  # [E, 2F, D]: gate rows [:F], up rows [F:] (mxmoe.MoE's w13)
        h = grouped_linear(x, w13, offs, self.recipe, validate=self.validate)  # [R, 2F]
        a, a_mx = swiglu(h, self.recipe, w2)  # fused with a's quantization where the route allows
        y = grouped_linear(a, w2, offs, self.recipe, validate=self.validate and a_mx is None, **_prequantized(a_mx))
        return y.type_as(x_RD)

    def _grouped_mm(self, *, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """torchtitan's seam: ``A [M, K] @ B_t[e] [K, N]`` per group (``offs`` int32 ``[E]`` end rows) as an
        mxmoe product under this module's recipe; ``[M, N]`` in A's dtype."""
        return grouped_linear(A, B_t.mT, offs, self.recipe, validate=self.validate)


_seam_classes: dict[type, type] = {}


def _seam_experts_class(parent: type) -> type:
    """For a ``GroupedExperts`` subclass with its own forward (e.g. gpt-oss's biased experts): a subclass
    of it whose ``_grouped_mm`` seam runs mxmoe's products (SwiGLU and casts stay the parent's)."""
    if parent not in _seam_classes:
        class Seam(parent):
            @dataclass(kw_only=True, slots=True)
            class Config(parent.Config):
                recipe: str = "mxfp8_128"
                validate: bool = False

            def __init__(self, config):
                super().__init__(config)
                self.recipe, self.validate = get_recipe(config.recipe), bool(config.validate)

            _grouped_mm = MXMoEGroupedExperts._grouped_mm

        Seam.__name__ = Seam.__qualname__ = f"MXMoE{parent.__name__}"
        _seam_classes[parent] = Seam
    return _seam_classes[parent]


@dataclass(frozen=True, kw_only=True)
class _LocalPlan:
    """What :meth:`MXMoETokenDispatcher.dispatch` hands its combine without expert parallelism."""

    slot_rows: torch.Tensor  # [T*K] int64: the padded row of token t's k-th choice
    scores: torch.Tensor  # [T, K] routing scores


class MXMoETokenDispatcher(AllToAllTokenDispatcher):
    """torchtitan's token dispatcher with every expert's row group padded to ``align`` rows (zero rows;
    the last group also takes the buffer's slack, so groups end at the buffer's last row).

    Without expert parallelism (no EP mesh): mxmoe's permutation plan (:func:`mxmoe.moe.permute_plan`,
    no host synchronization: a static buffer of ``ceil((T*K + E*(align-1)) / align) * align`` rows),
    gather and weighted top-k combine (FP32 sums). With it: torchtitan's all-to-all, then the received
    rows are placed expert-major into padded groups, and the combine is torchtitan's.

    Config: ``num_experts``, ``top_k`` (as torchtitan's), ``align`` (rows; :attr:`mxmoe.Recipe.align`).
    Raises ValueError for ``align < 1``.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(AllToAllTokenDispatcher.Config):
        align: int = 32

    def __init__(self, config: Config):
        super().__init__(config)
        if type(config.align) is not int or config.align < 1:
            raise ValueError(f"align must be a positive number of rows, got {config.align!r}")
        self.align = config.align

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
        """``x_TD [T, D]``, scores and expert ids ``[T, K]`` -> ``(rows [R, D], rows per expert [E] int64
        (padded), plan)``; under EP torchtitan's dispatch, padded in :meth:`_permute`."""
        if self.ep_mesh is not None:
            return super().dispatch(x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E)
        slot_rows, offs, rows, _ = permute_plan(topk_expert_ids_TK, self.num_experts, self.align)
        xp, _ = permute_tokens(x_TD, slot_rows, rows, self.top_k)
        padded = torch.diff(offs.to(torch.int64), prepend=offs.new_zeros(1, dtype=torch.int64))
        return xp, padded, _LocalPlan(slot_rows=slot_rows, scores=topk_scores_TK)

    def combine(self, routed_output_RD, metadata, x_TD):
        """Expert rows ``[R, D]`` -> tokens ``[T, D]`` in the rows' dtype, each the score-weighted sum of
        its K rows."""
        if isinstance(metadata, _LocalPlan):
            return combine(routed_output_RD, metadata.slot_rows, metadata.scores, validate=False)
        return super().combine(routed_output_RD, metadata, x_TD)

    def _permute(self, routed_input_RD, num_global_tokens_per_local_expert_E):
        """After the all-to-all: rows arrive rank-major (rank r's rows for local experts 0..e-1, then rank
        r+1's); they go expert-major into groups padded to ``align``. Returns torchtitan's tuple
        ``(input shape, padded rows [R', D], row of each received row [R] int64, rows per expert [e])``."""
        counts = num_global_tokens_per_local_expert_E.reshape(-1)  # [EP * e], rank-major
        e = counts.numel() // self.ep_mesh.size()
        n = routed_input_RD.shape[0]
        expert = torch.arange(counts.numel(), device=counts.device) % e
        expert_of_row = torch.repeat_interleave(expert, counts, output_size=n)
        slot_rows, offs, rows, _ = permute_plan(expert_of_row[:, None], e, self.align)  # stable: rank order kept
        xp, _ = permute_tokens(routed_input_RD, slot_rows, rows, 1)
        padded = torch.diff(offs.to(torch.int64), prepend=offs.new_zeros(1, dtype=torch.int64))
        return routed_input_RD.shape, xp, slot_rows, padded

    def _unpermute(self, routed_output_RD, input_shape, permuted_indices):
        """Padded expert rows back to the received (rank-major) order, padding dropped."""
        return routed_output_RD.index_select(0, permuted_indices)


def _swap_dispatcher(d, align: int):
    """The dispatcher config ``d`` made to pad expert groups to ``align`` rows. Raises ValueError for a
    dispatcher that cannot pad."""
    if isinstance(d, MXMoETokenDispatcher.Config):
        return dataclasses.replace(d, align=align)
    if type(d) in (LocalTokenDispatcher.Config, AllToAllTokenDispatcher.Config):
        return MXMoETokenDispatcher.Config(num_experts=d.num_experts, top_k=d.top_k, align=align)
    if "pad_multiple" in {f.name for f in dataclasses.fields(d)}:  # torchtitan's padding dispatchers
        have = d.pad_multiple or 1
        return dataclasses.replace(d, pad_multiple=have * align // math.gcd(have, align))
    raise ValueError(f"mxmoe's experts need expert groups padded to the recipe's alignment ({align} rows); "
                     f"{type(d).__qualname__} cannot pad them. Use torchtitan's 'standard' MoE communication "
                     f"backend (all-to-all) or HybridEP")


def convert_routed_experts(cfg: "RoutedExperts.Config", recipe: "str | Recipe" = "mxfp8_128",
                           fused_swiglu: bool = True, validate: bool = False) -> "RoutedExperts.Config":
    """A copy of a torchtitan ``RoutedExperts.Config`` whose experts run mxmoe's products under ``recipe``
    and whose dispatcher pads expert groups to ``recipe.align`` (other fields, e.g. sharding, kept).

    Raises:
        ValueError: unknown recipe; expert dims the recipe cannot take; a dispatcher that cannot pad.
        TypeError: ``cfg`` not a ``RoutedExperts.Config``; experts that are not ``GroupedExperts``.
    """
    if not isinstance(cfg, RoutedExperts.Config):
        raise TypeError(f"expected a torchtitan RoutedExperts.Config, got {type(cfg).__qualname__}")
    rec = get_recipe(recipe)
    inner = cfg.inner_experts
    if not isinstance(inner, GroupedExperts.Config):
        raise TypeError(f"mxmoe converts GroupedExperts (and subclasses with its _grouped_mm seam), got "
                        f"{type(inner).__qualname__}")
    rec.check_dims(inner.dim, inner.hidden_dim)
    kept = {f.name: getattr(inner, f.name) for f in dataclasses.fields(inner) if f.init}
    kept.update(recipe=rec.name if RECIPES.get(rec.name) == rec else rec, validate=validate)  # names stay JSON
    owner = type(inner)._owner
    if owner in (GroupedExperts, MXMoEGroupedExperts):
        new_inner = MXMoEGroupedExperts.Config(**{**kept, "fused_swiglu": fused_swiglu})
    else:  # another experts module with the seam: only its products change
        base = owner.__mro__[1] if owner in _seam_classes.values() else owner
        kept.pop("fused_swiglu", None)
        new_inner = _seam_experts_class(base).Config(**kept)
    return dataclasses.replace(cfg, inner_experts=new_inner, token_dispatcher=_swap_dispatcher(cfg.token_dispatcher, rec.align))


class MXMoEConverter(QuantizationConverter):
    """torchtitan model converter: every ``RoutedExperts`` of the model config on mxmoe's products
    (:func:`convert_routed_experts`). Pass ``MXMoEConverter.Config(recipe=...)`` in a model registry's
    ``converters`` list. Config: ``recipe`` (default ``"mxfp8_128"``), ``fused_swiglu``, ``validate``.

    Raises ValueError at construction for an unknown recipe; :meth:`convert` as
    :func:`convert_routed_experts`, and ValueError for a model without MoE experts.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        recipe: str = "mxfp8_128"
        fused_swiglu: bool = True
        validate: bool = False

    def __init__(self, config: Config):
        self.config = config
        get_recipe(config.recipe)

    def convert(self, model_config):
        c = self.config
        found = list(model_config.traverse(RoutedExperts.Config))
        if not found:
            raise ValueError("MXMoEConverter: the model config has no RoutedExperts (no MoE layers) to convert")
        for _fqn, cfg, parent, attr in found:
            new = convert_routed_experts(cfg, c.recipe, c.fused_swiglu, c.validate)
            if parent is None:
                model_config = new
            elif isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
        return model_config


@override(target=RoutedExperts.Config, description="mxmoe MX expert products")
def mxmoe_experts(cfg, recipe: str = "mxfp8_128", fused_swiglu: bool = True, validate: bool = False):
    """torchtitan override (``--override.imports mxmoe.integrations.torchtitan.mxmoe_experts``, kwargs as
    JSON after ``=``): each ``RoutedExperts`` on mxmoe's products, as :func:`convert_routed_experts`."""
    return convert_routed_experts(cfg, recipe, fused_swiglu, validate)
