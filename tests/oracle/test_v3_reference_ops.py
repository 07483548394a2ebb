"""tests/v3_reference_ops.py against transformers' DeepSeek-V3: the router op is bit-for-bit
DeepseekV3TopkRouter (and an independent per-token statement of the contract agrees), YaRN's
inverse frequencies / cos-sin factor / softmax scale are transformers', and MLA in the absorbed
form built from deepinfer's ops (grouped_linear, rope on pairs, sparse_attention over a latent
pool) reproduces DeepseekV3Attention. The tiny oracle configs exercise group-limited routing
and the selection bias (a reference without either would fail)."""

from __future__ import annotations

import pytest
import torch

from tiny_models_v3 import CONFIGS, V2_YARN, V3_YARN, make_hf_model
from v3_oracle import rel_err, single_thread
from v3_reference_ops import (mla_absorbed_attention, route_grouped_topk, route_grouped_topk_per_token,
                              yarn_rope)

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with single_thread():
        yield


def _router(num_experts, n_group, topk_group, top_k, norm, scaling, hidden=64, seed=0):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = transformers.DeepseekV3Config(hidden_size=hidden, n_routed_experts=num_experts, n_group=n_group,
                                        topk_group=topk_group, num_experts_per_tok=top_k,
                                        norm_topk_prob=norm, routed_scaling_factor=scaling)
    router = DeepseekV3TopkRouter(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(num_experts, hidden, generator=gen) * 0.1)
        router.e_score_correction_bias.copy_(torch.randn(num_experts, generator=gen) * 0.1)
    return router


ROUTINGS = [  # (E, n_group, topk_group, top_k, norm_topk_prob, routed_scaling_factor)
    (16, 4, 2, 4, True, 2.5), (8, 1, 1, 3, False, 1.5), (12, 3, 2, 3, True, 2.0),
    (16, 4, 2, 2, True, 2.5),  # the peers benchmark model
    (256, 8, 4, 8, True, 2.5),  # DeepSeek-V3 itself
]


@pytest.mark.parametrize("routing", ROUTINGS, ids=lambda r: "E{}_g{}_kg{}_k{}_norm{}_s{}".format(*r))
def test_router_is_transformers_bit_for_bit(routing):
    e, g, kg, k, norm, scaling = routing
    router = _router(e, g, kg, k, norm, scaling, hidden=64 if e < 256 else 256)
    x = torch.randn(512, router.hidden_dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, hf_w, hf_ids = router(x)
    w, ids = route_grouped_topk(x, router.weight, router.e_score_correction_bias, k, g, kg, norm, scaling)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (512, k)
    assert torch.equal(ids, hf_ids) and torch.equal(w, hf_w)
    # the contract stated token by token: same experts; weights up to the order of the k-term sum
    w2, ids2 = route_grouped_topk_per_token(x, router.weight, router.e_score_correction_bias, k, g, kg, norm, scaling)
    order, order2 = ids.sort(-1), ids2.sort(-1)
    assert torch.equal(order.values, order2.values)
    torch.testing.assert_close(w.gather(1, order.indices), w2.gather(1, order2.indices), rtol=1e-6, atol=0)


def _router_inputs(name):
    """The inputs of every MoE gate during a 300-token forward of a tiny oracle model."""
    hf, cfg = make_hf_model(name, seed=3)
    seen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, args, out: seen.append((m, args[0].reshape(-1, cfg.hidden_size))))
             for layer in hf.model.layers[cfg.first_k_dense_replace:]]
    with torch.no_grad():
        hf(torch.randint(2, cfg.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0)))
    for h in hooks:
        h.remove()
    return cfg, seen


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_oracle_configs_exercise_routing(name):
    """On real hidden states of each oracle config, the selection bias changes the chosen experts
    of some tokens, and where n_group > 1 so does the group limit: a router that ignored either
    would disagree with transformers (and fail the test above and the oracle tests)."""
    cfg, seen = _router_inputs(name)
    k, g, kg = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
    for gate, x in seen:
        _, ids = route_grouped_topk(x, gate.weight, gate.e_score_correction_bias, k, g, kg, cfg.norm_topk_prob, 1.0)
        chosen = ids.sort(-1).values
        _, no_bias = route_grouped_topk(x, gate.weight, torch.zeros_like(gate.e_score_correction_bias), k, g, kg,
                                        cfg.norm_topk_prob, 1.0)
        assert (no_bias.sort(-1).values != chosen).any(-1).float().mean() > 0.05
        if g > 1:
            _, ungrouped = route_grouped_topk(x, gate.weight, gate.e_score_correction_bias, k, 1, 1, cfg.norm_topk_prob, 1.0)
            assert (ungrouped.sort(-1).values != chosen).any(-1).float().mean() > 0.05
        assert len(ids.unique()) >= cfg.n_routed_experts * 3 // 4  # routing varies from token to token


ROPES = {
    "v3": V3_YARN, "v2": V2_YARN, "none": None,
    # not shipped by a DeepSeek model, but transformers' formula covers them
    "mscale_ne_all_dim": {**V3_YARN, "mscale": 1.0, "mscale_all_dim": 0.707},
    "no_mscale_keys": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256},
    "untruncated": {**V3_YARN, "truncate": False},
}


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_yarn_is_transformers(rope):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3Attention,
                                                                      DeepseekV3RotaryEmbedding)

    extra = {"rope_scaling": ROPES[rope]} if ROPES[rope] else {}
    cfg = transformers.DeepseekV3Config(**{**CONFIGS["v3_yarn_groups"], **extra, "max_position_embeddings": 5120})
    emb, attn = DeepseekV3RotaryEmbedding(cfg), DeepseekV3Attention(cfg, 0)
    inv_freq, factor, scale = yarn_rope(cfg.rope_parameters, cfg.qk_rope_head_dim,
                                        cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.max_position_embeddings)
    assert torch.equal(inv_freq, emb.inv_freq)
    assert factor == emb.attention_scaling and scale == attn.scaling
    if rope == "mscale_ne_all_dim":
        assert factor != 1.0  # cos and sin scaled: q_pe . k_pe by factor^2


def _causal_mask(t):
    return torch.full((t, t), float("-inf")).triu(1).view(1, 1, t, t)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_absorbed_mla_is_transformers_attention(name):
    hf, cfg = make_hf_model(name, seed=3)
    t = 300
    x = torch.randn(1, t, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    positions = torch.arange(t)
    inv_freq, factor, scale = yarn_rope(cfg.rope_parameters, cfg.qk_rope_head_dim,
                                        cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.max_position_embeddings)
    for layer in hf.model.layers[:2]:
        attn = layer.self_attn
        with torch.no_grad():
            ref, _ = attn(hidden_states=x, position_embeddings=hf.model.rotary_emb(x, positions[None]),
                          attention_mask=_causal_mask(t))
            out = mla_absorbed_attention(attn, x[0], positions, inv_freq, factor, scale)
        err = rel_err(out, ref[0])
        print(f"{name}: absorbed MLA rel err {err:.1e}")
        assert err <= 1e-5
    if factor == 1.0 and scale != (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5:
        # the softmax correction matters: without it the output is far off
        with torch.no_grad():
            plain = mla_absorbed_attention(attn, x[0], positions, inv_freq, factor,
                                           (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5)
        assert rel_err(plain, ref[0]) > 1e-3
