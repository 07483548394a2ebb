"""DeepSeek-V4, written only against Accelerator ops.

One forward runs a step: many sequences at once, each contributing a chunk of new
tokens (a whole prompt, a prefill chunk, or decode tokens) at its own positions,
reading and updating its decode state in a `StateCache`. Tokens of all sequences are
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

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.backends.base import Accelerator, WeightRole
from deepinfer.core.cache import LayerState, StateCache
from deepinfer.core.config import CSA, SLIDING, ModelConfig


@dataclass(slots=True)
class StepInput:
    """What the scheduler hands the model for one step."""

    ids: torch.Tensor  # [T] token ids, sequences back to back
    slots: torch.Tensor  # [B] cache slot of each sequence
    starts: torch.Tensor  # [B] position of each sequence's first new token
    lens: torch.Tensor  # [B] new tokens per sequence (>= 1)
    # after a prefix-cache hit (core/replay.py); None = zeros
    window_floor: torch.Tensor | None = None  # [B] tokens from here on read no window key below it
    num_restored: torch.Tensor | None = None  # [B] compressed entries of positions below it are cached: not rewritten


def _arange_within(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For groups of sizes `counts`: (group index of each element, index within its group)."""
    group = np.repeat(np.arange(len(counts)), counts)
    first = np.cumsum(counts) - counts
    return group, np.arange(len(group)) - first[group]


class StepMeta:
    """Index tensors of one step, shared by every layer of the same kind.

    Built on the host from host tensors (StepInput and the cache's block table live on the CPU:
    no device sync while planning), then moved to the cache's device in one go; `ids` is the
    device copy of the step's token ids, which the engine may patch with the previous step's
    samples before the forward. The index arithmetic runs in numpy: it is ~60 operations on
    arrays of a few hundred elements, where a torch op's fixed cost (~5 us) was most of a
    decode step's planning time."""

    def __init__(self, inp: StepInput, cache: StateCache, config: ModelConfig, planner=None):
        self.inp, self.cache, self.config = inp, cache, config
        self.starts, self.slots = inp.starts.numpy(), inp.slots.numpy()
        lens = inp.lens.numpy()
        self.first = np.cumsum(lens) - lens  # flat index of each sequence's first token
        self.ends = self.starts + lens
        self.num_tokens = int(lens.sum())
        if self.num_tokens > cache.max_step_tokens:
            raise ValueError(f"step has {self.num_tokens} tokens, cache scratch holds {cache.max_step_tokens}")
        self._by_rate: dict[tuple[str, int], dict] = {}
        # Rows this process computes the token-wise work for (queries, MoE, residual streams):
        # all of them, unless context parallelism (deepinfer/parallel) split the step over ranks;
        # keys and compressed inputs are then completed from the other ranks by all_tokens.
        self.own: slice | torch.Tensor = slice(None)
        # An accelerator's planner (its step program's) may compute the same arrays faster; it
        # declines what it does not cover (it returns False), and the numpy below is the definition.
        replay = inp.window_floor is not None or inp.num_restored is not None
        if planner is None or replay or not planner(self):
            self._plan()
        self._to_device(cache.device)

    def _plan(self) -> None:
        """Every index array of the step, in numpy."""
        inp, cache, config = self.inp, self.cache, self.config
        self.seq, within = _arange_within(inp.lens.numpy())
        self.positions = self.starts[self.seq] + within
        self.rope = {"main": config.rope_main.cos_sin(self.positions),
                     "compress": config.rope_compress.cos_sin(self.positions)}
        window = config.sliding_window
        key_pos = self.positions[:, None] + np.arange(-(window - 1), 1)
        if inp.window_floor is not None:  # keys never computed after a prefix-cache hit read as absent
            floor = inp.window_floor.numpy()[self.seq]
            floor = np.where(self.positions >= floor, floor, 0)
            key_pos = np.where(key_pos >= floor[:, None], key_pos, -1)
        self.window_rows = self.rows(key_pos, self.seq[:, None], cache.ring, 0)
        self.window_commit = self._commit(cache.ring, 0)
        # Read the block table now: with overlapped scheduling the CPU may hand a freed slot or
        # page to another request while this step is still queued on the device.
        for layer in cache.layers:
            if layer.rate:
                self.compressed(layer)

    def _to_device(self, device: torch.device) -> None:
        on_host = device.type == "cpu"

        def move(t):
            t = torch.from_numpy(t) if isinstance(t, np.ndarray) else t
            return t if on_host else t.to(device, non_blocking=True)

        self.ids = move(self.inp.ids)
        self.window_rows = move(self.window_rows)
        self.window_commit = tuple(map(move, self.window_commit))
        self.rope = {k: tuple(map(move, v)) for k, v in self.rope.items()}
        for info in self._by_rate.values():
            for k in ("tok_rows", "out_rows", "candidates", "attention_rows"):
                if k in info:
                    info[k] = move(info[k])
            info["cos_sin"] = tuple(map(move, info["cos_sin"]))
            info["commit"] = tuple(map(move, info["commit"]))

    def all_tokens(self, own_rows: torch.Tensor) -> torch.Tensor:
        """Rows of every token of the step, from the rows of the tokens this process owns."""
        return own_rows

    def rows(self, pos: np.ndarray, seq: np.ndarray, ring: int, ring_base: int) -> np.ndarray:
        """Row of token `pos` of batch sequence `seq` (broadcast against pos) in a [ring rows |
        scratch] tensor whose scratch starts at slots*ring: the step's own tokens are read from
        the scratch, older ones from the ring; negative positions give -1."""
        start = self.starts[seq]
        scratch = self.cache.max_seqs * ring + self.first[seq] + (pos - start)
        ringed = ring_base + self.slots[seq] * ring + pos % ring  # numpy's % is floor-mod, as torch.remainder
        rows = np.where(pos >= start, scratch, ringed)
        return np.where(pos >= 0, rows, -1)

    def _commit(self, ring: int, ring_base: int) -> tuple[np.ndarray, np.ndarray]:
        """(scratch rows, ring rows) of the tokens a ring of `ring` rows keeps after the step."""
        tokens = np.flatnonzero(self.positions >= (self.ends[self.seq] - ring))
        pos, seq = self.positions[tokens], self.seq[tokens]
        src = self.cache.max_seqs * ring + tokens
        dst = ring_base + self.slots[seq] * ring + pos % ring
        return src, dst

    def compressed(self, layer: LayerState) -> dict:
        """Windows finished in this step and the entries each token may see, for a layer kind."""
        key = (layer.kind, layer.rate)
        if key in self._by_rate:
            return self._by_rate[key]
        rate, ring, cache, inp = layer.rate, layer.comp_ring_size, self.cache, self.inp
        # windows w whose last token arrives in this step: starts//rate <= w < ends//rate,
        # except the restored ones of a prefix-cache hit (shared pages: read-only)
        first = self.starts if inp.num_restored is None else np.maximum(self.starts, inp.num_restored.numpy())
        w_lo = first // rate
        counts = np.maximum(self.ends // rate - w_lo, 0)
        win_seq, within = _arange_within(counts)
        win = w_lo[win_seq] + within
        # CSA entries mix the previous window (first half) with their own (second half)
        span = 2 * rate if layer.kind == CSA else rate
        tok_pos = (win[:, None] + 1) * rate - span + np.arange(span)
        tok_rows = self.rows(tok_pos, win_seq[:, None], ring, 0)
        out_rows = cache.entry_rows(layer, self.slots[win_seq], win)
        entry_cos_sin = self.config.rope_compress.cos_sin(win * rate)
        # entries visible to token at p: w < (p + 1) // rate
        visible = (self.positions + 1) // rate
        width = int(visible.max()) if self.num_tokens else 0
        entries = np.arange(width)[None, :]
        cand = cache.entry_rows(layer, self.slots[self.seq][:, None], entries)
        cand = np.where(entries < visible[:, None], cand, -1)
        info = dict(tok_rows=tok_rows, out_rows=out_rows, cos_sin=entry_cos_sin, candidates=cand,
                    commit=self._commit(ring, 0))
        if layer.kind != CSA:  # every visible entry is attended: the whole index list is known now
            base = cache.entry_base()
            info["attention_rows"] = np.concatenate([self.window_rows, np.where(cand >= 0, cand + base, -1)], axis=1)
        self._by_rate[key] = info
        return info


class DeepseekV4Model:
    """The model: weights (prepared by the accelerator) + the forward of one step."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], accel: Accelerator):
        self.config, self.accel = config, accel
        weights = dict(weights)
        index_scale = config.index_n_heads ** -0.5
        self.input_proj_splits = [self._fuse_input_projections(weights, i, index_scale)
                                  for i in range(config.num_hidden_layers)]
        # columns needed for every token of the step (kv and compressor inputs): q_a comes before
        # them and the indexer head weights after, both only for own rows
        self._key_cols = [(splits["kv_proj"][0], max(b for name, (_, b) in splits.items()
                                                     if not name.endswith("weights_proj")))
                          for splits in self.input_proj_splits]
        experts = {f"model.layers.{i}.mlp.experts.{n}" for i in range(config.num_hidden_layers)
                   for n in ("gate_up_proj", "down_proj")}  # read by moe_experts
        self.w = {name: accel.prepare_weight(t, WeightRole.EXPERTS if name in experts else WeightRole.PLAIN)
                  for name, t in weights.items()}
        if config.tie_word_embeddings and "lm_head.weight" not in self.w:
            self.w["lm_head.weight"] = self.w["model.embed_tokens.weight"]
        self._program, self._program_cache = None, None  # see step_program

    @staticmethod
    def _fuse_input_projections(weights: dict[str, torch.Tensor], i: int, index_scale: float) -> dict[str, tuple[int, int]]:
        """Every projection of a layer's attention input (q_a, kv, compressor and indexer kv/gate,
        indexer head weights) becomes one GEMM: a decode step is dominated by per-op overhead, so
        one [T, D] x [D, sum N] beats seven small ones. Returns name -> (start, end) columns.
        Keys and compressor inputs are needed for every token of the step, queries only for own
        rows (context parallelism): the former are one contiguous column block, and each
        compressor's kv and gate are adjacent (the window staging stores them side by side).
        The indexer head weights' 1/sqrt(heads) is folded into their rows (a power of two for
        every V4 config, so exact): one multiply less per CSA layer and step."""
        p = f"model.layers.{i}.self_attn."
        names = ["q_a_proj", "kv_proj", "compressor.kv_proj", "compressor.gate_proj", "compressor.indexer.kv_proj",
                 "compressor.indexer.gate_proj", "compressor.indexer.scorer.weights_proj"]
        parts, splits, start = [], {}, 0
        for name in names:
            key = p + name + ".weight"
            if key in weights:
                tensor = weights.pop(key).float()
                parts.append(tensor * index_scale if name.endswith("weights_proj") else tensor)
                splits[name] = (start, start + tensor.shape[0])
                start += tensor.shape[0]
        weights[p + "input_proj.weight"] = torch.cat(parts)
        s = f"model.layers.{i}.mlp.shared_experts."
        weights[s + "gate_up_proj.weight"] = torch.cat([weights.pop(s + "gate_proj.weight").float(),
                                                         weights.pop(s + "up_proj.weight").float()])
        return splits

    # ------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, inp: StepInput, cache: StateCache, logit_rows: torch.Tensor,
                meta: StepMeta | None = None, feature_layers: tuple[int, ...] = (),
                feature_rows: torch.Tensor | None = None):
        """Run one step, update `cache`, return logits [len(logit_rows), V] for the given flat
        token indices (e.g. each sequence's last token, or every prompt token for logprobs).
        `meta` (from `self.prepare(inp, cache)`) may be built ahead, on the CPU, while an
        earlier step runs. With `feature_layers` (the DSpark drafter's context), returns
        (logits, features [len(feature_rows), len(feature_layers), D]): the attention input of
        those layers, averaged over the hc streams, at the flat token indices `feature_rows`.
        The accelerator's step program (Accelerator.step_program) runs the steps it takes; the
        others run `forward_graph`."""
        meta = meta if meta is not None else self.prepare(inp, cache)
        program = self.step_program(cache)
        if program is not None and not feature_layers and program.runs(meta):
            return program(meta, logit_rows.to(cache.device))
        return self.forward_graph(meta, cache, logit_rows, feature_layers, feature_rows)

    @torch.inference_mode()
    def forward_graph(self, meta: StepMeta, cache: StateCache, logit_rows: torch.Tensor,
                      feature_layers: tuple[int, ...] = (), feature_rows: torch.Tensor | None = None):
        """`forward` op by op: the definition every step program must reproduce."""
        cfg, ops, w = self.config, self.accel, self.w
        ids = meta.ids[meta.own]
        x = ops.embedding(ids, w["model.embed_tokens.weight"])
        streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        features = []
        # Blocks alternate attention and MoE. Each block's mHC exit is fused with the next one's
        # entry (hc_post_pre_norm): one op call between blocks instead of three.
        h, post, comb = ops.hc_pre_norm(streams, *self._block_entry(0))
        for b in range(2 * cfg.num_hidden_layers):
            i = b // 2
            if b % 2 == 0 and i in feature_layers:  # the streams entering layer i
                features.append(streams[feature_rows.to(streams.device)].mean(dim=1))
            out = self._attention(i, h, meta, cache) if b % 2 == 0 else self._moe(i, h, ids)
            if b + 1 < 2 * cfg.num_hidden_layers:
                streams, h, post, comb = ops.hc_post_pre_norm(out, streams, post, comb, *self._block_entry(b + 1))
            else:
                streams = ops.hc_post(out, streams, post, comb)
        streams = meta.all_tokens(streams)[logit_rows.to(streams.device)]
        h = ops.hc_head(streams, w["model.hc_head.hc_fn"], w["model.hc_head.hc_base"],
                        w["model.hc_head.hc_scale"], cfg.rms_norm_eps, cfg.hc_eps)
        h = ops.rms_norm(h, w["model.norm.weight"], cfg.rms_norm_eps)
        logits = ops.linear(h, w["lm_head.weight"])
        return (logits, torch.stack(features, dim=1)) if feature_layers else logits

    def step_program(self, cache: StateCache):
        """The accelerator's step program for `cache` (built on first use), or None. Not with
        expert parallelism: its `routed_experts` hook dispatches to other ranks from Python."""
        if "routed_experts" in vars(self):
            return None
        if self._program_cache is not cache:
            self._program, self._program_cache = self.accel.step_program(self, cache), cache
        return self._program

    def decode_steps(self, ids: list[int], slots: list[int], starts: list[int], steps: int,
                     cache: StateCache) -> torch.Tensor | None:
        """`steps` greedy decode steps of a batch in one call of the accelerator's step program
        (multi-step scheduling): sequence b feeds ids[b] at position starts[b], then its own argmax
        each step. Returns the tokens [steps, B], or None where the program cannot (no program, or
        not for this batch): the engine then runs the steps one by one, with the same results."""
        program = self.step_program(cache)
        decode = getattr(program, "decode", None)
        return decode(ids, slots, starts, steps) if decode is not None else None

    def prepare(self, inp: StepInput, cache: StateCache) -> StepMeta:
        return StepMeta(inp, cache, self.config, planner=getattr(self.step_program(cache), "plan", None))

    def _block_entry(self, b: int) -> tuple:
        """hc_pre_norm's arguments after the streams for block b (2i: layer i's attention, 2i+1: its MoE)."""
        cfg, w = self.config, self.w
        p = f"model.layers.{b // 2}."
        hc, norm = (p + "attn_hc.", p + "input_layernorm.weight") if b % 2 == 0 else \
            (p + "ffn_hc.", p + "post_attention_layernorm.weight")
        return (w[hc + "fn"], w[hc + "base"], w[hc + "scale"], cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters,
                w[norm])

    # ------------------------------------------------------------ attention
    def _attention(self, i: int, h: torch.Tensor, meta: StepMeta, cache: StateCache) -> torch.Tensor:
        cfg, ops, w = self.config, self.accel, self.w
        p = f"model.layers.{i}.self_attn."
        layer = cache.layers[i]
        cos, sin = meta.rope["main" if layer.kind == SLIDING else "compress"]
        own = meta.own
        num_tokens, heads, head_dim = h.shape[0], cfg.num_attention_heads, cfg.head_dim

        fused = ops.linear(h, w[p + "input_proj.weight"])
        splits = self.input_proj_splits[i]
        lo, hi = self._key_cols[i]
        all_rows = meta.all_tokens(fused[:, lo:hi])  # kv + compressor inputs of every token

        def cols(first: str, last: str | None = None) -> torch.Tensor:  # columns of projection first..last
            a, b = splits[first][0], splits[last or first][1]
            return fused[:, a:b] if first in ("q_a_proj", "compressor.indexer.scorer.weights_proj") else \
                all_rows[:, a - lo:b - lo]

        q_lora = ops.rms_norm(cols("q_a_proj"), w[p + "q_a_norm.weight"], cfg.rms_norm_eps)
        q = ops.linear(q_lora, w[p + "q_b_proj.weight"]).view(num_tokens, heads, head_dim)
        q = ops.rms_norm_rope(q, None, cfg.rms_norm_eps, cos[own], sin[own])
        kv = ops.rms_norm_rope(cols("kv_proj"), w[p + "kv_norm.weight"], cfg.rms_norm_eps, cos, sin)
        scratch = cache.ring_rows
        layer.kv[scratch:scratch + kv.shape[0]].copy_(kv)

        indices = meta.window_rows[own]
        if layer.rate:
            info = meta.compressed(layer)
            base = cache.entry_base()
            self._compress(layer, cols("compressor.kv_proj", "compressor.gate_proj"), info, p + "compressor.",
                           layer.kv[base:], layer.comp_ring, cache)
            if layer.kind != CSA:  # HCA: window keys + every visible entry, planned with the step
                indices = info["attention_rows"][own]
            else:
                ip = p + "compressor.indexer."
                self._compress(layer, cols("compressor.indexer.kv_proj", "compressor.indexer.gate_proj"), info,
                               ip, layer.index_keys, layer.index_ring, cache)
                ccos, csin = meta.rope["compress"]
                q_idx = ops.linear(q_lora, w[ip + "q_b_proj.weight"]).view(num_tokens, cfg.index_n_heads, -1)
                q_idx = ops.rope(q_idx, ccos[own], csin[own])
                weights = cols("compressor.indexer.scorer.weights_proj")  # 1/sqrt(heads) folded in
                picked = ops.indexer_topk(q_idx, weights, layer.index_keys, info["candidates"][own], cfg.index_topk,
                                          cfg.index_head_dim ** -0.5)
                picked = torch.where(picked >= 0, picked + base, picked)
                indices = torch.cat([indices, picked], dim=1)

        out = ops.sparse_attention(q, layer.kv, indices, w[p + "sinks"], head_dim ** -0.5)
        out = ops.rope(out, cos[own], sin[own], inverse=True)
        src, dst = meta.window_commit
        layer.kv.index_copy_(0, dst, layer.kv.index_select(0, src))
        out = ops.grouped_linear(out.reshape(num_tokens, cfg.o_groups, -1), w[p + "o_a_proj.weight"])
        return ops.linear(out.flatten(1), w[p + "o_b_proj.weight"])

    def _compress(self, layer: LayerState, kv_gate: torch.Tensor, info: dict, p: str,
                  entries_out: torch.Tensor, ring: torch.Tensor, cache: StateCache) -> None:
        """Stage this step's [kv | gate] projections, turn every finished window into an entry
        (softmax-gated sum, RMSNorm, RoPE at the window's first position) and write it to its page."""
        cfg, ops, w = self.config, self.accel, self.w
        num_tokens = kv_gate.shape[0]
        scratch = cache.max_seqs * layer.comp_ring_size
        ring[scratch:scratch + num_tokens].copy_(kv_gate)
        rows = info["tok_rows"]
        if rows.shape[0]:
            entry = ops.compress_entries(ring, rows, w[p + "position_bias"], layer.kind == CSA, w[p + "kv_norm.weight"],
                                         cfg.rms_norm_eps, *info["cos_sin"])
            entries_out.index_copy_(0, info["out_rows"], entry.to(entries_out.dtype))
        src, dst = info["commit"]
        ring.index_copy_(0, dst, ring.index_select(0, src))

    # ------------------------------------------------------------ MoE
    def _moe(self, i: int, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        cfg, ops, w = self.config, self.accel, self.w
        p = f"model.layers.{i}.mlp."
        if cfg.mlp_layer_types[i] == "hash_moe":
            expert_ids = w[p + "gate.tid2eid"][ids]
            weights = ops.route_hash(h, w[p + "gate.weight"], expert_ids, cfg.routed_scaling_factor)
        else:
            weights, expert_ids = ops.route_topk(h, w[p + "gate.weight"], w[p + "gate.e_score_correction_bias"],
                                                 cfg.num_experts_per_tok, cfg.routed_scaling_factor)
        routed = self.routed_experts(i, h, weights, expert_ids)
        s = p + "shared_experts."
        return routed + ops.swiglu_mlp(h, w[s + "gate_up_proj.weight"], w[s + "down_proj.weight"], cfg.swiglu_limit)


    def routed_experts(self, i: int, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Layer i's routed experts on this process. Expert parallelism (deepinfer/parallel)
        replaces this per instance with a dispatch to the ranks that hold the experts."""
        if not h.shape[0]:  # a context-parallel rank with no tokens this step
            return torch.zeros_like(h)
        p = f"model.layers.{i}.mlp.experts."
        return self.accel.moe_experts(h, weights, ids, self.w[p + "gate_up_proj"], self.w[p + "down_proj"],
                                      self.config.swiglu_limit)


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every checkpoint tensor the model reads (HF names), with shape and dtype."""
    f32, i64 = torch.float32, torch.int64
    d, hd, n, e = cfg.hidden_size, cfg.head_dim, cfg.hc_mult, cfg.n_routed_experts
    inter, di = cfg.moe_intermediate_size, cfg.index_head_dim
    out = {
        "model.embed_tokens.weight": ((cfg.vocab_size, d), f32),
        "model.norm.weight": ((d,), f32),
        "model.hc_head.hc_fn": ((n, n * d), f32),
        "model.hc_head.hc_base": ((n,), f32),
        "model.hc_head.hc_scale": ((1,), f32),
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = ((cfg.vocab_size, d), f32)
    mix = (2 + n) * n
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out.update({
            p + "input_layernorm.weight": ((d,), f32),
            p + "post_attention_layernorm.weight": ((d,), f32),
            a + "sinks": ((cfg.num_attention_heads,), f32),
            a + "q_a_proj.weight": ((cfg.q_lora_rank, d), f32),
            a + "q_a_norm.weight": ((cfg.q_lora_rank,), f32),
            a + "q_b_proj.weight": ((cfg.num_attention_heads * hd, cfg.q_lora_rank), f32),
            a + "kv_proj.weight": ((hd, d), f32),
            a + "kv_norm.weight": ((hd,), f32),
            a + "o_a_proj.weight": ((cfg.o_groups * cfg.o_lora_rank, cfg.num_attention_heads * hd // cfg.o_groups), f32),
            a + "o_b_proj.weight": ((d, cfg.o_groups * cfg.o_lora_rank), f32),
        })
        for hc in ("attn_hc.", "ffn_hc."):
            out.update({p + hc + "fn": ((mix, n * d), f32), p + hc + "base": ((mix,), f32), p + hc + "scale": ((3,), f32)})
        if kind != SLIDING:
            c = a + "compressor."
            width = 2 * hd if kind == CSA else hd
            rate = cfg.compress_rate(i)
            out.update({
                c + "position_bias": ((rate, width), f32),
                c + "kv_proj.weight": ((width, d), f32),
                c + "gate_proj.weight": ((width, d), f32),
                c + "kv_norm.weight": ((hd,), f32),
            })
            if kind == CSA:
                x = c + "indexer."
                out.update({
                    x + "position_bias": ((rate, 2 * di), f32),
                    x + "kv_proj.weight": ((2 * di, d), f32),
                    x + "gate_proj.weight": ((2 * di, d), f32),
                    x + "kv_norm.weight": ((di,), f32),
                    x + "q_b_proj.weight": ((cfg.index_n_heads * di, cfg.q_lora_rank), f32),
                    x + "scorer.weights_proj.weight": ((cfg.index_n_heads, d), f32),
                })
        m = p + "mlp."
        out[m + "gate.weight"] = ((e, d), f32)
        if cfg.mlp_layer_types[i] == "hash_moe":
            out[m + "gate.tid2eid"] = ((cfg.vocab_size, cfg.num_experts_per_tok), i64)
        else:
            out[m + "gate.e_score_correction_bias"] = ((e,), f32)
        out.update({
            m + "experts.gate_up_proj": ((e, 2 * inter, d), f32),
            m + "experts.down_proj": ((e, d, inter), f32),
            m + "shared_experts.gate_proj.weight": ((inter, d), f32),
            m + "shared_experts.up_proj.weight": ((inter, d), f32),
            m + "shared_experts.down_proj.weight": ((d, inter), f32),
        })
    return out
