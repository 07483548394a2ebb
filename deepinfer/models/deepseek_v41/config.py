"""DeepseekV41Config: a DeepSeek-V4.1 `config.json` (nested `text_config`, the released key names),
parsed, normalised and validated, and each layer's role in the cross-layer hand-off (CSA2).

Roles (tests/goldens/v41/IMPLEMENTING.md, section 5): a layer with compress ratio 0 attends only its
window (SWA). Every other layer reads the compressed KV of the latest KV source at or before it and
the top-k picks of the latest index source at or before it. A KV source compresses its own KV and
makes index keys from it; an index source runs an indexer (over the latest KV source's keys); the
candidate source also publishes candidate blocks, and index sources after it score only inside them
("Reindex"). Layers after the last layer that owns paged state or Engram own nothing but their
window ring: the decoder half of the CED split, which prefill may run on each request's tail only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from deepinfer.models.base import ConfigError
from deepinfer.models.config_util import ConfigReader, check_token_ids, failer
from deepinfer.models.deepseek_v41.vision_config import VisionConfig
from deepinfer.models.rope import RopeConfig

QUANTIZATION = {"quant_method": "fp8", "weight_block_size": [32, 32], "scale_fmt": "ue8m0"}
ACT_BLOCK = 32  # FP8 activation quantization group (and the weight tile side)


def candidates_held(visible: int, blocks: int, size: int) -> int:
    """Entries inside a token's candidate blocks when it sees `visible` entries: every one while they
    fill at most `blocks` blocks, else blocks - 1 full blocks and the newest (always kept) one."""
    if -(-visible // size) <= blocks:
        return visible
    return (blocks - 1) * size + (visible - 1) % size + 1


def candidates_short_of_topk(topk: int, blocks: int, size: int, most: int) -> tuple[int, int] | None:
    """The first (visible, candidates) with topk < visible <= most and fewer than topk candidates: where
    a Reindex layer's top-k would pick among -inf scores. None if no token gets there. Past blocks *
    size entries the candidate count repeats with period `size`, so one period is enough to look at."""
    start = max(topk, blocks * size) + 1
    for visible in range(start, min(most, start + size - 1) + 1):
        held = candidates_held(visible, blocks, size)
        if held < topk:
            return visible, held
    return None


@dataclass(frozen=True, slots=True)
class LayerRole:
    """One backbone layer's place in the cross-layer hand-off."""

    layer: int
    rate: int  # compress ratio; 0 = sliding window only
    kv_source: int  # the layer whose compressed KV (and index keys) this layer reads; -1 for SWA
    index_source: int  # the layer whose top-k picks this layer uses; -1 for SWA
    candidates: bool = False  # the candidate source: publishes candidate blocks
    reindex: bool = False  # an index source after the candidate source: scores inside its candidates
    engram: bool = False  # Engram is added to the stream before this block

    @property
    def owns_kv(self) -> bool:
        return self.rate > 0 and self.kv_source == self.layer

    @property
    def owns_index(self) -> bool:
        return self.rate > 0 and self.index_source == self.layer

    @property
    def block_type(self) -> str:
        """The six block types of the released schedule (IMPLEMENTING.md, section 5; the goldens' names)."""
        if self.rate == 0:
            return "swa_only"
        if self.candidates:
            return "candidate_source"
        if self.reindex:
            return "candidate_index_source"
        if self.owns_kv:
            return "kv_index_source"
        return f"consumer_ratio{self.rate}"


@dataclass(slots=True)
class DeepseekV41Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    swiglu_limit: float
    sliding_window: int
    compress_ratios: list[int]  # backbone layers, then the DSpark stages (0)
    kv_source_layers: list[int]
    index_source_layers: list[int]
    candidate_source_layer: int  # -1: no candidate blocks
    candidate_topk_blocks: int
    candidate_block_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    max_position_embeddings: int
    rope_main: RopeConfig  # ratio-0 layers and DSpark: rope_theta, no YaRN
    rope_compress: RopeConfig  # every ratio > 0 layer: compress_rope_theta with YaRN
    engram_layer_ids: list[int]
    engram_max_ngram_size: int
    engram_vocab_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_pad_token_id: int
    engram_compressed_vocab_size: int
    engram_num_embeddings: list[int]
    num_nextn_predict_layers: int
    dspark: dict  # dspark_* keys
    quantized: bool  # FP8 32x32 dense weights (activations quantized per 32 before their GEMMs)
    expert_dtype: str  # "fp4" | "fp8" | "bf16"
    bos_token_id: int | None
    eos_token_ids: list[int]
    pad_token_id: int | None
    roles: list[LayerRole] = field(default_factory=list)
    checkpoint_dir: str | None = None  # where config.json was read (Engram's token map comes from its tokenizer)
    raw: dict = field(default_factory=dict)
    vision: VisionConfig | None = None  # the vision tower (`vision_config`, `image_token_id`); None: text only

    @property
    def rope_dim(self) -> int:
        return self.rope_main.dim

    @property
    def first_decoder_layer(self) -> int:
        """The CED split: the first layer after every layer that owns paged state (compressed KV,
        index keys) or adds Engram. From here on a layer keeps only its window ring."""
        owners = [r.layer for r in self.roles if r.owns_kv or r.engram]
        return max(owners) + 1 if owners else 0

    def role(self, layer: int) -> LayerRole:
        return self.roles[layer]

    # ------------------------------------------------------------ parsing
    @classmethod
    def from_dict(cls, data: dict, source: str = "config") -> "DeepseekV41Config":
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a JSON object")
        top = data
        if isinstance(data.get("text_config"), dict):
            data = {**data["text_config"]}
            for key in ("bos_token_id", "eos_token_id", "pad_token_id", "quantization_config"):
                if key in top and key not in data:
                    data[key] = top[key]
        elif top.get("model_type") == "deepseek_v41":
            raise ConfigError(f"{source}: a deepseek_v41 config keeps the model's keys in 'text_config'")
        model_type = top.get("model_type")
        if model_type not in ("deepseek_v41", None) or data.get("model_type") not in ("deepseek_v41_text", None):
            raise ConfigError(f"{source}: model_type is {model_type!r}; this parser reads 'deepseek_v41' configs")

        read = ConfigReader(data, source, label="text_config ")
        need, int_list = read.need, read.int_list
        read.check_fixed({"num_key_value_heads": 1, "hidden_act": "silu", "attention_bias": False,
                          "n_shared_experts": 1, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
                          "tie_word_embeddings": False}, "DeepSeek-V4.1")

        rope_dim = need("qk_rope_head_dim")
        scaling = data.get("rope_scaling")
        yarn = None
        if scaling is not None:
            if not isinstance(scaling, dict) or scaling.get("rope_type", scaling.get("type")) != "yarn":
                raise ConfigError(f"{source}: text_config 'rope_scaling' must be a yarn dict or absent, "
                                  f"got {scaling!r}")
            for key in ("factor", "original_max_position_embeddings"):
                if key not in scaling:
                    raise ConfigError(f"{source}: text_config rope_scaling needs {key!r}")
            yarn = {"factor": scaling["factor"], "original_max_position_embeddings":
                    scaling["original_max_position_embeddings"], "beta_fast": scaling.get("beta_fast", 32),
                    "beta_slow": scaling.get("beta_slow", 1)}

        quant = data.get("quantization_config")
        if quant is None:
            quantized, expert_dtype = False, "bf16"
        else:
            for key, value in QUANTIZATION.items():
                if quant.get(key) != value:
                    raise ConfigError(f"{source}: quantization_config {key!r} = {quant.get(key)!r} is not supported "
                                      f"(DeepSeek-V4.1's checkpoints use {value!r})")
            quantized, expert_dtype = True, quant.get("expert_dtype") or "fp8"
            if expert_dtype not in ("fp4", "fp8"):
                raise ConfigError(f"{source}: quantization_config 'expert_dtype' must be 'fp4' or 'fp8', "
                                  f"got {expert_dtype!r}")

        n_layers = need("num_hidden_layers")
        engram_layers = int_list("engram_layer_ids", [])
        cfg = cls(
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            num_hidden_layers=n_layers,
            num_attention_heads=need("num_attention_heads"),
            head_dim=need("head_dim"),
            q_lora_rank=need("q_lora_rank"),
            o_groups=need("o_groups"),
            o_lora_rank=need("o_lora_rank"),
            n_routed_experts=need("n_routed_experts"),
            num_experts_per_tok=need("num_experts_per_tok"),
            moe_intermediate_size=need("moe_intermediate_size"),
            routed_scaling_factor=need("routed_scaling_factor", float, 1.0),
            norm_topk_prob=need("norm_topk_prob", bool, True),
            swiglu_limit=need("swiglu_limit", float, 0.0),
            sliding_window=need("sliding_window"),
            compress_ratios=int_list("compress_ratios"),
            kv_source_layers=int_list("kv_source_layer_ids", []),
            index_source_layers=int_list("index_source_layer_ids", []),
            candidate_source_layer=need("candidate_source_layer_id", int, -1) if data.get(
                "candidate_source_layer_id", -1) != -1 else -1,
            candidate_topk_blocks=need("candidate_topk_blocks", default=0),
            candidate_block_size=need("candidate_block_size", default=0),
            index_n_heads=need("index_n_heads", default=0),
            index_head_dim=need("index_head_dim", default=0),
            index_topk=need("index_topk", default=0),
            hc_mult=need("hc_mult"),
            hc_sinkhorn_iters=need("hc_sinkhorn_iters"),
            hc_eps=need("hc_eps", float),
            rms_norm_eps=need("rms_norm_eps", float),
            max_position_embeddings=need("max_position_embeddings"),
            rope_main=RopeConfig(float(need("rope_theta", float, 10000.0)), rope_dim),
            rope_compress=RopeConfig(float(need("compress_rope_theta", float, 160000.0)), rope_dim, yarn),
            engram_layer_ids=engram_layers,
            engram_max_ngram_size=need("engram_max_ngram_size", default=0),
            engram_vocab_size=need("engram_vocab_size", default=0),
            engram_n_heads=need("engram_n_heads", default=0),
            engram_head_dim=need("engram_head_dim", default=0),
            engram_pad_token_id=need("engram_pad_token_id", default=2),
            engram_compressed_vocab_size=need("engram_compressed_vocab_size", default=0),
            engram_num_embeddings=int_list("engram_num_embeddings", []),
            num_nextn_predict_layers=need("num_nextn_predict_layers", default=0),
            dspark={k: v for k, v in data.items() if k.startswith("dspark_")},
            quantized=quantized,
            expert_dtype=expert_dtype,
            bos_token_id=data.get("bos_token_id"),
            eos_token_ids=read.eos_token_ids(),
            pad_token_id=data.get("pad_token_id"),
            checkpoint_dir=os.path.dirname(os.path.abspath(source)) if os.path.isfile(source) else None,
            raw=top,
        )
        cfg.vision = VisionConfig.from_dict(top, cfg.hidden_size, source)
        cfg.validate(source)
        cfg.roles = cfg._roles()
        return cfg

    # ------------------------------------------------------------ checks
    def validate(self, source: str = "config") -> None:
        fail = failer(source)

        n, ratios = self.num_hidden_layers, self.compress_ratios
        n_mtp = self.num_nextn_predict_layers
        if len(ratios) not in (n, n + n_mtp):
            fail(f"compress_ratios has {len(ratios)} entries; expected num_hidden_layers ({n}) plus "
                 f"num_nextn_predict_layers ({n_mtp})")
        if any(r < 0 for r in ratios):
            fail(f"compress_ratios must be >= 0, got {ratios}")
        if any(ratios[n:]):
            fail(f"the DSpark stages (compress_ratios[{n}:]) must be 0 (window only), got {ratios[n:]}")
        for key, layers in (("kv_source_layer_ids", self.kv_source_layers),
                            ("index_source_layer_ids", self.index_source_layers),
                            ("engram_layer_ids", self.engram_layer_ids)):
            if any(not 0 <= i < n for i in layers) or len(set(layers)) != len(layers):
                fail(f"{key} must list distinct backbone layers in [0, {n}), got {layers}")
        for i in self.kv_source_layers + self.index_source_layers:
            if ratios[i] == 0:
                fail(f"layer {i} is a KV or index source but has compress ratio 0 (sources compress)")
        if not set(self.kv_source_layers) <= set(self.index_source_layers):
            fail(f"every kv_source_layer_ids entry must also be an index source (the index keys come from "
                 f"its compressor), got {self.kv_source_layers} vs {self.index_source_layers}")
        for i in range(n):
            if not ratios[i]:
                continue
            kv = [s for s in self.kv_source_layers if s <= i]
            idx = [s for s in self.index_source_layers if s <= i]
            if not kv or not idx:
                fail(f"layer {i} has compress ratio {ratios[i]} but no KV source and index source at or before it")
            if ratios[max(kv)] != ratios[i] or ratios[max(idx)] != ratios[i]:
                fail(f"layer {i} (ratio {ratios[i]}) reads layer {max(kv)}'s compressed KV and layer {max(idx)}'s "
                     f"picks, whose ratios are {ratios[max(kv)]} / {ratios[max(idx)]}: they must match")
        c = self.candidate_source_layer
        if c >= 0:
            if c not in self.kv_source_layers:
                fail(f"candidate_source_layer_id {c} must be a KV source")
            if self.candidate_block_size <= 0 or self.candidate_topk_blocks <= 0:
                fail("candidate_block_size and candidate_topk_blocks must be positive with a candidate source")
            later = [s for s in self.kv_source_layers if s > c]
            if later and any(i > c for i in self.index_source_layers):
                fail(f"KV sources {later} after the candidate source {c}: the index sources after it score the "
                     "candidate source's keys, so it must be the last KV source")
            reindex = [i for i in self.index_source_layers if i > c]
            if reindex and self.index_topk > 0:
                self._check_candidates_cover_topk(reindex, ratios[c], fail)
        if any(ratios[:n]) and (self.index_n_heads <= 0 or self.index_head_dim <= 0 or self.index_topk <= 0):
            fail("index_n_heads, index_head_dim and index_topk must be positive when a layer compresses")
        if self.index_head_dim and self.index_head_dim < self.rope_dim:
            fail(f"index_head_dim ({self.index_head_dim}) must be >= qk_rope_head_dim ({self.rope_dim})")
        if self.rope_dim % 2 or not 0 < self.rope_dim <= self.head_dim:
            fail(f"qk_rope_head_dim {self.rope_dim} must be even and in (0, head_dim={self.head_dim}]")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            fail(f"num_attention_heads*head_dim ({self.num_attention_heads * self.head_dim}) must be divisible "
                 f"by o_groups ({self.o_groups})")
        if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
            fail(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, n_routed_experts="
                 f"{self.n_routed_experts}]")
        if self.sliding_window <= 0 or self.hc_mult <= 0 or self.hc_sinkhorn_iters <= 0:
            fail("sliding_window, hc_mult and hc_sinkhorn_iters must be positive")
        if self.quantized:
            dims = {"hidden_size": self.hidden_size, "q_lora_rank": self.q_lora_rank,
                    "moe_intermediate_size": self.moe_intermediate_size, "head_dim": self.head_dim,
                    "o_lora_rank * o_groups": self.o_lora_rank * self.o_groups}
            for name, value in dims.items():
                if value % ACT_BLOCK:
                    fail(f"{name} ({value}) must be a multiple of {ACT_BLOCK}: FP8 activations are quantized "
                         f"in groups of {ACT_BLOCK}")
        if self.head_dim % 16 or (self.index_head_dim and self.index_head_dim % 32):
            fail(f"head_dim ({self.head_dim}) must be a multiple of 16 and index_head_dim ({self.index_head_dim}) "
                 "of 32 (the KV / index-key FP4 groups)")
        if self.engram_layer_ids:
            if self.engram_max_ngram_size < 2 or self.engram_n_heads <= 0 or self.engram_head_dim % ACT_BLOCK:
                fail("Engram needs engram_max_ngram_size >= 2, engram_n_heads > 0 and engram_head_dim a multiple "
                     f"of {ACT_BLOCK}")
            if self.engram_compressed_vocab_size <= 0 or self.engram_vocab_size <= 1:
                fail("Engram needs engram_compressed_vocab_size and engram_vocab_size (> 1)")
            if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
                fail(f"engram_num_embeddings must list one table size per Engram layer {self.engram_layer_ids}")
        if self.num_nextn_predict_layers:
            d = self.dspark
            for key in ("dspark_block_size", "dspark_target_layer_ids"):
                if key not in d:
                    fail(f"num_nextn_predict_layers {self.num_nextn_predict_layers} needs {key!r}")
            if any(not 0 <= i < n for i in d["dspark_target_layer_ids"]):
                fail(f"dspark_target_layer_ids {d['dspark_target_layer_ids']} must be backbone layers")
        if self.vision is not None and not 0 <= self.vision.image_token_id < self.vocab_size:
            fail(f"image_token_id {self.vision.image_token_id} is not a token id in [0, vocab_size={self.vocab_size})")
        check_token_ids(self.eos_token_ids, self.vocab_size, source)

    def _check_candidates_cover_topk(self, reindex: list[int], rate: int, fail) -> None:
        """The Reindex layers score only inside the candidate blocks, and DeepSeek's top-k there takes
        min(index_topk, visible) entries. A token seeing more than index_topk entries but fewer than
        index_topk candidates would get the finite candidates plus some of its -inf others, which
        ones torch.topk leaves unspecified: no reference result exists, so such a config is refused
        wherever a position below max_position_embeddings can get there."""
        k, blocks, size = self.index_topk, self.candidate_topk_blocks, self.candidate_block_size
        most = self.max_position_embeddings // rate  # entries the last position sees
        short = candidates_short_of_topk(k, blocks, size, most)
        if short is None:
            return
        visible, held = short
        fail(f"index_topk ({k}) exceeds the candidate entries of the Reindex layers {reindex}: they keep "
             f"candidate_topk_blocks ({blocks}) blocks of candidate_block_size ({size}) entries, the newest block "
             f"partly filled, so a token at position {visible * rate - 1} sees {visible} entries of which {held} "
             f"are candidates, and DeepSeek's top-k would take {k - held} of its {visible - held} other entries "
             f"(all scored -inf), which ones torch leaves unspecified. Make (candidate_topk_blocks - 1) * "
             f"candidate_block_size + 1 >= index_topk (index_topk <= {(blocks - 1) * size + 1}, or "
             f"candidate_topk_blocks >= {-(-(k - 1) // size) + 1}), or max_position_embeddings <= "
             f"{visible * rate - 1} (no token then sees more than index_topk entries: it attends all of them)")

    def _roles(self) -> list[LayerRole]:
        roles = []
        c = self.candidate_source_layer
        for i in range(self.num_hidden_layers):
            rate = self.compress_ratios[i]
            kv = max((s for s in self.kv_source_layers if s <= i), default=-1) if rate else -1
            idx = max((s for s in self.index_source_layers if s <= i), default=-1) if rate else -1
            roles.append(LayerRole(i, rate, kv, idx, candidates=i == c, reindex=idx == i and 0 <= c < i,
                                   engram=i in self.engram_layer_ids))
        return roles

    # ------------------------------------------------------------ DSpark
    @property
    def dspark_experts(self) -> tuple[int, int]:
        """(routed experts, experts per token) of the DSpark stages: the dspark_* keys, else the backbone's."""
        d = self.dspark
        return (d.get("dspark_n_routed_experts") or self.n_routed_experts,
                d.get("dspark_num_experts_per_tok") or self.num_experts_per_tok)
