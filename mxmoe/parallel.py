"""Expert parallelism over ``torch.distributed``: each rank of a group holds ``E / W`` experts, and
tokens travel to their experts and back through two ``all_to_all_single`` exchanges, the first of
them optionally in MXFP8 (E4M3 data + E8M0 scales: ~0.52x the bytes of BF16).

Shape letters: T tokens on this rank, D model dim, F expert FFN dim, E experts in all, W ranks in
the expert-parallel group, E_l = E / W experts per rank (rank r holds experts ``[r*E_l, (r+1)*E_l)``),
S = T * top_k routed slots this rank sends, R rows it receives, M padded local rows.

    x [T, D] --router (replicated on every rank)--> experts, weights [T, top_k]
      --slots sorted by expert id (= by destination rank)--> send rows [S, D]
      --all_to_all_single, split sizes exchanged first--> recv rows [R, D]  (source rank, local expert, token)
      --regrouped by local expert, groups padded to recipe.align--> xp [M, D]
            (MXFP8 dispatch: the received bytes are the fprop operand, no re-quantization)
      --local SwiGLU experts, grouped_linear--> yp [M, D]
      --receive order, reverse all_to_all_single--> [S, D] in send order
      --back to slots, weighted sum over top_k--> y [T, D]

Inside a local expert's group the rows are ordered by source rank, then by token: the order a
single-process :class:`~mxmoe.moe.MoE` gives the concatenation of all ranks' batches. Row for row
the two layers run the same products, and under MXFP8 the 32-token blocks of wgrad line up too,
which is what the tests check.

Backward runs the same two exchanges in reverse (autograd functions around the all-to-alls):
gradients travel in the activation dtype (BF16 in BF16 training), or in ``combine_dtype``.

Training with ``torchrun``: :func:`maybe_init_distributed`, :func:`convert_to_expert_parallel`,
:func:`allreduce_gradients`, :func:`clip_grad_norm_`, :func:`full_state_dict`, :func:`shutdown_distributed`.
"""

from __future__ import annotations

import datetime
import os
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from mxmoe import ops
from mxmoe.formats import BLOCK, MXTensor
from mxmoe.layouts import padded_groups
from mxmoe.moe import MoE, Routing
from mxmoe.ops import quantize
from mxmoe.recipes import Recipe

DISPATCH_DTYPES = ("auto", "mxfp8", "bf16", None)


# --------------------------------------------------------------------------------------------
# Process group helpers
# --------------------------------------------------------------------------------------------
def _group(group):
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("expert parallelism needs torch.distributed initialized "
                           "(launch with torchrun and call mxmoe.parallel.maybe_init_distributed())")
    return group if group is not None else dist.group.WORLD


def _comm_device(group) -> torch.device:
    """Where this group's collectives want their tensors: the current GPU for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def maybe_init_distributed(backend: str | None = None, timeout_s: float | None = None):
    """Initialize the default process group when launched by ``torchrun`` with more than one rank.

    Reads ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK`` (and ``MASTER_ADDR``/``MASTER_PORT``) from the
    environment, as torchrun sets them. On CUDA the backend is NCCL and the current device becomes
    ``cuda:LOCAL_RANK``; ``NCCL_NVLS_ENABLE`` defaults to ``0`` (NVLink multicast off). On CPU it is gloo.

    Args:
        backend: force ``"nccl"`` or ``"gloo"``; default by CUDA availability.
        timeout_s: collective timeout in seconds (default: torch's).
    Returns:
        ``dist.group.WORLD`` when distributed (already initialized or initialized here), else
        ``None`` (single process: ``WORLD_SIZE`` unset or 1).
    """
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    kwargs = {}
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
    dist.init_process_group(backend, **kwargs)
    return dist.group.WORLD


def shutdown_distributed() -> None:
    """End of a distributed run: wait for every rank, then destroy the default process group
    (a gloo rank that tears down while its peer is still working can abort). No-op if none."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _check_same_config(config: dict[str, float], group) -> None:
    """All-gather a small tensor of numeric settings; ValueError on every rank if any differ."""
    names = list(config)
    mine = torch.tensor([float(config[k]) for k in names], dtype=torch.float64, device=_comm_device(group))
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    table = torch.stack(gathered).cpu()  # [W, fields]
    bad = [f"{name}: " + ", ".join(f"rank {r} has {table[r, i].item():g}" for r in range(world))
           for i, name in enumerate(names) if bool((table[:, i] != table[0, i]).any())]
    if bad:
        raise ValueError("ranks of the expert-parallel group disagree on the MoE configuration: " + "; ".join(bad))


def _broadcast_(t: torch.Tensor, group) -> None:
    """In place: ``t`` takes the value it has on the group's first rank."""
    dev = _comm_device(group)
    buf = t.detach().to(dev).contiguous()
    dist.broadcast(buf, src=dist.get_global_rank(group, 0), group=group)
    with torch.no_grad():
        t.copy_(buf)


# --------------------------------------------------------------------------------------------
# The exchange: all_to_all_single with uneven splits, and its autograd
# --------------------------------------------------------------------------------------------
def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows ``x[sum(in_splits[:r]) : ...]`` go to rank r; returns the ``sum(out_splits)`` rows received."""
    x = x.contiguous()
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Differentiable exchange: backward sends the gradient rows back along the reversed splits."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


def _slot_sum(rows: torch.Tensor, send_slots: torch.Tensor, tokens: int, top_k: int) -> torch.Tensor:
    """Rows in send order ``[S, D]`` -> per token sums over its top_k slots ``[T, D]``, summed in slot
    order j = 0..top_k-1 (as the single-process layer's ``repeat_interleave`` backward does)."""
    slots = rows.new_zeros(tokens * top_k, rows.shape[1]).index_copy_(0, send_slots, rows)
    return slots.view(tokens, top_k, rows.shape[1]).sum(dim=1)


class _GatherSlots(torch.autograd.Function):
    """``x [T, D]`` -> the rows of its routed slots in send order ``[S, D]``."""

    @staticmethod
    def forward(ctx, x, send_slots, top_k):
        ctx.save_for_backward(send_slots)
        ctx.tokens, ctx.top_k = x.shape[0], top_k
        return x.index_select(0, send_slots // top_k)

    @staticmethod
    def backward(ctx, grad):
        (send_slots,) = ctx.saved_tensors
        return _slot_sum(grad, send_slots, ctx.tokens, ctx.top_k), None, None


@dataclass
class DispatchPlan:
    """Where each routed slot goes and where each received row lands (one layer call)."""

    send_slots: torch.Tensor  # [S] int64 slot ids (t * top_k + j) sorted by expert: the send order
    send_splits: list[int]  # [W] rows this rank sends to each rank
    recv_splits: list[int]  # [W] rows this rank receives from each rank
    recv_counts: torch.Tensor  # [W, E_l] int64 (host) rows from each source rank for each local expert
    dest_rows: torch.Tensor  # [R] int64 row of each received row in the padded local buffer
    offs: torch.Tensor  # [E_l] int32 cumulative ends of the padded local expert groups
    rows: int  # M, padded local buffer size (>= align; the last group absorbs the slack)


class _MXDispatch(torch.autograd.Function):
    """MXFP8 dispatch: quantize ``x`` rowwise (along D) once, send data + scale bytes, regroup.

    Forward returns ``(xp, data, scale)``: ``data [M, D]`` E4M3 and ``scale [M, D/32]`` E8M0 bytes
    of the padded local buffer (the fprop operand, as received) and ``xp`` their dequantized value
    in ``x.dtype``, the autograd handle. Backward treats the rounding as identity (straight-through,
    as the single-process layer's quantization inside grouped_linear does) and sends the gradient
    rows back in ``grad_dtype`` (default ``x.dtype``).
    """

    @staticmethod
    def forward(ctx, x, plan: DispatchPlan, top_k: int, scale_rule: str, grad_dtype, group, act_block: int = BLOCK):
        T, D = x.shape
        Ds = D // BLOCK
        if T:
            q = quantize(x, -1, scale_rule, act_block)  # [T, D] e4m3, [T, D/32] e8m0 (1x128: replicated)
            wire = torch.cat([q.data.view(torch.uint8), q.scale.view(torch.uint8)], dim=1)  # [T, D + D/32]
        else:
            wire = torch.empty(0, D + Ds, dtype=torch.uint8, device=x.device)
        recv = _all_to_all(wire.index_select(0, plan.send_slots // top_k), plan.recv_splits, plan.send_splits, group)
        data = recv.new_zeros(plan.rows, D).index_copy_(0, plan.dest_rows, recv[:, :D])  # zero rows: byte 0
        scale = recv.new_zeros(plan.rows, Ds).index_copy_(0, plan.dest_rows, recv[:, D:])  # and scale 2^-127
        data, scale = data.view(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu)
        xp = MXTensor(data, scale, 1, scale_rule, (1, act_block)).dequantize(x.dtype)  # [M, D]
        ctx.mark_non_differentiable(data, scale)
        ctx.set_materialize_grads(False)  # no zero FP8 gradients made for data and scale
        ctx.plan, ctx.top_k, ctx.tokens, ctx.grad_dtype, ctx.group = plan, top_k, T, grad_dtype or x.dtype, group
        ctx.x_dtype = x.dtype
        return xp, data, scale

    @staticmethod
    def backward(ctx, grad_xp, _grad_data, _grad_scale):
        plan = ctx.plan
        g = grad_xp.index_select(0, plan.dest_rows).to(ctx.grad_dtype)  # [R, D] receive order
        g = _all_to_all(g, plan.send_splits, plan.recv_splits, ctx.group)  # [S, D] send order
        dx = _slot_sum(g.to(ctx.x_dtype), plan.send_slots, ctx.tokens, ctx.top_k)
        return dx, None, None, None, None, None, None


# --------------------------------------------------------------------------------------------
# The layer
# --------------------------------------------------------------------------------------------
class ExpertParallelMoE(MoE):
    """:class:`~mxmoe.moe.MoE` whose experts are spread over the ranks of a process group.

    Rank r of a group of W ranks holds experts ``[r*E_l, (r+1)*E_l)``, ``E_l = num_experts / W``;
    the router is replicated (broadcast from the group's first rank at construction). Every rank
    of the group must call forward (and backward) the same number of times, in the same order.

    Args:
        dim, ffn_dim, num_experts, top_k, recipe, aux_loss_coef, renormalize: as :class:`MoE`
            (``num_experts`` counts all experts of the group).
        ep_group: the expert-parallel process group (default: the world).
        dispatch_dtype: how tokens travel to their experts. ``"mxfp8"``: E4M3 data + E8M0 scales
            (D + D/32 bytes a row), used as is by the first expert product (needs an MXFP8 recipe);
            ``"bf16"``: BF16 (then expert outputs and gradients travel in BF16 too); ``None``: the
            activations' own dtype; ``"auto"`` (default): ``"mxfp8"`` under an MXFP8 recipe, else ``None``.
        combine_dtype: dtype in which expert outputs and all gradients travel (``torch.bfloat16``
            or ``"bf16"`` to halve FP32 traffic); default the activation dtype (BF16 in BF16 training).
    Parameters:
        router.weight ``[E, D]`` (replicated); w13 ``[E_l, 2F, D]``; w2 ``[E_l, D, F]`` (this rank's experts).
    Attributes:
        comm_stats: after each forward, rows and bytes this rank sent in the dispatch and the
            combine, in all and to other ranks (host ints, forward only; backward mirrors them).
    Raises:
        RuntimeError: torch.distributed is not initialized.
        ValueError: ``num_experts`` not divisible by the group size; ranks disagree on the
            configuration (raised on every rank); ``dispatch_dtype="mxfp8"`` with a non-MXFP8 recipe;
            and everything :class:`MoE` raises.
    """

    def __init__(self, dim: int, ffn_dim: int, num_experts: int, top_k: int, recipe: "str | Recipe" = "mxfp8",
                 ep_group=None, dispatch_dtype: str | None = "auto", combine_dtype=None,
                 aux_loss_coef: float = 0.01, renormalize: bool | None = None):
        group = _group(ep_group)
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if num_experts % world:
            raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel group size {world}")
        if dispatch_dtype not in DISPATCH_DTYPES:
            raise ValueError(f"dispatch_dtype must be one of {DISPATCH_DTYPES}, got {dispatch_dtype!r}")
        if combine_dtype == "bf16":
            combine_dtype = torch.bfloat16
        if combine_dtype not in (None, torch.bfloat16, torch.float32):
            raise ValueError(f"combine_dtype must be None, 'bf16', torch.bfloat16 or torch.float32, got {combine_dtype!r}")
        with torch.device("meta"):  # MoE.__init__ would allocate all E experts; real tensors follow
            super().__init__(dim, ffn_dim, num_experts, top_k, recipe, aux_loss_coef, renormalize)
        self.dispatch_dtype, self.combine_dtype = dispatch_dtype, combine_dtype
        self.ep_group, self.ep_size, self.ep_rank = group, world, rank
        self.num_local_experts = num_experts // world
        self.expert_offset = rank * self.num_local_experts  # global id of local expert 0
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(self.num_local_experts, 2 * ffn_dim, dim))
        self.w2 = nn.Parameter(torch.empty(self.num_local_experts, dim, ffn_dim))
        self.reset_parameters()
        self.aux_loss = torch.zeros(())
        self.comm_stats: dict[str, int] = {}
        self._check_config()
        _broadcast_(self.router.weight, group)

    # ---------------------------------------------------------------- construction helpers
    def _config(self) -> dict[str, float]:
        r = self.recipe
        return {"dim": self.dim, "ffn_dim": self.ffn_dim, "num_experts": self.num_experts, "top_k": self.top_k,
                "renormalize": self.renormalize, "aux_loss_coef": self.aux_loss_coef, "ep_size": self.ep_size,
                "recipe (crc32 of its fields)": zlib.crc32(repr(r).encode()), "align": r.align,
                "dispatch_dtype (index)": DISPATCH_DTYPES.index(self.dispatch_dtype),
                "combine_dtype (itemsize)": self.combine_dtype.itemsize if self.combine_dtype else 0}

    def _check_config(self) -> None:
        if self.dispatch_dtype == "mxfp8" and not self.recipe.mxfp8:
            raise ValueError(f"dispatch_dtype='mxfp8' needs an MXFP8 recipe, got {self.recipe.name!r}")
        _check_same_config(self._config(), self.ep_group)

    def set_recipe(self, recipe: "str | Recipe") -> None:
        """As :meth:`MoE.set_recipe`; once built, a collective: every rank must switch together."""
        super().set_recipe(recipe)
        if hasattr(self, "ep_group"):
            self._check_config()

    @classmethod
    def from_full(cls, moe: MoE, ep_group=None, dispatch_dtype: str | None = "auto",
                  combine_dtype=None) -> "ExpertParallelMoE":
        """This rank's share of a single-process :class:`MoE`: same settings and router, its expert slice.

        The result lives on ``moe``'s device and dtypes; the CPU RNG state is left unchanged.
        Collective (config check, router broadcast).
        """
        with torch.random.fork_rng(devices=[]):  # the throw-away init leaves the CPU RNG stream as it was
            ep = cls(moe.dim, moe.ffn_dim, moe.num_experts, moe.top_k, moe.recipe, ep_group, dispatch_dtype,
                     combine_dtype, moe.aux_loss_coef, moe.renormalize)
        ep.load_from_full(moe)
        return ep

    def load_from_full(self, moe: MoE) -> None:
        """Take router and the local slice ``[E_l*rank, E_l*(rank+1))`` of a full layer's experts.

        Parameters are replaced by copies on ``moe``'s device and dtype; the router is then broadcast
        from the group's first rank, so replicas agree even if the full layers differ between ranks.
        Raises ValueError if ``moe`` has another shape (dim, ffn_dim or num_experts).
        """
        mine = (self.dim, self.ffn_dim, self.num_experts)
        theirs = (moe.dim, moe.ffn_dim, moe.num_experts)
        if mine != theirs:
            raise ValueError(f"load_from_full: (dim, ffn_dim, num_experts) {theirs} of the full layer != {mine}")
        sl = slice(self.expert_offset, self.expert_offset + self.num_local_experts)
        self.router.weight = nn.Parameter(moe.router.weight.detach().clone(), moe.router.weight.requires_grad)
        self.w13 = nn.Parameter(moe.w13.detach()[sl].clone(), moe.w13.requires_grad)
        self.w2 = nn.Parameter(moe.w2.detach()[sl].clone(), moe.w2.requires_grad)
        _broadcast_(self.router.weight, self.ep_group)

    # ---------------------------------------------------------------- forward pieces
    def resolved_dispatch_dtype(self, x_dtype: torch.dtype) -> "str | torch.dtype":
        """``"mxfp8"`` or the torch dtype tokens travel in, for activations of ``x_dtype``."""
        d = self.dispatch_dtype
        if d == "auto":
            return "mxfp8" if self.recipe.mxfp8 else x_dtype
        if d == "mxfp8":
            if not self.recipe.mxfp8:
                raise ValueError(f"dispatch_dtype='mxfp8' needs an MXFP8 recipe, got {self.recipe.name!r}")
            return "mxfp8"
        return torch.bfloat16 if d == "bf16" else x_dtype

    def dispatch_plan(self, experts: torch.Tensor, counts: torch.Tensor) -> DispatchPlan:
        """Exchange per-expert counts (one all_to_all) and lay out the padded local buffer.

        Args:
            experts: ``[T, top_k]`` int64 global expert ids.
            counts: ``[E]`` int64 slots of this rank routed to each expert.
        Synchronizes with the device once (split sizes must be host integers).
        """
        W, El, align = self.ep_size, self.num_local_experts, self.recipe.align
        dev = experts.device
        send_slots = torch.argsort(experts.reshape(-1), stable=True)  # [S] by expert, then slot
        counts = counts.to(device=_comm_device(self.ep_group), dtype=torch.int64).contiguous()
        recv = torch.empty_like(counts)  # recv[src*E_l + e]: rows from src for local expert e
        dist.all_to_all_single(recv, counts, group=self.ep_group)
        host = torch.cat([counts, recv]).cpu()
        send_splits = host[:W * El].view(W, El).sum(1).tolist()
        recv_counts = host[W * El:].view(W, El)  # [W, E_l]
        recv_splits = recv_counts.sum(1).tolist()
        per_expert = recv_counts.sum(0)  # [E_l]
        group_start, ends = padded_groups(per_expert, align)  # [E_l] padded first / end row of each group
        M = max(int(ends[-1]), align)
        block_start = group_start + torch.cumsum(recv_counts, 0) - recv_counts  # [W, E_l] first row of (src, e)
        seg_len = recv_counts.reshape(-1)  # receive order is (src, e)
        seg_first = torch.cumsum(seg_len, 0) - seg_len  # first received row of each (src, e) segment
        R = int(seg_len.sum())
        seg = torch.repeat_interleave(torch.arange(W * El, device=dev), seg_len.to(dev), output_size=R)
        dest_rows = (block_start.reshape(-1) - seg_first).to(dev)[seg] + torch.arange(R, device=dev)
        ends[-1] = M
        return DispatchPlan(send_slots, send_splits, recv_splits, recv_counts, dest_rows,
                            ends.to(device=dev, dtype=torch.int32), M)

    def dispatch(self, x: torch.Tensor, plan: DispatchPlan) -> tuple[torch.Tensor, MXTensor | None]:
        """``x [T, D]`` -> padded local buffer ``xp [M, D]`` (``x.dtype``) and, under MXFP8 dispatch,
        the same rows as received, ``MXTensor [M, D]`` quantized along D."""
        how = self.resolved_dispatch_dtype(x.dtype)
        D = self.dim
        if how == "mxfp8":
            g = self.recipe.act_block
            xp, data, scale = _MXDispatch.apply(x, plan, self.top_k, self.recipe.scale_rule,
                                                self.combine_dtype, self.ep_group, g)
            row_bytes = D + D // BLOCK
            x_mx = MXTensor(data, scale, 1, self.recipe.scale_rule, (1, g))
        else:
            xs = _GatherSlots.apply(x, plan.send_slots, self.top_k).to(how)  # [S, D]
            xr = _AllToAll.apply(xs, plan.recv_splits, plan.send_splits, self.ep_group).to(x.dtype)  # [R, D]
            xp = xr.new_zeros(plan.rows, D).index_copy(0, plan.dest_rows, xr)
            row_bytes, x_mx = D * how.itemsize, None
        self._record("dispatch", plan, row_bytes)
        return xp, x_mx

    def combine(self, yp: torch.Tensor, plan: DispatchPlan, tokens: int) -> torch.Tensor:
        """Expert outputs ``yp [M, D]`` -> each slot's output ``[T * top_k, D]`` (slot t*top_k + j)."""
        dt = self.combine_dtype or (torch.bfloat16 if self.dispatch_dtype == "bf16" else yp.dtype)
        yr = yp.index_select(0, plan.dest_rows).to(dt)  # [R, D] receive order
        ys = _AllToAll.apply(yr, plan.send_splits, plan.recv_splits, self.ep_group).to(yp.dtype)  # [S, D]
        self._record("combine", plan, self.dim * dt.itemsize, reverse=True)
        return ys.new_zeros(tokens * self.top_k, self.dim).index_copy(0, plan.send_slots, ys)

    def _record(self, what: str, plan: DispatchPlan, row_bytes: int, reverse: bool = False) -> None:
        splits = plan.recv_splits if reverse else plan.send_splits
        rows, remote = sum(splits), sum(splits) - splits[self.ep_rank]
        self.comm_stats.update({f"{what}_rows": rows, f"{what}_bytes": rows * row_bytes,
                                f"{what}_remote_bytes": remote * row_bytes})

    def permute(self, x2: torch.Tensor, r: Routing):
        """Collective: exchange tokens so each rank holds its experts' rows (see :meth:`dispatch`). A group of
        one rank has nothing to exchange: it permutes as :class:`MoE` does (the same rows in the same order;
        no host synchronization, so the layer traces as one graph under torch.compile)."""
        if self.ep_size == 1:
            self.comm_stats = dict.fromkeys(("dispatch_rows", "dispatch_bytes", "dispatch_remote_bytes",
                                             "combine_rows", "combine_bytes", "combine_remote_bytes"), 0)
            return super().permute(x2, r)
        plan = self.dispatch_plan(r.experts, r.counts)
        xp, x_mx = self.dispatch(x2, plan)  # [M, D]
        return xp, plan.offs, x_mx, plan

    def unpermute(self, yp: torch.Tensor, plan: DispatchPlan, r: Routing) -> torch.Tensor:
        """Collective: the reverse exchange (see :meth:`combine`), then each token's weighted sum."""
        if not isinstance(plan, DispatchPlan):  # a group of one rank: MoE's own state (see permute)
            return super().unpermute(yp, plan, r)
        T = r.weights.shape[0]
        ys = self.combine(yp, plan, T)  # [T*top_k, D], slot t*top_k + j
        return ops.combine(ys, torch.arange(ys.shape[0], device=ys.device), r.weights, validate=False,
                           backend=r.backend)

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", ep_size={self.ep_size}, local_experts="
                f"[{self.expert_offset}, {self.expert_offset + self.num_local_experts}), "
                f"dispatch_dtype={self.dispatch_dtype!r}")


# --------------------------------------------------------------------------------------------
# Whole models: conversion, gradient synchronization, clipping, checkpoints
# --------------------------------------------------------------------------------------------
def convert_to_expert_parallel(model: nn.Module, group=None, dispatch_dtype: str | None = "auto",
                               combine_dtype=None) -> nn.Module:
    """Swap every :class:`MoE` inside ``model`` for an :class:`ExpertParallelMoE` holding this rank's
    expert slice (and the same router). Collective: every rank converts the same model structure.

    Returns ``model`` (changed in place), or the new layer if ``model`` itself is an ``MoE``.
    Layers already expert-parallel are left alone.
    """
    group = _group(group)
    if isinstance(model, MoE) and not isinstance(model, ExpertParallelMoE):
        return ExpertParallelMoE.from_full(model, group, dispatch_dtype, combine_dtype)
    for name, child in list(model.named_modules()):
        if isinstance(child, MoE) and not isinstance(child, ExpertParallelMoE):
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, attr, ExpertParallelMoE.from_full(child, group, dispatch_dtype, combine_dtype))
    return model


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters that differ between ranks: the local experts (w13, w2) of every ExpertParallelMoE."""
    return [p for m in model.modules() if isinstance(m, ExpertParallelMoE) for p in (m.w13, m.w2)]


def _split_params(model: nn.Module):
    experts = {id(p) for p in expert_parameters(model)}
    params = [p for p in model.parameters() if p.requires_grad]
    return [p for p in params if id(p) not in experts], [p for p in params if id(p) in experts]


def sync_replicated_parameters(model: nn.Module, group=None) -> None:
    """Broadcast every parameter and buffer except the local experts from the group's first rank."""
    group = _group(group)
    experts = {id(p) for p in expert_parameters(model)}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in experts:
            _broadcast_(t, group)


def allreduce_gradients(model: nn.Module, group=None) -> None:
    """After ``backward`` of each rank's mean loss over its own batch: make every gradient the one of
    the mean loss over the whole group's batch (data parallel over the same ranks).

    Replicated parameters (router, attention, embeddings, ...): gradients averaged over the group.
    Local experts: their gradients already hold every rank's contribution (it came back through
    the combine exchange), so they are divided by the group size. A parameter without a gradient
    gets zeros (every rank must reduce the same tensors).
    """
    group = _group(group)
    world = dist.get_world_size(group)
    replicated, experts = _split_params(model)
    for p in replicated + experts:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for p in experts:
        p.grad.div_(world)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in replicated:
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():  # one all_reduce per dtype, over a flat copy
        flat = torch.cat([g.reshape(-1) for g in grads]).to(_comm_device(group))
        dist.all_reduce(flat, group=group)
        flat = flat.div_(world).to(grads[0].device)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


def clip_grad_norm_(model: nn.Module, max_norm: float, group=None) -> torch.Tensor:
    """Clip to a global gradient norm over the whole expert-parallel model (call after
    :func:`allreduce_gradients`): replicated gradients counted once, every rank's experts added.

    Returns the total norm (FP32 scalar, same on every rank), before clipping.
    """
    group = _group(group)
    replicated, experts = _split_params(model)
    dev = _comm_device(group)

    def sq(ps):
        return sum((p.grad.float().square().sum().to(dev) for p in ps if p.grad is not None),
                   torch.zeros((), device=dev))

    local = sq(experts)
    dist.all_reduce(local, group=group)
    total = (sq(replicated) + local).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in replicated + experts:
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.device, p.grad.dtype))
    return total


def full_state_dict(model: nn.Module, group=None) -> dict[str, torch.Tensor]:
    """The state dict of the single-process model: every ExpertParallelMoE's w13/w2 all-gathered
    into ``[E, ...]`` (same keys as before conversion). Collective; the result is on every rank."""
    group = _group(group)
    state = model.state_dict()
    dev = _comm_device(group)
    for name, m in model.named_modules():
        if isinstance(m, ExpertParallelMoE):
            for pname in ("w13", "w2"):
                local = getattr(m, pname).detach().to(dev).contiguous()
                parts = [torch.empty_like(local) for _ in range(m.ep_size)]
                dist.all_gather(parts, local, group=group)
                state[f"{name}.{pname}" if name else pname] = torch.cat(parts).to(getattr(m, pname).device)
    return state
