"""DeepSeek-V4 (DeepseekV4ForCausalLM): mHC residual streams, shared-KV MQA over a sliding window plus
compressed entries (CSA with the Lightning Indexer, HCA), hash and top-k MoE, DSpark drafting."""

from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.model import DeepseekV4Model

__all__ = ["DeepseekV4Config", "DeepseekV4Model"]
