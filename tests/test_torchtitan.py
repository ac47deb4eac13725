"""mxmoe.integrations.torchtitan: torchtitan's MoE experts on mxmoe's products (CPU: the reference path).

The converted experts of torchtitan's own modules against an FP64 per-expert loop on the same weights
(and torchtitan's BF16 experts beside them), the padding dispatcher under expert parallelism against
torchtitan's own permutation, the converter and override entry points, and a forward + backward of
torchtitan's DeepSeek-V3 debug model with the converter.
"""

import importlib.util
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

HAVE_TORCHTITAN = importlib.util.find_spec("torchtitan") is not None
needs_torchtitan = pytest.mark.skipif(
    not HAVE_TORCHTITAN, reason="torchtitan is not installed (pip install -e '.[torchtitan]' installs 0.3.0)")


def test_import_mxmoe_does_not_import_torchtitan():
    code = "import sys, mxmoe, mxmoe.integrations; sys.exit('torchtitan' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def routed_experts(dim, hidden, num_experts, top_k, seed=0):
    """torchtitan's RoutedExperts (GroupedExperts + the 'standard' dispatcher) with random weights."""
    from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    cfg = RoutedExperts.Config(
        inner_experts=GroupedExperts.Config(dim=dim, hidden_dim=hidden, num_experts=num_experts),
        token_dispatcher=AllToAllTokenDispatcher.Config(num_experts=num_experts, top_k=top_k))
    m = cfg.build()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return cfg, m


def routing(T, num_experts, top_k, dim, seed=1):
    """Inputs of RoutedExperts.forward: x [1, T, D], scores and expert ids [1, T, K], tokens per expert.
    Every expert gets tokens (torch's CPU _grouped_mm leaves empty experts' gradients unset)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, T, dim, generator=g)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(T)])[None]
    ids[0, :num_experts, 0] = torch.arange(num_experts)
    scores = torch.rand(1, T, top_k, generator=g)
    counts = torch.bincount(ids.reshape(-1), minlength=num_experts)
    return x, scores, ids, counts


def loop_reference(m, x, scores, ids):
    """The experts as a plain FP64 loop over experts: sum_k score * W2 (silu(x W1^T) * (x W3^T))."""
    e = m.inner_experts
    x2, s, idx = x[0].double(), scores[0].double(), ids[0]
    y = torch.zeros_like(x2)
    for k in range(e.num_experts):
        tok, j = (idx == k).nonzero(as_tuple=True)
        h = F.silu(x2[tok] @ e.w1_EFD[k].double().t()) * (x2[tok] @ e.w3_EFD[k].double().t())
        y.index_add_(0, tok, (h @ e.w2_EDF[k].double().t()) * s[tok, j, None])
    return y[None]


def run(m, x, scores, ids, counts):
    """Output and gradients (x, scores, w1, w2, w3) of sum(out^2)."""
    x, scores = x.clone().requires_grad_(), scores.clone().requires_grad_()
    m.zero_grad()
    out = m(x, scores, ids, counts)
    out.double().square().sum().backward()
    e = m.inner_experts
    return [out.detach(), x.grad, scores.grad, e.w1_EFD.grad, e.w2_EDF.grad, e.w3_EFD.grad]


def converted(cfg, m, recipe, **kw):
    from mxmoe.integrations.torchtitan import convert_routed_experts

    c = convert_routed_experts(cfg, recipe, **kw).build()
    c.load_state_dict(m.state_dict())
    return c


@needs_torchtitan
@pytest.mark.parametrize("fused_swiglu", [True, False])
def test_fp32_recipe_equals_loop(fused_swiglu):
    """The plumbing (padding, w1/w3 concatenation, SwiGLU, combine) exactly, under the exact fp32 recipe."""
    cfg, m = routed_experts(64, 96, 6, 2)
    x, s, ids, counts = routing(50, 6, 2, 64)
    got = run(converted(cfg, m, "fp32", fused_swiglu=fused_swiglu), x, s, ids, counts)
    ref = run(_Loop(m), x, s, ids, counts)
    for a, b in zip(got, ref):
        assert rel(a, b) < 1e-5


class _Loop(torch.nn.Module):
    """loop_reference with the module's own parameters (for gradients)."""

    def __init__(self, m):
        super().__init__()
        self.inner_experts = m.inner_experts

    def forward(self, x, scores, ids, counts):
        return loop_reference(self, x, scores, ids)


@needs_torchtitan
@pytest.mark.parametrize("recipe,dims", [("mxfp8", (64, 128)), ("mxfp8_2d", (64, 128)), ("mxfp8_128", (128, 128))])
def test_mx_recipes_match_torchtitan_experts_within_mx_tolerance(recipe, dims):
    """Outputs and gradients of the converted experts against the FP64 loop: within MX tolerance (E4M3:
    ~2.4% RMS per operand, ~6-7% through two chained products), torchtitan's BF16 experts near 1%."""
    D, Fd = dims
    cfg, m = routed_experts(D, Fd, 8, 2)
    x, s, ids, counts = routing(96, 8, 2, D)
    ref = run(_Loop(m), x, s, ids, counts)
    bf16 = run(m, x, s, ids, counts)
    mx = run(converted(cfg, m, recipe), x, s, ids, counts)
    for a, b, r in zip(mx, bf16, ref):
        assert rel(b, r) < 0.02
        assert rel(a, r) < 0.12
    assert rel(mx[0], ref[0]) < 0.08


@needs_torchtitan
def test_fused_and_unfused_swiglu_agree():
    """cat(w1, w3) as one product with mxmoe's SwiGLU gives torchtitan's three products' MX numbers
    (x and the weights quantized along D either way; dgrad's blocks along 2F split at F)."""
    cfg, m = routed_experts(64, 96, 4, 2)
    x, s, ids, counts = routing(40, 4, 2, 64)
    a = run(converted(cfg, m, "mxfp8", fused_swiglu=True), x, s, ids, counts)
    b = run(converted(cfg, m, "mxfp8", fused_swiglu=False), x, s, ids, counts)
    for u, v in zip(a, b):
        assert rel(u, v) < 1e-2


@needs_torchtitan
@pytest.mark.parametrize("align", [32, 128])
def test_expert_parallel_permutation_pads_torchtitans_order(align):
    """Under EP the rows arrive rank-major; _permute puts them expert-major (rank order kept) into
    groups padded to `align` (zero rows), and _unpermute gives them back."""
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    from mxmoe.integrations.torchtitan import MXMoETokenDispatcher

    class Mesh:  # what _permute reads of the EP mesh
        def size(self):
            return 2

    ours = MXMoETokenDispatcher.Config(num_experts=6, top_k=2, align=align).build()
    theirs = AllToAllTokenDispatcher.Config(num_experts=6, top_k=2).build()
    ours.ep_mesh = theirs.ep_mesh = Mesh()
    counts = torch.tensor([3, 0, 5, 1, 2, 4])  # 2 ranks x 3 local experts, rank-major
    rows = torch.randn(int(counts.sum()), 8)
    _, plain, _, plain_counts = theirs._permute(rows, counts)
    shape, padded, index, padded_counts = ours._permute(rows, counts)
    assert shape == rows.shape and plain_counts.tolist() == [4, 2, 9]
    ends = torch.cumsum(padded_counts, 0)
    assert ends[-1] == padded.shape[0] and bool((ends[:-1] % align == 0).all())
    starts = (ends - padded_counts).tolist()
    got = torch.cat([padded[st:st + n] for st, n in zip(starts, plain_counts.tolist())])
    assert torch.equal(got, plain)
    assert float(padded.abs().sum()) == pytest.approx(float(plain.abs().sum()))  # the rest is zero
    assert torch.equal(ours._unpermute(padded, shape, index), rows)


@needs_torchtitan
def test_converter_and_override_rewrite_the_config_tree():
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.models.common.moe import RoutedExperts
    from torchtitan.models.deepseek_v3 import model_registry

    from mxmoe.integrations.torchtitan import MXMoEConverter, MXMoEGroupedExperts, MXMoETokenDispatcher

    spec = model_registry("debugmodel", converters=[MXMoEConverter.Config(recipe="mxfp8_128")])
    model = model_registry("debugmodel").model
    apply_overrides(OverrideConfig(imports=[("mxmoe.integrations.torchtitan.mxmoe_experts", {"recipe": "mxfp8"})]),
                    model)
    for tree, recipe, align in ((spec.model, "mxfp8_128", 128), (model, "mxfp8", 32)):
        found = list(tree.traverse(RoutedExperts.Config))
        assert len(found) == 5  # the debug model's MoE layers
        for _, cfg, _, _ in found:
            assert type(cfg.inner_experts) is MXMoEGroupedExperts.Config and cfg.inner_experts.recipe == recipe
            assert type(cfg.token_dispatcher) is MXMoETokenDispatcher.Config and cfg.token_dispatcher.align == align


@needs_torchtitan
def test_bad_inputs_raise_clear_errors():
    from torchtitan.models.common.token_dispatcher import DeepEPTokenDispatcher

    from mxmoe.integrations.torchtitan import MXMoEConverter, convert_routed_experts

    cfg, _ = routed_experts(64, 96, 4, 2)
    with pytest.raises(ValueError, match="unknown recipe"):
        convert_routed_experts(cfg, "mxfp4")
    with pytest.raises(ValueError, match="unknown recipe"):
        MXMoEConverter.Config(recipe="nope").build()
    with pytest.raises(ValueError, match="divisible by 128"):
        convert_routed_experts(cfg, "mxfp8_128")  # hidden_dim 96
    with pytest.raises(TypeError, match="RoutedExperts.Config"):
        convert_routed_experts(cfg.inner_experts, "mxfp8")
    deepep = replace(cfg, token_dispatcher=DeepEPTokenDispatcher.Config(num_experts=4, top_k=2))
    with pytest.raises(ValueError, match="cannot pad"):
        convert_routed_experts(deepep, "mxfp8")
    with pytest.raises(ValueError, match="no RoutedExperts"):
        MXMoEConverter.Config(recipe="mxfp8").build().convert(cfg.inner_experts)


@needs_torchtitan
def test_experts_with_their_own_forward_get_mx_products_through_the_seam():
    """gpt-oss's experts (biases, clamped SwiGLU: their own forward) keep it; their _grouped_mm seam runs
    mxmoe's products: the exact fp32 recipe vs mxfp8 within MX tolerance."""
    from torchtitan.models.common.moe import RoutedExperts
    from torchtitan.models.gpt_oss import model_registry

    from mxmoe.integrations.torchtitan import convert_routed_experts

    _, cfg, _, _ = next(iter(model_registry("debugmodel").model.traverse(RoutedExperts.Config)))
    cfg = replace(cfg, inner_experts=replace(cfg.inner_experts, hidden_dim=128))
    x, s, ids, counts = routing(64, 8, cfg.token_dispatcher.top_k, cfg.inner_experts.dim)
    outs = []
    for recipe in ("fp32", "mxfp8"):
        m = convert_routed_experts(cfg, recipe).build()
        assert type(m.inner_experts).__name__ == "MXMoEGptOssGroupedExperts"
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * p.shape[-1] ** -0.5)
        x2, s2 = x.clone().requires_grad_(), s.clone().requires_grad_()
        out = m(x2, s2, ids, counts)
        out.double().square().sum().backward()
        outs.append([out.detach(), x2.grad] + [p.grad for p in m.parameters()])
    for a, b in zip(*outs):
        assert rel(a, b) < 0.12


def debug_model(converters=None, layers=2):
    """torchtitan's DeepSeek-V3 debug model (dim 256, 8 experts of 256, top 3), first `layers` layers,
    attention through SDPA (FlexAttention has no CPU backward)."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.deepseek_v3 import model_registry

    cfg = model_registry("debugmodel", converters=converters).model
    cfg.layers = cfg.layers[:layers]
    for _, _, parent, attr in list(cfg.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    return cfg.build()


@needs_torchtitan
@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_128"])
def test_debug_model_forward_backward_with_converter(recipe):
    from mxmoe.integrations.torchtitan import MXMoEConverter, MXMoEGroupedExperts

    torch.manual_seed(0)
    ref = debug_model()
    ref.init_states()
    model = debug_model([MXMoEConverter.Config(recipe=recipe)])
    assert model.state_dict().keys() == ref.state_dict().keys()  # checkpoints interchangeable
    model.load_state_dict(ref.state_dict())
    experts = [m for m in model.modules() if isinstance(m, MXMoEGroupedExperts)]
    assert len(experts) == 1  # layer 0 is dense
    tokens = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(2))
    losses = []
    for mdl in (ref, model):
        logits = mdl(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.roll(-1, 1).flatten())
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[1] - losses[0]) < 0.02 * losses[0]
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    for e in experts:
        assert all(float(p.grad.norm()) > 0 for p in e.parameters())


@needs_torchtitan
def test_padding_dispatcher_with_torchtitans_experts_eager_and_compiled():
    """The padded groups change nothing for torchtitan's own BF16 experts (zero rows), bit for bit, and the
    dispatcher traces as one graph (torchtitan compiles each block with fullgraph=True). On the CPU the
    mxmoe products themselves do not compile (their reference loops branch on group sizes); on CUDA they
    are custom ops."""
    from mxmoe.integrations.torchtitan import MXMoETokenDispatcher

    cfg, m = routed_experts(64, 128, 8, 2)
    x, s, ids, counts = routing(96, 8, 2, 64)
    padded = replace(cfg, token_dispatcher=MXMoETokenDispatcher.Config(num_experts=8, top_k=2, align=32)).build()
    padded.load_state_dict(m.state_dict())
    ref = run(m, x, s, ids, counts)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):  # as torchtitan's apply_compile sets
        for mod in (padded, torch.compile(padded, fullgraph=True, backend="aot_eager")):
            for a, b in zip(run(mod, x, s, ids, counts), ref):
                assert torch.equal(a, b)
