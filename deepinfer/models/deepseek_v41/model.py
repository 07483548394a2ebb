"""DeepSeek-V4.1, written against Accelerator ops (tests/goldens/v41/IMPLEMENTING.md is the spec).

One forward runs a step: many sequences at once, each contributing a chunk of new tokens at its own
positions, flattened into one [T, ...] batch; per-sequence structure lives in index tensors
(step.py). Per layer (hidden D, N = hc_mult residual copies):

  [Engram: copies += gate * value of the n-gram rows]
  mixes_a = hc_mixes(copies)                       # pre / post / comb of the attention sub-layer
  copies = hc_post(attn(norm(collapse(copies, pre_in))), copies, post_a, comb_a)
  mixes_f = hc_mixes(copies)
  copies = hc_post(moe(norm(collapse(copies, pre_a))), copies, post_f, comb_f)
  pre_in = pre_f                                   # the collapse lags one sub-layer

Attention: one K = V head over the layer's window ring plus, on compressed layers, the indexer's
top-k of the KV source's compressed entries (CSA2: Full / Reuse / Reindex, config.py). Numerics as
trained: FP8 GEMM inputs quantized per 32 (by the weight op: the FP8 weights stay packed and carry
that quantization, numerics.py), window KV FP8-QDQ'd after RoPE, index queries and keys FP4 (E8M0
per 32), compressed entries FP4 (E4M3 per 16). Activations are rounded to bfloat16 wherever the reference (which runs in bf16)
holds them (`bf16`: op outputs, the residual copies), while every op computes in float32 inside: the
trained numerics, and within a few bf16 ulps of DeepSeek's code block by block (tests/oracle).

CED split: layers from `config.first_decoder_layer` on own only their window ring, so a long prefill
chunk runs them on each sequence's last DEEPINFER_YOCO_PREFILL_KEEP_TOKENS tokens only (compact),
reading no window key before that tail; `mask` computes every row with the same masking (a check),
`off` is exact. Sequences that need logits of earlier rows (prompt logprobs) run in full.
"""

from __future__ import annotations

import functools

import torch

from deepinfer import envs
from deepinfer.backends.base import Accelerator, WeightRole
from deepinfer.backends.quant import ActQuant, cat_rows, with_act
from deepinfer.models.base import (CacheSpec, CausalLM, DecodeCache, FeaturesRequest, MultimodalItem,
                                   MultimodalPrompt, ParallelContext, StepInput, TensorSpec, ViewCache)
from deepinfer.models.deepseek_v41 import moe, weights as checkpoint
from deepinfer.models.deepseek_v41.config import ACT_BLOCK, DeepseekV41Config
from deepinfer.models.deepseek_v41.engram import EngramHash, checkpoint_token_map, engram_update, lookup_rows
from deepinfer.models.deepseek_v41.indexer import select_candidate_blocks, topk_picks
from deepinfer.models.deepseek_v41.multimodal import ImageEncoder, encode_items, expand_prompt, pack_image
from deepinfer.models.deepseek_v41.numerics import bf16, gemm_input
from deepinfer.models.deepseek_v41.vision import VisionEncoder, checkpoint_tensors as vision_tensors
from deepinfer.models.deepseek_v41.vision_config import IMAGE_PLACEHOLDER
from deepinfer.models.deepseek_v41.step import CacheView, Rows, StepMeta, cache_spec


DEAD = -1  # Engram's class of an image-span position: no n-gram includes it


class StepState:
    """What a step's layers hand down the stack: each index source's picks and the candidate source's
    mask, for the rows they were computed on (IMPLEMENTING.md: shared_attn)."""

    def __init__(self):
        self.picks: dict[int, tuple[Rows, torch.Tensor]] = {}
        self.candidates: tuple[Rows, torch.Tensor] | None = None

    @staticmethod
    def gather(entry: tuple[Rows, torch.Tensor], rows: Rows) -> torch.Tensor:
        """The tensor's rows for the tokens of `rows` (a subset of the rows it was computed on)."""
        source, t = entry
        if source is rows or rows.tokens is None:
            return t
        if source.tokens is None:
            return t[rows.dev.tokens]
        index = torch.searchsorted(source.dev.flat, rows.dev.flat)
        return t[index]


# The FP8 weights whose GEMM input DeepSeek quantizes to FP8 per 32 (its linear()). Not wo_a (held in
# bf16, weights.py), nor the bf16 compressor, indexer-key, router and head weights.
_QUANTIZED_INPUT = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_b.weight",
                    "indexer.wq_b.weight", "engram.wkv.weight", "shared_experts.gate_up", "shared_experts.down",
                    "main_proj.weight")


def quantize_inputs(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights with V4.1's activation quantization (FP8 per 32, power-of-two scales) attached to
    the FP8 ones of _QUANTIZED_INPUT: the weight op applies it on every backend (numerics.py)."""
    act = ActQuant(ACT_BLOCK)
    return {n: with_act(t, act) if n.endswith(_QUANTIZED_INPUT) else t for n, t in weights.items()}


def fuse_shared_experts(weights: dict[str, torch.Tensor], prefixes: list[str]) -> None:
    """Each FFN's shared expert w1 / w3 as one gate_up GEMM and w2 as down, in their storage
    (QuantizedWeight.cat fuses FP8 exactly)."""
    for p in prefixes:
        p += "shared_experts."
        weights[p + "gate_up"] = cat_rows([weights.pop(p + "w1.weight"), weights.pop(p + "w3.weight")], p + "w1 / w3")
        weights[p + "down"] = weights.pop(p + "w2.weight")


class DeepseekV41Model(CausalLM):
    extra_prefixes = ("mtp.",)  # the DSpark stages (dspark.py)

    def __init__(self, config: DeepseekV41Config, weights: dict[str, torch.Tensor], accel: Accelerator,
                 parallel: ParallelContext | None = None):
        self.config, self.accel = config, accel
        self.parallel = parallel or ParallelContext()
        self.replay_window = config.sliding_window  # the window rings are not in the prefix cache
        self.quantized = config.quantized
        self.experts_quantized = config.expert_dtype != "bf16"
        self.limit = moe.swiglu_limit(config.swiglu_limit)
        specs = checkpoint.checkpoint_tensors(config)
        weights = dict(weights)
        self.tables = {n: weights.pop(n) for n, s in specs.items() if s.mapped}  # stay memory-mapped
        self.vision = VisionEncoder(config.vision, weights, accel) if config.vision is not None else None
        fuse_shared_experts(weights, [f"layers.{i}.ffn." for i in range(config.num_hidden_layers)])
        if self.quantized:
            weights = quantize_inputs(weights)
        self.w = {n: accel.prepare_weight(t, WeightRole.EXPERTS if specs.get(n, TensorSpec(())).experts
                                          else WeightRole.PLAIN) for n, t in weights.items()}
        ep = self.parallel.expert_parallel
        self.experts = []
        for i in range(config.num_hidden_layers):
            p = f"layers.{i}.ffn.experts."
            if ep is None:
                self.experts.append(self._local_experts(self.w[p + "gate_up"], self.w[p + "down"]))
            else:  # the ranks keep only their own experts; rows travel with their routing weights
                self.experts.append(ep.add_layer(self.w.pop(p + "gate_up"), self.w.pop(p + "down"),
                                                 config.num_experts_per_tok, self.limit, experts=self._expert_rows))
        self.engram = None
        if config.engram_layer_ids:
            self.engram = EngramHash(config, checkpoint_token_map(config), accel.device)
        self._views = ViewCache(CacheView, config)

    def _expert_rows(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                     down: torch.Tensor) -> torch.Tensor:
        return moe.routed_experts(self.accel, h, weights, ids, gate_up, down, self.limit, self.experts_quantized)

    def _local_experts(self, gate_up: torch.Tensor, down: torch.Tensor):
        """A layer's (or a DSpark stage's: dspark.py) routed experts, (h, weights, ids) -> [T, D]: one
        fixed-shape op (moe.routed_experts, as _expert_rows calls it)."""
        return functools.partial(self._expert_rows, gate_up=gate_up, down=down)

    # ------------------------------------------------------------ the model interface
    @classmethod
    def checkpoint_tensors(cls, config: DeepseekV41Config) -> dict[str, TensorSpec]:
        return checkpoint.checkpoint_tensors(config)

    checkpoint_name = staticmethod(checkpoint.checkpoint_name)
    checkpoint_source = staticmethod(checkpoint.checkpoint_source)

    def cache_spec(self, margin: int) -> CacheSpec:
        return cache_spec(self.config, margin)

    def view(self, cache: DecodeCache) -> CacheView:
        return self._views.get(cache)

    def prepare(self, inp: StepInput, cache: DecodeCache, steps: int | None = None) -> StepMeta:
        cp = self.parallel.context_parallel
        split = cp.split(inp.lens.tolist(), cache.device) if cp is not None else None
        if steps is not None:
            return StepMeta.ahead(inp, self.view(cache), self.config, steps, split)
        return StepMeta(inp, self.view(cache), self.config, split=split)

    def make_drafter(self, extra: dict[str, torch.Tensor], max_seqs: int, margin: int):
        from deepinfer.models.deepseek_v41.dspark import DSparkDrafter

        return DSparkDrafter.create(self, extra, max_seqs, margin)

    # ------------------------------------------------------------ image input (multimodal.py, vision.py)
    @property
    def multimodal_placeholders(self) -> dict[str, int]:
        v = self.config.vision
        return {} if v is None else {IMAGE_PLACEHOLDER: v.image_token_id, "<image>": v.image_token_id}

    def process_multimodal(self, prompt_token_ids: list[int], data: dict) -> MultimodalPrompt:
        return expand_prompt(prompt_token_ids, data, self.config.vision)

    def encode_multimodal(self, items: list[MultimodalItem]) -> list[torch.Tensor]:
        return encode_items(self.vision, items)

    @classmethod
    def encoder_tensors(cls, config: DeepseekV41Config) -> dict[str, TensorSpec]:
        if config.vision is None:
            raise ValueError("this DeepSeek-V4.1 checkpoint has no vision tower (its config.json has no "
                             "vision_config): there is no encoder to serve")
        return vision_tensors(config.vision)

    @classmethod
    def make_encoder(cls, config: DeepseekV41Config, weights: dict[str, torch.Tensor], accel: Accelerator):
        return ImageEncoder(config.vision, dict(weights), accel)

    def pack_multimodal(self, item: MultimodalItem) -> tuple[dict, bytes]:
        return pack_image(item.data)

    @staticmethod
    def _image_rows(inp: StepInput, n: int, device) -> torch.Tensor | None:
        """bool [T]: the step's rows inside an image span (those StepInput.embeds fills), or None."""
        if not inp.embeds:
            return None
        mask = torch.zeros(n, dtype=torch.bool)
        for row, rows in inp.embeds:
            mask[row:row + rows.shape[0]] = True
        return mask.to(device)

    # ------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, inp: StepInput, cache: DecodeCache, logit_rows: torch.Tensor, meta: StepMeta | None = None,
                request: FeaturesRequest | None = None):
        """Run one step, update `cache`, return logits [len(logit_rows), V] of the given flat token rows;
        with `request` (the DSpark drafter's context) also the input of its layers (after Engram),
        averaged over the hc copies, at its flat rows: [R, len(layers), D]."""
        cfg, ops, w = self.config, self.accel, self.w
        meta = meta if meta is not None else self.prepare(inp, cache)
        if meta.decoder is meta.encoder and cfg.first_decoder_layer < cfg.num_hidden_layers:
            meta.split_decoder(logit_rows, envs.ced_prefill_mode(),
                               envs.get("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS"))
        (rows, decoder), state = meta.bind(), StepState()  # the tensors of this meta (a replay swaps them)
        x = bf16(ops.embedding(meta.ids, w["embed.weight"]))
        image = self._image_rows(inp, x.shape[0], x.device)
        for row, embeds in inp.embeds or ():  # image spans: the learned markers and the aligner's rows
            x[row:row + embeds.shape[0]] = bf16(embeds)
        # Engram's n-grams reach back over every token of the step: hashed for all of them on every rank
        hashes = self._engram_hashes(meta, image) if self.engram is not None else None
        x = self._of_rows(x, rows)  # context parallelism: this rank's rows from here on
        streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        pre = torch.zeros(streams.shape[:2], device=streams.device)
        pre[:, 0].fill_(1.0)  # layer 0's attention reads copy 0 (`= 1.0` would make a new tensor each step)
        features = []
        for i, role in enumerate(cfg.roles):
            if i == cfg.first_decoder_layer and decoder is not rows:
                streams, pre = (StepState.gather((rows, t), decoder) for t in (streams, pre))
                rows = decoder
            if role.engram:
                streams = self._engram(i, streams, self._of_rows(hashes, rows), self._of_rows(image, rows))
            if request is not None and i in request.layers:  # (context parallelism: from every rank's rows)
                features.append(bf16(rows.gather(streams)[self._local_rows(rows.write, request.rows)].mean(dim=1)))
            streams, pre = self.block(f"layers.{i}.", streams, pre,
                                      lambda h, i=i: self._attention(i, h, meta, rows, state),
                                      lambda h, i=i, r=rows: self._moe(i, h, self._of_rows(image, r)))
        streams, pre = rows.gather(streams), rows.gather(pre)  # context parallelism: every rank's rows
        picked = self._local_rows(rows.write, logit_rows)
        h = bf16(ops.hc_collapse(streams[picked], pre[picked]))
        logits = ops.linear(bf16(ops.rms_norm(h, w["norm.weight"], cfg.rms_norm_eps)), w["head.weight"])
        return (logits, torch.stack(features, dim=1)) if request is not None and request.layers else logits

    def block(self, p: str, streams: torch.Tensor, pre: torch.Tensor, attention, ffn,
              w: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One block (a backbone layer, or a DSpark stage with its weights `w`) with the lagged
        hyper-connection schedule: each sub-layer makes its mixes at entry, uses post / comb itself and
        hands pre to the next sub-layer. -> (copies, pre for the next)."""
        cfg, ops, w = self.config, self.accel, self.w if w is None else w
        hc = (cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)
        attn_pre, post, comb = ops.hc_mixes(streams, w[p + "hc_attn_fn"], w[p + "hc_attn_base"], w[p + "hc_attn_scale"],
                                            *hc)
        h = bf16(ops.rms_norm(bf16(ops.hc_collapse(streams, pre)), w[p + "attn_norm.weight"], cfg.rms_norm_eps))
        streams = bf16(ops.hc_post(bf16(attention(h)), streams, post, comb))
        ffn_pre, post, comb = ops.hc_mixes(streams, w[p + "hc_ffn_fn"], w[p + "hc_ffn_base"], w[p + "hc_ffn_scale"],
                                           *hc)
        h = bf16(ops.rms_norm(bf16(ops.hc_collapse(streams, attn_pre)), w[p + "ffn_norm.weight"], cfg.rms_norm_eps))
        return bf16(ops.hc_post(bf16(ffn(h)), streams, post, comb)), ffn_pre

    def qlinear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """A GEMM with an FP8-stored weight on bf16 values x: its input quantized to FP8 per 32 first
        (DeepSeek's linear(); by the op itself where the weight carries it: numerics.gemm_input), its
        output in bf16."""
        return bf16(self.accel.linear(gemm_input(self.accel, x, weight, self.quantized), weight))

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return bf16(self.accel.rms_norm(x, weight, self.config.rms_norm_eps))

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        return bf16(self.accel.rope(x, cos, sin, inverse))

    @staticmethod
    def _local_rows(rows: Rows, flat: torch.Tensor) -> torch.Tensor:
        """Flat token indices -> positions within `rows` (which must hold them)."""
        flat = flat.to(rows.dev.flat.device)
        if rows.tokens is None:
            return flat
        at = torch.searchsorted(rows.dev.flat, flat)
        if bool((at >= rows.count).any()) or not torch.equal(rows.dev.flat[at.clamp(max=rows.count - 1)], flat):
            raise RuntimeError("a requested row was not computed by the decoder layers (CED split)")
        return at

    # ------------------------------------------------------------ attention
    def _attention(self, i: int, h: torch.Tensor, meta: StepMeta, rows: Rows, state: StepState) -> torch.Tensor:
        cfg, ops, w = self.config, self.accel, self.w
        role, view, dev = cfg.roles[i], meta.cache.layers[i], rows.dev
        p = f"layers.{i}.attn."
        n, heads, hd = h.shape[0], cfg.num_attention_heads, cfg.head_dim
        cos, sin = dev.rope.compress if role.rate else dev.rope.main
        qr = self.norm(self.qlinear(h, w[p + "wq_a.weight"]), w[p + "q_norm.weight"])
        q = self.rope(self.qlinear(qr, w[p + "wq_b.weight"]).view(n, heads, hd), cos, sin)
        kv = self.norm(self.qlinear(h, w[p + "wkv.weight"]), w[p + "kv_norm.weight"])
        kv = ops.fp8_qdq(self.rope(kv, cos, sin), ACT_BLOCK)
        pool = view.pool  # every rank writes the keys of every row (context parallelism gathers them)
        pool.data[pool.scratch_base + rows.write.dev.flat] = rows.gather(kv).to(pool.data.dtype)
        ring_offset = view.member * meta.cache.ring
        window, in_ring = dev.window[view.members]
        indices = window + in_ring * ring_offset
        if role.rate:
            if role.owns_kv:
                self._compress(i, h, meta, rows)
            picks = self._picks(i, h, qr, rows, state) if role.owns_index else \
                state.gather(state.picks[role.index_source], rows)
            indices = torch.cat([indices, torch.where(picks >= 0, picks + pool.page_base, picks)], dim=1)
        out = bf16(ops.sparse_attention_bf16(q, pool.data, indices, w[p + "attn_sink"], hd ** -0.5))
        out = self.rope(out, cos, sin, inverse=True)
        src, dst = rows.write.dev.commit[view.members]
        pool.data.index_copy_(0, dst + ring_offset, pool.data.index_select(0, src))
        out = bf16(ops.grouped_linear(out.reshape(n, cfg.o_groups, heads * hd // cfg.o_groups), w[p + "wo_a.weight"]))
        return self.qlinear(out.flatten(1), w[p + "wo_b.weight"])

    def _compress(self, i: int, h: torch.Tensor, meta: StepMeta, rows: Rows) -> None:
        """A KV source's new compressed entries (pairs, or tokens at ratio 1) and their index keys,
        written to its pages: latent -> keys = fp4(rope(k_norm(wk latent))), entry = fp4(rope(latent)).
        `h`: the rows of `rows` (under context parallelism this rank's share: the projections of every
        row are gathered and every rank computes every entry)."""
        cfg, ops, w = self.config, self.accel, self.w
        role, view = cfg.roles[i], meta.cache.layers[i]
        info = meta.writes[role.rate]
        p = f"layers.{i}.attn.compressor."
        if role.rate == 1 and rows.split is None:
            latent = bf16(ops.linear(h[info.tok_rows], w[p + "wkv.weight"]))
        elif role.rate == 1:
            latent = rows.gather(bf16(ops.linear(h, w[p + "wkv.weight"])))[info.tok_rows]
        else:  # stage every token's [kv | gate], pool each finished pair with a per-channel softmax
            ring = view.compressor.data
            staged = torch.cat([ops.linear(h, w[p + "wkv.weight"]), ops.linear(h, w[p + "wgate.weight"])], dim=-1)
            ring[info.scratch + meta.rows["all"].flat] = rows.gather(staged).to(ring.dtype)
            raw = ring[info.tok_rows.clamp(min=0)].float()
            latent = bf16(ops.compress_windows(raw[..., :cfg.head_dim], raw[..., cfg.head_dim:]))
            src, dst = info.commit
            ring.index_copy_(0, dst, ring.index_select(0, src))
        if not latent.shape[0]:
            return
        latent = self.norm(latent, w[p + "norm.weight"])
        cos, sin = info.cos_sin
        x = f"layers.{i}.attn.indexer."
        keys = self.norm(bf16(ops.linear(latent, w[x + "wk.weight"])), w[x + "k_norm.weight"])
        keys = ops.fp4_qdq(self.rope(keys, cos, sin), 32)
        view.index_keys.data[view.index_keys.page_base + info.out_rows] = keys.to(view.index_keys.data.dtype)
        entries = ops.fp4_qdq(self.rope(latent, cos, sin), 16, e4m3_scale=True)
        view.pool.data[view.pool.page_base + info.out_rows] = entries.to(view.pool.data.dtype)

    def _picks(self, i: int, h: torch.Tensor, qr: torch.Tensor, rows: Rows, state: StepState) -> torch.Tensor:
        """An index source's top-k entries per token (page rows, -1 = none), published for its readers."""
        cfg, ops, w = self.config, self.accel, self.w
        role, view, dev = cfg.roles[i], rows.meta.cache.layers[i], rows.dev
        x = f"layers.{i}.attn.indexer."
        heads, dim = cfg.index_n_heads, cfg.index_head_dim
        cos, sin = dev.rope.compress
        q = ops.fp4_qdq(self.rope(self.qlinear(qr, w[x + "wq_b.weight"]).view(h.shape[0], heads, dim), cos, sin), 32)
        weights = bf16(bf16(ops.linear(h, w[x + "weights_proj.weight"])) * (dim ** -0.5 * heads ** -0.5))
        candidates = dev.entries[role.rate]
        keys = view.index_keys.data[view.index_keys.page_base:]
        scores = ops.indexer_scores(q, weights, keys, candidates)
        if role.candidates:
            mask = select_candidate_blocks(scores, dev.visible[role.rate], cfg.candidate_topk_blocks,
                                           cfg.candidate_block_size)
            state.candidates = (rows, mask)
        elif role.reindex:
            # DeepSeek's top-k takes min(index_topk, visible) entries: a token that sees no more than
            # index_topk attends every one, candidate or not (its top-k runs past the finite scores into
            # all the -inf rest); the others pick among candidates only (config.py refuses the configs
            # where one could see fewer candidates than index_topk, but more entries).
            keep = state.gather(state.candidates, rows) | (dev.visible[role.rate] <= cfg.index_topk)[:, None]
            scores = scores.masked_fill(~keep, float("-inf"))
        picks = topk_picks(scores, candidates, cfg.index_topk)
        state.picks[i] = (rows, picks)
        return picks

    @staticmethod
    def _of_rows(mask: torch.Tensor | None, rows: Rows) -> torch.Tensor | None:
        """A per-token tensor of the whole step, for the tokens of `rows` (the CED split's subset, or this
        rank's share under context parallelism)."""
        return mask if mask is None or rows.tokens is None else mask[rows.dev.tokens]

    # ------------------------------------------------------------ MoE
    def _moe(self, i: int, h: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        return self.ffn(f"layers.{i}.ffn.", h, self.config.num_experts_per_tok, self.experts[i], image=image)

    def ffn(self, p: str, h: torch.Tensor, top_k: int, experts,
            w: dict[str, torch.Tensor] | None = None, image: torch.Tensor | None = None) -> torch.Tensor:
        """Routed experts (`experts(h, weights, ids)`) plus the shared expert, one bf16 rounding at the end.
        `image` (bool per row): rows inside an image span choose their experts with `gate.bias_vl`."""
        cfg, ops, w = self.config, self.accel, self.w if w is None else w
        gate, rule = w[p + "gate.weight"], (top_k, cfg.routed_scaling_factor, cfg.norm_topk_prob)
        weights, ids = moe.route(ops, h, gate, w[p + "gate.bias"], *rule)
        at = image.nonzero().squeeze(1) if image is not None else None
        if at is not None and at.numel():  # the router is row by row: image rows routed alone, as in the batch
            weights[at], ids[at] = moe.route(ops, h[at], gate, w[p + "gate.bias_vl"], *rule)
        routed = experts(h, weights, ids)  # also with no rows here: expert parallelism serves other ranks' rows
        gate_up = w[p + "shared_experts.gate_up"]
        shared = moe.swiglu_expert(ops, gemm_input(ops, h, gate_up, self.quantized), gate_up,
                                   w[p + "shared_experts.down"], self.limit, self.quantized)
        return bf16(routed + shared)

    # ------------------------------------------------------------ Engram
    def _engram_hashes(self, meta: StepMeta, image: torch.Tensor | None = None) -> torch.Tensor:
        """Hash ids [T, engram layers, cols] of every token of the step; the step's classes go to the
        Engram ring (look-back of later steps). Image-span positions (`image`) are DEAD in it: no n-gram
        spans or crosses them (a look-back that reaches one takes the pad class from there on, as at the
        sequence start), also for later steps that look back over them."""
        pool, dev = meta.cache.engram, meta.rows["all"]
        classes = self.engram.classes(meta.ids)
        if image is not None:
            classes = torch.where(image, DEAD, classes)
        pool.data[pool.scratch_base + dev.flat, 0] = classes
        back = dev.engram
        history = torch.where(back >= 0, pool.data[back.clamp(min=0), 0], torch.full_like(back, self.engram.pad))
        src, dst = dev.engram_commit
        pool.data.index_copy_(0, dst, pool.data.index_select(0, src))
        grams = torch.cat([classes.unsqueeze(1), history], dim=1)
        if self.config.vision is not None:
            blocked = (grams == DEAD).cumsum(dim=1) > 0
            grams = torch.where(blocked, torch.full_like(grams, self.engram.pad), grams)
        return self.engram(grams)

    def _engram(self, i: int, streams: torch.Tensor, hashes: torch.Tensor,
                image: torch.Tensor | None = None) -> torch.Tensor:
        """Layer i's Engram on the copies: its rows of the n-gram table, one key per copy and a shared value;
        the gate shut on image rows."""
        cfg, w = self.config, self.w
        p = f"layers.{i}.engram."
        ids = hashes[:, cfg.engram_layer_ids.index(i)]
        rows = lookup_rows(self.tables[p + "embed.weight"], self.tables[p + "embed.scale"], ids, streams.device)
        kv = self.qlinear(rows.flatten(1), w[p + "wkv.weight"])  # bf16 out
        return bf16(engram_update(streams, kv, w[p + "q_weight"] * w[p + "k_weight"], cfg.rms_norm_eps, shut=image))
