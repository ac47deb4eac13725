"""Expert parallelism (mxmoe.parallel) against the single-process MoE with the same weights.

Two ranks (gloo on the CPU; NCCL on two GPUs for the `gpu` test) are spawned once per backend;
every case runs in them and saves its tensors, and the parent compares them with the
single-process layer run on the concatenation of both ranks' batches (the order in which the
expert-parallel layer stacks each expert's received rows, so the products agree row for row).

Per case the loss is ``sum_r (y_r * g_r).sum() + aux_r`` (aux_r: the load-balancing loss of rank
r's own tokens), so the single-process gradients are: input rows = each rank's input gradient,
router = the sum of the ranks' router gradients (the router is replicated), experts = the
concatenation of the ranks' local expert gradients.
"""

from __future__ import annotations

import os
import socket
import traceback
from dataclasses import dataclass

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from mxmoe.moe import MoE
from mxmoe.ops import quantize
from mxmoe.recipes import get_recipe

WORLD = 2
TOKENS = 24  # per rank


@dataclass(frozen=True)
class Case:
    dim: int
    ffn_dim: int
    num_experts: int
    top_k: int
    recipe: str
    dispatch: str | None  # dispatch_dtype of the expert-parallel layer
    mx_input: bool  # inputs exactly representable in MXFP8 (the dispatch rounding is then exact)
    empty: tuple[int, ...]  # experts no token is routed to (crafted router rows)
    tol: float  # relative L2 error bound for outputs and every gradient
    tol_w13: float | None = None  # a looser bound for the w13 gradient, where one is justified
    spread: int = 0  # feature d of x is scaled by 2^k_d, k_d uniform in [-spread, spread]


# Rank 0 holds experts [0, E/2), rank 1 [E/2, E). With E=8, experts 0 (first of rank 0), 5 (middle
# of rank 1) and 7 (last of rank 1) get no tokens; with E=4 and experts 2, 3 empty, rank 1
# receives no token at all.
CASES = {
    # fp32 recipe, fp32 activations travel as they are: same products, same order -> FP32 round-off only.
    "fp32": Case(64, 96, 8, 2, "fp32", None, False, (0, 5, 7), 1e-5),
    "fp32_top3": Case(64, 96, 8, 3, "fp32", None, False, (), 1e-5),
    "fp32_rank1_idle": Case(64, 96, 4, 2, "fp32", None, False, (2, 3), 1e-5),
    # BF16 transport of fp32 activations: tokens, outputs and gradients each rounded once to BF16
    # (relative error <= 2^-9 = 2e-3 per element, ~1e-3 RMS): 1e-2 bounds it with margin.
    "bf16_dispatch": Case(64, 96, 8, 2, "fp32", "bf16", False, (0, 5, 7), 1e-2),
    # MXFP8 dispatch of MXFP8-representable inputs: the received bytes are the ones the
    # single-process grouped_linear makes from the same rows, every product sees the same operands
    # and the wgrad token blocks line up -> only FP32 summation order can differ.
    "mxfp8_exact_input": Case(64, 96, 8, 2, "mxfp8", "mxfp8", True, (0, 5, 7), 1e-5),
    "mxfp8_rank1_idle": Case(64, 96, 4, 2, "mxfp8", "mxfp8", True, (2, 3), 1e-5),
    # Features spread over 2^-8..2^8 (outlier features): fprop is still identical (both sides
    # quantize the same rows along D), and so are outputs, dx, router and w2 gradients. w13's wgrad
    # quantizes the tokens along M: the single-process layer from x, this layer from the
    # dequantized received rows, i.e. x rounded twice. E4M3 is a floating-point format, so in its
    # normal range the rounding of a value does not depend on the power-of-two block scale and the
    # second rounding changes nothing; only elements that were E4M3 subnormals in one of the two
    # blocks (below ~2^-15 of that block's amax) round differently. Measured 4.4e-6; bound 1e-4.
    "mxfp8": Case(64, 96, 8, 2, "mxfp8", "mxfp8", False, (0, 5, 7), 1e-5, tol_w13=1e-4, spread=8),
    "mxfp8_2d_top1": Case(64, 96, 8, 1, "mxfp8_2d", "mxfp8", True, (3,), 1e-5),
    # 1x128 dispatch (the received rows carry their 128-group scales) into the mxfp8_128 products
    "mxfp8_128": Case(128, 128, 8, 2, "mxfp8_128", "mxfp8", True, (0, 5, 7), 1e-5),
}


def build_case(name: str, device: str = "cpu"):
    """Same weights, inputs and loss weights in every process: (full MoE, x [W*T, D], g [W*T, D])."""
    c = CASES[name]
    torch.manual_seed(sorted(CASES).index(name))
    full = MoE(c.dim, c.ffn_dim, c.num_experts, c.top_k, recipe=c.recipe)
    x = torch.randn(WORLD * TOKENS, c.dim)
    g = torch.randn(WORLD * TOKENS, c.dim)
    feature_scale = 2.0 ** torch.randint(-c.spread, c.spread + 1, (c.dim,))
    with torch.no_grad():
        x *= feature_scale
        full.router.weight /= feature_scale  # the router's logits do not see the spread
        x[:, 0] = 3.0  # a constant feature: a router row with a large negative entry there is never chosen
        full.router.weight[list(c.empty), 0] = -8.0
    if c.mx_input:
        x = quantize(x, block=get_recipe(c.recipe).act_block).dequantize()
    return full.to(device), x.to(device), g.to(device)


class TinyModel(nn.Module):
    """Linear, then two residual MoE layers: what convert_to_expert_parallel walks through."""

    def __init__(self, recipe: str):
        super().__init__()
        self.inp = nn.Linear(64, 64)
        self.blocks = nn.ModuleList(nn.ModuleDict({"moe": MoE(64, 64, 4, 2, recipe=recipe)}) for _ in range(2))

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = x + b["moe"](x)
        return x


CLIP, LR = 1.0, 0.1  # the gradient norm is ~11: clipping acts


def build_model(device: str = "cpu"):
    torch.manual_seed(123)
    model = TinyModel("mxfp8")
    x, g = torch.randn(WORLD * TOKENS, 64), torch.randn(WORLD * TOKENS, 64)
    return model.to(device), x.to(device), g.to(device)


# ------------------------------------------------------------------------------ rank processes

def _rank_cases(rank: int, device: str) -> dict:
    from mxmoe.parallel import ExpertParallelMoE

    out = {}
    rows = slice(rank * TOKENS, (rank + 1) * TOKENS)
    for name, c in CASES.items():
        full, x, g = build_case(name, device)
        ep = ExpertParallelMoE.from_full(full, dispatch_dtype=c.dispatch)
        xr = x[rows].clone().requires_grad_()
        y = ep(xr)
        ((y * g[rows]).sum() + ep.aux_loss).backward()
        out[name] = {"y": y.detach(), "dx": xr.grad, "router": ep.router.weight.grad, "w13": ep.w13.grad,
                     "w2": ep.w2.grad, "aux": ep.aux_loss.detach(), "stats": dict(ep.comm_stats)}
    return {k: {n: t.cpu() if isinstance(t, torch.Tensor) else t for n, t in v.items()} for k, v in out.items()}


def _rank_errors(rank: int) -> dict:
    from mxmoe.parallel import ExpertParallelMoE

    errors = {}
    attempts = {
        "divisible": lambda: ExpertParallelMoE(64, 64, 3, 1, recipe="fp32"),
        "ffn_dim": lambda: ExpertParallelMoE(64, 64 if rank == 0 else 96, 4, 2, recipe="fp32"),
        "recipe": lambda: ExpertParallelMoE(64, 64, 4, 2, recipe="mxfp8" if rank == 0 else "mxfp8_2d"),
        "dispatch": lambda: ExpertParallelMoE(64, 64, 4, 2, recipe="fp32", dispatch_dtype="mxfp8"),
    }
    for what, make in attempts.items():
        try:
            make()
            errors[what] = None
        except ValueError as e:
            errors[what] = str(e)
    return errors


def _rank_model(rank: int, device: str) -> dict:
    from mxmoe import parallel

    model, x, g = build_model(device)
    full_state = {k: v.clone() for k, v in model.state_dict().items()}
    model = parallel.convert_to_expert_parallel(model)
    parallel.sync_replicated_parameters(model)
    gathered = {k: v.clone() for k, v in parallel.full_state_dict(model).items()}  # (aliases live params)
    rows = slice(rank * TOKENS, (rank + 1) * TOKENS)
    loss = (model(x[rows]) * g[rows]).sum() / TOKENS  # this rank's mean loss
    loss.backward()
    parallel.allreduce_gradients(model)
    grads = {n: p.grad.cpu().clone() for n, p in model.named_parameters()}
    norm = parallel.clip_grad_norm_(model, max_norm=CLIP)
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return {"types": [type(b["moe"]).__name__ for b in model.blocks],
            "state_equal": sorted(gathered) == sorted(full_state)
            and all(torch.equal(gathered[k].cpu(), full_state[k].cpu()) for k in full_state),
            "grads": grads, "norm": norm.item(),
            "stepped": {k: v.cpu() for k, v in parallel.full_state_dict(model).items()},
            "root": type(parallel.convert_to_expert_parallel(MoE(64, 64, 4, 2))).__name__}


def _worker(rank: int, port: int, out_dir: str, device: str) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
        torch.set_num_threads(1)
        from mxmoe.parallel import maybe_init_distributed, shutdown_distributed

        group = maybe_init_distributed(backend="nccl" if device == "cuda" else "gloo", timeout_s=60)
        assert group is not None
        dev = f"cuda:{rank}" if device == "cuda" else "cpu"
        result = {"cases": _rank_cases(rank, dev), "errors": _rank_errors(rank), "model": _rank_model(rank, dev)}
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        shutdown_distributed()  # barrier first: gloo aborts a rank that tears down while its peer works
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(out_dir, device: str) -> list[dict]:
    """Spawn WORLD rank processes, wait (killing our own children after 240 s), load their results."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, str(out_dir), device)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join()
    errs = [(out_dir / f"rank{r}.err").read_text() for r in range(WORLD) if (out_dir / f"rank{r}.err").exists()]
    codes = [p.exitcode for p in procs]
    assert not hung and not errs and codes == [0] * WORLD, \
        f"rank processes failed (hung: {len(hung)}, exit codes {codes}):\n" + "\n".join(errs)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD)]


@pytest.fixture(scope="module")
def cpu_ranks(tmp_path_factory):
    return run_ranks(tmp_path_factory.mktemp("ep_gloo"), "cpu")


# ------------------------------------------------------------------------------ comparisons

def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def reference(name: str, device: str = "cpu") -> dict:
    """The single-process layer on both ranks' tokens at once, with the per-rank aux losses."""
    full, x, g = build_case(name, device)
    x.requires_grad_()
    y = full(x)
    aux = []
    for r in range(WORLD):  # the load-balancing loss of each rank's own tokens
        full.route(x[r * TOKENS:(r + 1) * TOKENS])
        aux.append(full.aux_loss)
    ((y * g).sum() + sum(aux)).backward()
    counts = full.route(x.detach()).counts.cpu()
    return {"y": y.detach(), "dx": x.grad, "router": full.router.weight.grad, "w13": full.w13.grad,
            "w2": full.w2.grad, "aux": torch.stack(aux).detach(), "counts": counts}


def check_case(ranks: list[dict], name: str, device: str = "cpu", tol_scale: float = 1.0) -> dict:
    c = CASES[name]
    ref = reference(name, device)
    got = [r["cases"][name] for r in ranks]
    errs = {
        "y": rel(torch.cat([o["y"] for o in got]), ref["y"]),
        "dx": rel(torch.cat([o["dx"] for o in got]), ref["dx"]),
        "router": rel(sum(o["router"] for o in got), ref["router"]),
        "w13": rel(torch.cat([o["w13"] for o in got]), ref["w13"]),
        "w2": rel(torch.cat([o["w2"] for o in got]), ref["w2"]),
        "aux": rel(torch.stack([o["aux"] for o in got]), ref["aux"]),
    }
    for what, err in errs.items():
        tol = c.tol_w13 if (what == "w13" and c.tol_w13) else c.tol
        assert err < tol * tol_scale, f"{name}: {what} relative error {err:.3g} >= {tol * tol_scale:g} ({errs})"
    # the crafted routing happened: empty experts have zero gradients on their owning rank
    assert [e for e in range(c.num_experts) if ref["counts"][e] == 0] == list(c.empty)
    El = c.num_experts // WORLD
    for e in c.empty:
        assert bool((got[e // El]["w13"][e % El] == 0).all()) and bool((got[e // El]["w2"][e % El] == 0).all())
    return errs


@pytest.mark.parametrize("name", list(CASES))
def test_expert_parallel_equals_single_process(cpu_ranks, name):
    check_case(cpu_ranks, name)


def test_rank_receiving_no_tokens(cpu_ranks):
    """Experts 2 and 3 of rank 1 are empty: rank 1 receives nothing, but still sends and computes."""
    for name in ("fp32_rank1_idle", "mxfp8_rank1_idle"):
        r0, r1 = (r["cases"][name]["stats"] for r in cpu_ranks)
        assert r1["combine_rows"] == 0 and r0["combine_rows"] == 2 * WORLD * TOKENS  # R: rows received
        assert r1["dispatch_rows"] == r0["dispatch_rows"] == 2 * TOKENS  # S = T * top_k


def test_mxfp8_dispatch_bytes(cpu_ranks):
    """MXFP8 rows are D data bytes + D/32 scale bytes; BF16 rows 2D: 33/64 of the bytes."""
    mx, bf = (cpu_ranks[0]["cases"][n]["stats"] for n in ("mxfp8", "bf16_dispatch"))
    assert mx["dispatch_rows"] == bf["dispatch_rows"] == 2 * TOKENS
    assert mx["dispatch_bytes"] == 2 * TOKENS * (64 + 2) and bf["dispatch_bytes"] == 2 * TOKENS * 128


def test_config_errors(cpu_ranks):
    for r in cpu_ranks:
        e = r["errors"]
        assert "num_experts=3 is not divisible by the expert-parallel group size 2" in e["divisible"]
        assert "disagree" in e["ffn_dim"] and "ffn_dim: rank 0 has 64, rank 1 has 96" in e["ffn_dim"]
        assert "disagree" in e["recipe"] and "recipe" in e["recipe"]
        assert "needs an MXFP8 recipe" in e["dispatch"]


def test_convert_model_and_gradient_sync(cpu_ranks):
    """convert_to_expert_parallel on a model; allreduce_gradients gives the single-process gradients
    of the mean loss over both ranks' batches; full_state_dict gives back the unconverted state."""
    check_model(cpu_ranks, "cpu", tol=1e-5)


def check_model(ranks, device, tol):
    model, x, g = build_model(device)
    x.requires_grad_()
    ((model(x) * g).sum() / (WORLD * TOKENS)).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    ref_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item()
    torch.optim.SGD(model.parameters(), lr=LR).step()
    for r in ranks:
        assert r["model"]["types"] == ["ExpertParallelMoE"] * 2 and r["model"]["state_equal"]
        assert r["model"]["root"] == "ExpertParallelMoE"
        assert abs(r["model"]["norm"] - ref_norm) < tol * ref_norm
        for k, want in model.state_dict().items():  # one clipped SGD step: the same model
            assert rel(r["model"]["stepped"][k], want) < tol, k
    for n, want in ref.items():
        if n.endswith(("w13", "w2")):  # local experts: rank 0 then rank 1
            got = torch.cat([r["model"]["grads"][n] for r in ranks])
        else:  # replicated: equal on every rank after the all-reduce
            got = ranks[0]["model"]["grads"][n]
            assert torch.equal(got, ranks[1]["model"]["grads"][n]), n
        assert rel(got, want) < tol, (n, rel(got, want))


def test_needs_initialized_distributed():
    from mxmoe.parallel import ExpertParallelMoE, maybe_init_distributed

    if torch.distributed.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(RuntimeError, match="torch.distributed initialized"):
        ExpertParallelMoE(64, 64, 4, 2)
    env = os.environ.get("WORLD_SIZE")
    os.environ.pop("WORLD_SIZE", None)
    try:
        assert maybe_init_distributed() is None  # not launched by torchrun: single process
    finally:
        if env is not None:
            os.environ["WORLD_SIZE"] = env


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_expert_parallel_nccl(tmp_path, monkeypatch):
    """The same cases over NCCL on two GPUs (NVLink multicast off), against the single-process
    layer on cuda:0. GPU products may order their FP32 sums differently for different row counts
    (the last expert group's padding differs): 10x the CPU bounds."""
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    ranks = run_ranks(tmp_path, "cuda")
    for name in CASES:
        check_case(ranks, name, "cuda:0", tol_scale=10.0)
    check_model(ranks, "cuda:0", tol=1e-4)
    assert all("divisible" in r["errors"]["divisible"] for r in ranks)
