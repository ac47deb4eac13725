"""mxmoe.convert against the Hugging Face models it converts: tiny random models, nothing downloaded.

Tolerances (relative Frobenius error of the logits, model in FP32):
    fp32 recipe   1e-5 (measured 0 to 3e-7: only the summation order differs)
    bf16 recipe   median per token 1e-2 (measured ~3e-3); whole tensor 5e-2 (a token whose top-k choice
                  flips at a near-tie in the second layer can reach ~0.2 on its own)
    mxfp8         0.1 (measured 0.02 to 0.07)
Model in BF16, bf16 recipe, against the HF model in BF16: 5e-2 (measured 3e-3 to 6e-3).
"""

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mxmoe.convert import SUPPORTED_BLOCKS, HFSparseMoEBlock, convert  # noqa: E402
from mxmoe.moe import MoE  # noqa: E402

COMMON = dict(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, initializer_range=0.1)  # larger than HF's 0.02 so the experts matter


def _mixtral():
    cfg = transformers.MixtralConfig(**COMMON, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(cfg), 2


def _qwen2_moe():
    cfg = transformers.Qwen2MoeConfig(**COMMON, intermediate_size=128, moe_intermediate_size=96,
                                      shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                                      norm_topk_prob=False)
    return transformers.Qwen2MoeForCausalLM(cfg), 2


def _qwen3_moe(moe_intermediate_size=64):
    cfg = transformers.Qwen3MoeConfig(**COMMON, intermediate_size=128, moe_intermediate_size=moe_intermediate_size,
                                      num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, head_dim=16)
    return transformers.Qwen3MoeForCausalLM(cfg), 2


def _deepseek_v3_config(**kw):
    args = dict(COMMON, intermediate_size=128, moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
                n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                norm_topk_prob=True, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
                v_head_dim=16)
    args.update(kw)
    return transformers.DeepseekV3Config(**args)


def _deepseek_v3():
    model = transformers.DeepseekV3ForCausalLM(_deepseek_v3_config())
    _randomize_score_bias(model)
    return model, 1  # layer 0 is dense (first_k_dense_replace=1)


def _olmoe():
    cfg = transformers.OlmoeConfig(**COMMON, intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                                   norm_topk_prob=True, pad_token_id=1, eos_token_id=2)
    return transformers.OlmoeForCausalLM(cfg), 2


def _glm4_moe():
    cfg = transformers.Glm4MoeConfig(**COMMON, intermediate_size=128, moe_intermediate_size=64, n_routed_experts=4,
                                     num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                                     first_k_dense_replace=1, routed_scaling_factor=1.5, norm_topk_prob=True,
                                     head_dim=16)
    model = transformers.Glm4MoeForCausalLM(cfg)
    _randomize_score_bias(model)
    return model, 1


def _randomize_score_bias(model):
    with torch.no_grad():
        for m in model.modules():
            if isinstance(getattr(m, "e_score_correction_bias", None), torch.Tensor):
                m.e_score_correction_bias.normal_(0, 0.1)


BUILDERS = {"mixtral": _mixtral, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe}
for _name, _builder, _cls in (("deepseek_v3", _deepseek_v3, "DeepseekV3ForCausalLM"),
                              ("olmoe", _olmoe, "OlmoeForCausalLM"), ("glm4_moe", _glm4_moe, "Glm4MoeForCausalLM")):
    if hasattr(transformers, _cls):
        BUILDERS[_name] = _builder


def build(name):
    torch.manual_seed(0)
    model, num_blocks = BUILDERS[name]()
    return model.eval(), num_blocks, torch.randint(0, 100, (2, 16))


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def count_hf_blocks(model):
    return sum(type(m).__name__ in SUPPORTED_BLOCKS for m in model.modules())


@pytest.mark.parametrize("name", list(BUILDERS))
def test_fp32_recipe_matches_logits(name):
    model, num_blocks, ids = build(name)
    assert count_hf_blocks(model) == num_blocks
    with torch.no_grad():
        ref = model(ids).logits
    n_params = sum(p.numel() for p in model.parameters())
    converted = convert(copy.deepcopy(model), "fp32")
    assert sum(isinstance(m, HFSparseMoEBlock) for m in converted.modules()) == num_blocks
    assert count_hf_blocks(converted) == 0
    assert sum(p.numel() for p in converted.parameters()) == n_params  # same weights, no extras, none lost
    with torch.no_grad():
        out = converted(ids).logits
    assert rel(out, ref) < 1e-5


@pytest.mark.parametrize("name", list(BUILDERS))
def test_bf16_recipe_close(name):
    model, _, ids = build(name)
    with torch.no_grad():
        ref = model(ids).logits
        out = convert(copy.deepcopy(model), "bf16")(ids).logits
    per_token = (out - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert per_token.median().item() < 1e-2
    assert rel(out, ref) < 5e-2


@pytest.mark.parametrize("name", list(BUILDERS))
def test_bf16_model_bf16_recipe_close(name):
    """Model in BF16 end to end against the HF model in BF16 (mxmoe's router stays FP32, HF's Mixtral/Qwen is BF16)."""
    model, _, ids = build(name)
    model = model.to(torch.bfloat16)
    with torch.no_grad():
        ref = model(ids).logits
        out = convert(copy.deepcopy(model), "bf16")(ids).logits
    assert out.dtype == torch.bfloat16
    per_token = (out.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1)
    assert per_token.median().item() < 2e-2
    assert rel(out, ref) < 5e-2


@pytest.mark.parametrize("name", list(BUILDERS))
def test_mxfp8_forward_backward(name):
    model, num_blocks, ids = build(name)
    with torch.no_grad():
        ref = model(ids).logits
    converted = convert(copy.deepcopy(model), "mxfp8").train()
    out = converted(ids, labels=ids)
    assert rel(out.logits.detach(), ref) < 0.1
    moes = [m for m in converted.modules() if isinstance(m, MoE)]
    assert len(moes) == num_blocks
    (out.loss + sum(m.aux_loss for m in moes)).backward()
    for pname, p in converted.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
    for m in moes:
        assert m.w13.grad.abs().sum() > 0 and m.w2.grad.abs().sum() > 0 and m.router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("name", list(BUILDERS))
def test_block_call_convention(name):
    """The converted block returns what the installed HF block returns (a tensor, or a pair in older versions)."""
    model, _, _ = build(name)
    original = next(m for m in model.modules() if type(m).__name__ in SUPPORTED_BLOCKS)
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        want = original(x)
        got = convert(torch.nn.ModuleDict({"mlp": copy.deepcopy(original)}), "fp32")["mlp"](x)
    assert isinstance(got, tuple) == isinstance(want, tuple)
    if isinstance(want, tuple):
        assert rel(got[0], want[0]) < 1e-5 and got[1].shape == want[1].shape
    else:
        assert got.shape == want.shape and rel(got, want) < 1e-5


@pytest.mark.skipif("deepseek_v3" not in BUILDERS, reason="no DeepSeek-V3 in this transformers")
def test_deepseek_v3_group_limited_router():
    """8 experts in 4 groups, 2 groups kept, top_k 3, biased choice: the block alone, tokens well spread."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3

    torch.manual_seed(0)
    cfg = _deepseek_v3_config(n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2)
    block = modeling_deepseek_v3.DeepseekV3MoE(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    _randomize_score_bias(block)
    x = torch.randn(4, 32, 64)
    with torch.no_grad():
        want = block(x)
        want = want[0] if isinstance(want, tuple) else want
        new = convert(torch.nn.ModuleDict({"mlp": block}), "fp32")["mlp"]
        got = new(x)
        got = got[0] if isinstance(got, tuple) else got
    assert new.moe.n_group == 4 and new.moe.topk_group == 2 and new.moe.routed_scaling_factor == 2.5
    assert rel(got, want) < 1e-5


def test_mxfp8_needs_dims_divisible_by_32():
    torch.manual_seed(0)
    model, _ = _qwen3_moe(moe_intermediate_size=48)
    with pytest.raises(ValueError, match="divisible by 32"):
        convert(model, "mxfp8")
    assert count_hf_blocks(model) == 2  # nothing changed
    with pytest.warns(UserWarning, match="left unconverted"):
        convert(model, "mxfp8", strict=False)
    assert count_hf_blocks(model) == 2
    convert(model, "fp32")  # the exact recipe takes any dims
    assert count_hf_blocks(model) == 0


def test_output_router_logits_turned_off():
    model, _, ids = build("mixtral")
    model.config.output_router_logits = True
    with pytest.warns(UserWarning, match="output_router_logits"):
        convert(model, "fp32")
    assert model.config.output_router_logits is False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model(ids, labels=ids)
    assert torch.isfinite(out.loss)


class _FusedExperts(torch.nn.Module):
    """Stand-in for an HF fused-experts module with a given storage layout (flags as transformers 5 sets them)."""

    def __init__(self, gate_up, down, **flags):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(gate_up)
        self.down_proj = torch.nn.Parameter(down)
        for k, v in flags.items():
            setattr(self, k, v)


class _ExpertMLP(torch.nn.Module):
    def __init__(self, names, gate, up, down):
        super().__init__()
        for name, w in zip(names, (gate, up, down)):
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
            lin.weight.data.copy_(w)
            setattr(self, name, lin)


def test_expert_storage_layouts():
    """Every storage convention of the expert weights reads back as w13 [E, 2F, D] (gate first) and w2 [E, D, F]."""
    from mxmoe.convert import _expert_weights

    E, D, F = 3, 8, 4
    torch.manual_seed(0)
    gate, up, down = torch.randn(E, F, D), torch.randn(E, F, D), torch.randn(E, D, F)
    w13, w2 = torch.cat([gate, up], dim=1), down
    interleaved = torch.stack([gate, up], dim=2).reshape(E, 2 * F, D)  # rows gate0, up0, gate1, up1, ...
    layouts = {
        "fused": _FusedExperts(w13.clone(), down.clone()),
        "fused, flagged": _FusedExperts(w13.clone(), down.clone(), is_transposed=False, is_concatenated=True),
        "transposed, flagged": _FusedExperts(w13.mT.clone(), down.mT.clone(), is_transposed=True),
        "transposed, inferred": _FusedExperts(w13.mT.clone(), down.mT.clone()),
        "interleaved": _FusedExperts(interleaved, down.clone(), is_concatenated=False),
        "w1/w3/w2": torch.nn.ModuleList(_ExpertMLP(("w1", "w3", "w2"), gate[e], up[e], down[e]) for e in range(E)),
        "gate/up/down_proj": torch.nn.ModuleList(
            _ExpertMLP(("gate_proj", "up_proj", "down_proj"), gate[e], up[e], down[e]) for e in range(E)),
    }
    for what, experts in layouts.items():
        got13, got2 = _expert_weights(experts, E, D)
        assert torch.equal(got13, w13) and torch.equal(got2, w2), what
    fused = layouts["fused"]
    assert _expert_weights(fused, E, D)[0] is fused.gate_up_proj  # the standard layout is reused, not copied
    with pytest.raises(ValueError, match="has_bias"):
        _expert_weights(_FusedExperts(w13, down, has_bias=True), E, D)
    with pytest.raises(ValueError, match="cannot read"):
        _expert_weights(_FusedExperts(w13, down), E, D + 1)
