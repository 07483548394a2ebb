"""DeepSeek-V4, written only against Accelerator ops.

One forward runs a step: many sequences at once, each contributing a chunk of new
tokens (a whole prompt, a prefill chunk, or decode tokens) at its own positions,
reading and updating its decode state in a `DecodeCache`. Tokens of all sequences are
flattened into one [T, ...] batch; every layer sees them together, and per-sequence
structure lives only in index tensors (which rows of a pool each token reads).

Per layer (hidden D, N = hc_mult residual streams):
  streams -> mHC pre -> RMSNorm -> attention -> mHC post
          -> mHC pre -> RMSNorm -> MoE (hash or top-k routed + shared expert) -> mHC post
Attention is shared-KV MQA with partial RoPE over [sliding window keys + compressed
entries] (all entries on HCA layers, the Lightning Indexer's top-k on CSA layers),
with per-head sinks and the RoPE undone on the output before the grouped projection.
"""

from __future__ import annotations

import torch

from deepinfer.backends.base import Accelerator, WeightRole
from deepinfer.backends.quant import Weight, fuse_rows, scale_weight
from deepinfer.models.base import (CacheSpec, CausalLM, DecodeCache, FeaturesRequest, ParallelContext, StepInput,
                                   TensorSpec, ViewCache)
from deepinfer.models.deepseek_v4 import fused, weights as checkpoint
from deepinfer.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config
from deepinfer.models.deepseek_v4.step import CacheView, CompressedRows, LayerState, StepMeta, cache_spec


class DeepseekV4Model(CausalLM):
    """The model: weights (prepared by the accelerator) + the forward of one step."""

    extra_prefixes = ("mtp.",)  # the DSpark drafter's stages (dspark.py)

    def __init__(self, config: DeepseekV4Config, weights: dict[str, Weight], accel: Accelerator,
                 parallel: ParallelContext | None = None):
        self.config, self.accel = config, accel
        self.parallel = parallel or ParallelContext()
        self.replay_window = config.sliding_window  # the window rings are not in the prefix cache
        weights = dict(weights)
        index_scale = config.index_n_heads ** -0.5
        self.input_proj_splits = [self._fuse_input_projections(weights, i, index_scale)
                                  for i in range(config.num_hidden_layers)]
        self._input_segments = [sum(1 for name in weights if name.startswith(f"model.layers.{i}.self_attn.input_proj."))
                                for i in range(config.num_hidden_layers)]
        # columns needed for every token of the step (kv and compressor inputs): q_a comes before
        # them and the indexer head weights after, both only for own rows
        self._key_cols = [(splits["kv_proj"][0], max(b for name, (_, b) in splits.items()
                                                     if not name.endswith("weights_proj")))
                          for splits in self.input_proj_splits]
        stacks = {n for n, spec in checkpoint.checkpoint_tensors(config).items() if spec.experts}
        self.w = {name: accel.prepare_weight(t, WeightRole.EXPERTS if name in stacks else WeightRole.PLAIN)
                  for name, t in weights.items()}
        if config.tie_word_embeddings and "lm_head.weight" not in self.w:
            self.w["lm_head.weight"] = self.w["model.embed_tokens.weight"]
        # routed experts: this process's (accel.moe_experts), or expert parallelism's dispatch
        ep = self.parallel.expert_parallel
        self.experts = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}.mlp.experts."
            if ep is None:
                self.experts.append(self._local_experts(self.w[p + "gate_up_proj"], self.w[p + "down_proj"]))
            else:  # the ranks keep only their own experts: the full stacks are not held here
                self.experts.append(ep.add_layer(self.w.pop(p + "gate_up_proj"), self.w.pop(p + "down_proj"),
                                                 config.num_experts_per_tok, config.swiglu_limit))
        self._views = ViewCache(CacheView, config)

    # ------------------------------------------------------------ the model interface
    @classmethod
    def checkpoint_tensors(cls, config: DeepseekV4Config) -> dict[str, TensorSpec]:
        return checkpoint.checkpoint_tensors(config)

    checkpoint_name = staticmethod(checkpoint.checkpoint_name)
    checkpoint_source = staticmethod(checkpoint.checkpoint_source)

    def cache_spec(self, margin: int) -> CacheSpec:
        return cache_spec(self.config, margin)

    def view(self, cache: DecodeCache) -> CacheView:
        """This model's view of `cache` (built once per cache)."""
        return self._views.get(cache)

    def make_drafter(self, extra: dict[str, torch.Tensor], max_seqs: int, margin: int):
        from deepinfer.models.deepseek_v4.dspark import DSparkConfig, DSparkDrafter

        dcfg = DSparkConfig.from_model(self.config, extra)
        if dcfg is None:
            return None
        return DSparkDrafter(self.config, dcfg, extra, self.w, self.accel, max_seqs=max_seqs, margin=margin)

    @staticmethod
    def _fuse_input_projections(weights: dict[str, Weight], i: int, index_scale: float) -> dict[str, tuple[int, int]]:
        """Every projection of a layer's attention input (q_a, kv, compressor and indexer kv/gate,
        indexer head weights) becomes one GEMM: a decode step is dominated by per-op overhead, so
        one [T, D] x [D, sum N] beats seven small ones. Returns name -> (start, end) columns.
        Keys and compressor inputs are needed for every token of the step, queries only for own
        rows (context parallelism): the former are one contiguous column block, and each
        compressor's kv and gate are adjacent (the window staging stores them side by side).
        The indexer head weights' 1/sqrt(heads) is folded into their rows (a power of two for
        every V4 config, so exact): one multiply less per CSA layer and step.
        Projections are fused where the checkpoint stores them alike (quant.fuse_rows): one GEMM for
        a float32 or bf16 checkpoint; V4-Flash keeps q_a and kv in FP8 and the compressor and indexer
        projections in bf16, two GEMMs (`input_proj.0`, `input_proj.1`) whose outputs are concatenated."""
        p = f"model.layers.{i}.self_attn."
        names = ["q_a_proj", "kv_proj", "compressor.kv_proj", "compressor.gate_proj", "compressor.indexer.kv_proj",
                 "compressor.indexer.gate_proj", "compressor.indexer.scorer.weights_proj"]
        parts, splits, start = [], {}, 0
        for name in names:
            key = p + name + ".weight"
            if key in weights:
                tensor = weights.pop(key)
                parts.append(scale_weight(tensor, index_scale) if name.endswith("weights_proj") else tensor)
                splits[name] = (start, start + tensor.shape[0])
                start += tensor.shape[0]
        segments = fuse_rows(parts)
        if len(segments) == 1:
            weights[p + "input_proj.weight"] = segments[0]
        else:
            weights.update({f"{p}input_proj.{j}.weight": seg for j, seg in enumerate(segments)})
        s = f"model.layers.{i}.mlp.shared_experts."
        shared = fuse_rows([weights.pop(s + "gate_proj.weight"), weights.pop(s + "up_proj.weight")])
        if len(shared) != 1:
            raise ValueError(f"{s}gate_proj and up_proj are stored differently ({shared[0].dtype}, {shared[1].dtype}): "
                             "the shared expert needs them alike")
        weights[s + "gate_up_proj.weight"] = shared[0]
        return splits

    def _gemm_input(self, x: torch.Tensor) -> torch.Tensor:
        """x in the compute dtype (LLM(dtype=...)): what the weight ops multiply; they accumulate in
        float32 and return float32."""
        dtype = self.accel.compute_dtype
        return x if x.dtype == dtype else x.to(dtype)

    def _input_projection(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """[T, sum N] every attention input projection of layer i (see _fuse_input_projections)."""
        p = f"model.layers.{i}.self_attn."
        h = self._gemm_input(h)
        whole = self.w.get(p + "input_proj.weight")
        if whole is not None:
            return self.accel.linear(h, whole)
        return torch.cat([self.accel.linear(h, self.w[f"{p}input_proj.{j}.weight"])
                          for j in range(self._input_segments[i])], dim=-1)

    # ------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, inp: StepInput, cache: DecodeCache, logit_rows: torch.Tensor,
                meta: StepMeta | None = None, features: FeaturesRequest | None = None):
        """Run one step, update `cache`, return logits [len(logit_rows), V] for the given flat
        token indices (e.g. each sequence's last token, or every prompt token for logprobs).
        `meta` (from `self.prepare(inp, cache)`) may be built ahead, on the CPU, while an
        earlier step runs. With `features` (the DSpark drafter's context), returns
        (logits, features [len(features.rows), len(features.layers), D]): the attention input of
        those layers, averaged over the hc streams, at the flat token indices `features.rows`.
        The engine records this graph per shape bucket and replays it (core/graphs.py)."""
        meta = meta if meta is not None else self.prepare(inp, cache)
        return self.forward_graph(meta, logit_rows, features)

    @torch.inference_mode()
    def forward_graph(self, meta: StepMeta, logit_rows: torch.Tensor, request: FeaturesRequest | None = None):
        """`forward` op by op: the definition every replay of a recorded step reproduces. It reads
        the step only through `meta`'s tensors (core/graphs.py replays it with another step's)."""
        cfg, ops, w, cache = self.config, self.accel, self.w, meta.cache
        ids = meta.ids[meta.own]
        x = ops.embedding(ids, w["model.embed_tokens.weight"])
        streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        features = []
        # Blocks alternate attention and MoE. Each block's mHC exit is fused with the next one's
        # entry (hc_post_pre_norm): one op call between blocks instead of three.
        h, post, comb = fused.hc_pre_norm(ops, streams, *self._block_entry(0))
        for b in range(2 * cfg.num_hidden_layers):
            i = b // 2
            if b % 2 == 0 and request is not None and i in request.layers:  # the streams entering layer i
                features.append(streams[request.rows.to(streams.device)].mean(dim=1))
            out = self._attention(i, h, meta, cache) if b % 2 == 0 else self._moe(i, h, ids)
            if b + 1 < 2 * cfg.num_hidden_layers:
                streams, h, post, comb = fused.hc_post_pre_norm(ops, out, streams, post, comb,
                                                                *self._block_entry(b + 1))
            else:
                streams = ops.hc_post(out, streams, post, comb)
        streams = meta.all_tokens(streams).index_select(0, logit_rows.to(streams.device))
        h = ops.hc_head(streams, w["model.hc_head.hc_fn"], w["model.hc_head.hc_base"],
                        w["model.hc_head.hc_scale"], cfg.rms_norm_eps, cfg.hc_eps)
        h = ops.rms_norm(h, w["model.norm.weight"], cfg.rms_norm_eps)
        logits = ops.linear(self._gemm_input(h), w["lm_head.weight"])
        return (logits, torch.stack(features, dim=1)) if request is not None and request.layers else logits

    def prepare(self, inp: StepInput, cache: DecodeCache, steps: int | None = None) -> StepMeta:
        cp = self.parallel.context_parallel
        split = cp.split(inp.lens.tolist(), cache.device) if cp is not None else None
        return StepMeta(inp, self.view(cache), self.config, split=split, steps=steps)

    def _block_entry(self, b: int) -> tuple:
        """hc_pre_norm's arguments after the streams for block b (2i: layer i's attention, 2i+1: its MoE)."""
        cfg, w = self.config, self.w
        p = f"model.layers.{b // 2}."
        hc, norm = (p + "attn_hc.", p + "input_layernorm.weight") if b % 2 == 0 else \
            (p + "ffn_hc.", p + "post_attention_layernorm.weight")
        return (w[hc + "fn"], w[hc + "base"], w[hc + "scale"], cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters,
                w[norm])

    # ------------------------------------------------------------ attention
    def _attention(self, i: int, h: torch.Tensor, meta: StepMeta, cache: CacheView) -> torch.Tensor:
        cfg, ops, w = self.config, self.accel, self.w
        p = f"model.layers.{i}.self_attn."
        layer = cache.layers[i]
        cos, sin = meta.rope.main if layer.kind == SLIDING else meta.rope.compress
        own = meta.own
        num_tokens, heads, head_dim = h.shape[0], cfg.num_attention_heads, cfg.head_dim

        proj = self._input_projection(i, h)
        splits = self.input_proj_splits[i]
        lo, hi = self._key_cols[i]
        all_rows = meta.all_tokens(proj[:, lo:hi])  # kv + compressor inputs of every token

        def cols(first: str, last: str | None = None) -> torch.Tensor:  # columns of projection first..last
            a, b = splits[first][0], splits[last or first][1]
            return proj[:, a:b] if first in ("q_a_proj", "compressor.indexer.scorer.weights_proj") else \
                all_rows[:, a - lo:b - lo]

        q_lora = ops.rms_norm(cols("q_a_proj"), w[p + "q_a_norm.weight"], cfg.rms_norm_eps)
        q_in = self._gemm_input(q_lora)
        q = ops.linear(q_in, w[p + "q_b_proj.weight"]).view(num_tokens, heads, head_dim)
        q = fused.rms_norm_rope(ops, q, None, cfg.rms_norm_eps, cos[own], sin[own])
        kv = fused.rms_norm_rope(ops, cols("kv_proj"), w[p + "kv_norm.weight"], cfg.rms_norm_eps, cos, sin)
        scratch = cache.ring_rows
        layer.kv[scratch:scratch + kv.shape[0]].copy_(kv)

        indices = meta.window_rows[own]
        if layer.rate:
            info = meta.compressed(layer)
            base = cache.entry_base()
            self._compress(layer, cols("compressor.kv_proj", "compressor.gate_proj"), info, p + "compressor.",
                           layer.kv[base:], layer.comp_ring, cache)
            if layer.kind != CSA:  # HCA: window keys + every visible entry, planned with the step
                indices = info.attention_rows[own]
            else:
                ip = p + "compressor.indexer."
                self._compress(layer, cols("compressor.indexer.kv_proj", "compressor.indexer.gate_proj"), info,
                               ip, layer.index_keys, layer.index_ring, cache)
                ccos, csin = meta.rope.compress
                q_idx = ops.linear(q_in, w[ip + "q_b_proj.weight"]).view(num_tokens, cfg.index_n_heads, -1)
                q_idx = ops.rope(q_idx, ccos[own], csin[own])
                weights = cols("compressor.indexer.scorer.weights_proj")  # 1/sqrt(heads) folded in
                picked = ops.indexer_topk(q_idx, weights, layer.index_keys, info.candidates[own], cfg.index_topk,
                                          cfg.index_head_dim ** -0.5)
                picked = torch.where(picked >= 0, picked + base, picked)
                indices = torch.cat([indices, picked], dim=1)

        out = ops.sparse_attention(q, layer.kv, indices, w[p + "sinks"], head_dim ** -0.5)
        out = ops.rope(out, cos[own], sin[own], inverse=True)
        ops.copy_rows(layer.kv, *meta.window_commit)
        out = ops.grouped_linear(self._gemm_input(out.reshape(num_tokens, cfg.o_groups, -1)), w[p + "o_a_proj.weight"])
        return ops.linear(self._gemm_input(out.flatten(1)), w[p + "o_b_proj.weight"])

    def _compress(self, layer: LayerState, kv_gate: torch.Tensor, info: CompressedRows, p: str,
                  entries_out: torch.Tensor, ring: torch.Tensor, cache: CacheView) -> None:
        """Stage this step's [kv | gate] projections, turn every finished window into an entry
        (softmax-gated sum, RMSNorm, RoPE at the window's first position) and write it to its page."""
        cfg, ops, w = self.config, self.accel, self.w
        num_tokens = kv_gate.shape[0]
        scratch = cache.ring_slots * layer.comp_ring_size
        ring[scratch:scratch + num_tokens].copy_(kv_gate)
        rows = info.tok_rows
        if rows.shape[0]:
            entry = fused.compress_entries(ops, ring, rows, w[p + "position_bias"], layer.kind == CSA,
                                           w[p + "kv_norm.weight"], cfg.rms_norm_eps, *info.cos_sin)
            entries_out.index_copy_(0, info.out_rows, entry.to(entries_out.dtype))
        ops.copy_rows(ring, *info.commit)

    # ------------------------------------------------------------ MoE
    def _moe(self, i: int, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        cfg, ops, w = self.config, self.accel, self.w
        p = f"model.layers.{i}.mlp."
        if cfg.mlp_layer_types[i] == "hash_moe":
            expert_ids = w[p + "gate.tid2eid"].index_select(0, ids)
            weights = ops.route_hash(h, w[p + "gate.weight"], expert_ids, cfg.routed_scaling_factor)
        else:
            weights, expert_ids = ops.route_topk(h, w[p + "gate.weight"], w[p + "gate.e_score_correction_bias"],
                                                 cfg.num_experts_per_tok, cfg.routed_scaling_factor)
        x = self._gemm_input(h)
        routed = self.experts[i](x, weights, expert_ids)
        s = p + "shared_experts."
        return routed + ops.swiglu_mlp(x, w[s + "gate_up_proj.weight"], w[s + "down_proj.weight"], cfg.swiglu_limit)

    def _local_experts(self, gate_up: torch.Tensor, down: torch.Tensor):
        """A layer's routed experts on this process."""
        ops, limit = self.accel, self.config.swiglu_limit

        def experts(h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            if not h.shape[0]:  # a context-parallel rank with no tokens this step
                return torch.zeros_like(h)
            return ops.moe_experts(h, weights, ids, gate_up, down, limit)

        return experts
