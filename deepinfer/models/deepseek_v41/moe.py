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

from deepinfer.models.deepseek_v41.numerics import bf16

ACT_BLOCK = 32


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
    """One expert on rows x [n, D] (already quantized when `quantized`): down(qdq(swiglu * weight))."""
    gate, up = bf16(ops.linear(x, gate_up)).chunk(2, dim=-1)
    h = ops.swiglu(gate, up, limit)
    if weight is not None:
        h = h * weight.unsqueeze(-1)
    return bf16(ops.linear(_qdq(ops, h, quantized), down))


def routed_experts(ops, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, limit: float, quantized: bool) -> torch.Tensor:
    """sum_k expert_{ids[t, k]}(x[t], weights[t, k]) -> [T, D] float32. Experts run on the rows routed to
    them (only the experts hit); each token's k outputs are summed in a fixed order (slot order), so
    a token's result does not depend on which other tokens share the step."""
    num_tokens, top_k = ids.shape
    if not num_tokens:  # a context-parallel rank with no rows this step (the ops need some)
        return torch.zeros(0, x.shape[-1], device=x.device)
    xq = _qdq(ops, x, quantized)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    hit, counts = torch.unique_consecutive(flat[order], return_counts=True)
    token_of = order // top_k
    rows = torch.empty(num_tokens * top_k, x.shape[-1], dtype=torch.float32, device=x.device)
    begin = 0
    for expert, count in zip(hit.tolist(), counts.tolist()):
        sel = order[begin:begin + count]
        rows[begin:begin + count] = swiglu_expert(ops, xq[token_of[begin:begin + count]], gate_up[expert],
                                                  down[expert], limit, quantized, weights.reshape(-1)[sel])
        begin += count
    per_slot = torch.empty_like(rows)
    per_slot[order] = rows
    per_slot = per_slot.view(num_tokens, top_k, -1)
    out = per_slot[:, 0]
    for j in range(1, top_k):
        out = out + per_slot[:, j]
    return out


def swiglu_limit(limit: float) -> float:
    """The reference clamps only with a positive limit."""
    return limit if limit > 0 else math.inf
