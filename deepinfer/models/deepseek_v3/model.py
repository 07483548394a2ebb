"""DeepSeek-V3 / R1, written only against Accelerator ops.

One forward runs a step: many sequences at once, each contributing a chunk of new tokens (a
whole prompt, a prefill chunk, or a decode token) at its own positions. Tokens of all sequences
are flattened into one [T, D] batch; per-sequence structure lives only in StepMeta's index
tensors (which latent rows each token reads).

Per layer (pre-norm residual blocks, transformers' DeepseekV3DecoderLayer):
  x + MLA(RMSNorm(x)), then + MLP(RMSNorm(.)): a SwiGLU MLP in the first first_k_dense_replace
  layers, then MoE (sigmoid group-limited top-k routed experts + the shared experts).

MLA in the absorbed form, per token (c = kv_lora_rank, dn / dr / dv = nope / rope / value head dims):
  q = q_b(rms(q_a(x))) (or q_proj(x)) -> [H, dn + dr];  [latent | k_pe] = kv_a(x)
  row = [rms(latent) | rope(k_pe)]                    the cache row, c + dr floats, written at its position
  q_row[h] = [W_UK[h]^T q_nope[h] | rope(q_pe[h])]   W_UK[h] = kv_b's k_nope rows of head h [dn, c]
  o_lat[h] = softmax_t(q_row[h] . row_t * scale) row_t[:c]  MQA over the rows of positions <= p (no sink)
  out = o_proj(concat_h W_UV[h] o_lat[h])             W_UV[h] = kv_b's value rows of head h [dv, c]
which is transformers' attention with K/V expanded from the same rows (the scores are the same
numbers, so the scale is (dn + dr)^-0.5 with YaRN's mscale^2, not (c + dr)^-0.5). Upstream's
`MLA.forward` (attn_impl "absorb") computes the same einsums.
"""

from __future__ import annotations

import math

import torch

from deepinfer.backends.base import Accelerator, WeightRole
from deepinfer.backends.quant import Weight, fuse_rows, reorder_rows
from deepinfer.models.base import (CacheSpec, CausalLM, DecodeCache, FeaturesRequest, ParallelContext, StepInput,
                                   TensorSpec)
from deepinfer.models.deepseek_v3 import weights as checkpoint
from deepinfer.models.deepseek_v3.config import LORA_NORM_EPS, DeepseekV3Config
from deepinfer.models.deepseek_v3.step import StepMeta, cache_spec


def rope_pair_order(rope_dim: int) -> torch.Tensor:
    """The order of the rope rows of a rotate_half checkpoint (rope_interleave false: channel i pairs
    with i + dr/2) that makes them interleaved pairs, which the rope op rotates: [0, h, 1, h+1, ...],
    h = dr/2. Applied to q's and k's rope rows alike, it leaves every score unchanged."""
    half = rope_dim // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()


class DeepseekV3Model(CausalLM):
    """The model: weights (prepared by the accelerator) + the forward of one step."""

    replay_window = 0  # the latent pages are the whole decode state: prefix-cache hits are exact

    def __init__(self, config: DeepseekV3Config, weights: dict[str, Weight], accel: Accelerator,
                 parallel: ParallelContext | None = None):
        self.config, self.accel = config, accel
        self.parallel = parallel or ParallelContext()
        weights = dict(weights)
        for i in range(config.num_hidden_layers):
            self._prepare_layer(weights, i)
        stacks = {n for n, spec in checkpoint.checkpoint_tensors(config).items() if spec.experts}
        self.w = {name: accel.prepare_weight(t, WeightRole.EXPERTS if name in stacks else WeightRole.PLAIN)
                  for name, t in weights.items()}
        if config.tie_word_embeddings and "lm_head.weight" not in self.w:
            self.w["lm_head.weight"] = self.w["model.embed_tokens.weight"]
        self.no_sink = torch.full((config.num_attention_heads,), float("-inf"), device=accel.device)
        # routed experts of each MoE layer: this process's (accel.moe_experts), or expert parallelism's
        ep = self.parallel.expert_parallel
        self.experts: dict[int, object] = {}
        for i in range(config.first_k_dense_replace, config.num_hidden_layers):
            p = f"model.layers.{i}.mlp.experts."
            if ep is None:
                self.experts[i] = self._local_experts(self.w[p + "gate_up_proj"], self.w[p + "down_proj"])
            else:  # the ranks keep only their own experts: the full stacks are not held here
                self.experts[i] = ep.add_layer(self.w.pop(p + "gate_up_proj"), self.w.pop(p + "down_proj"),
                                               config.num_experts_per_tok, math.inf)

    # ------------------------------------------------------------ the model interface
    @classmethod
    def checkpoint_tensors(cls, config: DeepseekV3Config) -> dict[str, TensorSpec]:
        return checkpoint.checkpoint_tensors(config)

    checkpoint_name = staticmethod(checkpoint.checkpoint_name)
    checkpoint_source = staticmethod(checkpoint.checkpoint_source)

    @classmethod
    def ignored_prefixes(cls, config: DeepseekV3Config) -> tuple[str, ...]:
        return checkpoint.ignored_prefixes(config)

    def cache_spec(self, margin: int) -> CacheSpec:
        return cache_spec(self.config)

    def prepare(self, inp: StepInput, cache: DecodeCache, steps: int | None = None) -> StepMeta:
        cp = self.parallel.context_parallel
        split = cp.split(inp.lens.tolist(), cache.device) if cp is not None else None
        return StepMeta(inp, cache, self.config, split=split, steps=steps)

    def _prepare_layer(self, weights: dict[str, Weight], i: int) -> None:
        """A layer's checkpoint tensors in the form the forward multiplies by (host side; weights
        stay as stored, quant.py's exact row operations):
        - the input projections that read x, q_a (or q_proj) and kv_a_proj_with_mqa, as one GEMM
          where the checkpoint stores them alike (a decode step of a small model is bound by the
          cost per op call), else one per run (`input_proj.{j}`, outputs concatenated);
        - kv_b_proj split per head into W_UK^T [H*c, dn] (absorbed into the query: q_nope [T, H, dn]
          -> [T, H, c] with grouped_linear) and W_UV [H*dv, c] (after attention: [T, H, c] -> [T, H, dv]),
          float32 (the loader dequantizes it: weights.checkpoint_tensors);
        - a rotate_half checkpoint's rope rows reordered into interleaved pairs (rope_pair_order);
        - gate and up projections of the dense and shared MLPs stacked, as swiglu_mlp takes them."""
        cfg = self.config
        heads, dn, dr, dv, c = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                                cfg.kv_lora_rank)
        a = f"model.layers.{i}.self_attn."
        q_name = a + ("q_b_proj.weight" if cfg.q_lora_rank else "q_proj.weight")
        kv_a = weights.pop(a + "kv_a_proj_with_mqa.weight")
        if not cfg.rope_interleave:
            order = rope_pair_order(dr)
            head = torch.cat([torch.arange(dn), dn + order])
            weights[q_name] = reorder_rows(weights[q_name], (torch.arange(heads)[:, None] * (dn + dr) + head).flatten())
            kv_a = reorder_rows(kv_a, torch.cat([torch.arange(c), c + order]))
        first = weights.pop(a + ("q_a_proj.weight" if cfg.q_lora_rank else "q_proj.weight"))
        segments = fuse_rows([first, kv_a])
        if len(segments) == 1:
            weights[a + "input_proj.weight"] = segments[0]
        else:
            weights.update({f"{a}input_proj.{j}.weight": seg for j, seg in enumerate(segments)})
        kv_b = weights.pop(a + "kv_b_proj.weight").float().view(heads, dn + dv, c)
        weights[a + "w_uk_t"] = kv_b[:, :dn].transpose(1, 2).reshape(heads * c, dn).contiguous()
        weights[a + "w_uv"] = kv_b[:, dn:].reshape(heads * dv, c).contiguous()
        m = f"model.layers.{i}.mlp." + ("shared_experts." if cfg.is_moe(i) else "")
        if m + "gate_proj.weight" in weights:
            gate_up = fuse_rows([weights.pop(m + "gate_proj.weight"), weights.pop(m + "up_proj.weight")])
            if len(gate_up) != 1:
                raise ValueError(f"{m}gate_proj and up_proj are stored differently ({gate_up[0].dtype}, "
                                 f"{gate_up[1].dtype}): the MLP needs them alike")
            weights[m + "gate_up_proj.weight"] = gate_up[0]

    def _input_projection(self, a: str, h: torch.Tensor) -> torch.Tensor:
        """[T, q cols + latent_dim]: the layer's input projections (see _prepare_layer)."""
        whole = self.w.get(a + "input_proj.weight")
        if whole is not None:
            return self.accel.linear(h, whole)
        return torch.cat([self.accel.linear(h, self.w[f"{a}input_proj.{j}.weight"]) for j in range(2)], dim=-1)

    # ------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, inp: StepInput, cache: DecodeCache, logit_rows: torch.Tensor, meta: StepMeta | None = None,
                features: FeaturesRequest | None = None):
        """Run one step, write its latent rows to `cache`, return logits [len(logit_rows), V] of
        the given flat token rows. `meta` (from `self.prepare(inp, cache)`) may be built ahead.
        V3 has no drafter here: `features` is not taken."""
        if features is not None:
            raise ValueError("DeepSeek-V3 has no speculative drafter: a features request is not supported")
        meta = meta if meta is not None else self.prepare(inp, cache)
        cfg, ops, w = self.config, self.accel, self.w
        x = ops.embedding(meta.ids[meta.own], w["model.embed_tokens.weight"])
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            x = x + self._attention(i, ops.rms_norm(x, w[p + "input_layernorm.weight"], cfg.rms_norm_eps), meta)
            h = ops.rms_norm(x, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
            x = x + (self._moe(i, h) if cfg.is_moe(i) else self._mlp(p + "mlp.", h))
        x = meta.all_tokens(x)[logit_rows.to(x.device)]
        return ops.linear(ops.rms_norm(x, w["model.norm.weight"], cfg.rms_norm_eps), w["lm_head.weight"])

    def _attention(self, i: int, h: torch.Tensor, meta: StepMeta) -> torch.Tensor:
        """MLA, absorbed (module doc), over layer i's latent pool."""
        cfg, ops, w = self.config, self.accel, self.w
        a = f"model.layers.{i}.self_attn."
        heads, dn, c = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        num_tokens = h.shape[0]
        cos, sin = meta.rope
        own_cos, own_sin = cos[meta.own], sin[meta.own]
        proj = self._input_projection(a, h)
        q_cols, kv = proj[:, :-cfg.latent_dim], proj[:, -cfg.latent_dim:]
        if cfg.q_lora_rank:
            q_cols = ops.linear(ops.rms_norm(q_cols, w[a + "q_a_layernorm.weight"], LORA_NORM_EPS),
                                w[a + "q_b_proj.weight"])
        q = ops.rope(q_cols.view(num_tokens, heads, -1), own_cos, own_sin)  # rotates each head's trailing dr
        q_row = torch.cat([ops.grouped_linear(q[..., :dn], w[a + "w_uk_t"]), q[..., dn:]], dim=-1)
        # this step's latent rows, [rms(latent) | rope(k_pe)], from every token (all ranks')
        row = torch.cat([ops.rms_norm(kv[:, :c], w[a + "kv_a_layernorm.weight"], LORA_NORM_EPS), kv[:, c:]], dim=-1)
        row = meta.all_tokens(ops.rope(row, own_cos, own_sin))
        pool = meta.cache.pools[f"layers.{i}.latent"].data
        pool.index_copy_(0, meta.write_rows, row.to(pool.dtype))
        out = ops.sparse_attention(q_row, pool, meta.attention[meta.own], self.no_sink, cfg.softmax_scale)
        out = ops.grouped_linear(out[..., :c], w[a + "w_uv"])
        return ops.linear(out.flatten(1), w[a + "o_proj.weight"])

    # ------------------------------------------------------------ MLPs
    def _mlp(self, p: str, h: torch.Tensor) -> torch.Tensor:
        """A SwiGLU MLP without a clamp (the dense layers' and the shared experts')."""
        return self.accel.swiglu_mlp(h, self.w[p + "gate_up_proj.weight"], self.w[p + "down_proj.weight"], math.inf)

    def _moe(self, i: int, h: torch.Tensor) -> torch.Tensor:
        cfg, w = self.config, self.w
        p = f"model.layers.{i}.mlp."
        weights, ids = self.accel.route_grouped_topk(h, w[p + "gate.weight"], w[p + "gate.e_score_correction_bias"],
                                                     cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                                                     cfg.norm_topk_prob, cfg.routed_scaling_factor)
        routed = self.experts[i](h, weights, ids)
        return routed + self._mlp(p + "shared_experts.", h) if cfg.n_shared_experts else routed

    def _local_experts(self, gate_up: torch.Tensor, down: torch.Tensor):
        """A layer's routed experts on this process."""
        ops = self.accel

        def experts(h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            if not h.shape[0]:  # a context-parallel rank with no tokens this step
                return torch.zeros_like(h)
            return ops.moe_experts(h, weights, ids, gate_up, down, math.inf)

        return experts
