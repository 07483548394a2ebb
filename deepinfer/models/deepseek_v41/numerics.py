"""DeepSeek-V4.1's rounding points: its reference computes in bfloat16, so deepinfer rounds an
activation to bf16 wherever the reference holds one, while every op computes in float32 inside.

FP8 GEMMs quantize their input to e4m3 per 32 (power-of-two scales) first. An FP8 weight the model
marks with that quantization (backends.quant.ActQuant, model.py) has it applied by the weight op
itself, on every backend (nvidia's FP8 block GEMM quantizes in its own kernel); any other weight of a
quantized model gets its input quantized here (`gemm_input`). The reference quantizes bf16 values:
an input that is not one yet is rounded to bf16 first, as fp8_qdq does."""

from __future__ import annotations

import torch

from deepinfer.backends.quant import QuantizedWeight
from deepinfer.models.deepseek_v41.config import ACT_BLOCK


def bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to the nearest bfloat16 (ties to even), kept in float32."""
    return x.to(torch.bfloat16).float()


def quantizes_input(w) -> bool:
    """Whether the weight op on `w` quantizes its input itself (an FP8 weight carrying ActQuant)."""
    return isinstance(w, QuantizedWeight) and w.act is not None


def gemm_input(ops, x: torch.Tensor, w, quantized: bool) -> torch.Tensor:
    """x (bf16 values) as the GEMM with weight `w` of a model that quantizes activations (`quantized`)
    takes it: FP8-quantized per 32 here, or as is where the op does it (quantizes_input)."""
    if not quantized or quantizes_input(w):
        return x
    return ops.fp8_qdq(x, ACT_BLOCK)
