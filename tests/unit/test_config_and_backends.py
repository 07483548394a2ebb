"""Config parsing (modern and legacy keys) and backend selection errors."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.backends import AcceleratorUnavailable, get_accelerator
from deepinfer.models.base import ConfigError
from deepinfer.models.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Config
from deepinfer.models.rope import RopeConfig

LEGACY = dict(model_type="deepseek_v4", vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
              head_dim=32, qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=8,
              num_experts_per_tok=2, moe_intermediate_size=32, index_n_heads=4, index_head_dim=16, index_topk=4,
              compress_ratios=[0, 4, 128, 4], num_hash_layers=2, dspark_block_size=5, dspark_markov_rank=256,
              rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 256})


def test_legacy_keys_parse_like_transformers():
    import transformers

    legacy = DeepseekV4Config.from_dict(LEGACY)
    assert legacy.layer_types == [SLIDING, CSA, HCA, CSA]
    assert legacy.mlp_layer_types == ["hash_moe", "hash_moe", "moe", "moe"]
    assert legacy.rope_dim == 8
    assert legacy.dspark == {"dspark_block_size": 5, "dspark_markov_rank": 256}
    # yarn scales only the compress rope; sliding layers keep plain theta
    assert legacy.rope_compress.yarn is not None and legacy.rope_main.yarn is None
    hf = transformers.DeepseekV4Config(**{k: v for k, v in LEGACY.items() if k != "model_type"})
    modern = DeepseekV4Config.from_dict(hf.to_dict())
    assert modern.layer_types == legacy.layer_types and modern.mlp_layer_types == legacy.mlp_layer_types
    for ours in (legacy, modern):
        # the exact float32 frequencies transformers' rotary embedding computes
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
            DeepseekV4RotaryEmbedding,
        )

        rotary = DeepseekV4RotaryEmbedding(hf)
        assert torch.equal(ours.rope_compress.inv_freq(), rotary.compress_inv_freq)
        assert torch.equal(ours.rope_main.inv_freq(), rotary.main_inv_freq)


def test_rope_cos_sin_come_from_a_table_with_the_computed_values(monkeypatch):
    """A step gathers cos/sin from a per-config table that grows with the positions seen; the
    values are those of position * inv_freq in float32, also past the table's cap."""
    import numpy as np

    from deepinfer.models import rope as config_module

    rope = DeepseekV4Config.from_dict(LEGACY).rope_compress
    monkeypatch.setattr(config_module, "_COS_SIN_TABLES", {})
    for positions in (np.array([0, 5, 4095, 17]), np.array([9000, 3, 8191]), np.array([], dtype=np.int64)):
        freqs = torch.from_numpy(positions)[:, None].float() * rope.inv_freq()
        cos, sin = rope.cos_sin(positions)
        assert torch.equal(cos, freqs.cos()) and torch.equal(sin, freqs.sin())
    assert len(config_module._COS_SIN_TABLES) == 1  # one table, grown to 16384 positions
    assert next(iter(config_module._COS_SIN_TABLES.values()))[0].shape == (16384, rope.dim // 2)
    monkeypatch.setattr(config_module, "_COS_SIN_TABLE_MAX", 10000)
    far = np.array([20000, 1])
    freqs = torch.from_numpy(far)[:, None].float() * rope.inv_freq()
    assert torch.equal(rope.cos_sin(far)[0], freqs.cos())


# DeepSeek-V4.1-Flash's released RoPE: 64 rotated channels, theta 1e4 (window layers, DSpark) and
# 160000 with YaRN 16 / 65536 / 32 / 1 (compressed layers), 1M positions
RELEASED_ROPES = (RopeConfig(10000.0, 64), RopeConfig(160000.0, 64, {"factor": 16, "original_max_position_embeddings":
                                                                      65536, "beta_fast": 32, "beta_slow": 1}))


@pytest.mark.parametrize("rope", RELEASED_ROPES + (RopeConfig(10000.0, 8),), ids=["main", "yarn", "dim8"])
def test_rope_rotations_of_position_tensors_equal_the_tables(rope, monkeypatch):
    """A step that holds its positions as tensors (V4.1's captured drafting / verify steps) computes
    cos/sin from them, a few at a time in any order: the bits are those of the host table `cos_sin`
    gathers from and of one computation over every position (the device table this replaced), up to
    V4.1's 1M context."""
    import numpy as np

    from deepinfer.models import rope as config_module

    monkeypatch.setattr(config_module, "_COS_SIN_TABLES", {})
    n = (1 << 20) + 5  # max_model_len 1M + a DSpark block
    everything = torch.arange(0, n, 7)  # every 7th position: one computation over all of them at once
    freqs = everything[:, None].float() * rope.inv_freq()
    all_cos, all_sin = freqs.cos(), freqs.sin()
    order = torch.randperm(len(everything), generator=torch.Generator().manual_seed(0))
    for size in (1, 5, 160):  # batch 1, a block of 5, 32 blocks
        rows = order[:20000].split(size)
        for index in rows:
            cos, sin = rope.rotations(everything[index])
            assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (len(index), rope.dim // 2)
            assert torch.equal(cos, all_cos[index]) and torch.equal(sin, all_sin[index])
    positions = np.array([0, 1, 4095, 4096, 65535, 17, 9000])  # within the host table
    cos, sin = rope.rotations(torch.from_numpy(positions))
    expected = rope.cos_sin(positions)
    assert torch.equal(cos, expected[0]) and torch.equal(sin, expected[1])
    assert rope.inv_freq("cpu") is rope.inv_freq()  # the rates stay where they are: no copy per step


@pytest.mark.parametrize("change, message", [
    (dict(model_type="llama"), "model_type"),
    (dict(hidden_size=None), "hidden_size"),
    (dict(num_hidden_layers="4"), "num_hidden_layers"),
    (dict(compress_ratios=[0, 4, 64, 4]), "compress_ratios"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(o_groups=3), "o_groups"),
    (dict(qk_rope_head_dim=7), "rope dim"),
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(rope_scaling={"type": "yarn", "factor": 4}), "original_max_position_embeddings"),
    (dict(eos_token_id=9999), "eos_token_id"),
])
def test_broken_configs_name_the_key(change, message):
    data = {**LEGACY, **change}
    data = {k: v for k, v in data.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        DeepseekV4Config.from_dict(data)


def test_unknown_accelerator_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "tpu")
    with pytest.raises(AcceleratorUnavailable, match="tpu.*cpu, nvidia, ascend"):
        get_accelerator()


def test_nvidia_without_gpu_or_interpreter_is_a_clear_error(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "nvidia")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(AcceleratorUnavailable, match="TRITON_INTERPRET=1"):
        get_accelerator()


def test_ascend_refuses_clearly_without_torch_npu(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "ascend")
    with pytest.raises(AcceleratorUnavailable) as err:
        get_accelerator()
    assert str(err.value) == (
        "DEEPINFER_ACCELERATOR=ascend but torch_npu cannot be imported (No module named 'torch_npu'). Install CANN "
        "and the torch_npu build matching your torch, or set DEEPINFER_ACCELERATOR=cpu.")


def test_auto_picks_cpu_here(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    monkeypatch.delenv("DEEPINFER_ACCELERATOR", raising=False)
    assert get_accelerator().name == "cpu"


def test_registry_picks_the_family_and_lists_the_supported_ones(tmp_path):
    import json

    from deepinfer.models.registry import FAMILIES, family_of, load_config

    v4 = next(f for f in FAMILIES if f.name == "deepseek_v4")
    assert family_of({"architectures": ["DeepseekV4ForCausalLM"]}) is v4
    assert family_of({"model_type": "deepseek_v4"}) is v4  # no architectures: the model type decides
    assert family_of({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}).name == "deepseek_v3"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path)
    message = str(err.value)
    assert "'LlamaForCausalLM'" in message and "'llama'" in message
    for family in FAMILIES:  # every supported architecture is named, so the user sees what would work
        assert all(arch in message for arch in family.architectures)


# ------------------------------------------------------------------ DeepSeek-V3
V3_HUB = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=512, hidden_size=64,
              intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
              q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
              n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
              scoring_func="sigmoid", topk_method="noaux_tc", rope_theta=10000.0,
              rope_scaling={"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1})


@pytest.mark.parametrize("change, message", [
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(topk_method="group_limited_greedy"), "topk_method"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(moe_layer_freq=2), "moe_layer_freq"),
    (dict(n_group=3), "n_group"),
    (dict(topk_group=5), "topk_group"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),  # > topk_group * experts per group
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim"),
    (dict(kv_lora_rank="32"), "kv_lora_rank"),
    (dict(q_lora_rank=-1), "q_lora_rank"),
    (dict(rope_scaling={"type": "linear", "factor": 2}), "linear"),
    (dict(rope_scaling={"type": "yarn", "factor": 4}), "original_max_position_embeddings"),
    (dict(eos_token_id=9999), "eos_token_id"),
])
def test_broken_v3_configs_name_the_key(change, message):
    from deepinfer.models.deepseek_v3 import DeepseekV3Config

    with pytest.raises(ConfigError, match=message):
        DeepseekV3Config.from_dict({**V3_HUB, **change})


def test_v3_configs_in_every_spelling_parse_alike():
    """The hub's keys, transformers 5's rope_parameters, and DeepSeek's ModelArgs file give the same
    model; q_lora_rank null (or upstream's 0) means one q_proj."""
    import transformers

    from deepinfer.models.deepseek_v3 import DeepseekV3Config
    from deepinfer.models.registry import family_of

    hub = DeepseekV3Config.from_dict(V3_HUB)
    hf = DeepseekV3Config.from_dict(transformers.DeepseekV3Config(**{k: v for k, v in V3_HUB.items()
                                                                     if k != "model_type"}).to_dict())
    args = dict(vocab_size=512, dim=64, inter_dim=128, moe_inter_dim=32, n_layers=4, n_dense_layers=1, n_heads=4,
                n_routed_experts=16, n_shared_experts=1, n_activated_experts=4, n_expert_groups=4, n_limited_groups=2,
                route_scale=2.5, score_func="sigmoid", q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=24, original_seq_len=128, rope_theta=10000.0, rope_factor=40,
                beta_fast=32, beta_slow=1, mscale=1.0)
    assert family_of(args).name == "deepseek_v3"  # no architecture, no model_type: DeepSeek's own keys
    upstream = DeepseekV3Config.from_dict(args)
    for cfg in (hf, upstream):
        for key in ("hidden_size", "num_hidden_layers", "first_k_dense_replace", "n_group", "topk_group",
                    "q_lora_rank", "kv_lora_rank", "softmax_scale", "rope_attention_factor", "norm_topk_prob"):
            assert getattr(cfg, key) == getattr(hub, key), key
        assert torch.equal(cfg.rope.inv_freq(), hub.rope.inv_freq())
    assert hub.softmax_scale == pytest.approx(24 ** -0.5 * (0.1 * math.log(40) + 1) ** 2)
    assert DeepseekV3Config.from_dict({**V3_HUB, "q_lora_rank": None}).q_lora_rank is None
    assert DeepseekV3Config.from_dict({**args, "q_lora_rank": 0, "rope_factor": 1}).q_lora_rank is None
    with pytest.raises(ConfigError, match="score_func"):
        DeepseekV3Config.from_dict({**args, "score_func": "softmax"})


def test_the_ced_split_has_its_own_variable(monkeypatch):
    """DEEPINFER_CED_PREFILL_MODE sets V4.1's CED split; unset, it follows the prefix-cache replay's
    DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE (what the split read before it had its own variable)."""
    from deepinfer import envs

    monkeypatch.delenv("DEEPINFER_CED_PREFILL_MODE", raising=False)
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "off")
    assert envs.ced_prefill_mode() == "off"
    monkeypatch.setenv("DEEPINFER_CED_PREFILL_MODE", "compact")
    assert envs.ced_prefill_mode() == "compact" and envs.get("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE") == "off"
    monkeypatch.setenv("DEEPINFER_CED_PREFILL_MODE", "fast")
    with pytest.raises(envs.EnvError, match="DEEPINFER_CED_PREFILL_MODE"):
        envs.ced_prefill_mode()
