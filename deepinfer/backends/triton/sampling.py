"""MoE routing scores, token sampling (counter-based SplitMix64 Gumbel noise) and bitmask apply."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.backends.triton import alloc

from deepinfer.backends.reference import filter_logits, grouped_topk_ids
from deepinfer.backends.triton.gemm import linear

_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_VOCAB_BLOCK = 1024


# ------------------------------------------------------------------ routing


@triton.jit
def _sqrt_softplus_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    x = tl.load(x_ptr + i, mask=mask, other=0.0).to(tl.float32)
    y = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + y
    log1p = tl.where(u == 1.0, y, tl.log(u) * (y / tl.where(u == 1.0, 1.0, u - 1.0)))  # accurate for small y
    tl.store(out_ptr + i, tl.sqrt(tl.where(x > 20.0, x, log1p)), mask=mask)  # torch's softplus threshold


@triton.jit
def _sigmoid_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    x = tl.load(x_ptr + i, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, 1.0 / (1.0 + tl.exp(-x)), mask=mask)


@triton.jit
def _route_weights_kernel(scores_ptr, ids_ptr, out_ptr, E, scaling, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
                          NORMALIZE: tl.constexpr):
    t = tl.program_id(0)
    j = tl.arange(0, BLOCK_K)
    mask = j < TOP_K
    ids = tl.load(ids_ptr + t * TOP_K + j, mask=mask, other=0)
    w = tl.load(scores_ptr + t * E + ids, mask=mask, other=0.0)
    if NORMALIZE:
        w = w / (tl.sum(w, axis=0) + 1e-20)
    tl.store(out_ptr + t * TOP_K + j, w * scaling, mask=mask)


def route_scores(x: torch.Tensor, gate: torch.Tensor, kernel=_sqrt_softplus_kernel) -> torch.Tensor:
    """kernel(logits): sqrt(softplus) (V4's routers) or sigmoid (route_grouped_topk), elementwise."""
    logits = linear(x.float(), gate)
    scores = alloc.empty(*logits.shape, device=logits.device)
    n = logits.numel()
    if n:
        kernel[(triton.cdiv(n, 1024),)](logits, scores, n, BLOCK=1024)
    return scores


def _normalize(scores: torch.Tensor, ids: torch.Tensor, scaling: float, normalize: bool = True) -> torch.Tensor:
    t, k = ids.shape
    out = alloc.empty(t, k, dtype=torch.float32, device=scores.device)
    if t and k:
        _route_weights_kernel[(t,)](scores, ids.contiguous(), out, scores.shape[1], float(scaling),
                                    TOP_K=k, BLOCK_K=triton.next_power_of_2(k), NORMALIZE=bool(normalize))
    return out


def route_topk(x, gate, bias, top_k, scaling):
    scores = route_scores(x, gate)
    ids = torch.topk(scores + bias, top_k, dim=-1, sorted=False).indices  # the reference's selection
    return _normalize(scores, ids, scaling), ids


def route_grouped_topk(x, gate, bias, top_k, n_group, topk_group, normalize, scaling):
    scores = route_scores(x, gate, _sigmoid_kernel)
    ids = grouped_topk_ids(scores, bias, top_k, n_group, topk_group)  # the reference's selection (torch.topk)
    return _normalize(scores, ids, scaling, normalize), ids


def route_hash(x, gate, ids, scaling):
    return _normalize(route_scores(x, gate), ids, scaling)


# ------------------------------------------------------------------ sampling


@triton.jit
def _splitmix64(x, G: tl.constexpr, M1: tl.constexpr, M2: tl.constexpr):
    z = x + G
    z = (z ^ (z >> 30)) * M1
    z = (z ^ (z >> 27)) * M2
    return z ^ (z >> 31)


@triton.jit
def _argmax_kernel(x_ptr, div_ptr, seed_ptr, pos_ptr, out_ptr, V, stride,
                   NOISE: tl.constexpr, G: tl.constexpr, M1: tl.constexpr, M2: tl.constexpr,
                   BLOCK: tl.constexpr):
    """out[b] = argmax_v(x[b, v] (/ div[b] + Gumbel noise of (seed, position, v))), first index on ties.
    Without NOISE (greedy) the divisor, seed and position pointers are not read."""
    b = tl.program_id(0)
    if NOISE:
        div = tl.load(div_ptr + b)
        seed = tl.load(seed_ptr + b).to(tl.uint64, bitcast=True)
        pos = tl.load(pos_ptr + b).to(tl.uint64, bitcast=True)
        row_key = _splitmix64(_splitmix64(seed, G, M1, M2) ^ pos, G, M1, M2)
    best_val = float("-inf")
    best_idx = 0
    for v0 in range(0, V, BLOCK):
        v = v0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + b * stride + v, mask=v < V, other=float("-inf")).to(tl.float32)
        if NOISE:
            x = tl.math.div_rn(x, div)  # correctly rounded division, as torch's (GPU `/` is approximate)
            bits = _splitmix64(row_key + v.to(tl.uint64) * G, G, M1, M2)
            u = ((bits >> 40).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            x = x + -tl.log(-tl.log(u))
        x = tl.where(v < V, x, float("-inf"))
        blk_val = tl.max(x, axis=0)
        blk_idx = tl.min(tl.where(x == blk_val, v, V), axis=0)  # first maximum in the block
        take = blk_val > best_val
        best_idx = tl.where(take, blk_idx, best_idx)
        best_val = tl.where(take, blk_val, best_val)
    tl.store(out_ptr + b, best_idx.to(tl.int64))


def _argmax(values, noise: tuple | None = None) -> torch.Tensor:
    """Greedy argmax per row, or with noise = (divisor, seeds, positions) the Gumbel-max sample of
    values / divisor."""
    rows, vocab = values.shape
    out = alloc.empty(rows, dtype=torch.int64, device=values.device)
    divisor, seeds, positions = noise if noise is not None else (values, values, values)  # unread when greedy
    if rows:
        _argmax_kernel[(rows,)](values, divisor, seeds, positions, out, vocab, values.stride(0),
                                NOISE=noise is not None, G=_GOLDEN, M1=_MIX1, M2=_MIX2, BLOCK=_VOCAB_BLOCK)
    return out


def sample(logits, temperature, top_k, top_p, seeds, positions):
    logits = logits.float().contiguous()
    greedy = temperature < 1e-5
    tokens = _argmax(logits)
    if bool(greedy.all()):
        return tokens
    rows = (~greedy).nonzero().squeeze(1)
    temp = temperature[rows].float()
    values, divisor = logits[rows], temp.contiguous()
    filtered = (top_k[rows] > 0) | (top_p[rows] < 1.0)
    if bool(filtered.any()):
        # top-k / top-p need a sort: the reference's torch filter, on the tempered logits
        scaled = values / temp.unsqueeze(1)
        values = torch.where(filtered.unsqueeze(1), filter_logits(scaled, top_k[rows], top_p[rows]), values)
        divisor = torch.where(filtered, torch.ones_like(temp), temp)
    tokens[rows] = _argmax(values.contiguous(), (divisor.contiguous(), seeds[rows].contiguous(),
                                                  positions[rows].contiguous()))
    return tokens


@triton.jit
def _bitmask_kernel(logits_ptr, mask_ptr, V, W, stride, BLOCK: tl.constexpr):
    b, pid = tl.program_id(0), tl.program_id(1)
    v = pid * BLOCK + tl.arange(0, BLOCK)
    inb = v < V
    word = tl.load(mask_ptr + b * W + v // 32, mask=inb, other=-1)
    allowed = ((word >> (v % 32)) & 1) != 0
    tl.store(logits_ptr + b * stride + v, tl.full((BLOCK,), float("-inf"), tl.float32), mask=inb & ~allowed)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    rows, vocab = logits.shape
    if rows == 0 or vocab == 0:
        return
    target = logits if logits.stride(-1) == 1 else logits.contiguous()
    bitmask = bitmask.to(torch.int32).contiguous()
    _bitmask_kernel[(rows, triton.cdiv(vocab, _VOCAB_BLOCK))](target, bitmask, vocab, bitmask.shape[1],
                                                             target.stride(0), BLOCK=_VOCAB_BLOCK)
    if target is not logits:
        logits.copy_(target)


# ------------------------------------------------------------------ logit adjustments (SamplingParams)


@triton.jit
def _penalties_kernel(x_ptr, out_ptr, counts_ptr, prompt_ptr, rows_ptr, rep_ptr, freq_ptr, pres_ptr, V, stride,
                      BLOCK: tl.constexpr):
    b, pid = tl.program_id(0), tl.program_id(1)
    v = pid * BLOCK + tl.arange(0, BLOCK)
    inb = v < V
    x = tl.load(x_ptr + b * stride + v, mask=inb, other=0.0).to(tl.float32)
    r = tl.load(rows_ptr + b)
    if r >= 0:
        c = tl.load(counts_ptr + r * V + v, mask=inb, other=0)
        in_prompt = tl.load(prompt_ptr + r * V + v, mask=inb, other=0) != 0
        rep = tl.load(rep_ptr + b)
        freq = tl.load(freq_ptr + b)
        pres = tl.load(pres_ptr + b)
        penalized = tl.where(x < 0, x * rep, tl.math.div_rn(x, rep))  # correctly rounded, as torch's
        x = tl.where(in_prompt | (c > 0), penalized, x)
        x = x - freq * c.to(tl.float32)
        x = x - pres * tl.where(c > 0, 1.0, 0.0)
    tl.store(out_ptr + b * V + v, x, mask=inb)


def apply_penalties(logits, counts, prompt_mask, rows, repetition, frequency, presence):
    batch, vocab = logits.shape
    out = alloc.empty(batch, vocab, device=logits.device)
    if batch and vocab:
        logits = logits.float()
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        _penalties_kernel[(batch, triton.cdiv(vocab, _VOCAB_BLOCK))](
            logits, out, counts.contiguous(), prompt_mask.contiguous().view(torch.uint8), rows.contiguous(),
            repetition.float().contiguous(), frequency.float().contiguous(), presence.float().contiguous(),
            vocab, logits.stride(0), BLOCK=_VOCAB_BLOCK)
    return out


@triton.jit
def _min_p_kernel(x_ptr, out_ptr, min_p_ptr, temp_ptr, V, stride, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    min_p = tl.load(min_p_ptr + b)
    temp = tl.load(temp_ptr + b)
    active = (min_p > 0) & (temp >= 1e-5)
    best = float("-inf")
    if active:
        for v0 in range(0, V, BLOCK):
            v = v0 + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + b * stride + v, mask=v < V, other=float("-inf"))
            best = tl.maximum(best, tl.max(tl.math.div_rn(x, temp), axis=0))
    for v0 in range(0, V, BLOCK):
        v = v0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + b * stride + v, mask=v < V, other=0.0)
        if active:
            relative = tl.exp(tl.math.div_rn(x, temp) - best)
            x = tl.where(relative < min_p, float("-inf"), x)
        tl.store(out_ptr + b * V + v, x, mask=v < V)


def apply_min_p(logits, min_p, temperature):
    batch, vocab = logits.shape
    out = alloc.empty(batch, vocab, device=logits.device)
    if batch and vocab:
        logits = logits.float()
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        _min_p_kernel[(batch,)](logits, out, min_p.float().contiguous(), temperature.float().contiguous(), vocab,
                                logits.stride(0), BLOCK=_VOCAB_BLOCK)
    return out


@triton.jit
def _scatter_add_kernel(out_ptr, ids_ptr, values_ptr, K, stride, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + b * K + k, mask=k < K, other=-1)
        values = tl.load(values_ptr + b * K + k, mask=k < K, other=0.0)
        tl.atomic_add(out_ptr + b * stride + ids, values, mask=ids >= 0)  # repeated ids sum


def apply_logit_bias(logits, token_ids, bias):
    out = logits.float().contiguous().clone()
    batch, k = token_ids.shape
    if batch and k:
        _scatter_add_kernel[(batch,)](out, token_ids.contiguous(), bias.float().contiguous(), k, out.stride(0),
                                      BLOCK=triton.next_power_of_2(min(k, 1024)))
    return out


@triton.jit
def _count_kernel(counts_ptr, rows_ptr, tokens_ptr, N, V, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rows = tl.load(rows_ptr + i, mask=i < N, other=-1)
    tokens = tl.load(tokens_ptr + i, mask=i < N, other=-1)
    valid = (i < N) & (rows >= 0) & (tokens >= 0)
    tl.atomic_add(counts_ptr + rows * V + tokens, tl.full((BLOCK,), 1, tl.int32), mask=valid)


def count_tokens(counts, rows, tokens) -> None:
    n = rows.shape[0]
    if n:
        assert counts.is_contiguous() and counts.dtype == torch.int32, "count_tokens: counts must be contiguous int32"
        _count_kernel[(triton.cdiv(n, 256),)](counts, rows.contiguous(), tokens.contiguous(), n, counts.shape[1],
                                              BLOCK=256)
