"""DeepSeek-V4.1's checkpoint: the tensors the model reads, by their bare checkpoint names
(`layers.L.attn.wq_a.weight`, no `model.` prefix; IMPLEMENTING.md, section 0), and where the
per-expert tensors go.

Every matrix a weight op reads (projections, routers, experts, embedding, head) is kept as the
checkpoint stores it (`TensorSpec.stored`): FP8 e4m3 with E8M0 per 32x32 block and FP4 e2m1 with
E8M0 per 32 inputs stay a backends.quant.QuantizedWeight, bf16 stays bf16; the ops widen them in
registers (exact: power-of-two scales); wo_a is the exception (block_tensors). The model attaches its activation quantization to the FP8
weights it quantizes inputs for (model.py), so a GEMM computes dequant(act_quant(x)) @ dequant(W)
-- what DeepSeek's FP8 GEMM computes, up to summation order. Norms, biases, sinks and mixing
matrices become float32. The Engram tables stay as stored, memory-mapped from the file
(`TensorSpec.mapped`): the released tables are ~98 GB a layer, and a step reads a few rows.
"""

from __future__ import annotations

import re

import torch

from deepinfer.models.base import Destination, TensorSpec, expert_slice_source
from deepinfer.models.deepseek_v41 import vision
from deepinfer.models.deepseek_v41.config import DeepseekV41Config

_EXPERT_RE = re.compile(r"(layers\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.weight")
_EXPERT_PARTS = {"w1": ("gate_up", 0), "w3": ("gate_up", 1), "w2": ("down", None)}


def checkpoint_name(name: str) -> Destination | None:
    """A routed expert's w1/w3/w2 fill its slice of the layer's fused [E, 2I, D] / [E, D, I] stacks."""
    if m := _EXPERT_RE.fullmatch(name):
        stack, half = _EXPERT_PARTS[m.group(3)]
        return f"{m.group(1)}.{stack}", (int(m.group(2)), half)
    return None


def checkpoint_source(name: str, part: tuple[int, int | None] | None = None) -> str | None:
    """The checkpoint name of one expert's slice of a fused stack (for error messages)."""
    if part is None or (hit := expert_slice_source(name, part, r"(layers\.\d+\.ffn\.experts)\.(gate_up|down)",
                                                   _EXPERT_PARTS)) is None:
        return None
    m, w = hit
    return f"{m.group(1)}.{part[0]}.{w}.weight"


def _weight(shape: tuple[int, ...]) -> TensorSpec:
    """A matrix a weight op reads: kept as the checkpoint stores it (TensorSpec.stored)."""
    return TensorSpec(shape, stored=True)


def block_tensors(cfg: DeepseekV41Config, p: str, n_experts: int) -> dict[str, TensorSpec]:
    """The tensors of one block (a backbone layer or a DSpark stage) under prefix `p`, without the
    compressor and indexer (a backbone layer's roles add those)."""
    d, hd, hc, heads = cfg.hidden_size, cfg.head_dim, cfg.hc_mult, cfg.num_attention_heads
    mix, inter = (2 + hc) * hc, cfg.moe_intermediate_size
    a, f = p + "attn.", p + "ffn."
    out = {
        p + "attn_norm.weight": TensorSpec((d,)), p + "ffn_norm.weight": TensorSpec((d,)),
        a + "attn_sink": TensorSpec((heads,)),
        a + "wq_a.weight": _weight((cfg.q_lora_rank, d)), a + "q_norm.weight": TensorSpec((cfg.q_lora_rank,)),
        a + "wq_b.weight": _weight((heads * hd, cfg.q_lora_rank)),
        a + "wkv.weight": _weight((hd, d)), a + "kv_norm.weight": TensorSpec((hd,)),
        # FP8 on disk, bf16 in memory as DeepSeek's reference holds it (exact): it multiplies bf16 inputs
        # unquantized, where an FP8 weight would get nvidia's FP8 GEMM's own input quantization
        a + "wo_a.weight": TensorSpec((cfg.o_groups * cfg.o_lora_rank, heads * hd // cfg.o_groups), torch.bfloat16),
        a + "wo_b.weight": _weight((d, cfg.o_groups * cfg.o_lora_rank)),
        f + "gate.weight": _weight((n_experts, d)), f + "gate.bias": TensorSpec((n_experts,)),
        f + "experts.gate_up": TensorSpec((n_experts, 2 * inter, d), experts=True),
        f + "experts.down": TensorSpec((n_experts, d, inter), experts=True),
        f + "shared_experts.w1.weight": _weight((inter, d)), f + "shared_experts.w3.weight": _weight((inter, d)),
        f + "shared_experts.w2.weight": _weight((d, inter)),
    }
    for sub in ("attn", "ffn"):
        out.update({f"{p}hc_{sub}_fn": TensorSpec((mix, hc * d)), f"{p}hc_{sub}_base": TensorSpec((mix,)),
                    f"{p}hc_{sub}_scale": TensorSpec((3,))})
    return out


def checkpoint_tensors(cfg: DeepseekV41Config) -> dict[str, TensorSpec]:
    """Every backbone tensor the model reads (the DSpark stages `mtp.*` are the drafter's); with a vision
    tower also its tensors (vision.py) and each gate's `bias_vl`, which routes image-span positions."""
    d, hd = cfg.hidden_size, cfg.head_dim
    out = {"embed.weight": _weight((cfg.vocab_size, d)), "head.weight": _weight((cfg.vocab_size, d)),
           "norm.weight": TensorSpec((d,))}
    for role in cfg.roles:
        p = f"layers.{role.layer}."
        out.update(block_tensors(cfg, p, cfg.n_routed_experts))
        a = p + "attn."
        if role.owns_kv:
            out.update({a + "compressor.wkv.weight": _weight((hd, d)),
                        a + "compressor.norm.weight": TensorSpec((hd,)),
                        a + "indexer.wk.weight": _weight((cfg.index_head_dim, hd)),
                        a + "indexer.k_norm.weight": TensorSpec((cfg.index_head_dim,))})
            if role.rate > 1:
                out[a + "compressor.wgate.weight"] = _weight((hd, d))
        if role.owns_index:
            heads = cfg.index_n_heads * cfg.index_head_dim
            out.update({a + "indexer.wq_b.weight": _weight((heads, cfg.q_lora_rank)),
                        a + "indexer.weights_proj.weight": _weight((cfg.index_n_heads, d))})
        if role.engram:
            e = p + "engram."
            rows = cfg.engram_num_embeddings[cfg.engram_layer_ids.index(role.layer)]
            cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
            out.update({
                e + "embed.weight": TensorSpec((rows, cfg.engram_head_dim), torch.float8_e4m3fn, mapped=True),
                e + "embed.scale": TensorSpec((rows, cfg.engram_head_dim // 32), torch.float8_e8m0fnu, mapped=True),
                e + "wkv.weight": _weight(((cfg.hc_mult + 1) * d, cols * cfg.engram_head_dim)),
                e + "q_weight": TensorSpec((cfg.hc_mult, d)), e + "k_weight": TensorSpec((cfg.hc_mult, d)),
            })
        if cfg.vision is not None:
            out[p + "ffn.gate.bias_vl"] = TensorSpec((cfg.n_routed_experts,))
    if cfg.vision is not None:
        out.update(vision.checkpoint_tensors(cfg.vision))
    return out


def dspark_tensors(cfg: DeepseekV41Config) -> dict[str, TensorSpec]:
    """The DSpark stages' tensors (`mtp.K.*`): window-only blocks with the DSpark expert counts; stage 0
    adds the context projection, the last stage the norm, Markov head and confidence head. No
    embedding or LM head: the stages use the backbone's."""
    d, n = cfg.hidden_size, cfg.num_nextn_predict_layers
    rank = cfg.dspark.get("dspark_markov_rank", 256)
    targets = len(cfg.dspark.get("dspark_target_layer_ids", ()))
    out = {}
    for k in range(n):
        out.update(block_tensors(cfg, f"mtp.{k}.", cfg.dspark_experts[0]))
    last = f"mtp.{n - 1}."
    out.update({"mtp.0.main_proj.weight": _weight((d, targets * d)), "mtp.0.main_norm.weight": TensorSpec((d,)),
                last + "norm.weight": TensorSpec((d,)),
                last + "markov_head.embed.weight": _weight((cfg.vocab_size, rank)),
                last + "markov_head.head.weight": _weight((cfg.vocab_size, rank)),
                last + "confidence_head.proj.weight": _weight((1, d + rank))})
    return out

