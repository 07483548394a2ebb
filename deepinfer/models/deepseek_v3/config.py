"""DeepseekV3Config: a DeepSeek-V3 / R1 `config.json`, parsed, normalised and validated.

Accepts the hub's config.json (legacy `rope_scaling` + `rope_theta`, `scoring_func`, `topk_method`,
`quantization_config`), what transformers 5 writes (`rope_parameters`) and DeepSeek's own
inference config (ModelArgs keys: `dim`, `n_layers`, `n_dense_layers`, `rope_factor`, ...). Keys a
file leaves out take transformers' DeepseekV3Config defaults (V3's values), so a config
transformers reads is read the same here.

The numbers that are easy to get wrong (transformers 5.24, modeling_deepseek_v3.py and
modeling_rope_utils.py):
- `head_dim` in transformers' config is the rope dim (qk_rope_head_dim), not a head size.
- YaRN inverse frequencies: DeepSeek's formula (floor/ceil correction range, linear ramp), the
  same as V4's compressor rope (models/rope.py RopeConfig, shared).
- cos and sin are multiplied by the rope "attention factor": the config's own `attention_factor`,
  else mscale(f, mscale) / mscale(f, mscale_all_dim) when both are set, else mscale(f), with
  mscale(f, m) = 0.1 m ln f + 1 (1 for f <= 1). V3 / R1 ship mscale = mscale_all_dim, so 1.
- The softmax scale is (qk_nope_head_dim + qk_rope_head_dim)^-0.5, times mscale(f, mscale_all_dim)^2
  under YaRN when mscale_all_dim is set (V3: 192^-0.5 * (0.1 ln 40 + 1)^2 = 0.13523). The absorbed
  form keeps this scale (its scores are the same numbers).
- q_a_layernorm and kv_a_layernorm always use eps 1e-6 (built without rms_norm_eps); the block and
  final norms use rms_norm_eps.
DeepSeek's upstream code applies YaRN only when its run's max_seq_len exceeds original_seq_len
(always, for V3's 16384 > 4096), with one mscale for the softmax and no cos/sin factor: for its
configs (mscale = mscale_all_dim) the same numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deepinfer.models.base import ConfigError
from deepinfer.models.config_util import ConfigReader, check_token_ids, failer
from deepinfer.models.rope import RopeConfig  # DeepSeek's YaRN, shared with V4

if TYPE_CHECKING:
    import numpy as np
    import torch

# q_a_layernorm / kv_a_layernorm (transformers builds them without config.rms_norm_eps)
LORA_NORM_EPS = 1e-6


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(slots=True)
class DeepseekV3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None  # None: one q_proj (V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    rope_attention_factor: float  # multiplies cos and sin
    softmax_scale: float
    rope_interleave: bool  # False: rotate_half checkpoints (rope rows permuted into pairs at load)
    bos_token_id: int | None
    eos_token_ids: list[int]
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0  # MTP layers after the last one (not run: skipped at load)
    quantization: dict | None = None
    raw: dict = field(default_factory=dict)

    @property
    def latent_dim(self) -> int:
        """A latent cache row: the normed latent, then the roped shared key (V3: 512 + 64)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    def cos_sin(self, positions: "np.ndarray") -> tuple["torch.Tensor", "torch.Tensor"]:
        """(cos, sin) [len(positions), rope dim / 2] float32, times the rope attention factor."""
        cos, sin = self.rope.cos_sin(positions)
        if self.rope_attention_factor != 1.0:
            cos, sin = cos * self.rope_attention_factor, sin * self.rope_attention_factor
        return cos, sin

    @classmethod
    def from_dict(cls, data: dict, source: str = "config") -> "DeepseekV3Config":
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a JSON object")
        if "text_config" in data and isinstance(data["text_config"], dict):
            data = data["text_config"]
        if "model_type" not in data and "dim" in data and "n_layers" in data:
            data = _from_model_args(data)  # DeepSeek's inference/configs/*.json
        model_type = data.get("model_type")
        if model_type != "deepseek_v3":
            raise ConfigError(f"{source}: model_type is {model_type!r}; this parser reads 'deepseek_v3' models")

        read = ConfigReader(data, source, positive=True)
        need = read.need
        read.check_fixed({"hidden_act": "silu", "scoring_func": "sigmoid", "topk_method": "noaux_tc",
                          "moe_layer_freq": 1, "attention_bias": False}, "DeepSeek-V3")

        q_lora = data.get("q_lora_rank", 1536)
        if q_lora is not None and (not isinstance(q_lora, int) or isinstance(q_lora, bool) or q_lora < 0):
            raise ConfigError(f"{source}: 'q_lora_rank' must be a positive int or null, got {q_lora!r}")
        rope_dim = need("qk_rope_head_dim", default=64)
        nope_dim = need("qk_nope_head_dim", default=128)
        theta, yarn, attention_factor, mscale_all_dim = _rope(data, source)
        scale = (nope_dim + rope_dim) ** -0.5
        if yarn is not None and mscale_all_dim:
            m = yarn_mscale(yarn["factor"], mscale_all_dim)
            scale = scale * m * m  # in transformers' order (yarn_apply_mscale): the same float

        cfg = cls(
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            intermediate_size=need("intermediate_size", default=18432),
            moe_intermediate_size=need("moe_intermediate_size", default=2048),
            num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=need("num_attention_heads"),
            q_lora_rank=q_lora or None,
            kv_lora_rank=need("kv_lora_rank", default=512),
            qk_nope_head_dim=nope_dim,
            qk_rope_head_dim=rope_dim,
            v_head_dim=need("v_head_dim", default=128),
            n_routed_experts=need("n_routed_experts", default=256),
            num_experts_per_tok=need("num_experts_per_tok", default=8),
            n_shared_experts=need("n_shared_experts", default=1, positive=False),
            n_group=need("n_group", default=8),
            topk_group=need("topk_group", default=4),
            norm_topk_prob=need("norm_topk_prob", bool, True),
            routed_scaling_factor=need("routed_scaling_factor", float, 2.5),
            first_k_dense_replace=need("first_k_dense_replace", default=3, positive=False),
            rms_norm_eps=need("rms_norm_eps", float, 1e-6),
            max_position_embeddings=need("max_position_embeddings", default=4096),
            rope=RopeConfig(theta, rope_dim, yarn and {k: yarn.get(k) for k in
                                                       ("factor", "original_max_position_embeddings",
                                                        "beta_fast", "beta_slow")}),
            rope_attention_factor=attention_factor,
            softmax_scale=scale,
            rope_interleave=need("rope_interleave", bool, True),
            bos_token_id=data.get("bos_token_id", 0),
            eos_token_ids=read.eos_token_ids(),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            num_nextn_predict_layers=int(data.get("num_nextn_predict_layers", data.get("num_mtp_layers")) or 0),
            quantization=data.get("quantization_config"),
            raw=data,
        )
        cfg.validate(source)
        return cfg

    def validate(self, source: str = "config") -> None:
        fail = failer(source)

        e, g = self.n_routed_experts, self.n_group
        if e % g:
            fail(f"n_routed_experts ({e}) must be divisible by n_group ({g})")
        if not 1 <= self.topk_group <= g:
            fail(f"topk_group ({self.topk_group}) must be in [1, n_group={g}]")
        if self.topk_group < g and e // g < 2:
            fail(f"group-limited routing scores a group by its two best experts: n_routed_experts / n_group "
                 f"({e // g}) must be >= 2")
        if not 1 <= self.num_experts_per_tok <= self.topk_group * (e // g):
            fail(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, topk_group * n_routed_experts / "
                 f"n_group = {self.topk_group * (e // g)}]")
        if self.qk_rope_head_dim % 2:
            fail(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even (rope rotates channel pairs)")
        if self.first_k_dense_replace > self.num_hidden_layers:
            fail(f"first_k_dense_replace ({self.first_k_dense_replace}) exceeds num_hidden_layers "
                 f"({self.num_hidden_layers})")
        check_token_ids(self.eos_token_ids, self.vocab_size, source)


def _rope(data: dict, source: str) -> tuple[float, dict | None, float, float | None]:
    """(theta, yarn parameters or None, cos/sin attention factor, mscale_all_dim) from either the
    legacy `rope_scaling` + `rope_theta` keys or transformers 5's `rope_parameters`."""
    params = dict(data.get("rope_parameters") or {})
    params.update(data.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", data.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None, 1.0, None
    if kind != "yarn":
        raise ConfigError(f"{source}: rope type {kind!r} is not supported (DeepSeek-V3 uses 'yarn' or none)")
    if "original_max_position_embeddings" not in params:
        raise ConfigError(f"{source}: yarn rope scaling needs 'original_max_position_embeddings'")
    if params.get("truncate", True) is not True:
        raise ConfigError(f"{source}: yarn with truncate=false is not supported (DeepSeek's YaRN truncates)")
    orig = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:  # transformers: the ratio of the context lengths
        factor = data.get("max_position_embeddings", 4096) / orig
    yarn = {**params, "factor": float(factor)}
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    return theta, yarn, float(attention_factor), mscale_all_dim


def _from_model_args(args: dict) -> dict:
    """DeepSeek's ModelArgs keys (inference/model.py) in transformers' names. Upstream always
    normalises sigmoid top-k weights, always rotates interleaved pairs, and has one YaRN mscale (the
    softmax correction, no cos/sin factor); rope_factor 1 is no YaRN, q_lora_rank 0 no q LoRA."""
    if args.get("score_func", "softmax") != "sigmoid":
        raise ConfigError(f"score_func {args.get('score_func', 'softmax')!r} is not supported (DeepSeek-V3 "
                          "routes with 'sigmoid')")
    factor = float(args.get("rope_factor", 40))
    orig = args.get("original_seq_len", 4096)
    out = {
        "model_type": "deepseek_v3", "vocab_size": args.get("vocab_size"), "hidden_size": args.get("dim"),
        "intermediate_size": args.get("inter_dim"), "moe_intermediate_size": args.get("moe_inter_dim"),
        "num_hidden_layers": args.get("n_layers"), "first_k_dense_replace": args.get("n_dense_layers"),
        "num_attention_heads": args.get("n_heads"), "n_routed_experts": args.get("n_routed_experts"),
        "n_shared_experts": args.get("n_shared_experts"), "num_experts_per_tok": args.get("n_activated_experts"),
        "n_group": args.get("n_expert_groups", 1), "topk_group": args.get("n_limited_groups", 1),
        "routed_scaling_factor": args.get("route_scale", 1.0), "norm_topk_prob": True,
        "q_lora_rank": args.get("q_lora_rank", 0), "kv_lora_rank": args.get("kv_lora_rank"),
        "qk_nope_head_dim": args.get("qk_nope_head_dim"), "qk_rope_head_dim": args.get("qk_rope_head_dim"),
        "v_head_dim": args.get("v_head_dim"), "rope_theta": args.get("rope_theta", 10000.0),
        "max_position_embeddings": args.get("max_seq_len", int(orig * max(factor, 1.0))),
        "bos_token_id": args.get("bos_token_id", 0), "eos_token_id": args.get("eos_token_id", 1),
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    }
    if factor > 1:
        m = args.get("mscale", 1.0)
        out["rope_scaling"] = {"type": "yarn", "factor": factor, "original_max_position_embeddings": orig,
                               "beta_fast": args.get("beta_fast", 32), "beta_slow": args.get("beta_slow", 1),
                               "mscale": m, "mscale_all_dim": m}
    if args.get("dtype") == "fp8":
        out["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    return {k: v for k, v in out.items() if v is not None}
