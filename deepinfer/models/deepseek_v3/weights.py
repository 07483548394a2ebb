"""DeepSeek-V3's checkpoint: the tensors the model reads (HF names, as transformers'
`DeepseekV3ForCausalLM.state_dict()` has them) and where the other spellings go.

Three layouts reach us, resolved name by name (`checkpoint_name`):
- transformers' state dict: routed experts fused per layer, `mlp.experts.gate_up_proj` [E, 2I, D]
  (gate rows first) and `mlp.experts.down_proj` [E, D, I];
- the hub (deepseek-ai/DeepSeek-V3, R1, and what transformers' save_pretrained writes): per expert
  `model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`, FP8 e4m3 Linear weights with a float32
  `<name>_scale_inv` per 128x128 tile (kept FP8: `checkpoint_tensors`), and one
  multi-token-prediction layer after the last (`model.layers.61.*` in V3), which the model does
  not run (`ignored_prefixes`);
- DeepSeek's inference/convert.py: `model.` stripped, self_attn -> attn, mlp -> ffn, the module
  names of `_MODULES`, `weight_scale_inv` -> `scale`, `e_score_correction_bias` -> `bias`
  (`layers.0.attn.wq_a.weight`, `layers.3.ffn.experts.5.w1.weight`, `embed.weight`, `head.weight`).
"""

from __future__ import annotations

import re

from deepinfer.models.base import Destination, TensorSpec, expert_slice_source
from deepinfer.models.deepseek_v3.config import DeepseekV3Config

# DeepSeek's module name -> transformers' (inference/convert.py's mapping, inverted)
_MODULES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "wq": "q_proj", "wq_a": "q_a_proj",
    "q_norm": "q_a_layernorm", "wq_b": "q_b_proj", "wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm",
    "wkv_b": "kv_b_proj", "wo": "o_proj", "w1": "gate_proj", "w2": "down_proj", "w3": "up_proj",
}
_TOP = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
        "norm.weight": "model.norm.weight"}
# per-expert tensors -> (fused stack, half): gate rows then up rows, as transformers fuses them
_EXPERT_PARTS = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", None)}
_HUB_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_UPSTREAM_LAYER = re.compile(r"layers\.(\d+)\.(attn|ffn|attn_norm|ffn_norm)\.(.+)")


def checkpoint_name(name: str) -> Destination | None:
    """Where a hub per-expert tensor or an upstream-named tensor goes (HF naming); None if it has
    no counterpart (upstream `.scale` tensors then pair with their weight)."""
    if m := _HUB_EXPERT.fullmatch(name):
        fused, half = _EXPERT_PARTS[m.group(3)]
        return f"model.layers.{m.group(1)}.mlp.experts.{fused}", (int(m.group(2)), half)
    if name in _TOP:
        return _TOP[name], None
    if not (m := _UPSTREAM_LAYER.fullmatch(name)):
        return None
    layer, block, rest = m.groups()
    p = f"model.layers.{layer}."
    if block in ("attn_norm", "ffn_norm"):
        return (p + _MODULES[block] + ".weight", None) if rest == "weight" else None
    if block == "attn":
        module, _, leaf = rest.partition(".")
        return (p + f"self_attn.{_MODULES[module]}.weight", None) if module in _MODULES and leaf == "weight" else None
    if rest == "gate.weight":
        return p + "mlp.gate.weight", None
    if rest == "gate.bias":
        return p + "mlp.gate.e_score_correction_bias", None
    if e := re.fullmatch(r"experts\.(\d+)\.(w[123])\.weight", rest):
        fused, half = _EXPERT_PARTS[_MODULES[e.group(2)]]
        return p + f"mlp.experts.{fused}", (int(e.group(1)), half)
    if s := re.fullmatch(r"(shared_experts\.)?(w[123])\.weight", rest):
        return p + f"mlp.{s.group(1) or ''}{_MODULES[s.group(2)]}.weight", None
    return None


def checkpoint_source(hf: str, part: tuple[int, int | None] | None = None) -> str | None:
    """The hub name of one expert's slice of a fused stack (for error messages), else None: the
    other HF names are the hub's own."""
    stacks = r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)"
    if part is None or (hit := expert_slice_source(hf, part, stacks, _EXPERT_PARTS)) is None:
        return None
    m, proj = hit
    return f"model.layers.{m.group(1)}.mlp.experts.{part[0]}.{proj}.weight"


def _weight(shape: tuple[int, ...]) -> TensorSpec:
    """A weight a weight op reads: kept as the checkpoint stores it (TensorSpec.stored)."""
    return TensorSpec(shape, stored=True)


def checkpoint_tensors(cfg: DeepseekV3Config) -> dict[str, TensorSpec]:
    """Every checkpoint tensor the model reads (HF names), with its shape. The weights the ops read
    stay as stored (FP8 with its block scales, bf16); kv_b_proj is the exception: the model keeps
    it only in its absorbed per-head forms (W_UK^T, a transpose the block scales do not follow, and
    W_UV), built in float32 at load (kv_lora_rank x heads x 256 values a layer: ~0.15% of V3's)."""
    d, heads, e = cfg.hidden_size, cfg.num_attention_heads, cfg.n_routed_experts
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    out = {"model.embed_tokens.weight": _weight((cfg.vocab_size, d)), "model.norm.weight": TensorSpec((d,))}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = _weight((cfg.vocab_size, d))
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out.update({
            p + "input_layernorm.weight": TensorSpec((d,)),
            p + "post_attention_layernorm.weight": TensorSpec((d,)),
            a + "kv_a_proj_with_mqa.weight": _weight((cfg.latent_dim, d)),
            a + "kv_a_layernorm.weight": TensorSpec((cfg.kv_lora_rank,)),
            a + "kv_b_proj.weight": TensorSpec((heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)),
            a + "o_proj.weight": _weight((d, heads * cfg.v_head_dim)),
        })
        if cfg.q_lora_rank:
            out.update({a + "q_a_proj.weight": _weight((cfg.q_lora_rank, d)),
                        a + "q_a_layernorm.weight": TensorSpec((cfg.q_lora_rank,)),
                        a + "q_b_proj.weight": _weight((heads * qk, cfg.q_lora_rank))})
        else:
            out[a + "q_proj.weight"] = _weight((heads * qk, d))
        m = p + "mlp."
        if not cfg.is_moe(i):
            inter = cfg.intermediate_size
            out.update({m + "gate_proj.weight": _weight((inter, d)), m + "up_proj.weight": _weight((inter, d)),
                        m + "down_proj.weight": _weight((d, inter))})
            continue
        inter = cfg.moe_intermediate_size
        out.update({
            m + "gate.weight": _weight((e, d)),
            m + "gate.e_score_correction_bias": TensorSpec((e,)),
            m + "experts.gate_up_proj": TensorSpec((e, 2 * inter, d), experts=True),
            m + "experts.down_proj": TensorSpec((e, d, inter), experts=True),
        })
        if cfg.n_shared_experts:
            shared = inter * cfg.n_shared_experts  # one MLP of the shared experts' total width
            s = m + "shared_experts."
            out.update({s + "gate_proj.weight": _weight((shared, d)), s + "up_proj.weight": _weight((shared, d)),
                        s + "down_proj.weight": _weight((d, shared))})
    return out


def ignored_prefixes(cfg: DeepseekV3Config) -> tuple[str, ...]:
    """The multi-token-prediction layers the hub checkpoint stores after the last layer (V3 / R1:
    `model.layers.61.*`, num_nextn_predict_layers 1): transformers and llama.cpp skip them too."""
    n = cfg.num_hidden_layers
    return tuple(f"model.layers.{n + j}." for j in range(max(cfg.num_nextn_predict_layers, 1)))
