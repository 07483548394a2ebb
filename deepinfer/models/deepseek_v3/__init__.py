"""DeepSeek-V3 / R1 (DeepseekV3ForCausalLM): multi-head latent attention (q/kv LoRA, decoupled RoPE
with YaRN) over a paged latent cache in the absorbed form, dense first layers, then sigmoid
group-limited top-k MoE with a routing bias and shared experts."""

from deepinfer.models.deepseek_v3.config import DeepseekV3Config
from deepinfer.models.deepseek_v3.model import DeepseekV3Model

__all__ = ["DeepseekV3Config", "DeepseekV3Model"]
