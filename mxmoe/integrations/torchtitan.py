"""torchtitan's MoE experts on mxmoe's expert products (any mxmoe recipe), for torchtitan 0.2.2.

Why 0.2.2: it is the newest torchtitan release that runs with both torches this project uses, CI's
2.13.0 (CPU) and the GPU machines' 2.11 (0.3.0 imports ``torch.distributed.fsdp.DataParallelMeshDims``,
which torch 2.11 lacks: ``torchtitan.train`` fails to import there). docs/torchtitan.md has
the evidence.

torchtitan 0.2.2 builds its MoE layers (``torchtitan.models.moe.MoE``) as modules: a router, a token
reorderer and the experts, ``torchtitan.models.moe.GroupedExperts`` (``w1 [E, F, D]``, ``w2 [E, D, F]``,
``w3 [E, F, D]``; forward ``silu(x W1^T) * (x W3^T)`` then ``W2``, three ``torch._grouped_mm`` in BF16 on
the expert-ordered rows, each expert's group padded to the global ``TOKEN_GROUP_ALIGN_SIZE_M`` rows).
Model converters (``torchtitan.protocols.model_converter``), registered by name and listed in
``--model.converters``, rewrite the built model before it is parallelized. This module's converter,
``mxmoe``, turns every ``GroupedExperts`` into :class:`MXMoEGroupedExperts` in place: the same three
parameters (the same ``nn.Parameter`` objects, names, shapes and initialization, so FSDP2 sharding,
tensor / expert parallel placements, distributed checkpoints and the Hugging Face state-dict adapters
are untouched), whose forward runs :func:`mxmoe.grouped_linear` under the chosen recipe.

Padding. Without expert parallelism the experts pad each expert's row group to ``Recipe.align`` rows
themselves (32, or 128 under ``mxfp8_128``; mxmoe's permutation plan, no host synchronization): one
gather into the padded groups, fused with the quantization of x for the first product where the route
allows (:func:`mxmoe.ops.permute_tokens`), and one back after the products (:func:`mxmoe.ops.unpermute`,
whose backward is a gather too). Under expert parallelism torchtitan's ``ExpertParallel`` pads
the received rows to ``TOKEN_GROUP_ALIGN_SIZE_M`` after its all-to-all; the converter sets that to the
recipe's alignment (``set_token_group_alignment_size_m``, as torchtitan's own MXFP8 converter does).
Expert parallelism is not yet exercised in a multi-GPU run.

Fused and unfused. With ``fused_swiglu`` (the default) the gate and up weights are one product's weight
parts (:func:`mxmoe.grouped_linear` with ``w=(w1, w3)``: concatenated where they are quantized, and
each part's gradient its own wgrad output), so x is quantized once for one product ``x [w1; w3]^T -> h
[M, 2F]``, and mxmoe's SwiGLU
(:func:`mxmoe.ops.swiglu`) is fused with the quantization of its output for the W2 product where the
GPU route allows (Hopper: the expansion route under ``mxfp8`` / ``mxfp8_2d``, the promote-per-128
route under ``mxfp8_128``). torchtitan's token reorder and combine stay torchtitan's either way. With ``fused_swiglu=False`` the three products
run as torchtitan writes them (x quantized twice, torch's SwiGLU), each an MX :func:`~mxmoe.grouped_linear`.

Selecting it, on the command line of torchtitan's trainer (``torchtitan.train``)::

    --job.custom_config_module mxmoe.integrations.torchtitan --model.converters mxmoe --mxmoe.recipe mxfp8_128

(``--job.custom_config_module`` imports this module, which registers the converter, and adds its
``--mxmoe.*`` options: ``recipe``, ``fused_swiglu``, ``validate``, ``keep_fp8_weights``.) From Python:
:func:`convert_grouped_experts` on a built model (torchtitan builds DeepSeek-V3 from args completed by
``args.update_from_config(JobConfig())``, as its trainer does; a CPU forward needs :func:`cpu_histc`).

Compile: torchtitan 0.2.2's ``--compile.enable`` compiles each MoE layer's router and shared experts but
leaves the ``experts`` module out (it compiles its own ``_run_experts_grouped_mm`` function instead, around
FSDP's hooks on the module). The converter does the same for its experts: with ``--compile.enable`` (and
``model`` in ``--compile.components``) each converted module's forward runs the experts through
``torch.compile(fullgraph=True)`` with torchtitan's compile backend (:func:`compiled_experts`): the padding
plan, the gathers, the three products and the SwiGLU in one graph, mxmoe's kernels as custom ops in it.

Only torchtitan's plain ``GroupedExperts`` convert: gpt-oss's experts (``GptOssGroupedExperts``, biases
and a clamped SwiGLU) call ``torch._grouped_mm`` directly in 0.2.2 and are left as they are (the
converter says so). DeepEP's MoE is untested.

Dims: the experts' ``dim`` and ``hidden_dim`` (per tensor-parallel shard) must be multiples of the
recipe's scale groups (32; 128 under ``mxfp8_128``). Activations enter the products in BF16 (FP32 under
mxmoe's exact ``fp32`` test recipe), as torchtitan's own experts cast them; the weights are quantized
from the parameters' own dtype. On the CPU every recipe runs mxmoe's pure-torch reference.
"""

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    from torch.distributed.tensor import DTensor
    from torchtitan.models.moe.moe import GroupedExperts
    from torchtitan.models.moe import utils as _moe_utils
    from torchtitan.protocols.model_converter import _registry_model_converter_cls, register_model_converter
except ImportError as e:  # torchtitan absent, or a release without these seams
    raise ImportError(f"mxmoe.integrations.torchtitan needs torchtitan {'0.2.2'} (from a clone: pip install -e "
                      f"'.[torchtitan]'); importing it failed: {e}") from e

from mxmoe.moe import permute_plan
from mxmoe.ops import grouped_linear, permute_tokens, unpermute
from mxmoe.ops.activation import linear_swiglu
from mxmoe.ops.linear import prequantized_operands, weight_operands_apply
from mxmoe.ops.quantization import quantize_weight_both
from mxmoe.recipes import Recipe, get_recipe

TORCHTITAN_VERSION = "0.2.2"  # the release whose seams this module is written against (pyproject's extra)
CONVERTER_NAME = "mxmoe"  # for --model.converters

__all__ = ["MXMoEGroupedExperts", "MXMoEConverter", "MXMoEOptions", "JobConfig", "convert_grouped_experts",
           "run_experts", "compiled_experts", "cpu_histc", "CONVERTER_NAME", "TORCHTITAN_VERSION"]


def _local(w: torch.Tensor) -> torch.Tensor:
    """A parameter's local tensor: DTensors (tensor / expert parallel placements) to their shard, as
    torchtitan's experts do; plain tensors (FSDP2's unsharded parameters in forward) as they are."""
    return w.to_local() if isinstance(w, DTensor) else w


def _expert_parallel(w: torch.Tensor) -> bool:
    """Whether ``w`` is sharded over an expert-parallel mesh dim (then torchtitan's ExpertParallel pads)."""
    return isinstance(w, DTensor) and "ep" in (w.device_mesh.mesh_dim_names or ())


class MXMoEGroupedExperts(GroupedExperts):
    """torchtitan's ``GroupedExperts`` with its products run by :func:`mxmoe.grouped_linear`.

    Made from a built ``GroupedExperts`` by :meth:`convert` (in place: the parameters stay the module's).
    Attributes besides torchtitan's (``w1``, ``w2``, ``w3``, ``num_experts``, ``use_grouped_mm``, the
    last ignored): ``recipe`` (:class:`mxmoe.Recipe`), ``fused_swiglu``, ``validate`` (check shapes and
    group offsets in every product; synchronizes with the GPU), ``keep_fp8_weights`` (under activation
    checkpointing, the forward's FP8 weights kept for the recompute: :meth:`_weight_operands`).
    """

    recipe: Recipe
    fused_swiglu: bool
    validate: bool
    keep_fp8_weights: bool = False
    compile_backend: "str | None" = None  # torch.compile backend of the experts (None: eager)
    # (key, FP8 weight operands) of a checkpointed forward, kept for its recompute (_weight_operands)
    _recompute_operands: "tuple | None" = None

    @classmethod
    def convert(cls, experts: GroupedExperts, recipe: "str | Recipe" = "mxfp8_128", fused_swiglu: bool = True,
                validate: bool = False, keep_fp8_weights: bool = False) -> "MXMoEGroupedExperts":
        """``experts`` (a torchtitan ``GroupedExperts``, or one already converted) made an mxmoe one, in
        place; returns it. Raises TypeError for other modules, ValueError for an unknown recipe or dims
        the recipe cannot take."""
        if type(experts) not in (GroupedExperts, cls):
            raise TypeError(f"mxmoe converts torchtitan's GroupedExperts, got {type(experts).__qualname__}")
        rec = get_recipe(recipe)
        _, hidden, dim = experts.w1.shape
        rec.check_dims(dim, hidden)
        experts.__class__ = cls
        experts.recipe, experts.fused_swiglu, experts.validate = rec, bool(fused_swiglu), bool(validate)
        experts.keep_fp8_weights, experts._recompute_operands = bool(keep_fp8_weights), None
        return experts

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Experts on the expert-ordered rows ``x [R, D]`` (any float dtype) -> ``[R, D]`` in x's dtype.

        ``num_tokens_per_expert`` ``[E]`` (any number dtype): rows of each
        expert's group, in order. Without expert parallelism their sum is ``R`` and the groups are padded
        here; under it torchtitan has padded them to ``recipe.align`` and the rows past their sum are padding.
        """
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        self.recipe.check_dims(w2.shape[1], w2.shape[2])  # python ints: the shard this rank holds
        ep = _expert_parallel(self.w1)
        run = run_experts if self.compile_backend is None else compiled_experts(self.compile_backend, ep)
        return run(x, num_tokens_per_expert, w1, w2, w3, self.recipe, self.fused_swiglu, self.validate, ep,
                   self._weight_operands(x, w1, w2, w3))

    def _weight_operands(self, x, w1, w2, w3):
        """The FP8 weight operands ``((w1; w3), w2)``, each :func:`~mxmoe.ops.quantize_weight_both`'s pair, for a
        forward under activation checkpointing and its recompute; None elsewhere (the products quantize the
        weights themselves).

        A checkpointed block runs its forward twice a step on unchanged weights: in forward, and again in
        backward to remake what it did not save. Where the recipe quantizes each weight once for both products
        (square tiles, ``mxfp8_128``; not the ``_lowmem`` recipes, which trade time for memory) and
        ``keep_fp8_weights`` is on, the first forward's operands are kept on the module, 2 bytes a weight, until
        the recompute takes them, and the recompute reads no FP32 weight (FP32 weights: 6 bytes a weight moved
        once a step instead of twice). Off by default: they are held through the start of backward, where a
        training step's memory peaks. Forward knows it is checkpointed (or offloaded) by the saved-tensor
        hooks it runs under; forward code that runs inside backward is the recompute, which takes the operands off
        the module. Every other forward replaces or drops them, so they serve only the recompute of the latest
        forward (one a step never recomputes leaves them until the next forward). The recompute uses them only
        for the same weight tensors at the same version and address: an in-place update between the two
        requantizes, except one that bumps no version counter (through ``.data``), after which the recompute
        computes with the forward's weights, as an uncheckpointed layer's backward does. Under FSDP2 with
        ``reshard_after_forward`` the weights are gathered anew for backward at another address, so nothing is
        reused there (only held).
        """
        rec, params = self.recipe, (self.w1, self.w3, self.w2)
        recompute = torch._C._current_graph_task_id() != -1  # forward code inside backward: a checkpoint's recompute
        kept = self._recompute_operands
        self._recompute_operands = None
        if not (self.keep_fp8_weights and self.fused_swiglu and torch.is_grad_enabled() and not rec.requantize_weights
                and any(p.requires_grad for p in params) and weight_operands_apply(rec, x, w1)):
            return None
        key = tuple((id(p), w._version, w.data_ptr()) for p, w in zip(params, (w1, w3, w2)))
        if recompute:
            return kept[1] if kept is not None and kept[0] == key else None
        if torch._C._autograd._top_saved_tensors_default_hooks(True) is None:  # saved tensors kept as they are
            return None
        with torch.no_grad():  # (no autograd record: the recompute, which skips this, must save what forward did)
            ops = (quantize_weight_both((w1, w3), rec), quantize_weight_both(w2, rec))
        self._recompute_operands = (key, ops)
        return ops


def run_experts(x: torch.Tensor, num_tokens_per_expert: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                w3: torch.Tensor, recipe: Recipe, fused_swiglu: bool, validate: bool, expert_parallel: bool,
                weight_operands: tuple | None = None):
    """:meth:`MXMoEGroupedExperts.forward` on local tensors (``w1 [E, F, D]``, ``w2 [E, D, F]``, ``w3 [E, F, D]``):
    ``x [R, D]`` expert-ordered rows -> ``[R, D]`` in x's dtype. ``expert_parallel``: torchtitan has padded the
    groups to ``recipe.align`` (the rows past the counts' sum are padding); else they are padded here.
    ``weight_operands``: ``((w1; w3), w2)`` already quantized, each ``(along K, along N)`` (fused SwiGLU only;
    :meth:`MXMoEGroupedExperts._weight_operands`), or None."""
    xc = x.float() if recipe.compute_dtype == "float32" else x.bfloat16()
    counts = num_tokens_per_expert.to(torch.int64)
    if expert_parallel:  # padded by torchtitan (TOKEN_GROUP_ALIGN_SIZE_M = recipe.align)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        offs[-1:].fill_(x.shape[0])  # the last group takes the slack rows (zeros)
        return _experts(xc, w1, w2, w3, offs, recipe, fused_swiglu, validate, None, weight_operands).type_as(x)
    n = x.shape[0]
    expert_of_row = torch.repeat_interleave(torch.arange(counts.numel(), device=x.device), counts, output_size=n)
    slot_rows, offs, rows, _ = permute_plan(expert_of_row[:, None], counts.numel(), recipe.align)
    # the padding gather fused with the first product's quantization where the route allows (w1: its K, dtype)
    xp, xp_mx = permute_tokens(xc, slot_rows, rows, 1, recipe, w1)
    yp = _experts(xp, w1, w2, w3, offs, recipe, fused_swiglu, validate, xp_mx, weight_operands)
    return unpermute(yp, slot_rows).type_as(x)  # backward: a gather, not index_select's atomic index_add


_COMPILED: dict = {}


def compiled_experts(backend: str, expert_parallel: bool = False):
    """:func:`run_experts` under ``torch.compile(backend=backend, fullgraph=True)``, one per backend (the recipe
    and flags are guarded constants). Under expert parallelism the row count varies from step to step, so x's
    first dim is marked dynamic there, as torchtitan does for its own grouped experts."""
    key = (backend, expert_parallel)
    if key not in _COMPILED:
        fn = torch.compile(run_experts, backend=backend, fullgraph=True)
        if expert_parallel:
            inner = fn

            def fn(x, *args):
                torch._dynamo.mark_dynamic(x, 0)
                return inner(x, *args)
        _COMPILED[key] = fn
    return _COMPILED[key]


def _experts(x, w1, w2, w3, offs, rec: Recipe, fused_swiglu: bool, v: bool, x_mx=None, w_ops=None):
    """The SwiGLU experts on padded groups (``offs`` int32 end rows, the last ``x.shape[0]``); ``x_mx``: x's
    MXFP8 copies from the fused permutation (:func:`~mxmoe.ops.permute_tokens`), or None; ``w_ops``: the weights'
    FP8 operands (:func:`run_experts`'s ``weight_operands``), or None."""
    pre = prequantized_operands(x_mx)
    v_x = v and x_mx is None  # prequantized operands are checked by their maker, not re-validated
    if not fused_swiglu:
        h = F.silu(grouped_linear(x, w1, offs, rec, validate=v_x, **pre)) * grouped_linear(x, w3, offs, rec,
                                                                                         validate=v_x, **pre)
        return grouped_linear(h, w2, offs, rec, validate=v)
    # one product with cat(w1, w3) [E, 2F, D] (gate rows [:F], up rows [F:], mxmoe.MoE's w13), each part's
    # dW its own wgrad output: no copy of a concatenated gradient into w1.grad / w3.grad
    w13_mx, w2_mx = w_ops or (None, None)
    a, a_mx = linear_swiglu(x, (w1, w3), offs, rec, w2, validate=v_x, w_mx=w13_mx, **pre)  # a = SwiGLU(h), quantized
    return grouped_linear(a, w2, offs, rec, validate=v and a_mx is None, w_mx=w2_mx, **prequantized_operands(a_mx))


def convert_grouped_experts(model: nn.Module, recipe: "str | Recipe" = "mxfp8_128", fused_swiglu: bool = True,
                            validate: bool = False, compile_backend: "str | None" = None,
                            keep_fp8_weights: bool = False) -> list[str]:
    """Every torchtitan ``GroupedExperts`` of ``model`` made :class:`MXMoEGroupedExperts` (in place), and
    torchtitan's expert-parallel group padding set to the recipe's alignment. Returns the converted
    modules' names. ``compile_backend``: run the experts under ``torch.compile(fullgraph=True)`` with that
    backend (e.g. ``"inductor"``; :func:`compiled_experts`), None: eager. ``keep_fp8_weights``: under
    activation checkpointing, keep the forward's FP8 weights for the recompute
    (:meth:`MXMoEGroupedExperts._weight_operands`).

    Raises:
        ValueError: unknown recipe; expert dims the recipe cannot take; a model without GroupedExperts.
    """
    rec = get_recipe(recipe)
    names = [n for n, m in model.named_modules() if type(m) in (GroupedExperts, MXMoEGroupedExperts)]
    if not names:
        others = sorted({type(m).__name__ for m in model.modules() if "Experts" in type(m).__name__})
        raise ValueError("mxmoe's converter found no torchtitan GroupedExperts (no MoE layers) to convert"
                         + (f"; experts of other kinds are not converted: {others}" if others else ""))
    for n in names:
        e = MXMoEGroupedExperts.convert(model.get_submodule(n), rec, fused_swiglu, validate, keep_fp8_weights)
        e.compile_backend = compile_backend
    # torchtitan's ExpertParallel pads to this after its all-to-all (typed Literal[8, 16, 32]; a plain int)
    _moe_utils.set_token_group_alignment_size_m(rec.align)
    return names


@contextlib.contextmanager
def cpu_histc():
    """Inside the block, ``torch.histc`` of an integer CPU tensor counts it as FP32 (exact below 2**24 per bin)
    and returns the counts in its dtype, as CUDA's integer histc does.

    torchtitan 0.2.2's router and token reorderer count the int64 expert ids with ``torch.histc``, which the
    CPU has only for floats (``"histogram_cpu" not implemented for 'Long'``): wrap a CPU forward of a torchtitan
    MoE model in this block. Floats and CUDA tensors go to torch's own histc; the previous ``torch.histc`` is
    back on exit (it is process-wide meanwhile: other threads see the patch too).
    """
    histc = torch.histc

    def integer_histc(input, *args, **kwargs):
        if input.device.type == "cpu" and not input.is_floating_point():
            return histc(input.float(), *args, **kwargs).to(input.dtype)
        return histc(input, *args, **kwargs)

    torch.histc = integer_histc
    try:
        yield
    finally:
        torch.histc = histc


@dataclass
class MXMoEOptions:
    """``--mxmoe.*`` options of torchtitan's trainer (with ``--job.custom_config_module
    mxmoe.integrations.torchtitan``)."""

    recipe: str = "mxfp8_128"
    """mxmoe recipe of the expert products (mxfp8, mxfp8_2d, mxfp8_128, mxfp8_lowmem, bf16, fp32, ...)"""
    fused_swiglu: bool = True
    """one product with cat(w1, w3) and mxmoe's SwiGLU (default), or torchtitan's three products"""
    validate: bool = False
    """check shapes and group offsets in every product (synchronizes with the GPU; for debugging)"""
    keep_fp8_weights: bool = False
    """under activation checkpointing, keep a checkpointed layer's FP8 weights (2 bytes a weight) from its forward
    for its recompute, which then reads no FP32 weight (mxfp8_128): faster, but held through the step's peak"""


@dataclass
class JobConfig:
    """torchtitan merges this into its JobConfig (``--job.custom_config_module``)."""

    mxmoe: MXMoEOptions = field(default_factory=MXMoEOptions)


class MXMoEConverter:
    """torchtitan model converter ``mxmoe`` (``--model.converters mxmoe``): :func:`convert_grouped_experts`
    with the ``--mxmoe.*`` options (defaults without them). Raises ValueError at construction for an
    unknown recipe, in :meth:`convert` as :func:`convert_grouped_experts`."""

    def __init__(self, job_config, parallel_dims=None):
        self.options = getattr(job_config, "mxmoe", None) or MXMoEOptions()
        get_recipe(self.options.recipe)
        c = getattr(job_config, "compile", None)  # --compile.enable compiles the experts too (their own graph)
        on = c is not None and c.enable and "model" in getattr(c, "components", ["model"])
        self.compile_backend = getattr(c, "backend", "inductor") if on else None

    def convert(self, model: nn.Module) -> None:
        o = self.options
        convert_grouped_experts(model, o.recipe, o.fused_swiglu, o.validate, self.compile_backend, o.keep_fp8_weights)

    def post_optimizer_hook(self, model) -> None:
        pass


if CONVERTER_NAME in _registry_model_converter_cls:  # a re-import (register_model_converter asserts a new name)
    _registry_model_converter_cls[CONVERTER_NAME] = MXMoEConverter
else:
    register_model_converter(MXMoEConverter, CONVERTER_NAME)
