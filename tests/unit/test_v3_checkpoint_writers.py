"""The V3 checkpoint writers of tests/tiny_models_v3.py write what a loader will meet: the hub
layout is what transformers itself saves and loads (config.json in the hub's legacy keys
included), the FP8 copy has V3's dtypes, scale shapes, quantization_config and MTP layer, and
the oracle model each writer returns holds exactly what the files dequantize to; DeepSeek's own
layout has inference/convert.py's names and ModelArgs keys."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open

from tiny_models_v3 import (CONFIGS, FP8_SUFFIXES, QUANTIZATION_CONFIG, fp8_block_dequant, hub_state_dict,
                            make_hf_model, save_hf_layout, save_upstream_layout, upstream_name)
from v3_oracle import full_logits, prompts, rel_err, single_thread

transformers = pytest.importorskip("transformers")

# Dims over one 128x128 tile and not multiples of it: several and partial FP8 tiles
# (kv_a_proj_with_mqa [152, 160], q_b_proj [96, 136], experts' gate_proj [136, 160], ...).
WIDE = dict(hidden_size=160, q_lora_rank=136, kv_lora_rank=144, intermediate_size=200, moe_intermediate_size=136)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with single_thread():
        yield


def _read(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            out |= {k: fh.get_tensor(k) for k in fh.keys()}
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_hub_layout_is_what_transformers_saves_and_loads(name, tmp_path):
    hf, _ = make_hf_model(name, seed=5)
    ref = save_hf_layout(hf, tmp_path / "hub")
    hf.save_pretrained(tmp_path / "saved")
    mine, theirs = _read(tmp_path / "hub"), _read(tmp_path / "saved")
    assert sorted(mine) == sorted(theirs)
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    index = json.loads((tmp_path / "hub" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(mine) and len(set(index["weight_map"].values())) == 2
    # transformers reads the hub config.json (rope_scaling + rope_theta, scoring_func, ...) into the same model
    loaded = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hub", attn_implementation="eager",
                                                               experts_implementation="eager").float().eval()
    assert loaded.config.rope_parameters == hf.config.rope_parameters
    assert loaded.config.rope_interleave == hf.config.rope_interleave
    (p,) = prompts(hf.config.vocab_size, [64], seed=0)
    want = full_logits(hf, p)
    assert torch.equal(full_logits(loaded, p), want) and torch.equal(full_logits(ref, p), want)


def test_fp8_hub_layout_is_v3s(tmp_path):
    hf, cfg = make_hf_model("v3_yarn_groups", seed=5, **WIDE)
    ref = save_hf_layout(hf, tmp_path, fp8=True, plain_dtype=torch.bfloat16, mtp=True)
    files = _read(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"] == QUANTIZATION_CONFIG
    assert config["num_nextn_predict_layers"] == 1 and config["scoring_func"] == "sigmoid"
    assert config["rope_scaling"]["type"] == "yarn" and "rope_parameters" not in config
    mtp = f"model.layers.{cfg.num_hidden_layers}."
    for suffix in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight",
                   "shared_head.head.weight", "embed_tokens.weight", "self_attn.kv_b_proj.weight_scale_inv",
                   "mlp.experts.0.gate_proj.weight", "mlp.gate.e_score_correction_bias"):
        assert mtp + suffix in files
    assert files[mtp + "eh_proj.weight"].dtype == torch.bfloat16  # as in V3: MTP's own projections stay bf16
    quantized = 0
    for name, t in files.items():
        if name.endswith("_scale_inv"):
            w = files[name.removesuffix("_scale_inv")]
            assert t.dtype == torch.float32 and t.shape == (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
        elif name.endswith(FP8_SUFFIXES):
            assert t.dtype == torch.float8_e4m3fn and name + "_scale_inv" in files
            quantized += 1
        elif name.endswith("e_score_correction_bias"):
            assert t.dtype == torch.float32
        else:
            assert t.dtype == torch.bfloat16, name
    assert files["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (2, 2)  # [152, 160]
    # the returned oracle is what the files dequantize to, exactly; the MTP layer is not part of it
    want = hub_state_dict(ref)
    for name, t in want.items():
        got = (fp8_block_dequant(files[name], files[name + "_scale_inv"]) if name + "_scale_inv" in files
               else files[name].float())
        assert torch.equal(got, t), name
    # ... and close to the float32 model, within FP8's 3 mantissa bits
    orig = hub_state_dict(hf)
    w = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert 0 < rel_err(want[w], orig[w]) < 2 ** -4
    # the FP8 checkpoint's oracle is the returned model, not the float32 one (routing flips
    # make their logits differ by tens of percent)
    (p,) = prompts(cfg.vocab_size, [64], seed=0)
    assert rel_err(full_logits(ref, p), full_logits(hf, p)) > 1e-3


UPSTREAM = re.compile(r"embed\.weight|head\.weight|norm\.weight|layers\.\d+\.(attn_norm|ffn_norm)\.weight"
                      r"|layers\.\d+\.attn\.(wq|wq_a|wq_b|wkv_a|wkv_b|wo)\.(weight|scale)"
                      r"|layers\.\d+\.attn\.(q_norm|kv_norm)\.weight"
                      r"|layers\.\d+\.ffn\.(w1|w2|w3)\.(weight|scale)"
                      r"|layers\.\d+\.ffn\.(experts\.\d+|shared_experts)\.(w1|w2|w3)\.(weight|scale)"
                      r"|layers\.\d+\.ffn\.gate\.(weight|bias)")


@pytest.mark.parametrize("name", ["v3_yarn_groups", "lite_no_qlora"])
def test_upstream_layout_has_deepseeks_names(name, tmp_path):
    if name == "lite_no_qlora":  # upstream always normalises; this config does not
        hf, _ = make_hf_model(name, seed=5)
        with pytest.raises(ValueError, match="normalises"):
            save_upstream_layout(hf, tmp_path)
        hf, _ = make_hf_model(name, seed=5, norm_topk_prob=True)
    else:
        hf, _ = make_hf_model(name, seed=5, **WIDE)
    ref_up = save_upstream_layout(hf, tmp_path / "up", fp8=True)
    ref_hub = save_hf_layout(hf, tmp_path / "hub", fp8=True)
    up, hub = _read(tmp_path / "up"), _read(tmp_path / "hub")
    assert [f.name for f in (tmp_path / "up").glob("*.safetensors")] == ["model0-mp1.safetensors"]
    assert all(UPSTREAM.fullmatch(n) for n in up), [n for n in up if not UPSTREAM.fullmatch(n)]
    assert sorted(up) == sorted(upstream_name(n) for n in hub)  # one to one, same tensors
    assert all(torch.equal(up[upstream_name(n)].view(torch.uint8) if t.dtype == torch.float8_e4m3fn
                           else up[upstream_name(n)], t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t)
               for n, t in hub.items())
    assert all(torch.equal(a, b) for a, b in zip(ref_up.state_dict().values(), ref_hub.state_dict().values()))
    cfg = hf.config
    q = "layers.0.attn.wq_a" if cfg.q_lora_rank else "layers.0.attn.wq"
    for n in (f"{q}.weight", f"{q}.scale", "layers.0.attn.kv_norm.weight", "layers.0.ffn.w1.weight",
              f"layers.{cfg.first_k_dense_replace}.ffn.experts.3.w3.scale",
              f"layers.{cfg.first_k_dense_replace}.ffn.gate.bias",
              f"layers.{cfg.first_k_dense_replace}.ffn.shared_experts.w2.weight"):
        assert n in up, n
    args = json.loads((tmp_path / "up" / "config.json").read_text())
    assert args["dim"] == cfg.hidden_size and args["n_dense_layers"] == cfg.first_k_dense_replace
    assert args["n_expert_groups"] == cfg.n_group and args["n_limited_groups"] == cfg.topk_group
    assert args["q_lora_rank"] == (cfg.q_lora_rank or 0) and args["score_func"] == "sigmoid"
    assert args["rope_factor"] == (40.0 if name == "v3_yarn_groups" else 1.0) and args["dtype"] == "fp8"


def test_bench_config_is_issue_20s_and_llama_cpp_loads_it():
    """The peers benchmark model has issue 20's dimensions, and the values llama.cpp's converter
    and loader need (llama-model.cpp, conversion/deepseek.py): its loader asserts 1 < n_group < n_expert,
    n_expert % n_group == 0 and 0 < topk_group < n_group; the converter reads scoring_func
    (absent: softmax gating) and num_key_value_heads (to split kv_b_proj) from config.json, and
    rotates interleaved pairs with one mscale."""
    from tiny_models_v3 import BENCH, hub_config

    cfg = transformers.DeepseekV3Config(**BENCH)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.n_routed_experts, cfg.num_experts_per_tok) == (512, 6, 16, 2)
    assert (cfg.n_shared_experts, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim) == (1, 384, 128, 32)
    assert 1 < cfg.n_group < cfg.n_routed_experts and cfg.n_routed_experts % cfg.n_group == 0
    assert 0 < cfg.topk_group < cfg.n_group and cfg.num_experts_per_tok <= cfg.topk_group * cfg.n_routed_experts // cfg.n_group
    assert cfg.rope_interleave and cfg.rope_parameters["mscale"] == cfg.rope_parameters["mscale_all_dim"]
    assert cfg.num_hidden_layers not in (26, 27)  # llama.cpp takes those for V2-Lite and skips q_lora_rank
    written = hub_config(cfg, fp8=False)
    assert written["scoring_func"] == "sigmoid" and written["num_key_value_heads"] == cfg.num_attention_heads
    # transformers keeps scoring_func (not one of its fields) only when it is passed in: without it
    # save_pretrained's config.json makes llama.cpp gate with softmax
    assert cfg.to_dict()["scoring_func"] == "sigmoid"
    assert "scoring_func" not in transformers.DeepseekV3Config(hidden_size=64).to_dict()
