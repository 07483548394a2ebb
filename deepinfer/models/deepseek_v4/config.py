"""DeepseekV4Config: a DeepSeek-V4 `config.json`, parsed, normalised and validated.

Accepts what transformers' `DeepseekV4Config` writes (layer_types, compress_rates,
mlp_layer_types, nested rope_parameters) and the legacy keys of upstream
checkpoints (compress_ratios, num_hash_layers, qk_rope_head_dim, rope_scaling).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.models.base import ConfigError
from deepinfer.models.config_util import ConfigReader, check_token_ids, failer
from deepinfer.models.rope import RopeConfig

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_TYPES = ("hash_moe", "moe")
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}


@dataclass(slots=True)
class DeepseekV4Config:
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
    n_shared_experts: int
    routed_scaling_factor: float
    swiglu_limit: float
    sliding_window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    max_position_embeddings: int
    layer_types: list[str]
    mlp_layer_types: list[str]
    compress_rates: dict[str, int]
    rope_main: RopeConfig
    rope_compress: RopeConfig
    bos_token_id: int | None
    eos_token_ids: list[int]
    tie_word_embeddings: bool = False
    scoring_func: str = "sqrtsoftplus"
    dspark: dict = field(default_factory=dict)  # dspark_* keys, for the speculative decoder
    num_nextn_predict_layers: int = 0
    quantization: dict | None = None
    raw: dict = field(default_factory=dict)

    @property
    def rope_dim(self) -> int:
        return self.rope_main.dim

    def compress_rate(self, layer: int) -> int:
        kind = self.layer_types[layer]
        return 0 if kind == SLIDING else self.compress_rates[kind]

    @classmethod
    def from_dict(cls, data: dict, source: str = "config") -> "DeepseekV4Config":
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a JSON object")
        if "text_config" in data and isinstance(data["text_config"], dict):
            data = {**data["text_config"], **{k: v for k, v in data.items() if k.startswith("dspark_")}}
        model_type = data.get("model_type")
        if model_type != "deepseek_v4":
            raise ConfigError(f"{source}: model_type is {model_type!r}; deepinfer runs 'deepseek_v4' models")

        read = ConfigReader(data, source)
        need = read.need

        n_layers = need("num_hidden_layers")
        head_dim = need("head_dim", default=512)

        rates = dict(data.get("compress_rates") or {CSA: 4, HCA: 128})
        if data.get("compress_rate_csa") is not None:
            rates[CSA] = data["compress_rate_csa"]
        if data.get("compress_rate_hca") is not None:
            rates[HCA] = data["compress_rate_hca"]

        layer_types = data.get("layer_types")
        if layer_types is None and data.get("compress_ratios") is not None:
            try:
                layer_types = [_RATIO_TO_TYPE[int(r)] for r in data["compress_ratios"]]
            except (KeyError, ValueError, TypeError):
                raise ConfigError(f"{source}: compress_ratios entries must be 0, 4 or 128, "
                                  f"got {data['compress_ratios']!r}") from None
        if layer_types is None:
            layer_types = [HCA] * min(n_layers, 2) + [CSA if i % 2 else HCA for i in range(max(n_layers - 2, 0))]
        layer_types = list(layer_types)[:n_layers]
        if len(layer_types) != n_layers or any(t not in LAYER_TYPES for t in layer_types):
            raise ConfigError(f"{source}: layer_types must list {n_layers} entries from {LAYER_TYPES}, "
                              f"got {layer_types!r}")

        mlp_types = data.get("mlp_layer_types")
        if mlp_types is None:
            n_hash = data.get("num_hash_layers", 3)
            mlp_types = ["hash_moe"] * min(n_layers, n_hash) + ["moe"] * max(0, n_layers - n_hash)
        mlp_types = list(mlp_types)[:n_layers]
        if len(mlp_types) != n_layers or any(t not in MLP_TYPES for t in mlp_types):
            raise ConfigError(f"{source}: mlp_layer_types must list {n_layers} entries from {MLP_TYPES}")

        if data.get("qk_rope_head_dim") is not None:
            rope_dim = int(data["qk_rope_head_dim"])
        else:
            rope_dim = int(head_dim * (data.get("partial_rotary_factor") or 64 / 512))
        if rope_dim % 2 or not 0 < rope_dim <= head_dim:
            raise ConfigError(f"{source}: rope dim {rope_dim} must be even and in (0, head_dim={head_dim}]")

        rope_params = data.get("rope_parameters") or {}
        if isinstance(rope_params.get("main"), dict) and isinstance(rope_params.get("compress"), dict):
            main_theta = float(rope_params["main"].get("rope_theta", data.get("rope_theta", 10000.0)))
            comp = rope_params["compress"]
            comp_theta = float(comp.get("rope_theta", data.get("compress_rope_theta", 160000.0)))
            yarn = comp if comp.get("rope_type", comp.get("type")) == "yarn" else None
        else:
            main_theta = float(data.get("rope_theta", 10000.0))
            comp_theta = float(data.get("compress_rope_theta", 160000.0))
            scaling = data.get("rope_scaling") or (rope_params if rope_params else None)
            yarn = scaling if scaling and scaling.get("type", scaling.get("rope_type")) == "yarn" else None
        if yarn is not None:
            for key in ("factor", "original_max_position_embeddings"):
                if key not in yarn:
                    raise ConfigError(f"{source}: yarn rope scaling needs {key!r}")
            yarn = {k: yarn.get(k) for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")}

        cfg = cls(
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            num_hidden_layers=n_layers,
            num_attention_heads=need("num_attention_heads"),
            head_dim=head_dim,
            q_lora_rank=need("q_lora_rank"),
            o_groups=need("o_groups", default=8),
            o_lora_rank=need("o_lora_rank"),
            n_routed_experts=need("n_routed_experts"),
            num_experts_per_tok=need("num_experts_per_tok"),
            moe_intermediate_size=need("moe_intermediate_size"),
            n_shared_experts=need("n_shared_experts", default=1),
            routed_scaling_factor=need("routed_scaling_factor", float, 1.5),
            swiglu_limit=need("swiglu_limit", float, 10.0),
            sliding_window=need("sliding_window", default=128),
            index_n_heads=need("index_n_heads", default=64),
            index_head_dim=need("index_head_dim", default=128),
            index_topk=need("index_topk", default=512),
            hc_mult=need("hc_mult", default=4),
            hc_sinkhorn_iters=need("hc_sinkhorn_iters", default=20),
            hc_eps=need("hc_eps", float, 1e-6),
            rms_norm_eps=need("rms_norm_eps", float, 1e-6),
            max_position_embeddings=need("max_position_embeddings", default=1048576),
            layer_types=layer_types,
            mlp_layer_types=mlp_types,
            compress_rates={CSA: int(rates[CSA]), HCA: int(rates[HCA])},
            rope_main=RopeConfig(main_theta, rope_dim),
            rope_compress=RopeConfig(comp_theta, rope_dim, yarn),
            bos_token_id=data.get("bos_token_id"),
            eos_token_ids=read.eos_token_ids(),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            scoring_func=data.get("scoring_func", "sqrtsoftplus"),
            dspark={k: v for k, v in data.items() if k.startswith("dspark_")},
            num_nextn_predict_layers=int(data.get("num_nextn_predict_layers") or 0),
            quantization=data.get("quantization_config"),
            raw=data,
        )
        cfg.validate(source)
        return cfg

    def validate(self, source: str = "config") -> None:
        fail = failer(source)

        if self.scoring_func != "sqrtsoftplus":
            fail(f"scoring_func {self.scoring_func!r} is not supported (DeepSeek-V4 uses 'sqrtsoftplus')")
        if self.n_shared_experts != 1:
            fail(f"n_shared_experts must be 1 for DeepSeek-V4, got {self.n_shared_experts}")
        if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
            fail(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, n_routed_experts="
                 f"{self.n_routed_experts}]")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            fail(f"num_attention_heads*head_dim ({self.num_attention_heads * self.head_dim}) must be "
                 f"divisible by o_groups ({self.o_groups})")
        for kind, rate in self.compress_rates.items():
            if rate <= 0:
                fail(f"compress rate of {kind} must be positive, got {rate}")
        if self.sliding_window <= 0 or self.hc_mult <= 0 or self.hc_sinkhorn_iters <= 0:
            fail("sliding_window, hc_mult and hc_sinkhorn_iters must be positive")
        if self.index_head_dim < self.rope_dim and CSA in self.layer_types:
            fail(f"index_head_dim ({self.index_head_dim}) must be >= the rope dim ({self.rope_dim})")
        check_token_ids(self.eos_token_ids, self.vocab_size, source)
