"""mxmoe.integrations.torchtitan: torchtitan's MoE experts on mxmoe's products (CPU: the reference path).

torchtitan 0.2.2's own MoE layer (router, reorderer, GroupedExperts) with the experts converted, against
an FP64 per-expert loop on the same weights (and torchtitan's BF16 for-loop experts beside them; its
grouped_mm path pads through a Triton kernel, CUDA only), the expert-parallel padding with the recipe's
alignment, the converter through torchtitan's own config parsing, and a forward + backward of
torchtitan's DeepSeek-V3 debug model with the converter; what torchtitan gives, kept: distributed
checkpoints (DCP, one process), FSDP2 (torchtitan's apply_fsdp, 2 gloo ranks on the CPU) and activation
checkpointing (torch.utils.checkpoint and torchtitan's apply_ac).
"""

import importlib.util
from pathlib import Path
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

HAVE_TORCHTITAN = importlib.util.find_spec("torchtitan") is not None
needs_torchtitan = pytest.mark.skipif(
    not HAVE_TORCHTITAN, reason="torchtitan is not installed (pip install -e '.[torchtitan]' installs 0.2.2)")


@pytest.fixture(autouse=True)
def _histc_of_integers_on_cpu(monkeypatch):
    """torchtitan 0.2.2's router and reorderer count the int64 expert ids with torch.histc, which the
    CPU has only for floats (CUDA has it for integers, counts in the ids' dtype): counted as floats
    here (exact below 2**24), returned in the ids' dtype."""
    histc = torch.histc

    def patched(input, *args, **kwargs):
        if input.device.type == "cpu" and not input.is_floating_point():
            return histc(input.float(), *args, **kwargs).to(input.dtype)
        return histc(input, *args, **kwargs)

    monkeypatch.setattr(torch, "histc", patched)


def test_import_mxmoe_does_not_import_torchtitan():
    code = "import sys, mxmoe, mxmoe.integrations; sys.exit('torchtitan' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def moe_layer(dim, hidden, num_experts, top_k, seed=0, score_before_experts=False):
    """torchtitan's MoE layer (no shared experts, softmax router) with random weights; its experts run
    torchtitan's for-loop (the grouped_mm path pads with a CUDA kernel)."""
    from torchtitan.models.moe import MoE, MoEArgs

    args = MoEArgs(num_experts=num_experts, num_shared_experts=0, top_k=top_k, score_func="softmax",
                   score_before_experts=score_before_experts, use_grouped_mm=False, load_balance_coeff=None)
    m = MoE(args, dim=dim, hidden_dim=hidden)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return m


def converted(m, recipe, **kw):
    """A copy of the MoE layer with its experts converted."""
    import copy

    from mxmoe.integrations.torchtitan import MXMoEGroupedExperts

    c = copy.deepcopy(m)
    MXMoEGroupedExperts.convert(c.experts, recipe, **kw)
    return c


class _Loop(torch.nn.Module):
    """The layer with its experts as a plain FP64 loop: sum_k score * W2 (silu(x W1^T) * (x W3^T)), the
    routing torchtitan's own (same router weights)."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x):
        m, e = self.m, self.m.experts
        bs, slen, dim = x.shape
        x2 = x.reshape(-1, dim)
        scores, ids, _ = m.router(x2, m.expert_bias)
        x2, s = x2.double(), scores.double()
        y = torch.zeros_like(x2)
        for k in range(e.num_experts):
            tok, j = (ids == k).nonzero(as_tuple=True)
            h = F.silu(x2[tok] @ e.w1[k].double().t()) * (x2[tok] @ e.w3[k].double().t())
            y.index_add_(0, tok, (h @ e.w2[k].double().t()) * s[tok, j, None])
        return y.reshape(bs, slen, dim)


def tokens(T, dim, seed=1):
    return torch.randn(1, T, dim, generator=torch.Generator().manual_seed(seed))


def run(m, x):
    """Output and gradients (x, router, w1, w2, w3) of sum(out^2)."""
    x = x.clone().requires_grad_()
    for p in m.parameters():
        p.grad = None
    out = m(x)
    out.double().square().sum().backward()
    mm = m.m if isinstance(m, _Loop) else m
    e = mm.experts
    return [out.detach(), x.grad, mm.router.gate.weight.grad, e.w1.grad, e.w2.grad, e.w3.grad]


@needs_torchtitan
@pytest.mark.parametrize("fused_swiglu", [True, False])
@pytest.mark.parametrize("score_before_experts", [False, True])
def test_fp32_recipe_equals_loop(fused_swiglu, score_before_experts):
    """The plumbing (padding, w1/w3 concatenation, SwiGLU, gather back) exactly, under the exact fp32 recipe."""
    m = moe_layer(64, 96, 6, 2, score_before_experts=score_before_experts)
    x = tokens(50, 64)
    got = run(converted(m, "fp32", fused_swiglu=fused_swiglu), x)
    ref = run(_Loop(m), x) if not score_before_experts else run(m, x)  # the loop weights after the experts
    for a, b in zip(got, ref):
        assert rel(a, b) < 1e-5


@needs_torchtitan
@pytest.mark.parametrize("recipe,dims", [("mxfp8", (64, 128)), ("mxfp8_2d", (64, 128)), ("mxfp8_128", (128, 128))])
def test_mx_recipes_match_torchtitan_experts_within_mx_tolerance(recipe, dims):
    """Outputs and gradients of the converted experts against the FP64 loop: within MX tolerance (E4M3:
    ~2.4% RMS per operand, ~6-7% through two chained products), torchtitan's experts (FP32 loop) exact."""
    D, Fd = dims
    m = moe_layer(D, Fd, 8, 2)
    x = tokens(96, D)
    ref = run(_Loop(m), x)
    theirs = run(m, x)
    mx = run(converted(m, recipe), x)
    for a, b, r in zip(mx, theirs, ref):
        assert rel(b, r) < 1e-4
        assert rel(a, r) < 0.12
    assert rel(mx[0], ref[0]) < 0.08


@needs_torchtitan
def test_fused_and_unfused_swiglu_agree():
    """cat(w1, w3) as one product with mxmoe's SwiGLU gives torchtitan's three products' MX numbers
    (x and the weights quantized along D either way; dgrad's blocks along 2F split at F)."""
    m = moe_layer(64, 96, 4, 2)
    x = tokens(40, 64)
    a = run(converted(m, "mxfp8", fused_swiglu=True), x)
    b = run(converted(m, "mxfp8", fused_swiglu=False), x)
    for u, v in zip(a, b):
        assert rel(u, v) < 1e-2


@needs_torchtitan
@pytest.mark.parametrize("fused_swiglu", [True, False])
def test_experts_alone_empty_groups_and_bf16_rows(fused_swiglu):
    """The converted experts on expert-ordered rows (float counts: any number dtype works), with experts
    that get no rows, BF16 rows in and out, against the FP64 per-expert loop."""
    m = moe_layer(64, 64, 6, 1)
    e = converted(m, "fp32", fused_swiglu=fused_swiglu).experts
    counts = torch.tensor([5.0, 0.0, 7.0, 0.0, 0.0, 3.0])
    x = tokens(15, 64)[0].bfloat16()
    out = e(x, counts)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    ref, start = [], 0
    for k, n in enumerate(counts.long().tolist()):
        xs = x[start:start + n].double()
        ref.append((F.silu(xs @ e.w1[k].double().t()) * (xs @ e.w3[k].double().t())) @ e.w2[k].double().t())
        start += n
    assert rel(out, torch.cat(ref)) < 0.01  # BF16 output rounding


@needs_torchtitan
@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_128"])
def test_compiled_experts_are_one_graph_and_match_eager(recipe):
    """With a compile backend the converted experts run under torch.compile(fullgraph=True) (what
    --compile.enable gives them inside torchtitan): padding plan, gathers, products and SwiGLU traced whole
    (a graph break is an error), with the eager numbers, empty experts included."""
    from mxmoe.integrations.torchtitan import MXMoEGroupedExperts

    torch._dynamo.reset()
    m = moe_layer(128, 128, 6, 1)
    eager = converted(m, recipe).experts
    comp = converted(m, recipe).experts
    comp.compile_backend = "aot_eager"
    assert isinstance(comp, MXMoEGroupedExperts)
    counts = torch.tensor([50, 0, 70, 0, 30, 0])
    x = tokens(150, 128)[0].bfloat16()
    outs = []
    for e in (eager, comp):
        xx = x.clone().requires_grad_()
        y = e(xx, counts)
        y.float().square().mean().backward()
        outs.append([y.float(), xx.grad.float(), e.w1.grad, e.w2.grad, e.w3.grad])
    for a, b in zip(*outs):
        assert torch.isfinite(b).all() and rel(b, a) < 1e-5


@needs_torchtitan
def test_converter_compiles_the_experts_with_compile_enable():
    """--compile.enable (model among --compile.components) sets torchtitan's compile backend on the experts."""
    from torchtitan.config import ConfigManager

    from mxmoe.integrations.torchtitan import MXMoEConverter

    base = ["--job.custom_config_module", "mxmoe.integrations.torchtitan", "--model.converters", "mxmoe"]
    assert MXMoEConverter(ConfigManager().parse_args(base)).compile_backend is None
    on = MXMoEConverter(ConfigManager().parse_args(base + ["--compile.enable"]))
    assert on.compile_backend == "inductor"
    off = MXMoEConverter(ConfigManager().parse_args(base + ["--compile.enable", "--compile.components", "loss"]))
    assert off.compile_backend is None


@needs_torchtitan
@pytest.mark.parametrize("recipe,align", [("mxfp8", 32), ("mxfp8_128", 128)])
def test_expert_parallel_padding_uses_the_recipe_alignment(recipe, align):
    """Under EP torchtitan's ExpertParallel pads the received rows (models.moe.utils._permute, its CPU
    permutation here) to TOKEN_GROUP_ALIGN_SIZE_M, which the converter sets to the recipe's alignment;
    the experts' EP branch takes those groups (the last absorbing the slack) as they are."""
    from torchtitan.models.moe import utils
    from torchtitan.models.moe.kernels import generate_permute_indices

    from mxmoe.integrations.torchtitan import convert_grouped_experts

    m = moe_layer(128, 128, 6, 2)
    old = utils.TOKEN_GROUP_ALIGN_SIZE_M
    try:
        convert_grouped_experts(m, recipe)
        assert utils.TOKEN_GROUP_ALIGN_SIZE_M == align
        counts = torch.tensor([3, 0, 5, 1, 2, 4])  # 2 ranks x 3 local experts, rank-major
        rows = int(counts.sum())
        padded_max = utils._round_up(rows + 3 * align, align)
        _, padded_counts, _ = generate_permute_indices(counts, 3, 2, padded_max, align, use_cpu=True)
        assert padded_counts.tolist() == [-(-n // align) * align for n in (4, 2, 9)]
    finally:
        utils.set_token_group_alignment_size_m(old)


@needs_torchtitan
def test_converter_through_torchtitans_config_and_registry():
    """--job.custom_config_module adds --mxmoe.*; --model.converters mxmoe converts the built debug model."""
    from torchtitan.config import ConfigManager
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model
    from torchtitan.models.moe import utils
    from torchtitan.protocols.model_converter import build_model_converters

    from mxmoe.integrations.torchtitan import MXMoEGroupedExperts

    cfg = ConfigManager().parse_args(["--job.custom_config_module", "mxmoe.integrations.torchtitan",
                                      "--model.name", "deepseek_v3", "--model.flavor", "debugmodel",
                                      "--model.converters", "mxmoe", "--mxmoe.recipe", "mxfp8",
                                      "--mxmoe.keep-fp8-weights"])
    assert cfg.model.converters == ["mxmoe"] and cfg.mxmoe.recipe == "mxfp8" and cfg.mxmoe.fused_swiglu
    assert cfg.mxmoe.keep_fp8_weights
    default = ConfigManager().parse_args(["--job.custom_config_module", "mxmoe.integrations.torchtitan"])
    assert not default.mxmoe.keep_fp8_weights  # off by default: it holds 2 bytes a weight through the peak
    with torch.device("meta"):
        model = DeepSeekV3Model(debug_args(job_config=cfg))
    params = dict(model.named_parameters())
    old = utils.TOKEN_GROUP_ALIGN_SIZE_M
    try:
        build_model_converters(cfg, None).convert(model)
    finally:
        utils.set_token_group_alignment_size_m(old)
    experts = [m for m in model.modules() if isinstance(m, MXMoEGroupedExperts)]
    assert len(experts) == 5  # the debug model's MoE layers
    assert all(e.recipe.name == "mxfp8" and e.keep_fp8_weights for e in experts)
    assert all(params[n] is p for n, p in model.named_parameters())  # the same parameters


@needs_torchtitan
def test_bad_inputs_raise_clear_errors():
    from mxmoe.integrations.torchtitan import MXMoEConverter, MXMoEGroupedExperts, MXMoEOptions, convert_grouped_experts

    m = moe_layer(64, 96, 4, 2)
    with pytest.raises(ValueError, match="unknown recipe"):
        convert_grouped_experts(m, "mxfp4")
    with pytest.raises(ValueError, match="unknown recipe"):
        MXMoEConverter(type("C", (), {"mxmoe": MXMoEOptions(recipe="nope")})())
    with pytest.raises(ValueError, match="divisible by 128"):
        convert_grouped_experts(m, "mxfp8_128")  # hidden_dim 96
    with pytest.raises(TypeError, match="GroupedExperts"):
        MXMoEGroupedExperts.convert(m.router, "mxfp8")
    with pytest.raises(ValueError, match="no torchtitan GroupedExperts"):
        convert_grouped_experts(m.router, "mxfp8")


@needs_torchtitan
def test_gpt_oss_experts_are_named_not_converted():
    """gpt-oss's experts call torch._grouped_mm themselves in 0.2.2: the converter names them."""
    from torchtitan.models.gpt_oss.model.moe import GptOssGroupedExperts

    from mxmoe.integrations.torchtitan import convert_grouped_experts

    with torch.device("meta"):
        e = GptOssGroupedExperts(dim=64, hidden_dim=64, num_experts=4, swiglu_limit=7.0, use_grouped_mm=True)
    with pytest.raises(ValueError, match="GptOssGroupedExperts"):
        convert_grouped_experts(torch.nn.Sequential(e), "mxfp8")


def debug_args(layers=6, job_config=None):
    """torchtitan's DeepSeek-V3 debug model's arguments (dim 256, 8 experts of 256, top 3; SDPA), first
    `layers` layers, completed from a job config as the trainer does (on a CPU-only machine that turns
    torchtitan's grouped_mm experts into their loop)."""
    import copy

    from torchtitan.config import JobConfig
    from torchtitan.models.deepseek_v3 import deepseekv3_args

    args = copy.deepcopy(deepseekv3_args["debugmodel"])  # update_from_config writes into it
    args.n_layers = layers
    args.update_from_config(job_config or JobConfig())
    return args


def debug_model(layers=2):
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model

    return DeepSeekV3Model(debug_args(layers))


@needs_torchtitan
@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_128"])
def test_debug_model_forward_backward_with_converter(recipe):
    from torchtitan.models.moe import utils

    from mxmoe.integrations.torchtitan import MXMoEGroupedExperts, convert_grouped_experts

    torch.manual_seed(0)
    ref = debug_model()
    with torch.no_grad():  # the trainer runs it so (torchtitan 0.2.2 writes some weights in place)
        ref.init_weights(buffer_device=torch.device("cpu"))
    model = debug_model()
    old = utils.TOKEN_GROUP_ALIGN_SIZE_M
    try:
        names = convert_grouped_experts(model, recipe)
    finally:
        utils.set_token_group_alignment_size_m(old)
    assert names == ["layers.1.moe.experts"]  # layer 0 is dense
    assert model.state_dict().keys() == ref.state_dict().keys()  # checkpoints interchangeable
    model.load_state_dict(ref.state_dict())
    experts = [m for m in model.modules() if isinstance(m, MXMoEGroupedExperts)]
    toks = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(2))
    losses = []
    for mdl in (ref, model):
        logits = mdl(toks)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), toks.roll(-1, 1).flatten())
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[1] - losses[0]) < 0.02 * losses[0]
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    for e in experts:
        assert all(float(p.grad.norm()) > 0 for p in e.parameters())


# The "keep what torchtitan gives": distributed checkpoints, FSDP2, activation checkpointing.


def _unconverted_and_converted(recipe, layers=2):
    """The debug model (torchtitan's init) and a second one, differently initialized, converted."""
    from torchtitan.models.moe import utils

    from mxmoe.integrations.torchtitan import convert_grouped_experts

    torch.manual_seed(0)
    ref = debug_model(layers)
    with torch.no_grad():
        ref.init_weights(buffer_device=torch.device("cpu"))
    torch.manual_seed(1)
    model = debug_model(layers)
    old = utils.TOKEN_GROUP_ALIGN_SIZE_M
    try:
        convert_grouped_experts(model, recipe)
    finally:
        utils.set_token_group_alignment_size_m(old)
    return ref, model


def _debug_tokens(batch=2, seq=64, seed=2):
    return torch.randint(0, 2048, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _loss_and_grads(model, toks):
    for p in model.parameters():
        p.grad = None
    logits = model(toks)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), toks.roll(-1, 1).flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@needs_torchtitan
def test_distributed_checkpoint_of_unconverted_model_loads_into_converted(tmp_path):
    """Same state-dict keys, shapes and dtypes; a torch.distributed.checkpoint save of the unconverted
    model (single process, no process group) loads into the converted one, which then computes the
    unconverted model's logits and gradients (fp32 recipe: exact plumbing)."""
    import torch.distributed.checkpoint as dcp

    ref, model = _unconverted_and_converted("fp32")
    sd_ref, sd = ref.state_dict(), model.state_dict()
    assert list(sd) == list(sd_ref)
    for k in sd_ref:
        assert (sd[k].shape, sd[k].dtype) == (sd_ref[k].shape, sd_ref[k].dtype), k
    assert any(not torch.equal(sd[k], sd_ref[k]) for k in sd if "experts" in k)  # loading has work to do
    dcp.save(sd_ref, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    dcp.load(sd, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)  # in place, into the parameters
    for k, v in model.state_dict().items():
        assert torch.equal(v, sd_ref[k]), k
    toks = _debug_tokens(1, 48)
    (l_ref, g_ref), (l, g) = _loss_and_grads(ref, toks), _loss_and_grads(model, toks)
    assert rel(l, l_ref) < 1e-5
    assert g.keys() == g_ref.keys()
    for n in g_ref:
        assert rel(g[n], g_ref[n]) < 1e-4, n
    # and back: the converted model's checkpoint into a fresh unconverted one
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "ckpt2"), no_dist=True)
    torch.manual_seed(3)
    fresh = debug_model(2)
    sd_fresh = fresh.state_dict()
    dcp.load(sd_fresh, checkpoint_id=str(tmp_path / "ckpt2"), no_dist=True)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, sd_ref[k]), k


class _Checkpointed(torch.nn.Module):
    """The MoE layer under non-reentrant torch.utils.checkpoint, as torchtitan's activation checkpointing runs it."""

    def __init__(self, m, use_reentrant: bool = False):
        super().__init__()
        self.m, self.use_reentrant = m, use_reentrant
        self.router, self.experts = m.router, m.experts

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.m, x, use_reentrant=self.use_reentrant)


@needs_torchtitan
@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_128"])
@pytest.mark.parametrize("fused_swiglu", [True, False])
def test_activation_checkpointing_of_moe_layer_gives_the_same_gradients(recipe, fused_swiglu):
    """torch.utils.checkpoint (non-reentrant, as torchtitan's) around the MoE layer with converted experts:
    the recomputed forward quantizes the same way, so output and gradients are bitwise the plain ones."""
    m = converted(moe_layer(128, 128, 8, 2), recipe, fused_swiglu=fused_swiglu)
    x = tokens(96, 128)
    plain, ac = run(m, x), run(_Checkpointed(m), x)
    for a, b in zip(ac, plain):
        assert torch.equal(a, b)


@needs_torchtitan
@pytest.mark.parametrize("recipe", ["mxfp8_128", "mxfp8_128_lowmem", "mxfp8_128 keep off"])
def test_checkpoint_recompute_takes_the_forwards_fp8_weights(recipe, monkeypatch):
    """Under activation checkpointing with ``mxfp8_128`` and ``keep_fp8_weights`` the recompute takes the first
    forward's FP8 weight operands: each weight quantized once a step, not twice (``_lowmem`` keeps none: the forward's
    two and dgrad's requantization of w13 as before, plus the recompute's; nor does the default, off); output and
    gradients bitwise the plain run's; nothing left on the module after backward. Without checkpointing nothing
    is kept. An in-place update of a weight between forward and recompute makes the recompute quantize afresh."""
    import mxmoe.integrations.torchtitan as tt
    import mxmoe.ops.linear as linear

    calls = []

    def counted(w, *args, **kwargs):
        calls.append(len(w) if isinstance(w, tuple) else 1)
        return quantize_weight_both(w, *args, **kwargs)

    from mxmoe.ops.quantization import quantize_weight_both

    monkeypatch.setattr(tt, "quantize_weight_both", counted)
    monkeypatch.setattr(linear, "quantize_weight_both", counted)
    keep = recipe != "mxfp8_128 keep off"
    recipe = recipe.split()[0]
    m = converted(moe_layer(128, 128, 8, 2), recipe, keep_fp8_weights=keep)
    x = tokens(96, 128)
    plain = run(m, x)
    assert calls == ([2, 1] if recipe == "mxfp8_128" else [2, 2])  # (w1, w3), w2; lowmem: w13 again in dgrad
    assert m.experts._recompute_operands is None
    calls.clear()
    ck = _Checkpointed(m)
    for p in m.parameters():
        p.grad = None  # (not accumulated into plain's)
    out = ck(x.clone().requires_grad_())
    kept = m.experts._recompute_operands is not None
    assert kept == (recipe == "mxfp8_128" and keep)
    out.double().square().sum().backward()
    assert m.experts._recompute_operands is None
    assert calls == {(True, "mxfp8_128"): [2, 1], (False, "mxfp8_128"): [2, 1, 2, 1]}.get((keep, recipe), [2, 2, 2])
    for a, b in zip(run(ck, x), plain):
        assert torch.equal(a, b)
    if kept:  # a forward that is not recomputed (grad off, or its output dropped) leaves nothing for a later one
        with torch.no_grad():
            ck(x)
        assert m.experts._recompute_operands is None
        ck(x.clone().requires_grad_())  # output dropped: its operands stay, for a recompute that never comes
        with torch.no_grad():
            m.experts.w2.data.mul_(2.0)  # (no version bump)
        ref = run(converted(m, recipe), x)  # the new weights, plain
        reentrant = run(_Checkpointed(m, use_reentrant=True), x)  # forward under no_grad, recompute in backward
        for a, b in zip(reentrant, ref):
            assert torch.equal(a, b)
        with torch.no_grad():
            m.experts.w2.data.mul_(0.5)
    if kept:  # a weight changed in place after forward: the recompute requantizes
        calls.clear()
        out = ck(x.clone().requires_grad_())
        with torch.no_grad():
            m.experts.w2.mul_(2.0)
        out.double().square().sum().backward()
        assert calls == [2, 1, 2, 1] and m.experts._recompute_operands is None


@needs_torchtitan
def test_compiled_experts_under_checkpoint_take_the_kept_fp8_weights():
    """The compiled experts (``torch.compile(fullgraph=True)``, as with ``--compile.enable``) take the kept
    operands as graph inputs: under checkpointing, output and gradients bitwise the eager plain run's."""
    torch._dynamo.reset()
    m = converted(moe_layer(128, 128, 8, 2), "mxfp8_128")
    x = tokens(96, 128)
    plain = run(m, x)
    m.experts.compile_backend = "aot_eager"
    try:
        for _ in range(2):  # the second step reuses the compiled graphs
            for a, b in zip(run(_Checkpointed(m), x), plain):
                assert torch.equal(a, b)
            assert m.experts._recompute_operands is None
    finally:
        torch._C._dynamo.eval_frame._set_lru_cache(True)


@needs_torchtitan
@pytest.mark.parametrize("mode", ["full", "selective_op"])
def test_torchtitans_apply_ac_on_converted_debug_model(mode):
    """torchtitan's apply_ac (full, and per-op selective with DeepSeek-V3's save list) on the converted
    debug model: loss and gradients bitwise those without checkpointing."""
    from torchtitan.config.job_config import ActivationCheckpoint
    from torchtitan.distributed.activation_checkpoint import apply_ac
    from torchtitan.models.deepseek_v3.infra.parallelize import _op_sac_save_list

    from mxmoe.integrations.torchtitan import MXMoEGroupedExperts

    from torchtitan.models.moe import utils

    from mxmoe.integrations.torchtitan import convert_grouped_experts

    torch.manual_seed(0)
    model = debug_model(2)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    old = utils.TOKEN_GROUP_ALIGN_SIZE_M
    try:
        convert_grouped_experts(model, "mxfp8")
    finally:
        utils.set_token_group_alignment_size_m(old)
    toks = _debug_tokens(1, 48)
    l0, g0 = _loss_and_grads(model, toks)
    cfg = ActivationCheckpoint(mode="full") if mode == "full" else ActivationCheckpoint(
        mode="selective", selective_ac_option="op")
    try:
        apply_ac(model, cfg, op_sac_save_list=_op_sac_save_list)
    finally:
        torch._C._dynamo.eval_frame._set_lru_cache(True)  # apply_ac turns dynamo's LRU cache off
    assert all(type(b).__name__ == "CheckpointWrapper" for b in model.layers.values())
    assert sum(isinstance(m, MXMoEGroupedExperts) for m in model.modules()) == 1
    l1, g1 = _loss_and_grads(model, toks)
    assert torch.equal(l0, l1)
    g1 = {n.replace("_checkpoint_wrapped_module.", ""): v for n, v in g1.items()}
    assert g1.keys() == g0.keys()
    for n in g0:
        assert torch.equal(g1[n], g0[n]), n


@needs_torchtitan
@pytest.mark.slow
def test_torchtitans_layer_sac_with_kept_fp8_weights(monkeypatch):
    """torchtitan's apply_ac as the suite runs it (selective, every second block checkpointed) on the converted
    4-layer debug model (MoE layers 1-3; 1 and 3 checkpointed), ``mxfp8_128``: with ``keep_fp8_weights`` each step
    quantizes the experts' weights 6 times instead of 10 (3 forwards, 2 recomputes, two weights each), with loss
    and gradients bitwise those without it."""
    from torchtitan.config.job_config import ActivationCheckpoint
    from torchtitan.distributed.activation_checkpoint import apply_ac
    from torchtitan.models.moe import utils

    import mxmoe.integrations.torchtitan as tt
    import mxmoe.ops.linear as linear
    from mxmoe.ops.quantization import quantize_weight_both

    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return quantize_weight_both(*args, **kwargs)

    monkeypatch.setattr(tt, "quantize_weight_both", counted)
    monkeypatch.setattr(linear, "quantize_weight_both", counted)
    monkeypatch.setattr(utils, "TOKEN_GROUP_ALIGN_SIZE_M", utils.TOKEN_GROUP_ALIGN_SIZE_M)
    out = {}
    for keep in (False, True):
        torch.manual_seed(0)
        model = debug_model(4)
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device("cpu"))
        tt.convert_grouped_experts(model, "mxfp8_128", keep_fp8_weights=keep)
        try:
            apply_ac(model, ActivationCheckpoint(mode="selective", selective_ac_option="2"))
        finally:
            torch._C._dynamo.eval_frame._set_lru_cache(True)  # apply_ac turns dynamo's LRU cache off
        assert [type(b).__name__ for b in model.layers.values()] == ["TransformerBlock", "CheckpointWrapper"] * 2
        for _ in range(2):
            calls.clear()
            out[keep] = _loss_and_grads(model, _debug_tokens(1, 128))
            assert len(calls) == (6 if keep else 10)
    assert torch.equal(out[True][0], out[False][0])
    assert all(torch.equal(out[True][1][n], out[False][1][n]) for n in out[False][1])


def _fsdp2_worker(rank, world, init_file, recipe):
    """One rank of test_fsdp2_...: torchtitan's apply_fsdp on the converted debug model (gloo, CPU)."""
    import copy
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard
    from torchtitan.models.llama4.infra.parallelize import apply_fsdp

    histc = torch.histc  # the fixture's patch, in this process
    torch.histc = lambda i, *a, **k: histc(i.float(), *a, **k).to(i.dtype) if not i.is_floating_point() \
        else histc(i, *a, **k)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))  # a hung collective fails the test
    try:
        ref, model = _unconverted_and_converted(recipe)
        model.load_state_dict(ref.state_dict())  # the same weights on every rank
        plain = copy.deepcopy(model)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        apply_fsdp(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False)
        for m in model.modules():  # its gradient divide factor 1 reduce-scatters with PREMUL_SUM, which
            if isinstance(m, FSDPModule):  # gloo lacks ("Cannot use ReduceOp.PREMUL_SUM with Gloo"): SUM
                m.set_force_sum_reduction_for_comms(True)
        experts = model.layers["1"].moe.experts
        for w in (experts.w1, experts.w2, experts.w3):
            assert isinstance(w, DTensor) and w.placements == (Shard(0),), w
            assert w.to_local().shape[0] == experts.num_experts // world
        all_toks = [_debug_tokens(1, 32, seed=10 + r) for r in range(world)]
        loss, grads = _loss_and_grads(model, all_toks[rank])  # gradients summed over ranks (torchtitan's
        # apply_fsdp turns FSDP's division off: its loss is divided by the global token count instead)
        for p in plain.parameters():
            p.grad = None
        ref_losses = []
        for t in all_toks:
            logits = plain(t)
            lr = F.cross_entropy(logits.flatten(0, 1).float(), t.roll(-1, 1).flatten())
            lr.backward()
            ref_losses.append(lr.detach())
        assert rel(loss, ref_losses[rank]) < 1e-6, (loss, ref_losses[rank])
        pg = dict(plain.named_parameters())
        assert grads.keys() == pg.keys()
        for n, g in grads.items():
            assert isinstance(g, DTensor), n
            assert rel(g.full_tensor(), pg[n].grad) < 1e-5, (n, rel(g.full_tensor(), pg[n].grad))
        for w in ("w1", "w2", "w3"):
            g = grads[f"layers.1.moe.experts.{w}"]
            assert g.placements == (Shard(0),) and float(g.full_tensor().norm()) > 0
    finally:
        dist.destroy_process_group()


@needs_torchtitan
def test_fsdp2_shards_converted_experts_and_matches_unsharded(tmp_path):
    """torchtitan's apply_fsdp (FSDP2 fully_shard per block, as its DeepSeek-V3 parallelize calls it
    without EP) on the converted debug model, 2 ranks on the CPU over gloo: the expert weights are DTensors
    sharded on dim 0 (4 of the 8 experts a rank); each rank's loss and the reduce-scattered gradients are
    the unsharded converted model's (summed over both ranks' batches)."""
    import torch.multiprocessing as mp
    import torchtitan.models.deepseek_v3  # noqa: F401  (imported once, here, for the forked ranks)
    import torchtitan.models.llama4.infra.parallelize  # noqa: F401

    # forked, not spawned: a spawned rank spends ~10 s importing torchtitan again (inductor, datasets)
    mp.start_processes(_fsdp2_worker, args=(2, str(tmp_path / "pg"), "mxfp8"), nprocs=2, start_method="fork")


# The README's torchtitan Python example, exactly as the README gives it (keep the two in step).
README_EXAMPLE = """\
import torch
import torch.nn.functional as F
from torchtitan.config import JobConfig
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, deepseekv3_args

from mxmoe.integrations.torchtitan import convert_grouped_experts, cpu_histc

args = deepseekv3_args["debugmodel"]  # torchtitan's DeepSeek-V3 debug model: dim 256, 8 experts, top 3
args.n_layers = 2                     # layer 0 dense, layer 1 MoE: a quick CPU run
args.update_from_config(JobConfig())  # what torchtitan's trainer does before building (sets moe_impl)
model = DeepSeekV3Model(args)
with torch.no_grad():
    model.init_weights(buffer_device=torch.device("cpu"))
print(convert_grouped_experts(model, "mxfp8"))  # ['layers.1.moe.experts']: its products now MXFP8

tokens = torch.randint(0, args.vocab_size, (2, 64))
with cpu_histc():  # torchtitan counts expert ids with torch.histc, which the CPU has only for floats
    logits = model(tokens)
loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.roll(-1, 1).flatten())
loss.backward()
print(f"loss {loss.item():.3f}")
"""


@needs_torchtitan
@pytest.mark.slow
def test_readme_python_example_runs_on_the_cpu(monkeypatch, capsys):
    """The README's example, as written, on a CPU: no patch of the tests' own (this file's histc fixture is
    undone), only what the example does itself (``update_from_config``, :func:`cpu_histc`)."""
    import copy

    from torchtitan.models.deepseek_v3 import deepseekv3_args
    from torchtitan.models.moe import utils

    from mxmoe.integrations.torchtitan import cpu_histc

    monkeypatch.undo()  # torch.histc as torch has it
    with pytest.raises(NotImplementedError, match="histogram_cpu"):
        torch.histc(torch.tensor([0, 1]), bins=2, min=0, max=2)
    with cpu_histc():
        assert torch.histc(torch.tensor([0, 1, 1]), bins=2, min=0, max=2).tolist() == [1, 2]
    monkeypatch.setitem(deepseekv3_args, "debugmodel", copy.deepcopy(deepseekv3_args["debugmodel"]))
    monkeypatch.setattr(utils, "TOKEN_GROUP_ALIGN_SIZE_M", utils.TOKEN_GROUP_ALIGN_SIZE_M)
    assert README_EXAMPLE in (Path(__file__).parents[1] / "README.md").read_text(), "README's example changed"
    exec(compile(README_EXAMPLE, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "['layers.1.moe.experts']" in out and "loss " in out
    assert torch.histc is not None and "integer_histc" not in torch.histc.__name__  # put back


@needs_torchtitan
@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_128"])
@pytest.mark.parametrize("fused_swiglu", [True, False])
def test_gpu_experts_fused_permute_and_unpermute(recipe, fused_swiglu, monkeypatch):
    """On CUDA with FP32 parameters (a one-GPU torchtitan run's): the converted experts (the padding gather
    fused with the first product's quantization, the gather back by :func:`mxmoe.ops.unpermute`) give the
    unfused permutation's numbers bit for bit, eager and compiled by inductor within FP32-summation noise of
    each other, and the FP64 loop's within MX tolerance; first, middle and last experts empty."""
    import copy

    from mxmoe.integrations.torchtitan import MXMoEGroupedExperts

    torch._dynamo.reset()
    base = moe_layer(256, 384, 7, 1).experts.cuda()
    counts = torch.tensor([0, 300, 1, 0, 517, 130, 0], device="cuda")
    x = tokens(948, 256)[0].cuda().bfloat16()
    dy = tokens(948, 256, seed=3)[0].cuda().bfloat16()

    def run_experts(fused_permute: bool, backend=None):
        monkeypatch.setenv("MXMOE_FUSED_PERMUTE", "1" if fused_permute else "0")
        e = MXMoEGroupedExperts.convert(copy.deepcopy(base), recipe, fused_swiglu=fused_swiglu)
        e.compile_backend = backend
        xx = x.clone().requires_grad_()
        y = e(xx, counts)
        y.backward(dy)
        return [y.float(), xx.grad.float(), e.w1.grad, e.w2.grad, e.w3.grad]

    fused, plain, compiled = run_experts(True), run_experts(False), run_experts(True, "inductor")
    # compiled: inductor fuses torch's SwiGLU of the unfused products (FP32 silu * up, one rounding; eager
    # rounds twice), and the next product's E4M3 rounding turns some one-ulp BF16 differences into 1/16 ones:
    # 1.2e-2 measured on the H200 (fused: mxmoe's own SwiGLU either way, under 1e-3)
    for a, b, c in zip(fused, plain, compiled):
        assert torch.isfinite(a).all() and torch.equal(a, b)
        assert rel(c, a) < (1e-3 if fused_swiglu else 3e-2)
    xd, w1, w2, w3 = x.double(), base.w1.double(), base.w2.double(), base.w3.double()
    ref, start = [], 0
    for k, n in enumerate(counts.tolist()):
        xs = xd[start:start + n]
        ref.append((F.silu(xs @ w1[k].t()) * (xs @ w3[k].t())) @ w2[k].t())
        start += n
    assert rel(fused[0], torch.cat(ref)) < 0.08


@needs_torchtitan
@pytest.mark.gpu
def test_gpu_checkpointed_experts_keep_their_fp8_weights_for_the_recompute():
    """On CUDA (the sm_90 promote-per-128 route, FP32 parameters as in a one-GPU torchtitan run): the MoE layer
    under checkpointing with ``keep_fp8_weights`` gives the plain layer's output and gradients bit for bit, eager;
    compiled by inductor, within FP32-summation noise of eager; nothing kept after backward."""
    torch._dynamo.reset()
    base = moe_layer(256, 384, 7, 2).cuda()
    x = tokens(1024, 256).cuda()
    plain = run(converted(base, "mxfp8_128"), x)
    for backend in (None, "inductor"):
        m = converted(base, "mxfp8_128", keep_fp8_weights=True)
        m.experts.compile_backend = backend
        try:
            out = run(_Checkpointed(m), x)
        finally:
            torch._C._dynamo.eval_frame._set_lru_cache(True)
        assert m.experts._recompute_operands is None
        for a, b in zip(out, plain):
            assert torch.isfinite(a).all()
            assert torch.equal(a, b) if backend is None else rel(a, b) < 1e-3


@needs_torchtitan
def test_suite_flavors_hold_the_suite_tokenizers_vocabulary():
    """Every model of the torchtitan suite (the cut flavors and the kill-and-resume debug model) has an
    embedding table at least as large as the suite's tokenizer: a token id past it is a device-side assert
    on the GPU (torchtitan's debug model has 2,048 entries; its -v32k flavor the tokenizer's 32,768)."""
    from benchmarks import bench_torchtitan as T
    from benchmarks import torchtitan_job as J

    for name, m in T.MODELS.items():
        args = J._flavor_table(m["model"])[m["flavor"]]
        assert args.vocab_size >= T.VOCAB, (name, m["flavor"], args.vocab_size)


@needs_torchtitan
@pytest.mark.parametrize("model", ["llama4", "deepseek_v3", "qwen3"])
def test_suite_torchao_filters_take_the_routed_experts_or_all_experts(model):
    """The torchtitan suite's torchao peer converts the scope it names: ``torchao.fp8_grouped`` the routed experts
    only (each MoE layer's ``GroupedExperts``, as mxmoe's converter), ``torchao.fp8_grouped_shared`` every module
    whose fqn contains ``experts``: the shared experts' linears too, where the model has them."""
    import copy

    from benchmarks import torchtitan_job as J
    from torchtitan.models.moe.moe import GroupedExperts
    from torchtitan.protocols.train_spec import get_train_spec

    from torchtitan.config import JobConfig

    spec = get_train_spec(model)
    args = copy.deepcopy(spec.model_args["debugmodel_moe" if model == "qwen3" else "debugmodel"])
    args.update_from_config(JobConfig())  # as the trainer completes them
    with torch.device("meta"):
        net = spec.model_cls(args)
    routed = {f for f, x in net.named_modules() if J.routed_experts(x, f)}
    grouped = {f for f, x in net.named_modules() if isinstance(x, GroupedExperts)}
    assert routed == grouped and routed
    wide = {f for f, x in net.named_modules() if J.any_experts(x, f)}
    shared = {f for f in wide if "shared_experts" in f}
    assert wide - shared == routed
    if model == "qwen3":
        assert not shared
    else:  # Llama 4 and DeepSeek-V3 have shared experts: only the wide filter takes them
        assert shared and not shared & routed
    conv = J._registry_model_converter_cls
    assert conv["torchao.fp8_grouped"].module_filter is J.routed_experts
    assert conv["torchao.fp8_grouped_shared"].module_filter is J.any_experts


@needs_torchtitan
def test_suite_trainer_reports_step_memory_the_suite_parses(monkeypatch, capsys):
    """The trainer module notes ``memory_allocated()`` before each CUDA backward (and runs the backward) and the
    allocator's peak active bytes after each optimizer step, both past the warm-up; at exit it prints the most of
    each, which the suite reads back as ``peak_active_gib`` and ``backward_start_gib``. Nothing is printed
    before the warm-up is over."""
    from benchmarks import bench_torchtitan as T
    from benchmarks import torchtitan_job as J

    monkeypatch.setattr(J, "_backward_start", [])
    monkeypatch.setattr(J, "_step_peak", [])
    allocated = iter([2**30 * g for g in [60.0] * J.MEMORY_WARMUP + [30.5, 32.25, 31.0]])
    peaks = iter([2**30 * g for g in [41.5, 43.0, 42.0]])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: next(allocated))
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {"active_bytes.all.peak": next(peaks)})
    ran = []
    backward = J.record_backward_start(lambda self, *a, **k: ran.append((self, a, k)))
    cpu = torch.ones(2)
    backward(cpu, "g")  # a CPU backward is not noted
    assert J._backward_start == [] and ran == [(cpu, ("g",), {})]
    cuda = type("CudaTensor", (), {"is_cuda": True, "device": "cuda:0"})()
    for step in range(J.MEMORY_WARMUP + 3):
        backward(cuda, retain_graph=True)
        J.record_step_peak(None, (), {})  # the warm-up's steps read nothing
        if step == J.MEMORY_WARMUP - 1:
            J.report_step_memory()
            assert capsys.readouterr().out == "" and J._step_peak == []
    assert len(ran) == J.MEMORY_WARMUP + 4 and ran[-1] == (cuda, (), {"retain_graph": True})
    J.report_step_memory()
    out = capsys.readouterr().out
    # the warm-up's 60 GiB backward starts are left out: the most of the rest
    assert out.strip() == "mxmoe-bench step memory: peak active 43.00 GiB, at backward start 32.25 GiB"
    log = "step: 20  loss: 7.1  memory: 44.00GiB(31%)  tps: 70,000  mfu: 9.00%\n" + out
    parsed = T.parse_log(log, 10)
    assert parsed["peak_active_gib"] == 43.0 and parsed["backward_start_gib"] == 32.25 and parsed["peak_gib"] == 44.0
    # without the line (and with the line of aa97ab4-5b10fe8, which read the resting state at exit): None
    old = "mxmoe-bench peak memory: active 33.67 GiB, reserved 42.68 GiB, at backward start 34.08 GiB"
    assert T.parse_log(log.splitlines()[0] + "\n" + old, 10)["peak_active_gib"] is None
