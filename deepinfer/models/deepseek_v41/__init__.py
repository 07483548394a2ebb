"""DeepSeek-V4.1 (DeepseekV41ForCausalLM): a causal encoder / decoder split (CED), CSA2 attention in which
a few source layers compute compressed KV, index keys and candidate blocks that later layers reuse,
Engram n-gram memory, a lagged hyper-connection schedule, FP8 / FP4 quantization points as trained,
three DSpark draft stages in the checkpoint, and a vision tower (ViT + aligner) for image input."""

from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.model import DeepseekV41Model

__all__ = ["DeepseekV41Config", "DeepseekV41Model"]
