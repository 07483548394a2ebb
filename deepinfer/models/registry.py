"""Which model family a checkpoint is: its config.json's `architectures[0]`, else `model_type`
(a nested `text_config` counts for both), as vLLM's models/registry.py maps architectures; a
config with neither is the family whose upstream inference config keys it has (DeepSeek's own
ModelArgs files name no architecture)."""

from __future__ import annotations

import json
import os

from deepinfer.models.base import ConfigError, Family


def _deepseek_v4():
    from deepinfer.models.deepseek_v4 import DeepseekV4Config, DeepseekV4Model

    return DeepseekV4Config, DeepseekV4Model


def _deepseek_v3():
    from deepinfer.models.deepseek_v3 import DeepseekV3Config, DeepseekV3Model

    return DeepseekV3Config, DeepseekV3Model


def _deepseek_v41():
    from deepinfer.models.deepseek_v41 import DeepseekV41Config, DeepseekV41Model

    return DeepseekV41Config, DeepseekV41Model


FAMILIES = (
    Family("deepseek_v4", ("DeepseekV4ForCausalLM",), ("deepseek_v4",), _deepseek_v4),
    # DeepSeek's own inference config (ModelArgs: dim, n_layers, kv_lora_rank, ...) names no model
    Family("deepseek_v3", ("DeepseekV3ForCausalLM",), ("deepseek_v3",), _deepseek_v3,
           upstream_keys=("dim", "n_layers", "kv_lora_rank")),
    Family("deepseek_v41", ("DeepseekV41ForCausalLM",), ("deepseek_v41",), _deepseek_v41),
)


def read_config(model_dir: str | os.PathLike) -> tuple[dict, str]:
    """(config.json as a dict, its path) with errors that say what is wrong with the directory."""
    model_dir = os.fspath(model_dir)
    path = os.path.join(model_dir, "config.json")
    if not os.path.isdir(model_dir):
        raise ConfigError(f"model directory {model_dir!r} does not exist")
    if not os.path.isfile(path):
        raise ConfigError(f"{path} not found: a model directory needs an HF config.json")
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data, path


def family_of(data: dict, source: str = "config") -> Family:
    nested = data.get("text_config") if isinstance(data.get("text_config"), dict) else {}
    archs = data.get("architectures") or nested.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    model_type = data.get("model_type") or nested.get("model_type")
    for family in FAMILIES:
        if arch in family.architectures:
            return family
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    if arch is None and model_type is None:
        for family in FAMILIES:
            if family.upstream_keys and all(k in data for k in family.upstream_keys):
                return family
    supported = ", ".join(f"{a} (model_type {t!r})" for f in FAMILIES for a, t in zip(f.architectures, f.model_types))
    raise ConfigError(f"{source}: architecture {arch!r} / model_type {model_type!r} is not supported; "
                      f"deepinfer runs {supported}")


def load_config(model_dir: str | os.PathLike):
    """(the family's parsed config, the family's model class) of a checkpoint directory."""
    data, path = read_config(model_dir)
    config_cls, model_cls = family_of(data, path).load()
    return config_cls.from_dict(data, source=path), model_cls
