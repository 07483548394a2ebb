"""Model families behind a registry (registry.py); the interface the engine drives (base.py)."""

from deepinfer.models.base import CausalLM, ConfigError, ParallelContext, StepInput, TensorSpec
from deepinfer.models.registry import FAMILIES, load_config

__all__ = ["FAMILIES", "CausalLM", "ConfigError", "ParallelContext", "StepInput", "TensorSpec", "load_config"]
