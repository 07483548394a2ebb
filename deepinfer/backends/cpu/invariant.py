"""Batch-invariant versions of the cpu ops (DEEPINFER_BATCH_INVARIANT=1).

A token's result must not depend on which other tokens share the step, on its row within
the step, or on how far the step's index lists are padded with -1. On this backend four
things break that in the fast ops (measured, tests/unit/test_batch_invariance.py):
- MKL's sgemm picks its kernel by row count: a 1-row F.linear, a 2-3-row one and a
  >= 4-row one round differently (~1e-6), and with 2+ threads the split moves again.
  Here every GEMM runs on fixed-shape operands: rows are padded to ROW_BLOCK and the
  product is a bmm over [n_blocks, ROW_BLOCK, K] blocks, so each row always meets the same
  [ROW_BLOCK, K] x [K, N] kernel, whatever the block count and its place in the block.
- ATen's vectorised sigmoid / silu / softplus differ by an ulp from their scalar tail
  loop, and which elements land in the tail depends on the tensor's size. They are written
  here with exp / log1p / division, whose vector and scalar paths agree bit for bit.
- Attention and indexer scores were reduced over the whole (batch-padded) index width.
  Here keys are processed in fixed KEY_BLOCK-column blocks of the index list: scores are
  [H, D] x [D, KEY_BLOCK] products, and attention is an online softmax that starts from
  the sink and folds the blocks in column order. A block with no valid index is an exact
  no-op (its weights are exactly 0 and the running max does not move), so trailing -1
  padding, whatever its width, cannot change a result.
- A reduction along a non-innermost dim with a small output (the compressor's softmax over a
  window's tokens) is split over threads along the reduced dim: written here as scans.
Ops not redefined here (embedding, rms_norm, rope, hc_post, sample, apply_token_bitmask, and
DeepSeek-V4.1's indexer_scores / sparse_attention_bf16, which already reduce in fixed blocks of a
token's own row with bmm) are row-wise with fixed per-row shapes; the tests check them.
"""

from __future__ import annotations

import torch

from deepinfer.backends.reference import _QUERY_BLOCK, grouped_topk_ids, hc_split, rms_norm, topk_by_query_blocks

ROW_BLOCK = 16
KEY_BLOCK = 64


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    return torch.reciprocal(torch.exp(-x) + 1.0)


def _softplus(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(x.clamp(max=20.0))))


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    lead, k, n = x.shape[:-1], x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    blocks = -(-rows // ROW_BLOCK)
    if blocks == 0:
        return x.new_empty(*lead, n, dtype=torch.float32)
    padded = x2.new_zeros(blocks * ROW_BLOCK, k, dtype=torch.float32)
    padded[:rows] = x2
    out = torch.bmm(padded.view(blocks, ROW_BLOCK, k), weight.t().expand(blocks, k, n))
    return out.view(-1, n)[:rows].view(*lead, n)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    groups, k = x.shape[-2], x.shape[-1]
    w = weight.view(groups, -1, k)
    return torch.stack([linear(x[:, g], w[g]) for g in range(groups)], dim=1)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    gate = gate.clamp(max=limit)
    return gate * _sigmoid(gate) * up.clamp(min=-limit, max=limit)


def swiglu_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, limit: float) -> torch.Tensor:
    gate, up = linear(x, gate_up).chunk(2, dim=-1)
    return linear(swiglu(gate, up, limit), down)


def _weighted_streams(weights: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """sum_n weights[:, n] * streams[:, n], always in stream order."""
    out = weights[:, 0, None] * streams[:, 0]
    for n in range(1, streams.shape[1]):
        out = out + weights[:, n, None] * streams[:, n]
    return out


def _hc_mix(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    return linear(rms_norm(streams.flatten(-2), None, norm_eps), fn)


def hc_mixes(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
    n = streams.shape[-2]
    flat = streams.flatten(-2).float()
    mix = linear(flat, fn) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
    pre_b, post_b, _ = base.split([n, n, n * n])
    _, _, comb = hc_split(mix, base, scale, n, hc_eps, sinkhorn_iters)  # softmax and sums: row-wise
    return _sigmoid(pre_w * scale[0] + pre_b) + hc_eps, 2 * _sigmoid(post_w * scale[1] + post_b), comb


def hc_collapse(streams, weights):
    return _weighted_streams(weights.float(), streams.float())


def hc_pre(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
    n = streams.shape[-2]
    mix = _hc_mix(streams, fn, norm_eps)
    pre_w, post_w, _ = mix.split([n, n, n * n], dim=-1)
    pre_b, post_b, _ = base.split([n, n, n * n])
    _, _, comb = hc_split(mix, base, scale, n, hc_eps, sinkhorn_iters)
    pre = _sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    return _weighted_streams(pre, streams), 2 * _sigmoid(post_w * scale[1] + post_b), comb


def hc_head(streams, fn, base, scale, norm_eps, hc_eps):
    pre = _sigmoid(_hc_mix(streams, fn, norm_eps) * scale + base) + hc_eps
    return _weighted_streams(pre, streams)


def _pad_columns(index: torch.Tensor, block: int) -> torch.Tensor:
    extra = -index.shape[1] % block
    return torch.nn.functional.pad(index, (0, extra), value=-1) if extra else index


def indexer_topk(q, weights, keys, candidates, topk, scale):
    def scores_of(sl: slice, cand: torch.Tensor) -> torch.Tensor:
        qs, head_w = q[sl].float(), weights[sl].float().unsqueeze(1)  # [t, H, Di], [t, 1, H]
        padded = _pad_columns(cand, KEY_BLOCK)
        scores = torch.empty(padded.shape, dtype=torch.float32, device=q.device)
        for b in range(0, padded.shape[1], KEY_BLOCK):
            blk = padded[:, b:b + KEY_BLOCK]
            gathered = keys[blk.clamp(min=0)].float()  # [t, KB, Di]
            per_head = torch.relu(torch.bmm(qs, gathered.transpose(1, 2))) * scale  # [t, H, KB]
            scores[:, b:b + KEY_BLOCK] = torch.bmm(head_w, per_head).squeeze(1)
        return scores[:, :cand.shape[1]]

    return topk_by_query_blocks(candidates, topk, scores_of)


def sparse_attention(q, kv, indices, sinks, scale):
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
    padded = _pad_columns(indices, KEY_BLOCK)
    for start in range(0, num_tokens, _QUERY_BLOCK):
        sl = slice(start, start + _QUERY_BLOCK)
        qs, idx = q[sl].float(), padded[sl]
        t = qs.shape[0]
        # the sink is the first "key": running max starts at it, with weight exp(0) = 1 and no value
        run_max = sinks.float().view(1, -1, 1).expand(t, -1, 1).clone()
        denom = torch.ones(t, num_heads, 1, dtype=torch.float32, device=q.device)
        acc = torch.zeros(t, num_heads, head_dim, dtype=torch.float32, device=q.device)
        for b in range(0, idx.shape[1], KEY_BLOCK):
            blk = idx[:, b:b + KEY_BLOCK]
            valid = blk >= 0
            if not bool(valid.any()):
                continue  # exact no-op for every row, so skipping it changes nothing
            keys = kv[blk.clamp(min=0)].float()  # [t, KB, D]
            logits = torch.bmm(qs, keys.transpose(1, 2)) * scale  # [t, H, KB]
            logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
            new_max = torch.maximum(run_max, logits.amax(dim=-1, keepdim=True))
            # no sink (-inf) and no valid key yet in a row: nothing to rescale, weights 0 (not NaN)
            safe_max = new_max.masked_fill(torch.isneginf(new_max), 0.0)
            rescale = torch.exp(run_max - safe_max)
            p = torch.exp(logits - safe_max)
            denom = denom * rescale + p.sum(dim=-1, keepdim=True)
            acc = acc * rescale + torch.bmm(p, keys)
            run_max = new_max
        # denom is 0 only without a sink and without a valid index: such a token gets zeros
        out[sl] = torch.where(denom > 0, acc / denom, 0.0)
    return out


def _normalized(weights: torch.Tensor) -> torch.Tensor:
    """weights / (their sum over k + 1e-20), the sum in k order (ATen may split it by batch)."""
    total = weights[:, 0]
    for j in range(1, weights.shape[1]):
        total = total + weights[:, j]
    return weights / (total.unsqueeze(1) + 1e-20)


def _normalize_weights(scores: torch.Tensor, ids: torch.Tensor, scaling: float) -> torch.Tensor:
    return _normalized(scores.gather(1, ids)) * scaling


def route_topk(x, gate, bias, top_k, scaling):
    scores = _softplus(linear(x.float(), gate)).sqrt()
    ids = torch.topk(scores + bias, top_k, dim=-1, sorted=False).indices
    return _normalize_weights(scores, ids, scaling), ids


def route_grouped_topk(x, gate, bias, top_k, n_group, topk_group, normalize, scaling):
    scores = _sigmoid(linear(x.float(), gate))
    ids = grouped_topk_ids(scores, bias, top_k, n_group, topk_group)
    weights = scores.gather(1, ids)
    return (_normalized(weights) if normalize else weights) * scaling, ids


def route_hash(x, gate, ids, scaling):
    return _normalize_weights(_softplus(linear(x.float(), gate)).sqrt(), ids, scaling)


def moe_experts(x, weights, ids, gate_up, down, limit):
    num_tokens, top_k = ids.shape
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    hit, counts = torch.unique_consecutive(flat_ids[order], return_counts=True)
    token_of = order // top_k
    rows = torch.empty(num_tokens * top_k, x.shape[-1], dtype=torch.float32, device=x.device)
    begin = 0
    for expert, count in zip(hit.tolist(), counts.tolist()):
        sel = token_of[begin:begin + count]
        g, u = linear(x[sel], gate_up[expert]).chunk(2, dim=-1)
        rows[begin:begin + count] = linear(swiglu(g, u, limit), down[expert])
        begin += count
    per_slot = torch.empty_like(rows)
    per_slot[order] = rows
    per_slot = per_slot.view(num_tokens, top_k, -1)
    out = weights[:, 0, None] * per_slot[:, 0]
    for j in range(1, top_k):  # fixed slot order
        out = out + weights[:, j, None] * per_slot[:, j]
    return out


def compress_windows(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """softmax over the window's tokens, weighted sum of kv, with both sums as scans along the
    window: ATen splits a reduction whose output is small over threads along the reduced dim, so
    softmax / sum rounded a window differently with 2 threads depending on how many windows the
    step finished. A scan runs each output's sum in order on one thread; max is exact in any order."""
    gate = gate.float()
    weight = (gate - gate.amax(dim=1, keepdim=True)).exp()
    return (kv.float() * weight).cumsum(dim=1)[:, -1] / weight.cumsum(dim=1)[:, -1]


OPS = ("linear", "grouped_linear", "swiglu", "swiglu_mlp", "hc_pre", "hc_mixes", "hc_collapse", "hc_head",
       "indexer_topk", "sparse_attention", "route_topk", "route_grouped_topk", "route_hash", "moe_experts",
       "compress_windows")
