"""The toy family's config.json: the fields the engine reads, validated with errors that name the key."""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.models.base import ConfigError


@dataclass(frozen=True, slots=True)
class ToyConfig:
    vocab_size: int
    hidden_size: int
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: list[int]

    @classmethod
    def from_dict(cls, data: dict, source: str = "config") -> "ToyConfig":
        if data.get("model_type") != "toy":
            raise ConfigError(f"{source}: model_type is {data.get('model_type')!r}; this parser reads 'toy' models")
        for key in ("vocab_size", "hidden_size", "max_position_embeddings"):
            if not isinstance(data.get(key), int) or data[key] < 1:
                raise ConfigError(f"{source}: {key!r} must be a positive int, got {data.get(key)!r}")
        eos = data.get("eos_token_id", 1)
        return cls(data["vocab_size"], data["hidden_size"], data["max_position_embeddings"],
                   data.get("bos_token_id", 0), eos if isinstance(eos, list) else [eos])
