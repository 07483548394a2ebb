"""Plain-torch references for what DeepSeek-V3 adds to deepinfer's op set, and the V3 numerics an
engine must reproduce, each checked against transformers in tests/oracle/test_v3_reference_ops.py.

- route_grouped_topk: the proposed new accelerator op (sigmoid, group-limited top-k routing with
  a selection-only bias, "noaux_tc"); bit-for-bit transformers' DeepseekV3TopkRouter.
- route_grouped_topk_per_token: the same contract written independently, one token at a time.
- yarn_rope / rope_cos_sin: inverse frequencies, the cos/sin attention factor and the softmax
  scale, from a config's rope_parameters (transformers' _compute_yarn_parameters and
  yarn_apply_mscale).
- mla_absorbed_attention: MLA in the absorbed form expressed with deepinfer's existing ops
  (grouped_linear, rms_norm, rope on interleaved pairs, sparse_attention over a latent pool);
  matches transformers' DeepseekV3Attention.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


# ------------------------------------------------------------------ the router (new op)
def route_grouped_topk(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int,
                       topk_group: int, norm_topk_prob: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing. x [T, D], gate [E, D], bias [E] float32 -> (weights [T, k] float32,
    ids [T, k] int64). See V3_NOTES.md for the contract; this is the same op sequence as
    transformers (so the same bits, including the column order of topk(sorted=False))."""
    num_tokens, num_experts = x.shape[0], gate.shape[0]
    scores = F.linear(x.float(), gate.float()).sigmoid()  # [T, E]
    biased = scores + bias.float()  # used to choose, never as a weight
    per_group = num_experts // n_group
    grouped = biased.view(num_tokens, n_group, per_group)
    group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]: the 2 best biased scores
    kept = torch.topk(group_score, k=topk_group, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_score).scatter_(1, kept, 1).bool()  # [T, G]
    allowed = keep.unsqueeze(-1).expand(-1, -1, per_group).reshape(num_tokens, num_experts)
    ids = torch.topk(biased.masked_fill(~allowed, float("-inf")), k=top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)  # the unbiased sigmoid scores of the chosen experts
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def route_grouped_topk_per_token(x, gate, bias, top_k, n_group, topk_group, norm_topk_prob, scaling):
    """The contract again, token by token in Python, sorted by biased score (descending, ties
    to the lower index): an independent statement of the semantics. Same ids as a set and the
    same weights up to the order of the k-term normalising sum."""
    scores = F.linear(x.float(), gate.float()).sigmoid()
    num_experts = gate.shape[0]
    per_group = num_experts // n_group
    all_w, all_ids = [], []
    for s in scores:
        b = (s + bias.float()).tolist()
        group_score = [sum(sorted(b[g * per_group:(g + 1) * per_group], reverse=True)[:2]) for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: (-group_score[g], g))[:topk_group]
        candidates = [e for g in groups for e in range(g * per_group, (g + 1) * per_group)]
        ids = sorted(candidates, key=lambda e: (-b[e], e))[:top_k]
        w = s[ids]
        if norm_topk_prob:
            w = w / (w.sum() + 1e-20)
        all_w.append(w * scaling)
        all_ids.append(torch.tensor(ids))
    return torch.stack(all_w), torch.stack(all_ids)


# ------------------------------------------------------------------ RoPE / YaRN
def _get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_rope(rope_parameters: dict, rope_dim: int, qk_head_dim: int,
              max_position_embeddings: int) -> tuple[torch.Tensor, float, float]:
    """-> (inv_freq [rope_dim / 2] float32, attention_factor (multiplies cos and sin),
    softmax_scale) from transformers 5's rope_parameters (rope_type "default" or "yarn").
    attention_factor: the rope_parameters' own, else mscale(f, mscale) / mscale(f, mscale_all_dim)
    when both are set and non-zero, else mscale(f) = 0.1 ln f + 1.
    softmax_scale: qk_head_dim^-0.5, times mscale(f, mscale_all_dim)^2 when mscale_all_dim is
    set and non-zero (yarn only)."""
    base = float(rope_parameters["rope_theta"])
    pos_freqs = base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    scale = qk_head_dim ** -0.5
    if rope_parameters.get("rope_type", "default") == "default":
        return 1.0 / pos_freqs, 1.0, scale
    factor = rope_parameters.get("factor")
    orig = rope_parameters["original_max_position_embeddings"]
    if factor is None:
        factor = max_position_embeddings / orig
    mscale, mscale_all_dim = rope_parameters.get("mscale"), rope_parameters.get("mscale_all_dim")
    attention_factor = rope_parameters.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(_get_mscale(factor, mscale) / _get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _get_mscale(factor)
    beta_fast = rope_parameters.get("beta_fast") or 32
    beta_slow = rope_parameters.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (rope_dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope_parameters.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # share of the original frequency (high-frequency pairs keep theirs)
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    if mscale_all_dim:
        m = _get_mscale(factor, mscale_all_dim)
        scale = scale * m * m  # in this order, as yarn_apply_mscale: the same float
    return inv_freq, attention_factor, scale


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, attention_factor: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, R/2] for deepinfer's rope op (one angle per channel pair), the attention
    factor multiplied in as transformers does: angle = float32(position) * inv_freq in float32."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return freqs.cos() * attention_factor, freqs.sin() * attention_factor


def rope_pairs_permutation(rope_dim: int) -> torch.Tensor:
    """For rope_interleave=False checkpoints (rotate_half: channel i pairs with i + R/2): the
    order of the rope rows (of q_b_proj / q_proj per head and of kv_a_proj_with_mqa's last R rows)
    that turns them into interleaved pairs, so deepinfer's rope op applies. Apply the same
    permutation to q and k: their dot product is unchanged."""
    half = rope_dim // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()


# ------------------------------------------------------------------ ops as deepinfer defines them
def grouped_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """base.py: x [T, G, K], weight [G*N, K] as G blocks [N, K] -> [T, G, N]."""
    groups, k = x.shape[-2], x.shape[-1]
    return torch.einsum("tgk,gnk->tgn", x, weight.view(groups, -1, k))


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """base.py: interleaved pairs on the trailing 2 * cos.shape[-1] channels."""
    r = 2 * cos.shape[-1]
    if x.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    nope, rot = x[..., :-r], x[..., -r:]
    x0, x1 = rot[..., 0::2], rot[..., 1::2]
    return torch.cat([nope, torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), -1).flatten(-2)], -1)


def sparse_attention(q, kv, indices, sinks, scale):
    """base.py: shared-KV MQA (K == V) over index lists, sinks join the softmax."""
    valid = indices >= 0
    keys = kv[indices.clamp(min=0)]  # [T, K, D]
    logits = torch.einsum("thd,tkd->thk", q, keys) * scale
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    sink = sinks.view(1, -1, 1).expand(logits.shape[0], -1, 1)
    probs = torch.softmax(torch.cat([logits, sink], -1), -1)[..., :-1]
    return torch.einsum("thk,tkd->thd", probs, keys)


# ------------------------------------------------------------------ MLA, absorbed
def absorbed_weights(kv_b_proj: torch.Tensor, num_heads: int, nope_dim: int, v_dim: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj.weight [H*(dn+dv), c] -> (W_UK^T stacked [H*c, dn]: grouped_linear from q_nope
    [T, H, dn] to the latent [T, H, c]; W_UV [H*dv, c]: grouped_linear from the attended latent
    [T, H, c] to [T, H, dv]). Per head h the rows are [k_nope (dn) | v (dv)]."""
    c = kv_b_proj.shape[-1]
    w = kv_b_proj.view(num_heads, nope_dim + v_dim, c)
    w_uk, w_uv = w[:, :nope_dim], w[:, nope_dim:]
    return w_uk.transpose(1, 2).reshape(num_heads * c, nope_dim).contiguous(), w_uv.reshape(num_heads * v_dim, c)


def mla_absorbed_attention(attn, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                           attention_factor: float, scale: float) -> torch.Tensor:
    """transformers' DeepseekV3Attention (module `attn`) on one causal sequence, computed as an
    engine with a latent cache does: x [T, D] (the layer's normed input), positions [T] ->
    o_proj input-and-output [T, D]. Each token's cache row is [kv_a_layernorm(latent) | rope(k_pe)]
    (c + R floats); a query's row is [q_nope @ W_UK (per head, c) | rope(q_pe) (R)]; the pool is
    attended as MQA with K = the whole row, V = the same row (its first c channels are kept)."""
    cfg = attn.config
    heads, dn, dr, dv, c = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    eps = attn.kv_a_layernorm.variance_epsilon
    t = x.shape[0]
    if attn.q_lora_rank is None:
        q = F.linear(x, attn.q_proj.weight)
    else:
        q = F.linear(rms_norm(F.linear(x, attn.q_a_proj.weight), attn.q_a_layernorm.weight, eps), attn.q_b_proj.weight)
    q = q.view(t, heads, dn + dr)
    kv = F.linear(x, attn.kv_a_proj_with_mqa.weight)  # [T, c + R]
    q_nope, q_pe = q[..., :dn], q[..., dn:]
    latent, k_pe = kv[:, :c], kv[:, c:]
    if not cfg.rope_interleave:  # rotate_half checkpoints: reorder the rope channels into pairs
        perm = rope_pairs_permutation(dr)
        q_pe, k_pe = q_pe[..., perm], k_pe[..., perm]
    cos, sin = rope_cos_sin(inv_freq, positions, attention_factor)
    row = torch.cat([rms_norm(latent, attn.kv_a_layernorm.weight, eps), rope(k_pe, cos, sin)], -1)  # cache
    w_uk_t, w_uv = absorbed_weights(attn.kv_b_proj.weight, heads, dn, dv)
    q_row = torch.cat([grouped_linear(q_nope, w_uk_t), rope(q_pe, cos, sin)], -1)  # [T, H, c + R]
    causal = torch.arange(t)[None, :].expand(t, t)
    indices = torch.where(causal <= torch.arange(t)[:, None], causal, torch.full_like(causal, -1))
    no_sink = torch.full((heads,), float("-inf"))
    attended = sparse_attention(q_row, row, indices, no_sink, scale)[..., :c]  # [T, H, c]
    out = grouped_linear(attended, w_uv).reshape(t, heads * dv)
    return F.linear(out, attn.o_proj.weight)
