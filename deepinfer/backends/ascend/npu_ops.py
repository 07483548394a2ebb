"""Ops computed by torch_npu fused operators. `bind(torch_npu)` is called by AscendAccelerator once
torch_npu has been imported (lazily, never at package import).

Signatures followed (Ascend PyTorch API reference, torch_npu 7.0.0):
- npu_rms_norm(self, gamma, epsilon=1e-6) -> (y, rstd); y = x * rsqrt(mean(x^2) + eps) * gamma.
- npu_swiglu(input, dim=-1) -> silu(A) * B, A/B the first/second half along dim; contiguous input.
- npu_grouped_matmul([x], [w], group_list=counts, split_item=2, group_type=0, group_list_type=1)
  -> [y]: rows of x grouped by expert along M (group_list_type=1: rows per group), y_g = x_g @ w[g]
  with w one 3-D [E, K, N] tensor (how vllm-ascend calls it for MoE).

The expert permutation is a stable torch argsort + gather (the reference's grouping), not
npu_moe_init_routing_v2: that fusion is the next step once it can be checked on hardware.

Quantized weights. No torch_npu matmul documents DeepSeek's formats: npu_weight_quant_batchmatmul
(torch_npu 7.0.0 API reference) takes int8 / int4 weights with per-channel or per-group
antiquant scales, not float8_e4m3fn or e2m1 values; npu_quant_matmul multiplies int8 / int4
operands with 1-D per-channel weight scales and per-token activation scales, no 2-D block scales;
npu_grouped_matmul is used here unquantized. So FP8 / FP4 weights stay in memory as loaded and are widened per call:
a dense weight by the reference (row chunks), routed experts only where the call hits them.
"""

from __future__ import annotations

import torch

from deepinfer.backends.quant import QuantizedWeight

_npu = None  # the torch_npu module, set by bind()

def bind(torch_npu) -> None:
    global _npu
    _npu = torch_npu


def prepare_expert_weight(tensor: torch.Tensor) -> torch.Tensor:
    """[E, N, K] checkpoint layout -> [E, K, N] contiguous, the layout npu_grouped_matmul multiplies
    by (done once, at load, for weights of role EXPERTS)."""
    return tensor.transpose(1, 2).contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x = x.float()
    if x.numel() == 0:
        return x.clone()
    gamma = torch.ones(x.shape[-1], dtype=torch.float32, device=x.device) if weight is None else weight.float()
    return _npu.npu_rms_norm(x, gamma, epsilon=float(eps))[0]


def _swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    # our swiglu clamps its inputs first (gate from above, up both ways); npu_swiglu then is exact
    both = torch.cat([gate.float().clamp(max=limit), up.float().clamp(min=-limit, max=limit)], dim=-1)
    return _npu.npu_swiglu(both.contiguous(), dim=-1)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    if gate.numel() == 0:
        return torch.empty(gate.shape, dtype=torch.float32, device=gate.device)
    return _swiglu_clamped(gate, up, limit)


def _experts_for_call(stack, hit: torch.Tensor | None) -> torch.Tensor:
    """The [E', K, N] float32 stack npu_grouped_matmul multiplies: as prepared (float32, transposed at
    load), or, for narrower storage, only the experts `hit` widened for this call (a QuantizedWeight
    in the checkpoint's [E, N, K] layout is transposed too)."""
    if hit is None:
        return stack
    if isinstance(stack, QuantizedWeight):
        return stack[hit].dequantize().transpose(1, 2).contiguous()
    return stack[hit].float()


def round_bf16(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.bfloat16).float()


def moe_experts(x, weights, ids, gate_up, down, limit, act=None):
    """gate_up [E, D, 2I], down [E, I, D]: the layouts prepare_weight stored (role EXPERTS), float32;
    bf16 stacks (same layout) and QuantizedWeight stacks ([E, 2I, D] / [E, D, I]) are widened per call,
    only the experts the call hits (npu_grouped_matmul takes no FP8 / FP4 weights: npu_ops' doc).
    `act` (a callable: FP8 quantize-dequantize or round_bf16) selects moe_experts_bf16's numerics:
    each GEMM input through it, each GEMM output rounded to bf16, the routing weight scaling the
    intermediate, the slots' outputs summed unweighted in slot order."""
    num_tokens, top_k = ids.shape
    if num_tokens == 0:
        return torch.zeros(0, x.shape[-1], dtype=torch.float32, device=x.device)
    narrow = isinstance(gate_up, QuantizedWeight) or gate_up.dtype != torch.float32
    hit = None
    if narrow:
        hit, ids = torch.unique(ids, return_inverse=True)
    gate_up, down = _experts_for_call(gate_up, hit), _experts_for_call(down, hit)
    num_experts, inter = gate_up.shape[0], gate_up.shape[2] // 2
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # the reference's grouping by expert
    counts = torch.bincount(flat_ids, minlength=num_experts).to(torch.int64)
    rows = (x.float() if act is None else act(x.float()))[order // top_k].contiguous()
    h = _npu.npu_grouped_matmul([rows], [gate_up], group_list=counts, split_item=2, group_type=0,
                                group_list_type=1)[0]
    if act is not None:
        h = round_bf16(h)
    hidden = _swiglu_clamped(h[:, :inter], h[:, inter:], limit)
    if act is not None:
        hidden = act(hidden * weights.reshape(-1)[order].float().unsqueeze(-1)).contiguous()
    out_rows = _npu.npu_grouped_matmul([hidden], [down], group_list=counts, split_item=2, group_type=0,
                                       group_list_type=1)[0]
    # token-major order, then a fixed-order sum over each token's k experts (as the reference)
    per_slot = torch.empty_like(out_rows)
    per_slot[order] = out_rows
    per_slot = per_slot.view(num_tokens, top_k, -1)
    if act is None:
        return (per_slot * weights.float().unsqueeze(-1)).sum(dim=1)
    per_slot = round_bf16(per_slot)
    out = per_slot[:, 0]
    for j in range(1, top_k):
        out = out + per_slot[:, j]
    return out
