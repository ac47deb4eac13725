"""torch.compile traces the layer, the expert-parallel layer and the training model as one graph, forward
and backward, on the CPU (``fullgraph=True``: any graph break is an error).

On the CPU every op runs its pure-torch twin; the per-group reference product is one custom op under
compile (its loop's sizes are data), so what Dynamo traces here is the layer's own Python: routing, the
permutation plan, the autograd functions, the autocast handling. A line Dynamo cannot trace in any of
them (e.g. ``torch.amp.is_autocast_available`` in ``MoE.forward``, which torch 2.11's Dynamo does not
know) fails these tests. ``.ci/run`` runs this file under torch 2.13 (the test command) and again under
torch 2.11, the GPU machines' release, whose Dynamo knows fewer builtins.
"""

import pytest
import torch

from mxmoe.moe import MoE

# one recipe of each family: 1x32 (and its low-memory form), 1x128 (and its low-memory form), plain
RECIPES = ["mxfp8", "mxfp8_lowmem", "mxfp8_128", "mxfp8_128_lowmem", "bf16"]


def _dims(recipe: str) -> tuple[int, int]:
    return (128, 128) if "128" in recipe else (64, 96)


def _fwd_bwd(layer, x, params):
    xg = x.clone().requires_grad_()
    for p in params:
        p.grad = None
    y = layer(xg)
    (y.float().square().mean() + layer.aux_loss).backward()
    return [y.detach().float(), xg.grad.float()] + [p.grad.float() for p in params]


def _assert_close(eager, compiled, what, tol=1e-5):
    for i, (e, c) in enumerate(zip(eager, compiled)):
        assert torch.isfinite(c).all(), f"{what}: output {i} not finite"
        err = ((c - e).norm() / e.norm().clamp_min(1e-30)).item()
        assert err <= tol, f"{what}: output {i} differs from eager by {err:.2e}"


def _compiled_one_graph(layer):
    torch._dynamo.reset()
    return torch.compile(layer, fullgraph=True, backend="aot_eager")


@pytest.mark.parametrize("recipe, autocast", [(r, False) for r in RECIPES] + [("mxfp8", True), ("mxfp8_128", True)])
def test_moe_traces_as_one_graph(recipe, autocast):
    """MoE forward + backward under torch.compile(fullgraph=True), FP32 and BF16-autocast inputs: traced
    whole, and the same numbers as eager (the same ops: aot_eager does not fuse; under autocast BF16 values
    may round in other places, ~1e-3)."""
    dim, ffn = _dims(recipe)
    torch.manual_seed(0)
    moe = MoE(dim, ffn, 6, 2, recipe=recipe)
    x = torch.randn(3, 40, dim)  # [batch, seq, D]; 240 routed rows over 6 experts, some groups ragged
    params = [moe.router.weight, moe.w13, moe.w2]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        eager = _fwd_bwd(moe, x, params)
        compiled = _fwd_bwd(_compiled_one_graph(moe), x, params)
    _assert_close(eager, compiled, f"{recipe} autocast={autocast}", 1e-2 if autocast else 1e-5)


def test_moe_traces_with_empty_experts():
    """Tokens routed to two of eight experts (the router's weight rigged): empty groups first, in the
    middle and last, still one graph."""
    torch.manual_seed(0)
    moe = MoE(128, 128, 8, 1, recipe="mxfp8_128")
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[2, 0] = moe.router.weight[5, 1] = 10.0
    x = torch.randn(64, 128)
    x[:, :2] = x[:, :2].abs()
    params = [moe.w13, moe.w2]
    _assert_close(_fwd_bwd(moe, x, params), _fwd_bwd(_compiled_one_graph(moe), x, params), "empty experts")


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_128"])
def test_expert_parallel_layer_of_one_rank_traces_as_one_graph(recipe, tmp_path):
    """ExpertParallelMoE over a group of one rank (gloo, this process): nothing to exchange, so it permutes
    as MoE does, with no host synchronization, and traces whole; its numbers are MoE's."""
    import torch.distributed as dist

    from mxmoe.parallel import ExpertParallelMoE

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        dim, ffn = _dims(recipe)
        torch.manual_seed(0)
        full = MoE(dim, ffn, 4, 2, recipe=recipe)
        ep = ExpertParallelMoE.from_full(full)
        x = torch.randn(96, dim)
        ref = _fwd_bwd(full, x, [full.w13, full.w2])
        eager = _fwd_bwd(ep, x, [ep.w13, ep.w2])
        _assert_close(ref, eager, f"{recipe}: one-rank ExpertParallelMoE vs MoE")
        _assert_close(eager, _fwd_bwd(_compiled_one_graph(ep), x, [ep.w13, ep.w2]), f"{recipe} expert parallel")
        assert ep.comm_stats["dispatch_bytes"] == 0
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_128", "bf16"])
def test_training_model_traces_as_one_graph(recipe):
    """The main job's model (what ``mxmoe train --compile`` compiles: embeddings, attention, MoE blocks, LM
    head, cross-entropy and the aux loss), forward + backward, one graph."""
    from mxmoe.train import MoELM, make_config

    cfg = make_config("tiny", dim=128, ffn_dim=128, layers=2, seq_len=32, experts=4, top_k=2)
    torch.manual_seed(0)
    model = MoELM(cfg, recipe)
    idx = torch.randint(0, 256, (2, 32))
    tgt = torch.randint(0, 256, (2, 32))
    params = [p for p in model.parameters() if p.requires_grad]

    def step(m):
        for p in params:
            p.grad = None
        ce, aux = m(idx, tgt)
        (ce + aux).backward()
        return [ce.detach(), aux.detach()] + [p.grad.clone() for p in params]

    eager = step(model)
    torch._dynamo.reset()
    compiled = step(torch.compile(model, fullgraph=True, backend="aot_eager"))
    _assert_close(eager, compiled, f"training model {recipe}")


def test_a_graph_break_fails_these_tests(monkeypatch):
    """The check itself: a line Dynamo cannot trace in MoE.forward's path makes the fullgraph compile fail
    (here a call of a function Dynamo is told not to trace, as it treats an unknown builtin)."""
    import mxmoe.moe as moe_module

    @torch._dynamo.disable
    def untraceable(device_type):
        return None

    monkeypatch.setattr(moe_module, "autocast_dtype", untraceable)
    moe = MoE(64, 96, 4, 2, recipe="mxfp8")
    with pytest.raises(Exception, match="(?i)graph break|disable|skip"):
        _compiled_one_graph(moe)(torch.randn(16, 64))
