"""DeepSeek-V4's checkpoint: the tensors the model reads (HF names, as transformers'
`DeepseekV4ForCausalLM.state_dict()` has them) and where DeepSeek's original names go.

Three spellings of the same tensors reach us: HF state_dict names, DeepSeek's upstream names, and
what transformers 5.x `save_pretrained` writes -- the conversion mapping run backwards, i.e.
upstream inner names under a `model.` prefix (`model.layers.0.attn.wq_a.weight`, per-expert
w1/w2/w3) beside `model.embed_tokens.weight` and `head.weight`. The loader resolves each name on
its own (`checkpoint_name`), not per checkpoint.
"""

from __future__ import annotations

import re

import torch

from deepinfer.models.base import Destination, TensorSpec, expert_slice_source
from deepinfer.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config

# Upstream (DeepSeek inference/model.py) name -> HF name: the renames of transformers'
# `conversion_mapping.py` ("deepseek_v4" entry), written out per tensor. Layer entries are
# relative to `layers.{i}.` / `model.layers.{i}.`. Note the HF module tree nests the indexer
# inside the compressor (`attn.indexer.*` -> `self_attn.compressor.indexer.*`).
_TOP_RENAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
_LAYER_RENAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn",
    "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    # transformers' save_pretrained reverses the `.norm.` -> `.kv_norm.` rename into this name
    "attn.norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.attn_sink": "self_attn.sinks",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
# Routed experts are per expert upstream; HF fuses them: gate_up_proj[j] = cat([w1, w3]), down_proj[j] = w2.
_EXPERT_PARTS = {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None)}
_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)")
_EXPERT_RE = re.compile(r"ffn\.experts\.(\d+)\.(w[123])\.weight")


def checkpoint_name(name: str) -> Destination | None:
    """Where an upstream-named tensor (or transformers' save_pretrained spelling of it) goes in HF
    naming; None if it has no HF counterpart."""
    name = name.removeprefix("model.")
    if name in _TOP_RENAMES:
        return _TOP_RENAMES[name], None
    if not (m := _LAYER_RE.fullmatch(name)):
        return None
    layer, rest = m.groups()
    if rest in _LAYER_RENAMES:
        return f"model.layers.{layer}.{_LAYER_RENAMES[rest]}", None
    if e := _EXPERT_RE.fullmatch(rest):
        fused, half = _EXPERT_PARTS[e.group(2)]
        return f"model.layers.{layer}.mlp.experts.{fused}", (int(e.group(1)), half)
    return None


def checkpoint_source(hf: str, part: tuple[int, int | None] | None = None) -> str | None:
    """The upstream name of an HF-named tensor, or of one expert's slice of a fused stack (for
    error messages): the inverse of `checkpoint_name`."""
    if part is not None:
        m, w = expert_slice_source(hf, part, r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)",
                                   _EXPERT_PARTS)
        return f"layers.{m.group(1)}.ffn.experts.{part[0]}.{w}.weight"
    if up := next((u for u, h in _TOP_RENAMES.items() if h == hf), None):
        return up
    if m := re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf):
        rest = next((u for u, h in _LAYER_RENAMES.items() if h == m.group(2)), None)
        return rest and f"layers.{m.group(1)}.{rest}"
    return None


def _weight(shape: tuple[int, ...]) -> TensorSpec:
    """A weight a weight op reads: kept as the checkpoint stores it (TensorSpec.stored)."""
    return TensorSpec(shape, stored=True)


def checkpoint_tensors(cfg: DeepseekV4Config) -> dict[str, TensorSpec]:
    """Every checkpoint tensor the model reads (HF names), with shape and dtype. The projections,
    routers, experts, embedding and head are kept as the checkpoint stores them (bf16, FP8, FP4);
    norms, biases, sinks, mixing matrices and position biases become float32."""
    i64 = torch.int64
    d, hd, n, e = cfg.hidden_size, cfg.head_dim, cfg.hc_mult, cfg.n_routed_experts
    inter, di = cfg.moe_intermediate_size, cfg.index_head_dim
    out = {
        "model.embed_tokens.weight": _weight((cfg.vocab_size, d)),
        "model.norm.weight": TensorSpec((d,)),
        "model.hc_head.hc_fn": TensorSpec((n, n * d)),
        "model.hc_head.hc_base": TensorSpec((n,)),
        "model.hc_head.hc_scale": TensorSpec((1,)),
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = _weight((cfg.vocab_size, d))
    mix = (2 + n) * n
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out.update({
            p + "input_layernorm.weight": TensorSpec((d,)),
            p + "post_attention_layernorm.weight": TensorSpec((d,)),
            a + "sinks": TensorSpec((cfg.num_attention_heads,)),
            a + "q_a_proj.weight": _weight((cfg.q_lora_rank, d)),
            a + "q_a_norm.weight": TensorSpec((cfg.q_lora_rank,)),
            a + "q_b_proj.weight": _weight((cfg.num_attention_heads * hd, cfg.q_lora_rank)),
            a + "kv_proj.weight": _weight((hd, d)),
            a + "kv_norm.weight": TensorSpec((hd,)),
            a + "o_a_proj.weight": _weight((cfg.o_groups * cfg.o_lora_rank,
                                                cfg.num_attention_heads * hd // cfg.o_groups)),
            a + "o_b_proj.weight": _weight((d, cfg.o_groups * cfg.o_lora_rank)),
        })
        for hc in ("attn_hc.", "ffn_hc."):
            out.update({p + hc + "fn": TensorSpec((mix, n * d)), p + hc + "base": TensorSpec((mix,)),
                        p + hc + "scale": TensorSpec((3,))})
        if kind != SLIDING:
            c = a + "compressor."
            width = 2 * hd if kind == CSA else hd
            rate = cfg.compress_rate(i)
            out.update({
                c + "position_bias": TensorSpec((rate, width)),
                c + "kv_proj.weight": _weight((width, d)),
                c + "gate_proj.weight": _weight((width, d)),
                c + "kv_norm.weight": TensorSpec((hd,)),
            })
            if kind == CSA:
                x = c + "indexer."
                out.update({
                    x + "position_bias": TensorSpec((rate, 2 * di)),
                    x + "kv_proj.weight": _weight((2 * di, d)),
                    x + "gate_proj.weight": _weight((2 * di, d)),
                    x + "kv_norm.weight": TensorSpec((di,)),
                    x + "q_b_proj.weight": _weight((cfg.index_n_heads * di, cfg.q_lora_rank)),
                    x + "scorer.weights_proj.weight": _weight((cfg.index_n_heads, d)),
                })
        m = p + "mlp."
        out[m + "gate.weight"] = _weight((e, d))
        if cfg.mlp_layer_types[i] == "hash_moe":
            out[m + "gate.tid2eid"] = TensorSpec((cfg.vocab_size, cfg.num_experts_per_tok), i64)
        else:
            out[m + "gate.e_score_correction_bias"] = TensorSpec((e,))
        out.update({
            m + "experts.gate_up_proj": TensorSpec((e, 2 * inter, d), experts=True),
            m + "experts.down_proj": TensorSpec((e, d, inter), experts=True),
            m + "shared_experts.gate_proj.weight": _weight((inter, d)),
            m + "shared_experts.up_proj.weight": _weight((inter, d)),
            m + "shared_experts.down_proj.weight": _weight((d, inter)),
        })
    return out
