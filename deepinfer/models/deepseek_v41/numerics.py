"""DeepSeek-V4.1's rounding points: its reference computes in bfloat16, so deepinfer rounds an
activation to bf16 wherever the reference holds one, while every op computes in float32 inside."""

from __future__ import annotations

import torch


def bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to the nearest bfloat16 (ties to even), kept in float32."""
    return x.to(torch.bfloat16).float()
