"""Drop-in conversion of Hugging Face ``transformers`` sparse-MoE blocks to :class:`mxmoe.MoE`.

Shape letters: T tokens, D model dim (``hidden_size``), F expert FFN dim, E routed experts.

    model = MixtralForCausalLM.from_pretrained(...)
    model = convert(model, recipe="mxfp8")  # in place; every supported MoE block now runs on mxmoe

Supported blocks (matched by class name, so no model module is imported here):

    =========================  ==========================================  ==================================
    HF block class             router                                      extra
    =========================  ==========================================  ==================================
    MixtralSparseMoeBlock      softmax -> top_k -> renormalize              router jitter noise (training)
    Qwen2MoeSparseMoeBlock     softmax -> top_k -> renormalize if           shared expert * sigmoid(shared gate)
                               ``norm_topk_prob``
    Qwen3MoeSparseMoeBlock     as Qwen2-MoE                                 -
    OlmoeSparseMoeBlock        as Qwen2-MoE                                 -
    DeepseekV3MoE              sigmoid + ``e_score_correction_bias`` for    shared experts (ungated)
                               choice, grouped top-k (``n_group``,
                               ``topk_group``), renormalize if
                               ``norm_topk_prob``, * ``routed_scaling_factor``
    Glm4MoeMoE                 as DeepSeek-V3                               shared experts (ungated)
    =========================  ==========================================  ==================================

Expert storage read (all seen across transformers versions): fused 3D parameters ``gate_up_proj``
``[E, 2F, D]`` (or ``[E, D, 2F]`` when transposed; gate/up concatenated or interleaved) with
``down_proj`` ``[E, D, F]`` (or ``[E, F, D]``), and per-expert ``nn.Linear`` lists with
``w1/w3/w2`` (Mixtral 4.x) or ``gate_proj/up_proj/down_proj``. Experts must be bias-free SwiGLU
(SiLU gate), which all supported models are.

What the converted block keeps: the router weight (an FP32 product in mxmoe, as in HF DeepSeek-V3;
Mixtral/Qwen compute their router logits in the model dtype, which only matters in BF16 models),
the shared expert modules as they are (dense, model precision), Mixtral's training-time router
jitter, and the block's call convention, found by calling the original block once on two zero
tokens: a tensor (transformers 5) or ``(hidden_states, router_logits)`` (transformers 4.x
Mixtral/Qwen-MoE, whose decoder layers unpack a pair).

Not kept: transformers (4.5x and 5) records ``router_logits`` with forward hooks on its own block
or router classes, which the converted model no longer contains, so ``output_router_logits``
cannot work; :func:`convert` turns the config flag off (with a warning). Use each block's
``moe.aux_loss`` (mxmoe's Switch-form balance loss) instead. Parameter names change
(``mlp.moe.w13`` ...), so a converted model's state dict does not load into the HF class.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

from mxmoe.moe import MoE
from mxmoe.recipes import Recipe, get_recipe


@dataclass(frozen=True)
class BlockSpec:
    """How to read one HF sparse-MoE block class."""

    scoring: str  # "softmax" (Mixtral, Qwen) or "sigmoid" (DeepSeek-V3: biased, group-limited choice)
    renormalize: bool | None  # fixed top-k renormalization; None: read ``norm_topk_prob``
    shared: str | None = None  # attribute of the shared-expert MLP, if any
    shared_gate: str | None = None  # attribute of the shared expert's sigmoid gate ``nn.Linear(D, 1)``, if any


SUPPORTED_BLOCKS: dict[str, BlockSpec] = {
    "MixtralSparseMoeBlock": BlockSpec("softmax", renormalize=True),
    "Qwen2MoeSparseMoeBlock": BlockSpec("softmax", None, shared="shared_expert", shared_gate="shared_expert_gate"),
    "Qwen3MoeSparseMoeBlock": BlockSpec("softmax", None),
    "DeepseekV3MoE": BlockSpec("sigmoid", None, shared="shared_experts"),
    "OlmoeSparseMoeBlock": BlockSpec("softmax", None),  # as Qwen3-MoE
    "Glm4MoeMoE": BlockSpec("sigmoid", None, shared="shared_experts"),  # as DeepSeek-V3
}


class HFRoutedMoE(MoE):
    """:class:`mxmoe.MoE` with the router variants of the supported HF models.

    ``scoring="softmax"`` is MoE's own router (softmax over E, top_k, optional renormalization).
    ``scoring="sigmoid"`` is DeepSeek-V3's: ``s = sigmoid(logits)``; experts are chosen on
    ``s + e_score_correction_bias`` among the ``topk_group`` of ``n_group`` expert groups with the
    largest sum of their two best biased scores; the weights are the unbiased ``s`` of the chosen
    experts, divided by their sum (+1e-20) if ``renormalize``, times ``routed_scaling_factor``.
    The balance loss uses ``s / sum(s)`` as the router probabilities.

    Args (beyond :class:`mxmoe.MoE`'s):
        scoring: ``"softmax"`` or ``"sigmoid"``.
        n_group, topk_group: expert groups and groups kept per token (sigmoid scoring; E % n_group == 0).
        routed_scaling_factor: multiplies the routing weights.
    Buffers:
        e_score_correction_bias ``[E]`` float32 (zeros unless copied from a model; choice only).
    Attributes after forward:
        router_logits ``[T, E]`` float32, aux_loss.
    """

    def __init__(self, dim: int, ffn_dim: int, num_experts: int, top_k: int, recipe: "str | Recipe" = "mxfp8",
                 aux_loss_coef: float = 0.01, renormalize: bool | None = None, scoring: str = "softmax",
                 n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0):
        super().__init__(dim, ffn_dim, num_experts, top_k, recipe, aux_loss_coef, renormalize)
        if scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
        if num_experts % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(f"need num_experts % n_group == 0 and 1 <= topk_group <= n_group, got "
                             f"E={num_experts}, n_group={n_group}, topk_group={topk_group}")
        self.scoring, self.n_group, self.topk_group = scoring, n_group, topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))
        self.router_logits = None

    def __getstate__(self):
        state = super().__getstate__()
        state["router_logits"] = None  # graph-attached, per forward: not copied or pickled
        return state

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """HF routing rules on FP32 logits ``[T, E]``; keeps ``router_logits`` for the block's return."""
        self.router_logits = logits
        if self.scoring == "softmax":
            probs, weights, experts = super().select(logits)
        else:
            scores = logits.sigmoid()  # [T, E]
            experts = self._group_limited_top_k(scores + self.e_score_correction_bias.float())
            weights = scores.gather(1, experts)  # [T, top_k]
            if self.renormalize:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            probs = scores / scores.sum(dim=-1, keepdim=True)
        return probs, weights * self.routed_scaling_factor, experts

    def _group_limited_top_k(self, choice: torch.Tensor) -> torch.Tensor:
        """``choice [T, E]`` -> top_k expert ids ``[T, top_k]`` among the best ``topk_group`` groups."""
        T, G = choice.shape[0], self.n_group
        if G == 1:
            return choice.topk(self.top_k, dim=-1)[1]
        grouped = choice.view(T, G, self.num_experts // G)  # [T, G, E/G]
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)  # [T, G]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1)[1], True)
        masked = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(T, self.num_experts)
        return masked.topk(self.top_k, dim=-1)[1]

    def extra_repr(self) -> str:
        s = super().extra_repr() + f", scoring={self.scoring!r}, renormalize={self.renormalize}"
        if self.scoring == "sigmoid":
            s += f", n_group={self.n_group}, topk_group={self.topk_group}"
        if self.routed_scaling_factor != 1.0:
            s += f", routed_scaling_factor={self.routed_scaling_factor}"
        return s


class HFSparseMoEBlock(nn.Module):
    """Replacement for an HF sparse-MoE block: :class:`HFRoutedMoE` plus the optional shared expert.

    ``y = moe(x) + [sigmoid(shared_expert_gate(x)) *] shared_expert(x)``

    Args:
        moe: the routed experts.
        shared_expert: dense MLP applied to every token (kept from the HF block), or None.
        shared_expert_gate: ``nn.Linear(D, 1)`` whose sigmoid scales ``shared_expert`` (Qwen2-MoE), or None.
        jitter_noise: training-time multiplicative input noise ``U(1-j, 1+j)`` (Mixtral's ``router_jitter_noise``).
        return_router_logits: return ``(y, router_logits [T, E])`` instead of ``y`` (transformers 4.x
            Mixtral/Qwen-MoE decoder layers unpack a pair).
    """

    def __init__(self, moe: HFRoutedMoE, shared_expert: nn.Module | None = None,
                 shared_expert_gate: nn.Module | None = None, jitter_noise: float = 0.0,
                 return_router_logits: bool = False):
        super().__init__()
        self.moe = moe
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate
        self.jitter_noise = jitter_noise
        self.return_router_logits = return_router_logits

    def forward(self, hidden_states: torch.Tensor):
        """hidden_states ``[batch, seq, D]`` -> same shape (and ``router_logits [T, E]`` if asked)."""
        x = hidden_states
        if self.training and self.jitter_noise > 0:
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        y = self.moe(x)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            y = y + shared
        if self.return_router_logits:
            return y, self.moe.router_logits
        return y


def convert(model: nn.Module, recipe: "str | Recipe" = "mxfp8", *, strict: bool = True,
            aux_loss_coef: float = 0.01) -> nn.Module:
    """Replace every supported HF sparse-MoE block of ``model`` (in place) with :class:`HFSparseMoEBlock`.

    The routed experts' weights move into ``w13 [E, 2F, D]`` (gate rows ``[:F]``, up rows ``[F:]``)
    and ``w2 [E, D, F]``; a fused ``[E, 2F, D]`` gate/up parameter and an ``[E, D, F]`` down
    parameter are reused as they are (no copy), other layouts are copied. Parameters keep their
    device, dtype and ``requires_grad``. With ``recipe="fp32"`` (model in FP32) the converted
    model computes the original's function up to summation order.

    Args:
        model: a ``transformers`` model (or any module) containing blocks named in :data:`SUPPORTED_BLOCKS`.
        recipe: mxmoe recipe name or :class:`~mxmoe.recipes.Recipe` for the expert products.
        strict: under an MXFP8 recipe, a block whose D or F is not a multiple of 32 raises
            (before anything is changed); with ``strict=False`` it is left unconverted with a warning.
        aux_loss_coef: coefficient of each block's ``moe.aux_loss``.
    Returns:
        ``model`` itself.
    Raises:
        ValueError: MXFP8 recipe with dims not divisible by 32 (strict), a non-SiLU activation,
            biased or expert-parallel experts, or an expert layout that cannot be read.
    """
    recipe = get_recipe(recipe)
    found = [(name, module) for name, module in model.named_modules() if type(module).__name__ in SUPPORTED_BLOCKS]
    plans = []
    for name, block in found:
        dims = _block_dims(block)
        if recipe.mxfp8 and (dims[0] % 32 or dims[1] % 32):
            msg = (f"{name} ({type(block).__name__}): MXFP8 recipe {recipe.name!r} needs hidden and expert "
                   f"intermediate sizes divisible by 32, got D={dims[0]}, F={dims[1]}")
            if strict:
                raise ValueError(msg + " (convert(..., strict=False) leaves such blocks unconverted)")
            warnings.warn(msg + "; block left unconverted", stacklevel=2)
            continue
        plans.append((name, block))
    config = getattr(model, "config", None)
    for name, block in plans:
        new = _convert_block(block, recipe, config, aux_loss_coef)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    if not found:
        warnings.warn(f"convert found no supported sparse-MoE block in {type(model).__name__} "
                      f"(supported: {', '.join(sorted(SUPPORTED_BLOCKS))}); nothing was replaced", stacklevel=2)
    if plans and getattr(config, "output_router_logits", False):
        warnings.warn("converted MoE blocks do not feed transformers' router_logits recording; "
                      "setting config.output_router_logits = False (use each block's moe.aux_loss)", stacklevel=2)
        config.output_router_logits = False
    return model


def _block_dims(block: nn.Module) -> tuple[int, int]:
    """``(D, F)`` of an HF block, from its router weight ``[E, D]`` and the experts' down projection."""
    D = block.gate.weight.shape[1]
    experts = block.experts
    if isinstance(experts, nn.ModuleList):
        first = experts[0]
        return D, (first.w2 if hasattr(first, "w2") else first.down_proj).weight.shape[1]
    return D, experts.down_proj.shape[1 if _is_transposed(experts, D) else 2]


def _is_transposed(experts: nn.Module, D: int) -> bool:
    """Fused layout: ``[E, 2F, D]`` + ``[E, D, F]`` (False) or ``[E, D, 2F]`` + ``[E, F, D]`` (True).

    Read from the experts' ``is_transposed`` flag (transformers 5) or inferred from the shapes;
    both layouts fit only if F = 0.
    """
    flag = getattr(experts, "is_transposed", None)
    if flag is not None:
        return bool(flag)
    return not (experts.gate_up_proj.shape[2] == D and experts.down_proj.shape[1] == D)


def _lookup(objs, names, default):
    """First attribute found among ``names`` on the objects ``objs`` (None skipped), else ``default``."""
    for obj in objs:
        for n in names:
            if obj is not None and getattr(obj, n, None) is not None:
                return getattr(obj, n)
    return default


def _convert_block(block: nn.Module, recipe: Recipe, config, aux_loss_coef: float) -> HFSparseMoEBlock:
    spec = SUPPORTED_BLOCKS[type(block).__name__]
    gate = block.gate
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    where = (gate, block, text_config)
    E, D = gate.weight.shape
    w13, w2 = _expert_weights(block.experts, E, D)
    Fdim = w2.shape[2]
    top_k = _lookup(where, ("top_k", "num_experts_per_tok"), None)
    if top_k is None:
        raise ValueError(f"{type(block).__name__}: cannot find top_k / num_experts_per_tok")
    renormalize = spec.renormalize
    if renormalize is None:
        renormalize = bool(_lookup(where, ("norm_topk_prob",), False))
    kw = {}
    if spec.scoring == "sigmoid":
        kw = dict(n_group=int(_lookup(where, ("num_group", "n_group"), 1)),
                  topk_group=int(_lookup(where, ("topk_group",), 1)),
                  routed_scaling_factor=float(_lookup(where, ("routed_scaling_factor",), 1.0)))
    return_router_logits = _probe_returns_tuple(block, D)
    with torch.device("meta"):  # no allocation or random init of weights that are replaced next
        moe = HFRoutedMoE(D, Fdim, E, int(top_k), recipe, aux_loss_coef, renormalize, spec.scoring, **kw)
    moe.router.weight = gate.weight
    moe.w13 = w13
    moe.w2 = w2
    bias = getattr(gate, "e_score_correction_bias", None)
    moe.e_score_correction_bias = (bias.detach().float() if bias is not None
                                   else torch.zeros(E, device=gate.weight.device))
    moe.aux_loss = torch.zeros((), device=gate.weight.device)
    new = HFSparseMoEBlock(
        moe,
        shared_expert=getattr(block, spec.shared) if spec.shared else None,
        shared_expert_gate=getattr(block, spec.shared_gate) if spec.shared_gate else None,
        jitter_noise=float(_lookup((block, text_config), ("jitter_noise", "router_jitter_noise"), 0.0)),
        return_router_logits=return_router_logits,
    )
    new.train(block.training)
    return new


def _check_silu(module: nn.Module, what: str) -> None:
    act = getattr(module, "act_fn", None)
    if act is not None and not isinstance(act, nn.SiLU) and type(act).__name__ != "SiLUActivation":
        raise ValueError(f"{what}: mxmoe experts are SwiGLU (SiLU gate), got activation {type(act).__name__}")


def _expert_weights(experts: nn.Module, E: int, D: int) -> tuple[nn.Parameter, nn.Parameter]:
    """``(w13 [E, 2F, D], w2 [E, D, F])`` Parameters from HF experts of any supported storage."""
    what = type(experts).__name__
    _check_silu(experts, what)
    if isinstance(experts, nn.ModuleList):  # per-expert MLPs (transformers 4.x)
        if len(experts) != E:
            raise ValueError(f"{what}: {len(experts)} experts but router has {E} outputs")
        gates, ups, downs = [], [], []
        for mlp in experts:
            _check_silu(mlp, what)
            names = ("w1", "w3", "w2") if hasattr(mlp, "w1") else ("gate_proj", "up_proj", "down_proj")
            lins = [getattr(mlp, n, None) for n in names]
            if any(not isinstance(l, nn.Linear) or l.bias is not None for l in lins):
                raise ValueError(f"{what}: expected bias-free nn.Linear {names}, got {type(mlp).__name__}")
            gates.append(lins[0].weight)
            ups.append(lins[1].weight)
            downs.append(lins[2].weight)
        req = gates[0].requires_grad
        with torch.no_grad():
            w13 = torch.cat([torch.stack(gates), torch.stack(ups)], dim=1)  # [E, 2F, D]
            w2 = torch.stack(downs)  # [E, D, F]
        return nn.Parameter(w13, requires_grad=req), nn.Parameter(w2, requires_grad=req)

    gu, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gu, torch.Tensor) or not isinstance(down, torch.Tensor):
        raise ValueError(f"{what}: unknown expert storage (neither per-expert MLPs nor gate_up_proj/down_proj)")
    for flag, bad in (("has_bias", True), ("has_gate", False), ("has_post_expert_norm", True),
                      ("_is_expert_parallel", True)):
        if getattr(experts, flag, not bad) == bad:
            raise ValueError(f"{what}: {flag}={bad} is not supported")
    if any(getattr(experts, n, None) is not None for n in ("gate_up_proj_bias", "down_proj_bias")):
        raise ValueError(f"{what}: biased experts are not supported")
    if gu.dim() != 3 or down.dim() != 3 or gu.shape[0] != E or down.shape[0] != E:
        raise ValueError(f"{what}: expected 3D [E={E}, ...] expert weights, got {tuple(gu.shape)}, {tuple(down.shape)}")
    transposed = _is_transposed(experts, D)
    if transposed:
        gu_std, down_std = gu.transpose(1, 2), down.transpose(1, 2)
    else:
        gu_std, down_std = gu, down
    Fdim = down_std.shape[2]
    if gu_std.shape != (E, 2 * Fdim, D) or down_std.shape != (E, D, Fdim):
        raise ValueError(f"{what}: cannot read gate_up_proj {tuple(gu.shape)} / down_proj {tuple(down.shape)} "
                         f"as [E, 2F, D] / [E, D, F] with E={E}, D={D} (is_transposed={transposed})")
    concatenated = getattr(experts, "is_concatenated", True)
    if not transposed and concatenated:
        w13 = gu if isinstance(gu, nn.Parameter) else nn.Parameter(gu)  # reused, no copy
    else:
        with torch.no_grad():
            w = gu_std if concatenated else torch.cat([gu_std[:, 0::2], gu_std[:, 1::2]], dim=1)
            w13 = nn.Parameter(w.contiguous(), requires_grad=gu.requires_grad)
    if not transposed:
        w2 = down if isinstance(down, nn.Parameter) else nn.Parameter(down)
    else:
        with torch.no_grad():
            w2 = nn.Parameter(down_std.contiguous(), requires_grad=down.requires_grad)
    return w13, w2


@torch.no_grad()
def _probe_returns_tuple(block: nn.Module, D: int) -> bool:
    """Whether the installed HF block returns ``(hidden_states, router_logits)``: run it on 2 tokens."""
    p = block.gate.weight
    was_training = block.training
    try:
        block.eval()
        out = block(torch.zeros(1, 2, D, device=p.device, dtype=_activation_dtype(block)))
    except Exception:  # e.g. weights on the meta device: fall back on the transformers major version
        import transformers

        major = int(transformers.__version__.split(".")[0])
        return major < 5 and SUPPORTED_BLOCKS[type(block).__name__].scoring == "softmax"
    finally:
        block.train(was_training)
    return isinstance(out, tuple)


def _activation_dtype(block: nn.Module) -> torch.dtype:
    w = getattr(block.experts, "down_proj", None)
    if not isinstance(w, torch.Tensor):
        w = block.experts[0].w2.weight if hasattr(block.experts[0], "w2") else block.experts[0].down_proj.weight
    return w.dtype
