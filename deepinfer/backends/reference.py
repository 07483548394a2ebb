"""Reference implementations of every Accelerator op, in plain float32 torch.

These define the numerics the other backends are tested against. They are
also the cpu backend's hot path, so they are batched: no Python loop over
tokens, and MoE loops only over the experts that were hit. Weight ops take
float32, bf16 / f16 or quantized weights (backends/quant.py): the reference
widens them to float32 (in bounded row chunks) and multiplies in float32.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from deepinfer.backends.quant import QuantizedWeight, Weight, act_quant, widen

# Queries per block in sparse_attention / indexer_topk: bounds the gathered
# [block, K, D] tensor so long prefills do not allocate T*K*D at once.
_QUERY_BLOCK = 256


# Weights stored narrower than float32 (bf16, FP8, FP4: backends/quant.py) are widened this many
# bytes of float32 rows at a time: a 129,280-row bf16 LM head never exists as one float32 copy.
_WIDEN_BYTES = 32 << 20


def _rows(weight: Weight, start: int, stop: int) -> torch.Tensor:
    """float32 rows [start, stop) of a [N, K] weight of either kind."""
    if isinstance(weight, QuantizedWeight):
        return weight.rows(start, stop).dequantize()
    return weight[start:stop].float()


def linear(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """y = x @ widen(weight).T in float32; a QuantizedWeight's `act` quantizes x first."""
    if isinstance(weight, torch.Tensor) and weight.dtype == torch.float32:
        return F.linear(x.float(), weight)
    if isinstance(weight, QuantizedWeight) and weight.act is not None:
        x = act_quant(x, weight.act)
    x = x.float()
    n, k = weight.shape
    step = _WIDEN_BYTES // (4 * max(k, 1))
    if isinstance(weight, QuantizedWeight):  # whole row blocks: no refined scale grids
        step = max(weight.block[0], step - step % weight.block[0])
    if step >= n:
        return F.linear(x, widen(weight))
    out = x.new_empty(*x.shape[:-1], n)
    for start in range(0, n, step):
        out[..., start:start + step] = F.linear(x, _rows(weight, start, min(n, start + step)))
    return out


def grouped_linear(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    groups, k = x.shape[-2], x.shape[-1]
    if isinstance(weight, torch.Tensor) and weight.dtype == torch.float32:
        w = weight.view(groups, -1, k)  # [G, N, K]
        return torch.einsum("tgk,gnk->tgn", x.float(), w)
    n = weight.shape[0] // groups
    if isinstance(weight, QuantizedWeight) and weight.act is not None:
        x = act_quant(x, weight.act)
    return torch.stack([F.linear(x[:, g].float(), _rows(weight, g * n, (g + 1) * n)) for g in range(groups)], dim=1)


FP8_MAX = 448.0  # largest finite float8_e4m3fn
_FP8_AMAX_FLOOR = 1e-4  # DeepSeek's act_quant guard: an all-zero group gets a finite scale


def fp8_block_quant(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (float8_e4m3fn [R, C], float32 scales [ceil(R/b0), ceil(C/b1)]), one scale
    max(amax, 1e-4) / 448 per block[0] x block[1] tile (edge tiles partial). (1, 128) is
    DeepSeek's act_quant, (128, 128) its weight quantization."""
    (r, c), (b0, b1) = x.shape, block
    rb, cb = -(-r // b0), -(-c // b1)
    tiled = F.pad(x.float(), (0, cb * b1 - c, 0, rb * b0 - r)).view(rb, b0, cb, b1)
    scale = tiled.abs().amax(dim=(1, 3)).clamp(min=_FP8_AMAX_FLOOR) / FP8_MAX
    q = (tiled / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.view(rb * b0, cb * b1)[:r, :c].contiguous(), scale


# ---------------------------------------------------------------- DeepSeek-V4.1's quantization points
# Bit-exact to DeepSeek's quantizers (tests/goldens/v41: ops act_quant / fp4_e8m0 / fp4_e4m3). Their input
# is bf16 (the trained format): a float32 x is rounded to bf16 first.
_FP8_MAX_INV = torch.tensor(1 / 448, dtype=torch.float32)  # the kernels multiply by this rounded reciprocal
_FP4_MAX_INV = torch.tensor(1 / 6, dtype=torch.float32)
_E2M1_CODE = torch.tensor([0, 1, 2, 3, 4, -1, 5, -1, 6, -1, -1, -1, 7], dtype=torch.uint8)  # by 2*|value|


def pow2_scale(amax: torch.Tensor, max_inv: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(amax * max_inv)) from the float32 product's bits: its exponent, plus one if any
    mantissa bit is set (DeepSeek's fast_round_scale; E8M0 scales)."""
    bits = (amax.float() * max_inv.to(amax.device)).contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def _groups(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the quantization group {block}")
    return x.to(torch.bfloat16).float().unflatten(-1, (-1, block))


def fp8_quantize(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 per `block` of the last dim with power-of-two scales: (codes float8_e4m3fn [..., K],
    scales float32 [..., K / block]). amax floored at 1e-4, values clamped to +-448, round to nearest even."""
    g = _groups(x, block)
    s = pow2_scale(g.abs().amax(dim=-1).clamp_min(1e-4), _FP8_MAX_INV)
    q = (g / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), s


def fp8_qdq(x: torch.Tensor, block: int) -> torch.Tensor:
    q, s = fp8_quantize(x, block)
    return (q.float().unflatten(-1, (-1, block)) * s.unsqueeze(-1)).flatten(-2)


def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """float32 in [-6, 6] -> the nearest e2m1 value {0, .5, 1, 1.5, 2, 3, 4, 6} (signed), ties to the even
    code: a value's quantum is half its binade's power of two 2^floor(log2|v|) (taken from the exponent
    bits), at least 0.5, and torch.round rounds half to even."""
    mag = v.abs()
    binade = (mag.view(torch.int32) & 0x7F800000).clamp(0x3F800000, 0x40800000).view(torch.float32)  # in [1, 4]
    quantum = binade * 0.5
    return torch.copysign(torch.round(mag / quantum) * quantum, v)


def _fp4_values(x: torch.Tensor, block: int, e4m3_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the e2m1 values [..., K / block, block] before scaling, the scales [..., K / block])."""
    g = _groups(x, block)
    amax = g.abs().amax(dim=-1)
    if e4m3_scale:
        s = (amax.clamp_min(6 * 2 ** -9) / 6).clamp(max=FP8_MAX).to(torch.float8_e4m3fn).float()
    else:
        s = pow2_scale(amax.clamp_min(6 * 2 ** -126), _FP4_MAX_INV)
    return e2m1_round((g / s.unsqueeze(-1)).clamp(-6, 6)), s


def fp4_quantize(x: torch.Tensor, block: int, e4m3_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 e2m1 per `block` of the last dim: (4-bit codes uint8 [..., K] (bit 3 the sign), scales float32
    [..., K / block]). E8M0 scales (e4m3_scale False; the indexer's, block 32): amax floored at 6 * 2^-126,
    s = 2^ceil(log2(amax * fp32(1/6))). E4M3 scales (compressed KV, block 16): amax floored at 6 * 2^-9,
    s = e4m3(min(amax / 6, 448)), a division. Values x / s (a division) clamped to +-6, rounded to e2m1."""
    v, s = _fp4_values(x, block, e4m3_scale)
    codes = _E2M1_CODE.to(v.device)[(2 * v.abs()).long()] | (torch.signbit(v).to(torch.uint8) << 3)
    return codes.flatten(-2), s


def fp4_qdq(x: torch.Tensor, block: int, e4m3_scale: bool = False) -> torch.Tensor:
    v, s = _fp4_values(x, block, e4m3_scale)
    return (v * s.unsqueeze(-1)).flatten(-2)


def embedding(ids: torch.Tensor, weight: Weight) -> torch.Tensor:
    if isinstance(weight, QuantizedWeight):
        return weight.gather_rows(ids).dequantize()
    return F.embedding(ids, weight).float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x = x.float()
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    rope_dim = 2 * cos.shape[-1]
    if x.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    if inverse:
        sin = -sin
    nope, r = x[..., :-rope_dim], x[..., -rope_dim:].float()
    x0, x1 = r[..., 0::2], r[..., 1::2]
    rotated = torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1).flatten(-2)
    return torch.cat([nope, rotated], dim=-1)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def swiglu_mlp(x: torch.Tensor, gate_up: Weight, down: Weight, limit: float) -> torch.Tensor:
    gate, up = linear(x, gate_up).chunk(2, dim=-1)
    return linear(swiglu(gate, up, limit), down)


def _hc_mix(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    flat = rms_norm(streams.flatten(-2), None, norm_eps)
    return F.linear(flat, fn)


def hc_split(mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, hc_eps: float,
             sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mixes [T, (2+N)N] -> (pre, post, Sinkhorn-normalised comb), shared with invariant.py."""
    pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.reshape(-1, n, n) * scale[2] + comb_b.view(n, n), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_mixes(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
    # DeepSeek-V4.1's order: project the raw stream, then scale by its rsqrt(mean square)
    flat = streams.flatten(-2).float()
    mix = F.linear(flat, fn) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return hc_split(mix, base, scale, streams.shape[-2], hc_eps, sinkhorn_iters)


def hc_collapse(streams, weights):
    return (weights.float().unsqueeze(-1) * streams.float()).sum(dim=-2)


def hc_pre(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
    pre, post, comb = hc_mixes(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)
    return hc_collapse(streams, pre), post, comb


def hc_post(block_out, streams, post, comb):
    return post.unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)


def hc_head(streams, fn, base, scale, norm_eps, hc_eps):
    mix = _hc_mix(streams, fn, norm_eps)
    pre = torch.sigmoid(mix * scale + base) + hc_eps
    return (pre.unsqueeze(-1) * streams).sum(dim=-2)


def compress_windows(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return (kv.float() * gate.float().softmax(dim=1)).sum(dim=1)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def indexer_scores(q, weights, keys, candidates):
    out = torch.empty(candidates.shape, dtype=torch.float32, device=q.device)
    for start in range(0, candidates.shape[0], _QUERY_BLOCK):
        sl = slice(start, start + _QUERY_BLOCK)
        gathered = keys[candidates[sl].clamp(min=0)].float()  # [t, M, Di]
        per_head = _bf16(torch.bmm(q[sl].float(), gathered.transpose(1, 2))).relu()  # [t, H, M]
        out[sl] = _bf16((_bf16(per_head * weights[sl].float().unsqueeze(-1))).sum(dim=1))
    return out.masked_fill_(candidates < 0, float("-inf"))


def indexer_topk(q, weights, keys, candidates, topk, scale):
    def scores_of(sl: slice, cand: torch.Tensor) -> torch.Tensor:
        gathered = keys[cand.clamp(min=0)].float()  # [t, M, Di]
        scores = torch.relu(torch.einsum("thd,tmd->thm", q[sl].float(), gathered)) * scale
        return (scores * weights[sl].float().unsqueeze(-1)).sum(dim=1)  # [t, M]

    return topk_by_query_blocks(candidates, topk, scores_of)


def topk_by_query_blocks(candidates: torch.Tensor, topk: int, scores_of) -> torch.Tensor:
    """The indexer's pick, shared with invariant.py: queries in blocks of _QUERY_BLOCK (bounded
    [t, M, Di] gathers), scores_of(rows, candidates of those rows) -> [t, M] scores."""
    num_tokens, num_cand = candidates.shape
    k = min(topk, num_cand)
    out = torch.full((num_tokens, k), -1, dtype=torch.int64, device=candidates.device)
    if k == 0 or num_tokens == 0:
        return out
    for start in range(0, num_tokens, _QUERY_BLOCK):
        sl = slice(start, start + _QUERY_BLOCK)
        cand = candidates[sl]
        out[sl] = pick_topk(scores_of(sl, cand).masked_fill(cand < 0, float("-inf")), cand, k)
    return out


def pick_topk(scores: torch.Tensor, cand: torch.Tensor, k: int) -> torch.Tensor:
    """The k best candidates per row (-1 where fewer are valid, i.e. score -inf). A stable sort:
    equal scores keep candidate order, so the pick never depends on padding width."""
    values, order = scores.sort(dim=-1, descending=True, stable=True)
    picked = cand.gather(1, order[:, :k])
    return torch.where(torch.isfinite(values[:, :k]), picked, torch.full_like(picked, -1))


def sparse_attention(q, kv, indices, sinks, scale):
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
    no_sink = bool(torch.isneginf(sinks).any())
    for start in range(0, num_tokens, _QUERY_BLOCK):
        sl = slice(start, start + _QUERY_BLOCK)
        idx = indices[sl]
        valid = idx >= 0
        keys = kv[idx.clamp(min=0)].float()  # [t, K, D]
        logits = torch.einsum("thd,tkd->thk", q[sl].float(), keys) * scale
        logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
        sink = sinks.float().view(1, -1, 1).expand(logits.shape[0], -1, 1)
        combined = torch.cat([logits, sink], dim=-1)
        probs = torch.softmax(combined, dim=-1)[..., :-1]
        if no_sink:  # a softmax over nothing (no valid index) is 0/0: such a token gets zeros
            probs = probs.masked_fill(~valid.any(dim=1)[:, None, None], 0.0)
        out[sl] = torch.einsum("thk,tkd->thd", probs, keys)
    return out


SPARSE_BLOCK = 64  # DeepSeek-V4.1's online-softmax block (sparse_attention_bf16)


def sparse_attention_bf16(q, kv, indices, sinks, scale):
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
    for start in range(0, num_tokens, _QUERY_BLOCK):
        sl = slice(start, start + _QUERY_BLOCK)
        qs, idx = q[sl].float(), indices[sl]
        t = qs.shape[0]
        run_max = torch.full((t, num_heads, 1), -1e30, dtype=torch.float32, device=q.device)
        denom = torch.zeros(t, num_heads, 1, dtype=torch.float32, device=q.device)
        acc = torch.zeros(t, num_heads, head_dim, dtype=torch.float32, device=q.device)
        for b in range(0, idx.shape[1], SPARSE_BLOCK):
            blk = idx[:, b:b + SPARSE_BLOCK]
            valid = blk >= 0
            keys = kv[blk.clamp(min=0)].float() * valid.unsqueeze(-1)  # [t, KB, D]
            logits = torch.bmm(qs, keys.transpose(1, 2)).masked_fill(~valid.unsqueeze(1), float("-inf")) * scale
            new_max = torch.maximum(run_max, logits.amax(dim=-1, keepdim=True))
            rescale = torch.exp(run_max - new_max)
            p = torch.exp(logits - new_max)
            denom = denom * rescale + p.sum(dim=-1, keepdim=True)
            acc = acc * rescale + torch.bmm(_bf16(p), keys)
            run_max = new_max
        denom = denom + torch.exp(sinks.float().view(1, -1, 1) - run_max)
        out[sl] = acc / denom
    return out


# Largest [H, queries, keys] logits block dense_attention materialises (float32 elements: 64 MB).
_DENSE_LOGITS = 1 << 24


def dense_attention(q, k, v, lens, scale):
    num_tokens, num_heads, head_dim = q.shape
    if sum(lens) != num_tokens or min(lens, default=0) < 0:
        raise ValueError(f"dense_attention: lens {list(lens)} must be >= 0 and sum to the {num_tokens} tokens")
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
    start = 0
    for n in lens:
        keys = k[start:start + n].float().transpose(0, 1)  # [H, n, D]
        values = v[start:start + n].float().transpose(0, 1)
        block = max(1, _DENSE_LOGITS // max(num_heads * n, 1))
        for q0 in range(start, start + n, block):
            q1 = min(q0 + block, start + n)
            logits = torch.matmul(q[q0:q1].float().transpose(0, 1), keys.transpose(1, 2)) * scale
            out[q0:q1] = torch.matmul(logits.softmax(dim=-1), values).transpose(0, 1)
        start += n
    return out


def _normalize_weights(scores: torch.Tensor, ids: torch.Tensor, scaling: float) -> torch.Tensor:
    weights = scores.gather(1, ids)
    return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * scaling


def route_topk(x, gate, bias, top_k, scaling):
    scores = F.softplus(linear(x.float(), gate)).sqrt()
    ids = torch.topk(scores + bias, top_k, dim=-1, sorted=False).indices
    return _normalize_weights(scores, ids, scaling), ids


def route_grouped_topk(x, gate, bias, top_k, n_group, topk_group, normalize, scaling):
    """transformers' DeepseekV3TopkRouter op for op (the same bits on a float32 gate, column order
    included); a bf16 gate is widened as `linear` widens it."""
    scores = torch.sigmoid(linear(x.float(), gate))
    ids = grouped_topk_ids(scores, bias, top_k, n_group, topk_group)
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def grouped_topk_ids(scores: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int,
                     topk_group: int) -> torch.Tensor:
    """route_grouped_topk's selection from its scores s [T, E] -> ids [T, top_k]: torch.topk as
    transformers, shared by the backends that compute the scores in kernels."""
    num_tokens, num_experts = scores.shape
    biased = scores + bias
    if topk_group < n_group:  # keep the topk_group groups whose two best biased scores sum highest
        group_score = biased.view(num_tokens, n_group, -1).topk(2, dim=-1).values.sum(dim=-1)
        kept = torch.topk(group_score, k=topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, kept, True)
        biased = biased.masked_fill(~keep.repeat_interleave(num_experts // n_group, dim=1), float("-inf"))
    return torch.topk(biased, k=top_k, dim=-1, sorted=False).indices


def route_hash(x, gate, ids, scaling):
    scores = F.softplus(linear(x.float(), gate)).sqrt()
    return _normalize_weights(scores, ids, scaling)


def moe_experts(x, weights, ids, gate_up, down, limit):
    num_tokens, top_k = ids.shape
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # deterministic grouping by expert
    hit, counts = torch.unique_consecutive(flat_ids[order], return_counts=True)
    token_of = order // top_k
    rows = torch.empty(num_tokens * top_k, x.shape[-1], dtype=torch.float32, device=x.device)
    begin = 0
    for expert, count in zip(hit.tolist(), counts.tolist()):  # only experts that were hit
        sel = token_of[begin:begin + count]
        g, u = linear(x[sel], gate_up[expert]).chunk(2, dim=-1)
        rows[begin:begin + count] = linear(swiglu(g, u, limit), down[expert])
        begin += count
    # back to token-major order, then a fixed-order sum over each token's k experts
    # (deterministic, unlike scattered index_add_ accumulation)
    per_slot = torch.empty_like(rows)
    per_slot[order] = rows
    return (per_slot.view(num_tokens, top_k, -1) * weights.unsqueeze(-1)).sum(dim=1)


# ---------------------------------------------------------------- sampling
_MASK64 = (1 << 64) - 1


def _to_signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _to_signed(0x9E3779B97F4A7C15)
_MIX1 = _to_signed(0xBF58476D1CE4E5B9)
_MIX2 = _to_signed(0x94D049BB133111EB)


def _srl(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finaliser on int64 tensors holding uint64 bit patterns (wrapping arithmetic)."""
    z = x + _GOLDEN
    z = (z ^ _srl(z, 30)) * _MIX1
    z = (z ^ _srl(z, 27)) * _MIX2
    return z ^ _srl(z, 31)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] uniforms in (0, 1), a pure function of (seed, position, column):
    the counter-based generator that makes a row's draws independent of the batch."""
    row_key = splitmix64(splitmix64(seeds) ^ positions)
    cols = torch.arange(width, dtype=torch.int64, device=seeds.device)
    bits = splitmix64(row_key.unsqueeze(1) + cols * _GOLDEN)
    return (_srl(bits, 40).float() + 0.5) * (1.0 / (1 << 24))


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what top-k / top-p exclude; rows with top_k <= 0 and top_p >= 1 pass through."""
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = ranks >= k.unsqueeze(1)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= (mass_before >= top_p.unsqueeze(1)) & (ranks > 0)
    masked_sorted = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, masked_sorted)


def copy_rows(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    pool.index_copy_(0, dst, pool.index_select(0, src))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def sample(logits, temperature, top_k, top_p, seeds, positions, argmax=None):
    """`argmax`: a backend's kernel for the greedy pick (Accelerator.argmax), torch.argmax by default."""
    logits = logits.float()
    greedy = temperature < 1e-5
    tokens = logits.argmax(dim=-1) if argmax is None else argmax(logits)
    if bool(greedy.all()):
        return tokens
    rows = (~greedy).nonzero().squeeze(1)
    scaled = logits[rows] / temperature[rows].unsqueeze(1)
    scaled = filter_logits(scaled, top_k[rows], top_p[rows])
    gumbel = -torch.log(-torch.log(uniform_noise(seeds[rows], positions[rows], logits.shape[-1])))
    tokens[rows] = (scaled + gumbel).argmax(dim=-1)
    return tokens


def apply_penalties(logits, counts, prompt_mask, rows, repetition, frequency, presence):
    out = logits.float().clone()
    sel = (rows >= 0).nonzero().squeeze(1)
    if not len(sel):
        return out
    seen_out = counts[rows[sel]]
    x = out[sel]
    rep = repetition[sel].float().unsqueeze(1)
    seen = prompt_mask[rows[sel]] | (seen_out > 0)
    x = torch.where(seen, torch.where(x < 0, x * rep, x / rep), x)
    x = x - frequency[sel].float().unsqueeze(1) * seen_out.float()
    x = x - presence[sel].float().unsqueeze(1) * (seen_out > 0).float()
    out[sel] = x
    return out


def apply_min_p(logits, min_p, temperature):
    out = logits.float().clone()
    sel = ((min_p > 0) & (temperature >= 1e-5)).nonzero().squeeze(1)
    if not len(sel):
        return out
    scaled = out[sel] / temperature[sel].float().unsqueeze(1)
    relative = torch.exp(scaled - scaled.max(dim=-1, keepdim=True).values)  # p(v) / p(top)
    out[sel] = out[sel].masked_fill(relative < min_p[sel].float().unsqueeze(1), float("-inf"))
    return out


def apply_logit_bias(logits, token_ids, bias):
    out = logits.float().clone()
    valid = token_ids >= 0
    rows = torch.arange(token_ids.shape[0], device=logits.device).unsqueeze(1).expand_as(token_ids)
    out.index_put_((rows[valid], token_ids[valid]), bias[valid].float(), accumulate=True)
    return out


def count_tokens(counts, rows, tokens) -> None:
    valid = (rows >= 0) & (tokens >= 0)
    counts.index_put_((rows[valid], tokens[valid]), torch.ones_like(rows[valid], dtype=counts.dtype),
                      accumulate=True)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    vocab = logits.shape[-1]
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).flatten(-2)[..., :vocab].bool()
    logits.masked_fill_(~allowed, float("-inf"))
