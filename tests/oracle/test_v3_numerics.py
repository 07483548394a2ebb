"""DeepSeek-V3's numerics in deepinfer against transformers 5: the router op (route_grouped_topk)
is DeepseekV3TopkRouter bit for bit on the reference and agrees on every cpu op class; the
parsed config's YaRN inverse frequencies, cos/sin factor and softmax scale are transformers'
(from transformers' config and from the hub's legacy keys); and the model gets far from
transformers when the softmax correction or the rope channel layout is wrong, so the oracle
tests would notice. The tiny oracle configs exercise group-limited routing and the selection
bias (a router without either would fail)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from deepinfer.backends import reference
from deepinfer.models.base import ConfigError
from deepinfer.models.deepseek_v3 import DeepseekV3Config
from model_runner import build_model, new_cache, run_schedule
from tiny_models_v3 import CONFIGS, V2_YARN, V3_YARN, hub_config, make_hf_model
from v3_oracle import full_logits, prompts, rel_err, single_thread

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


def route_per_token(x, gate, bias, top_k, n_group, topk_group, normalize, scaling):
    """base.py's route_grouped_topk contract written again, token by token in Python, sorted by
    biased score (descending, ties to the lower index): an independent statement of the semantics."""
    scores = F.linear(x.float(), gate.float()).sigmoid()
    per_group = gate.shape[0] // n_group
    all_w, all_ids = [], []
    for s in scores:
        b = (s + bias.float()).tolist()
        group_score = [sum(sorted(b[g * per_group:(g + 1) * per_group], reverse=True)[:2]) for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: (-group_score[g], g))[:topk_group]
        candidates = [e for g in groups for e in range(g * per_group, (g + 1) * per_group)]
        ids = sorted(candidates, key=lambda e: (-b[e], e))[:top_k]
        w = s[ids]
        if normalize:
            w = w / (w.sum() + 1e-20)
        all_w.append(w * scaling)
        all_ids.append(torch.tensor(ids))
    return torch.stack(all_w), torch.stack(all_ids)


ROUTINGS = [  # (E, n_group, topk_group, top_k, norm_topk_prob, routed_scaling_factor)
    (16, 4, 2, 4, True, 2.5), (8, 1, 1, 3, False, 1.5), (12, 3, 2, 3, True, 2.0),
    (16, 4, 2, 2, True, 2.5),  # the peers benchmark model
    (256, 8, 4, 8, True, 2.5),  # DeepSeek-V3 itself
]


@pytest.mark.parametrize("routing", ROUTINGS, ids=lambda r: "E{}_g{}_kg{}_k{}_norm{}_s{}".format(*r))
def test_router_is_transformers_bit_for_bit(routing, monkeypatch):
    from deepinfer.backends.cpu import make

    e, g, kg, k, norm, scaling = routing
    router = _router(e, g, kg, k, norm, scaling, hidden=64 if e < 256 else 256)
    x = torch.randn(512, router.hidden_dim, generator=torch.Generator().manual_seed(1))
    args = (router.weight, router.e_score_correction_bias, k, g, kg, norm, scaling)
    with torch.no_grad():
        _, hf_w, hf_ids = router(x)
    w, ids = reference.route_grouped_topk(x, *args)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (512, k)
    assert torch.equal(ids, hf_ids) and torch.equal(w, hf_w)
    # the contract stated token by token, and every cpu op class: the same experts, the same weights
    # up to the order of the k-term sum (and, in batch-invariant mode, its own sigmoid and GEMM)
    results = {"per token": route_per_token(x, *args)}
    for invariant in ("0", "1"):
        monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", invariant)
        results[f"cpu invariant={invariant}"] = make().route_grouped_topk(x, *args)
    order = ids.sort(-1)
    for name, (w2, ids2) in results.items():
        order2 = ids2.sort(-1)
        assert torch.equal(order.values, order2.values), name
        torch.testing.assert_close(w.gather(1, order.indices), w2.gather(1, order2.indices), rtol=1e-6, atol=0)


def _router_inputs(name):
    """The inputs of every MoE gate during a 300-token forward of a tiny oracle model."""
    hf, cfg = make_hf_model(name, seed=3)
    seen = []
    def record(gate, args, out):
        seen.append((gate, args[0].reshape(-1, cfg.hidden_size)))

    hooks = [layer.mlp.gate.register_forward_hook(record) for layer in hf.model.layers[cfg.first_k_dense_replace:]]
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
    route = reference.route_grouped_topk
    for gate, x in seen:
        _, ids = route(x, gate.weight, gate.e_score_correction_bias, k, g, kg, cfg.norm_topk_prob, 1.0)
        chosen = ids.sort(-1).values
        _, no_bias = route(x, gate.weight, torch.zeros_like(gate.e_score_correction_bias), k, g, kg,
                           cfg.norm_topk_prob, 1.0)
        assert (no_bias.sort(-1).values != chosen).any(-1).float().mean() > 0.05
        if g > 1:
            _, ungrouped = route(x, gate.weight, gate.e_score_correction_bias, k, 1, 1, cfg.norm_topk_prob, 1.0)
            assert (ungrouped.sort(-1).values != chosen).any(-1).float().mean() > 0.05
        assert len(ids.unique()) >= cfg.n_routed_experts * 3 // 4  # routing varies from token to token


ROPES = {
    "v3": V3_YARN, "v2": V2_YARN, "none": None,
    # not shipped by a DeepSeek model, but transformers' formula covers them
    "mscale_ne_all_dim": {**V3_YARN, "mscale": 1.0, "mscale_all_dim": 0.707},
    "no_mscale_keys": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256},
}


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_yarn_is_transformers(rope):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3Attention,
                                                                      DeepseekV3RotaryEmbedding)

    extra = {"rope_scaling": ROPES[rope]} if ROPES[rope] else {}
    cfg = transformers.DeepseekV3Config(**{**CONFIGS["v3_yarn_groups"], **extra, "max_position_embeddings": 5120})
    emb, attn = DeepseekV3RotaryEmbedding(cfg), DeepseekV3Attention(cfg, 0)
    # what transformers writes (rope_parameters) and what the hub ships (rope_scaling + rope_theta)
    for data in (cfg.to_dict(), hub_config(cfg, fp8=False)):
        ours = DeepseekV3Config.from_dict(data)
        assert torch.equal(ours.rope.inv_freq(), emb.inv_freq)
        assert ours.rope_attention_factor == emb.attention_scaling and ours.softmax_scale == attn.scaling
        positions = torch.arange(0, 5000, 7)
        cos, sin = emb(torch.zeros(1), positions[None])
        half = cfg.qk_rope_head_dim // 2  # transformers repeats each angle; the rope op takes one per pair
        ours_cos, ours_sin = ours.cos_sin(positions.numpy())
        assert torch.equal(ours_cos, cos[0, :, :half]) and torch.equal(ours_sin, sin[0, :, :half])
    if rope == "mscale_ne_all_dim":
        assert ours.rope_attention_factor != 1.0  # cos and sin scaled: q_pe . k_pe by factor^2


def test_untruncated_yarn_is_refused_by_name():
    data = transformers.DeepseekV3Config(**{**CONFIGS["v3_yarn_groups"],
                                            "rope_scaling": {**V3_YARN, "truncate": False}}).to_dict()
    with pytest.raises(ConfigError, match="truncate"):
        DeepseekV3Config.from_dict(data)


@pytest.mark.parametrize("name, break_it", [
    ("v3_yarn_groups", "softmax_scale"),  # YaRN's mscale^2 on the softmax (1.87 at factor 40)
    ("v2_yarn_rotate_half", "rope_interleave"),  # a rotate_half checkpoint's rope rows taken as pairs
])
def test_the_oracle_notices_a_wrong_scale_or_rope_layout(name, break_it):
    """The same model with the YaRN softmax correction dropped, or a rotate_half checkpoint read as
    interleaved pairs, is far from transformers (the oracle tests hold it to 1e-4)."""
    hf, cfg = make_hf_model(name, seed=3)
    (p,) = prompts(cfg.vocab_size, [200], seed=1)
    ref = full_logits(hf, p)
    good = build_model(hf, cfg)
    assert rel_err(run_schedule(good, new_cache(good), [p], [[(0, 200)]])[0], ref) < 1e-4
    broken = build_model(hf, cfg)
    if break_it == "softmax_scale":
        plain = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
        broken.config = dataclasses.replace(broken.config, softmax_scale=plain)
    else:
        data = {**cfg.to_dict(), "rope_interleave": True}
        broken = build_model(hf, transformers.DeepseekV3Config(**{k: v for k, v in data.items()
                                                                  if k not in ("model_type", "transformers_version")}))
    err = rel_err(run_schedule(broken, new_cache(broken), [p], [[(0, 200)]])[0], ref)
    print(f"{name} with {break_it} wrong: rel err {err:.2e}")
    assert err > 1e-2
