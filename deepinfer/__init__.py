"""deepinfer: an inference engine for DeepSeek's mixture-of-experts models."""

from deepinfer.backends import get_accelerator
from deepinfer.llm import LLM
from deepinfer.outputs import CompletionOutput, RequestOutput
from deepinfer.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "get_accelerator"]
__version__ = "0.1.0"
