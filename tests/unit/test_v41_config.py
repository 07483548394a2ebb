"""DeepSeek-V4.1 through the registry: config parsing (the released keys, nested text_config), the
roles it derives, clear errors for settings deepinfer does not run, and the checkpoint's loading
(bare names, 32x32 E8M0 FP8 and per-32 FP4 scales, the Engram tables memory-mapped)."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deepinfer.backends.quant import QuantizedWeight, widen
from deepinfer.core.loader import CheckpointError, load_checkpoint
from deepinfer.models.base import ConfigError
from deepinfer.models.deepseek_v41 import DeepseekV41Config, DeepseekV41Model
from deepinfer.models.registry import family_of, load_config
from v41_goldens import CONFIGS, WIDE_CONFIG, checkpoint_dir
from v41_released import RELEASED_CONFIG, text_only


def test_registry_picks_the_family_by_architecture():
    assert family_of(RELEASED_CONFIG).name == "deepseek_v41"
    assert family_of({"model_type": "deepseek_v41", "text_config": {}}).name == "deepseek_v41"
    for config in CONFIGS:
        cfg, cls = load_config(checkpoint_dir(config))
        assert cls is DeepseekV41Model and isinstance(cfg, DeepseekV41Config)
        assert cfg.checkpoint_dir == str(checkpoint_dir(config).resolve())


def test_released_config_parses_to_the_released_schedule():
    cfg = DeepseekV41Config.from_dict(text_only())
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.n_routed_experts, cfg.num_experts_per_tok) == (5120, 40, 384, 6)
    types = [r.block_type for r in cfg.roles]
    assert types[:2] == ["swa_only"] * 2
    assert [i for i, t in enumerate(types) if t == "kv_index_source"] == [2, 8, 14]
    assert types[20] == "candidate_source"
    assert [i for i, t in enumerate(types) if t == "candidate_index_source"] == [24, 28, 32, 36]
    assert all(types[i] == "consumer_ratio2" for i in (3, 7, 9, 13, 15, 19))
    assert all(types[i] == "consumer_ratio1" for i in (21, 23, 25, 39))
    assert cfg.roles[39].index_source == 36 and cfg.roles[39].kv_source == 20
    assert cfg.roles[23].index_source == 20 and cfg.roles[10].kv_source == 8
    assert cfg.first_decoder_layer == 21  # layers 21-39 own only their window rings
    assert cfg.rope_compress.yarn == {"factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                                      "beta_slow": 1}
    assert cfg.rope_main.yarn is None and cfg.rope_dim == 64
    assert cfg.quantized and cfg.expert_dtype == "fp4"
    assert cfg.dspark_experts == (128, 3) and cfg.num_nextn_predict_layers == 3
    assert cfg.engram_layer_ids == [1, 14] and cfg.eos_token_ids == [1]


def test_vision_config_gives_the_released_vision_tower():
    data = text_only()
    data.update(image_token_id=129264, vision_config={
        "model_type": "deepseek_v41_vision", "num_hidden_layers": 32, "hidden_size": 1024, "num_attention_heads": 16,
        "intermediate_size": 2816, "patch_size": 14, "rope_theta": 10000, "downsample_ratio": 3,
        "max_image_tokens": 1024, "min_pixels": 295936, "max_wh_ratio": None})
    v = DeepseekV41Config.from_dict(data, source="config.json").vision
    assert (v.num_hidden_layers, v.hidden_size, v.max_image_tokens, v.image_token_id) == (32, 1024, 1024, 129264)
    assert v.text_hidden_size == 5120 and DeepseekV41Config.from_dict(text_only()).vision is None


def bad(edit, match: str, top: bool = False):
    data = text_only()
    edit(data if top else data["text_config"])
    with pytest.raises(ConfigError, match=match):
        DeepseekV41Config.from_dict(data, source="config.json")


def test_unsupported_settings_are_named():
    bad(lambda t: t.update(num_key_value_heads=2), "num_key_value_heads")
    bad(lambda t: t.update(scoring_func="softmax"), "scoring_func")
    bad(lambda t: t.update(tie_word_embeddings=True), "tie_word_embeddings")
    bad(lambda t: t.pop("hidden_size"), "hidden_size")
    bad(lambda t: t.update(hidden_size="big"), "hidden_size")
    bad(lambda t: t["quantization_config"].update(weight_block_size=[128, 128]), "weight_block_size", top=True)
    bad(lambda t: t["quantization_config"].update(expert_dtype="int4"), "expert_dtype", top=True)
    bad(lambda t: t.update(vision_config={"num_hidden_layers": 32, "patch_size": "14"}), "'patch_size'", top=True)
    bad(lambda t: t.update(vision_config={"num_hidden_layers": 32}, image_token_id=200000), "image_token_id", top=True)
    bad(lambda t: t.update(compress_ratios=[0, 0, 2]), "compress_ratios")
    bad(lambda t: t.update(kv_source_layer_ids=[2, 8, 15, 20]), "must also be an index source")
    bad(lambda t: t["compress_ratios"].__setitem__(20, 2), "layer 21 .* must match")
    bad(lambda t: t.update(candidate_source_layer_id=24), "candidate_source_layer_id")
    bad(lambda t: t.update(index_source_layer_ids=[8, 14, 20]), "index source")
    bad(lambda t: t.update(engram_num_embeddings=[1]), "engram_num_embeddings")
    bad(lambda t: t.update(dspark_target_layer_ids=[40]), "dspark_target_layer_ids")
    bad(lambda t: t.update(qk_rope_head_dim=7), "qk_rope_head_dim")
    bad(lambda t: t.update(moe_intermediate_size=2300), "moe_intermediate_size")


def test_topk_wider_than_the_candidates_is_refused_where_deepseek_is_unspecified(tmp_path):
    """A Reindex layer's top-k runs over candidate scores only (-inf elsewhere) and takes min(index_topk,
    visible) entries. Where a token can see more entries than index_topk but fewer candidates, DeepSeek
    returns some of its -inf entries, which ones torch.topk leaves unspecified: the config is refused at
    load, naming the three keys. mini6wide (no token sees more than index_topk entries) loads."""
    wide = json.loads((checkpoint_dir(WIDE_CONFIG) / "config.json").read_text())
    assert DeepseekV41Config.from_dict(wide).index_topk == 128
    released = text_only()
    refused = [(wide, {"max_position_embeddings": 129}),  # position 128 sees 129 entries, 16 candidates
               # 64 blocks of 8 = 512 = index_topk, but the newest block is partly filled: 505 candidates of 513
               (released, {"candidate_topk_blocks": 64}),
               (released, {"index_topk": 16385})]
    for data, change in refused:
        data = copy.deepcopy(data)
        data["text_config"].update(change)
        (tmp_path / "config.json").write_text(json.dumps(data))
        with pytest.raises(ConfigError) as raised:
            load_config(tmp_path)
        for key in ("index_topk", "candidate_topk_blocks", "candidate_block_size"):
            assert key in str(raised.value), (change, str(raised.value))
    data = copy.deepcopy(released)
    data["text_config"].update(candidate_topk_blocks=65)  # 64 full blocks + the newest: >= 513 candidates
    assert DeepseekV41Config.from_dict(data).candidate_topk_blocks == 65


def test_engram_table_sizes_must_follow_the_primes():
    data = text_only()
    data["text_config"]["engram_num_embeddings"] = [384006168, 384016683]
    cfg = DeepseekV41Config.from_dict(data)
    from deepinfer.models.deepseek_v41.engram import EngramLayout
    with pytest.raises(ConfigError, match="384016682 rows"):
        EngramLayout.from_config(cfg)


@pytest.mark.parametrize("config", CONFIGS)
def test_golden_checkpoint_loads_with_bare_names(config):
    cfg, cls = load_config(checkpoint_dir(config))
    weights, extra = load_checkpoint(checkpoint_dir(config), cls.checkpoint_tensors(cfg), cls,
                                     keep_prefixes=cls.extra_prefixes)
    assert set(weights) == set(cls.checkpoint_tensors(cfg))
    assert extra and all(n.startswith("mtp.") for n in extra)
    with safe_open(checkpoint_dir(config) / "model.safetensors", "pt") as f:
        # an FP8 weight: kept as stored (the file's e4m3 bytes, its 32x32 E8M0 tiles), dequantizing exactly
        q, s = f.get_tensor("layers.2.attn.wq_b.weight"), f.get_tensor("layers.2.attn.wq_b.scale")
        kept = weights["layers.2.attn.wq_b.weight"]
        assert isinstance(kept, QuantizedWeight) and kept.block == (32, 32) and kept.scale.dtype == torch.uint8
        assert torch.equal(kept.data.view(torch.uint8), q.view(torch.uint8))
        expected = q.float() * s.float().repeat_interleave(32, 0).repeat_interleave(32, 1)
        assert torch.equal(kept.dequantize(), expected)
        # an FP4 expert: w3 of expert 1 is the second half of its fused gate_up rows
        w3 = widen(weights["layers.1.ffn.experts.gate_up"])[1, cfg.moe_intermediate_size:]  # kept FP4 as stored
        packed, s4 = f.get_tensor("layers.1.ffn.experts.1.w3.weight"), f.get_tensor("layers.1.ffn.experts.1.w3.scale")
        assert w3.shape == (cfg.moe_intermediate_size, cfg.hidden_size)
        lo = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
        vals = torch.stack([lo[packed.view(torch.uint8).long() & 15], lo[packed.view(torch.uint8).long() >> 4]], -1)
        assert torch.equal(w3, vals.flatten(-2) * s4.float().repeat_interleave(32, -1))
        # the Engram table: a memory-mapped view of the file, in its stored dtype
        name = f"layers.{cfg.engram_layer_ids[0]}.engram.embed.weight"
        table = weights[name]
        assert table.dtype == torch.float8_e4m3fn and torch.equal(table.view(torch.uint8),
                                                                   f.get_tensor(name).view(torch.uint8))


def test_engram_tables_are_mapped_not_read():
    """The table tensor's memory is a mapping of the checkpoint file (/proc/self/maps), so a table never
    has to fit in memory: the pages a lookup touches come from the file."""
    import os
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("needs /proc/self/maps (Linux) to see where a tensor's memory comes from")
    cfg, cls = load_config(checkpoint_dir("ced10"))
    weights, _ = load_checkpoint(checkpoint_dir("ced10"), cls.checkpoint_tensors(cfg), cls,
                                 keep_prefixes=cls.extra_prefixes)
    ptr = weights["layers.1.engram.embed.weight"].data_ptr()
    mapped_from = None
    for line in open("/proc/self/maps"):
        parts = line.split()
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= ptr < hi:
            mapped_from = parts[5] if len(parts) > 5 else None
    assert mapped_from is not None and mapped_from.endswith("model.safetensors")
    ordinary = weights["layers.1.attn_norm.weight"].data_ptr()  # bf16 widened to float32: ordinary memory
    assert not any(int(l.split()[0].split("-")[0], 16) <= ordinary < int(l.split()[0].split("-")[1], 16)
                   and l.rstrip().endswith("model.safetensors") for l in open("/proc/self/maps"))


def broken_checkpoint(tmp_path, edit) -> str:
    src = checkpoint_dir("mini6")
    dst = tmp_path / "mini6"
    shutil.copytree(src, dst)
    with safe_open(src / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_broken_checkpoints_name_the_tensor(tmp_path):
    cfg, cls = load_config(checkpoint_dir("mini6"))
    expected = cls.checkpoint_tensors(cfg)

    def load(edit):
        d = broken_checkpoint(tmp_path / str(len(list(tmp_path.iterdir()))), edit)
        return load_checkpoint(d, expected, cls, keep_prefixes=cls.extra_prefixes)

    with pytest.raises(CheckpointError, match="layers.1.attn.wq_a.weight.*without its scale"):
        load(lambda t: t.pop("layers.1.attn.wq_a.scale"))
    with pytest.raises(CheckpointError, match="layers.1.attn.wkv.weight.*scale shape"):
        load(lambda t: t.update({"layers.1.attn.wkv.scale": t["layers.1.attn.wkv.scale"][:1]}))
    with pytest.raises(CheckpointError, match="layers.0.engram.embed.weight.*stored dtype"):
        load(lambda t: t.update({"layers.0.engram.embed.weight": t["layers.0.engram.embed.weight"].float()}))
    with pytest.raises(CheckpointError, match="missing tensor layers.3.ffn.experts.2.w2.weight"):
        load(lambda t: [t.pop("layers.3.ffn.experts.2.w2.weight"), t.pop("layers.3.ffn.experts.2.w2.scale")])


def test_engram_needs_the_checkpoints_tokenizer(tmp_path):
    dst = tmp_path / "ced10"
    shutil.copytree(checkpoint_dir("ced10"), dst)
    (dst / "tokenizer.json").unlink()
    cfg, cls = load_config(dst)
    weights, _ = load_checkpoint(dst, cls.checkpoint_tensors(cfg), cls, keep_prefixes=cls.extra_prefixes)
    from deepinfer.backends import get_accelerator
    with pytest.raises(ConfigError, match="tokenizer.json"):
        cls(cfg, weights, get_accelerator("cpu"))
    data = json.loads((checkpoint_dir("ced10") / "config.json").read_text())
    data["text_config"]["engram_compressed_vocab_size"] = 395
    (dst / "config.json").write_text(json.dumps(data))
    shutil.copy(checkpoint_dir("ced10") / "tokenizer.json", dst / "tokenizer.json")
    cfg, cls = load_config(dst)
    with pytest.raises(ConfigError, match="394 Engram token classes"):
        cls(cfg, weights, get_accelerator("cpu"))
