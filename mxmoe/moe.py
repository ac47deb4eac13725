"""The MoE layer: router, token permutation, SwiGLU experts as grouped products, combine.

Shape letters: T tokens, D model dim, F expert FFN dim, E experts, top_k experts per token,
M = padded routed rows (T * top_k plus per-expert padding).

    x [T, D] --router--> probs [T, E] --top_k--> (expert ids, weights) [T, top_k]
      --permute--> xp [M, D], rows grouped by expert, each group padded to `align` rows
      --grouped_linear(w13)--> h [M, 2F] --SwiGLU--> a [M, F] --grouped_linear(w2)--> yp [M, D]
      --combine: gather + weighted sum over top_k (FP32)--> y [T, D]

The padded buffer has a static size (no host sync): ``M = ceil((T*top_k + E*(align-1)) / align) * align``;
the slack rows are zero and belong to the last expert's group, so every row of every product is
defined and zero rows add nothing.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import nn

from mxmoe.backend import Backend, autocast_dtype, resolve
from mxmoe.formats import MXTensor
from mxmoe.layouts import padded_groups, padded_rows
from mxmoe.ops import combine, grouped_linear, permute_tokens, router_logits
from mxmoe.ops.activation import linear_swiglu
from mxmoe.ops.linear import check_high_precision, prequantized_operands
from mxmoe.ops.tokens import linear_combine
from mxmoe.recipes import Recipe, get_recipe


@dataclass
class Routing:
    """Where each (token, choice) slot goes in the expert-ordered buffer."""

    weights: torch.Tensor  # [T, top_k] float32 router weights
    experts: torch.Tensor  # [T, top_k] int64 expert ids
    slot_rows: torch.Tensor  # [T * top_k] int64 row of slot t*top_k + j in the padded buffer
    offs: torch.Tensor  # [E] int32 cumulative end rows of the padded expert groups
    rows: int  # M, static padded buffer size
    counts: torch.Tensor  # [E] int64 routed tokens per expert (unpadded)
    backend: Backend  # the kernels of this forward (and its backward), resolved once from x's device


def permute_plan(experts: torch.Tensor, num_experts: int, align: int) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Rows of each routed slot in an expert-ordered buffer whose groups start on ``align`` rows
    (:func:`mxmoe.layouts.padded_groups`; size :func:`mxmoe.layouts.padded_rows`).

    Args:
        experts: ``[T, top_k]`` int64 expert ids.
    Returns:
        ``(slot_rows [T*top_k] int64, offs [E] int32, M, counts [E] int64)``. ``M`` is the static bound
        :func:`~mxmoe.layouts.padded_rows` (known without a sync); ``offs[-1] <= M`` is the padded end of the
        last group. The slack rows ``[offs[-1], M)`` belong to no group: the grouped products skip their
        tiles, and what the layer's kernels leave in them is unspecified (nothing reads them back). Runs on
        device with no host synchronization.
    """
    flat = experts.reshape(-1)
    n = flat.numel()
    M = padded_rows(n, num_experts, align)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync the GPU to size its output
    group_start, ends = padded_groups(counts, align)  # padded start / end row of each expert
    order = torch.argsort(flat, stable=True)  # slots in expert order
    first_sorted = torch.cumsum(counts, 0) - counts  # position in `order` where each expert starts
    sorted_experts = flat[order]
    rank = torch.arange(n, device=flat.device) - first_sorted[sorted_experts]
    slot_rows = torch.empty_like(flat)
    slot_rows[order] = group_start[sorted_experts] + rank
    return slot_rows, ends.to(torch.int32), M, counts


def _as_int(name: str, v) -> int:
    """``v`` as an int (ints, numpy / torch integer scalars; not bools), else TypeError naming ``name``."""
    if not isinstance(v, bool):
        try:
            return operator.index(v)
        except TypeError:
            pass
    raise TypeError(f"{name} must be an int, got {v!r}")


class MoE(nn.Module):
    """Sparse mixture-of-experts feed-forward layer with SwiGLU experts.

    Args:
        dim: model dim D.
        ffn_dim: expert hidden dim F (a multiple of the recipe's scale groups, as ``dim``:
            :meth:`~mxmoe.recipes.Recipe.check_dims`).
        num_experts: E.
        top_k: experts per token (``1 <= top_k <= num_experts``).
        recipe: ``"mxfp8"`` (default), ``"mxfp8_2d"``, ``"mxfp8_lowmem"``, ``"mxfp8_bf16_wgrad"``, ``"mxfp8_128"``,
            ``"mxfp8_128_lowmem"``, ``"bf16"``, ``"fp32"`` (:data:`mxmoe.recipes.RECIPES`) or a
            :class:`~mxmoe.recipes.Recipe`.
        aux_loss_coef: coefficient of the load-balancing loss (Switch Transformer form,
            ``E * sum_e f_e * P_e``); the scaled value is in ``self.aux_loss`` after forward.
        renormalize: divide the top_k probabilities by their sum (Mixtral); default ``top_k > 1``
            (with top_k = 1 the weight would always be 1 and the router would learn only from the
            auxiliary loss, so the raw probability is used, as in Switch Transformer).
    Parameters:
        router.weight ``[E, D]``; w13 ``[E, 2F, D]`` (gate rows ``[:F]``, up rows ``[F:]``); w2 ``[E, D, F]``.
    Raises:
        TypeError: sizes or ``top_k`` that are not integers; a recipe that is neither a name nor a Recipe.
        ValueError: non-positive sizes, ``top_k`` outside ``[1, num_experts]``, or dims not divisible
            by the recipe's scale groups (32 under the OCP MX recipes, 128 under ``mxfp8_128`` and
            ``mxfp8_128_lowmem``) or by 8 under bf16 (BF16 grouped GEMMs need 16-byte rows).
    """

    def __init__(self, dim: int, ffn_dim: int, num_experts: int, top_k: int,
                 recipe: "str | Recipe" = "mxfp8", aux_loss_coef: float = 0.01, renormalize: bool | None = None):
        super().__init__()
        dim, ffn_dim, num_experts = _as_int("dim", dim), _as_int("ffn_dim", ffn_dim), _as_int("num_experts", num_experts)
        if min(dim, ffn_dim, num_experts) < 1:
            raise ValueError(f"dim, ffn_dim and num_experts must be positive, got {dim}, {ffn_dim}, {num_experts}")
        top_k = _as_int("top_k", top_k)
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        self.dim, self.ffn_dim, self.num_experts, self.top_k = dim, ffn_dim, num_experts, top_k
        self.aux_loss_coef = aux_loss_coef
        self.renormalize = top_k > 1 if renormalize is None else renormalize
        self.set_recipe(recipe)
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * ffn_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.reset_parameters()
        self.aux_loss = torch.zeros(())

    def __getstate__(self):
        """Copies and pickles drop the last forward's graph-attached ``aux_loss`` (deepcopy of a
        non-leaf tensor fails, and a copy should not hold the original's autograd graph)."""
        state = super().__getstate__()
        state["aux_loss"] = torch.zeros(())
        return state

    def reset_parameters(self) -> None:
        nn.init.normal_(self.router.weight, std=self.dim ** -0.5)
        nn.init.normal_(self.w13, std=self.dim ** -0.5)
        nn.init.normal_(self.w2, std=self.ffn_dim ** -0.5)

    def set_recipe(self, recipe: "str | Recipe") -> None:
        """Switch the expert products' precision recipe (weights are unchanged)."""
        recipe = get_recipe(recipe)
        recipe.check_dims(self.dim, self.ffn_dim)
        self.recipe = recipe

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert choice from FP32 router logits ``[T, E]``: softmax, top_k, optional renormalization.

        Returns ``(probs [T, E]`` used by the load-balancing loss, ``weights [T, top_k]``,
        ``experts [T, top_k]`` int64). Subclasses change the routing rule here (mxmoe.convert does).
        """
        probs = logits.softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)  # [T, top_k]
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights, experts

    def route(self, x: torch.Tensor) -> Routing:
        """Router in FP32, :meth:`select`, the permutation plan; sets ``self.aux_loss``."""
        logits = router_logits(x, self.router.weight)  # [T, E] FP32 (autocast does not apply)
        probs, weights, experts = self.select(logits)
        slot_rows, offs, rows, counts = permute_plan(experts, self.num_experts, self.recipe.align)
        frac_routed = counts.to(torch.float32) / max(experts.numel(), 1)  # f_e
        mean_prob = probs.sum(dim=0) / max(probs.shape[0], 1)  # P_e; zero (not NaN) with no tokens
        self.aux_loss = self.aux_loss_coef * self.num_experts * (frac_routed * mean_prob).sum()
        return Routing(weights, experts, slot_rows, offs, rows, counts, resolve(x.device))

    def permute(self, x2: torch.Tensor, r: Routing):
        """Tokens ``x2 [T, D]`` -> the expert-ordered buffer ``xp [M, D]`` (groups padded to
        ``recipe.align`` rows). Returns ``(xp, offs [E] int32, x_mx, state)``: ``x_mx`` is xp's rows
        already in MXFP8, or None: quantized along D (axis 1, fprop's operand: e.g. tokens received
        in MXFP8) or, where xp is already its own BF16 MX values along D (the fused permute +
        quantization of :func:`~mxmoe.ops.permute_tokens`), its FP8 copy along rows (axis 0,
        wgrad's operand). ``state`` is what :meth:`unpermute` needs. Expert-parallel subclasses
        exchange tokens here."""
        xp, xp_wgrad = permute_tokens(x2, r.slot_rows, r.rows, self.top_k, self.recipe, self.w13, backend=r.backend)
        return xp, r.offs, xp_wgrad, r

    def unpermute(self, yp: torch.Tensor, state, r: Routing) -> torch.Tensor:
        """Expert outputs ``yp [M, D]`` -> tokens ``[T, D]``: each token's top_k outputs weighted by
        ``r.weights`` (:func:`~mxmoe.ops.combine`: on CUDA one kernel, and one for its backward).
        ``state`` is what :meth:`permute` returned."""
        return combine(yp, state.slot_rows, r.weights, validate=False, backend=r.backend)

    def experts_forward(self, xp: torch.Tensor, offs: torch.Tensor, x_mx: MXTensor | None = None,
                        backend: Backend | None = None, r: Routing | None = None) -> torch.Tensor:
        """SwiGLU experts on the expert-ordered buffer ``xp [M, D]`` -> ``[M, D]``; ``x_mx``: the same
        rows already in MXFP8 (:meth:`permute`'s contract; no second quantization): along D, fprop
        uses it; along rows, xp is its BF16 MX values and wgrad uses it. ``backend``: the kernels
        (:func:`mxmoe.backend.resolve` of xp's device by default). With the routing ``r`` the result is
        the tokens' output ``[T, D]`` instead: the layer's own top-k combine as one op with the down
        projection (:func:`mxmoe.ops.tokens.linear_combine`, which fuses their backward kernels)."""
        be = backend or resolve(xp.device)
        # h [M, 2F] = xp w13^T, then a = SwiGLU(h), fused with a's quantization where the route allows
        a, a_mx = linear_swiglu(xp, self.w13, offs, self.recipe, self.w2, **prequantized_operands(x_mx), backend=be)
        if r is not None:
            return linear_combine(a, self.w2, offs, r.slot_rows, r.weights, self.recipe, **prequantized_operands(a_mx),
                                  backend=be)  # [T, D]
        return grouped_linear(a, self.w2, offs, self.recipe, validate=False, **prequantized_operands(a_mx),
                              backend=be)  # [M, D]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``[..., T, D]``, at least 2-D (e.g. ``[batch, seq, D]`` or ``[T, D]``; one token is
        ``[1, D]``), any float dtype -> same shape and dtype.

        Under autocast (e.g. BF16 on CUDA) the experts run on activations in the autocast dtype, as
        autocast's own linear layers would; the router sees x itself (FP32 products); the output is
        cast back to x's dtype.

        Raises:
            ValueError: x with fewer than 2 dims (a 1-D x of D values is ambiguous: one token, or D
                tokens of a wrong width) or a last dim other than D. TypeError: x not float16, bfloat16,
                float32 or float64 (an integer or FP8 tensor).
        """
        if x.dim() < 2 or x.shape[-1] != self.dim:
            raise ValueError(f"MoE expects x of shape [..., T, {self.dim}] (at least 2-D, last dim {self.dim}), "
                             f"got input of shape {tuple(x.shape)}")
        check_high_precision("MoE", x=x)
        shape = x.shape
        x2 = x.reshape(-1, self.dim)  # [T, D]
        r = self.route(x2)  # on x's own values (FP32 under autocast's FP32 residual stream)
        cast = autocast_dtype(x.device.type)
        if cast is not None and x2.dtype == torch.float32:
            x2 = x2.to(cast)  # BF16 activations: the fused kernels apply
        xp, offs, x_mx, state = self.permute(x2, r)  # [M, D]
        if type(self).unpermute is MoE.unpermute and state is r:  # the layer's own combine: one op with w2's product
            y = self.experts_forward(xp, offs, x_mx, r.backend, r)  # [T, D]
        else:  # a subclass's unpermute (e.g. expert parallel: the reverse exchange first)
            y = self.unpermute(self.experts_forward(xp, offs, x_mx, r.backend), state, r)  # [T, D]
        return y.view(shape).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, ffn_dim={self.ffn_dim}, num_experts={self.num_experts}, top_k={self.top_k}, "
                f"recipe={self.recipe.name!r}")
