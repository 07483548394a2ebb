"""DeepSeek-V4.1's MoE as trained, composed of Accelerator ops.

Router: scores sqrt(softplus(x W^T)); experts by top-k of scores + bias (the bias only selects);
weights = scores / (sum + 1e-20) when norm_topk_prob and k > 1 (top-1 is not renormalised), times
routed_scaling_factor. Expert: SwiGLU with up clamped to +-limit and gate clamped above; with FP8/FP4
weights the input and the intermediate are FP8-quantized per 32 before their GEMMs, and the routing
weight multiplies the intermediate *before* it is quantized for w2 (IMPLEMENTING.md, section 6).
Each GEMM's output is rounded to bfloat16 (the reference's activations); the routed experts' outputs
add up in float32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from deepinfer.models.deepseek_v41.config import ACT_BLOCK
from deepinfer.models.deepseek_v41.numerics import bf16, quantizes_input


def _qdq(ops, x: torch.Tensor, quantized: bool) -> torch.Tensor:
    return ops.fp8_qdq(x, ACT_BLOCK) if quantized else bf16(x)


def route(ops, x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float,
          normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k])."""
    if normalize and top_k > 1:
        return ops.route_topk(x, gate, bias, top_k, scaling)
    _, ids = ops.route_topk(x, gate, bias, top_k, 1.0)  # the selection; its weights are renormalised
    return F.softplus(ops.linear(x, gate).gather(1, ids)).sqrt() * scaling, ids


def swiglu_expert(ops, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, limit: float,
                  quantized: bool, weight: torch.Tensor | None = None) -> torch.Tensor:
    """One expert on rows x [n, D] (as gate_up takes them: numerics.gemm_input): down(qdq(swiglu * weight)),
    the intermediate quantized by the down projection's op where `down` carries that (bf16 first, as
    fp8_qdq rounds)."""
    gate, up = bf16(ops.linear(x, gate_up)).chunk(2, dim=-1)
    h = ops.swiglu(gate, up, limit)
    if weight is not None:
        h = h * weight.unsqueeze(-1)
    return bf16(ops.linear(bf16(h) if quantizes_input(down) else _qdq(ops, h, quantized), down))


def routed_experts(ops, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, limit: float, quantized: bool) -> torch.Tensor:
    """sum_k expert_{ids[t, k]}(x[t], weights[t, k]) -> [T, D] float32: the accelerator's moe_experts_bf16
    (backends/base.py: swiglu_expert's numerics per slot, the k outputs summed in float32 in slot order,
    so a token's result does not depend on which other tokens share the step). The one call of the
    routed experts, the backbone's and the drafter's."""
    return ops.moe_experts_bf16(x, weights, ids, gate_up, down, limit, ACT_BLOCK if quantized else 0)


def swiglu_limit(limit: float) -> float:
    """The reference clamps only with a positive limit."""
    return limit if limit > 0 else math.inf
