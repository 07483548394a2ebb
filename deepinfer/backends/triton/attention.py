"""Attention-side kernels: compressor window reduction, sparse MQA with sinks, indexer scores, dense
bidirectional attention over packed sequences (a vision encoder's patch grids)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.backends.triton import alloc
from deepinfer.backends.triton.quant import _bf16

# Fixed block sizes: a token's reduction order never depends on the batch it is in.
_ATTN_BLOCK_K = 32
_BF16_BLOCK_K = 64  # DeepSeek-V4.1's online-softmax block: part of its numerics, not a tuning choice
_ATTN_BLOCK_H = 16  # tl.dot needs >= 16 rows on GPU; padded heads are masked
_INDEX_BLOCK_M = 32
_DENSE_BLOCK_M = 64  # queries of one sequence and head per program
_DENSE_BLOCK_N = 64  # keys folded into the online softmax at a time


@triton.jit
def _compress_kernel(kv_ptr, gate_ptr, out_ptr, L, D, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
    w, pid = tl.program_id(0), tl.program_id(1)
    j = tl.arange(0, BLOCK_L)
    d = pid * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (j[:, None] < L) & (d[None, :] < D)
    offs = (w * L + j[:, None]) * D + d[None, :]
    g = tl.load(gate_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
    g = tl.where(d[None, :] < D, g, 0.0)  # padded channels: finite, never stored
    e = tl.exp(g - tl.max(g, axis=0)[None, :])
    p = e / tl.sum(e, axis=0)[None, :]
    kv = tl.load(kv_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + w * D + d, tl.sum(kv * p, axis=0), mask=d < D)


def compress_windows(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    w, length, d = kv.shape
    out = alloc.empty(w, d, dtype=torch.float32, device=kv.device)
    if w and length:
        block_l = triton.next_power_of_2(length)
        block_d = max(16, min(triton.next_power_of_2(d), 8192 // block_l))
        _compress_kernel[(w, triton.cdiv(d, block_d))](kv.contiguous(), gate.contiguous(), out, length, d,
                                                       BLOCK_L=block_l, BLOCK_D=block_d)
    elif w:
        out.fill_(float("nan"))  # softmax over no slots, as the reference
    return out


@triton.jit
def _sparse_attention_kernel(q_ptr, kv_ptr, idx_ptr, sinks_ptr, out_ptr, H, D, K, scale,
                             BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (token, head group): online softmax over the index list in fixed BLOCK_K
    chunks, seeded with the sink (max = sink, denominator = 1, no value; a -inf sink drops out at
    the first valid key, whose rescale factor exp(-inf) is 0)."""
    t, hg = tl.program_id(0), tl.program_id(1)
    h = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(q_ptr + (t * H + h[:, None]) * D + d[None, :], mask=hmask[:, None] & dmask[None, :],
                other=0.0).to(tl.float32)
    m = tl.load(sinks_ptr + h, mask=hmask, other=0.0).to(tl.float32)
    denom = tl.full((BLOCK_H,), 1.0, dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_ptr + t * K + kk, mask=kk < K, other=-1)
        valid = idx >= 0
        kv = tl.load(kv_ptr + idx[:, None] * D + d[None, :], mask=valid[:, None] & dmask[None, :],
                     other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(kv), input_precision="ieee") * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # no sink (-inf) and no valid key yet: nothing to rescale and weights 0, not exp(-inf + inf)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, kv, input_precision="ieee")
        m = m_new
    # denom is 0 only without a sink and without a valid index: such a token gets zeros
    out = tl.where(denom[:, None] > 0, acc / denom[:, None], 0.0)
    tl.store(out_ptr + (t * H + h[:, None]) * D + d[None, :], out, mask=hmask[:, None] & dmask[None, :])


def sparse_attention(q, kv, indices, sinks, scale, block_h: int = _ATTN_BLOCK_H, block_k: int = _ATTN_BLOCK_K):
    """block_h / block_k: fixed per backend (the ascend backend passes smaller tiles for its
    on-chip buffer); never derived from the token count."""
    t, h, d = q.shape
    out = alloc.empty(t, h, d, dtype=torch.float32, device=q.device)
    if t:
        _sparse_attention_kernel[(t, triton.cdiv(h, block_h))](
            q.contiguous(), kv.contiguous(), indices.contiguous(), sinks.float().contiguous(), out,
            h, d, indices.shape[1], float(scale),
            BLOCK_H=block_h, BLOCK_K=block_k, BLOCK_D=max(16, triton.next_power_of_2(d)))
    return out


@triton.jit
def _sparse_attention_bf16_kernel(q_ptr, kv_ptr, idx_ptr, sinks_ptr, out_ptr, H, D, K, scale,
                                  BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                                  BF16_DOT: tl.constexpr):
    """DeepSeek-V4.1's sparse attention: online softmax over BLOCK_K (64) indices at a time, running
    max from -1e30, probabilities rounded to bf16 before P.V (the denominator sums them unrounded),
    the sink joins the denominator at the end. q and kv hold bf16 values, so products are exact and
    only the float32 accumulation order differs from the reference. BF16_DOT (on a GPU) runs both
    dots on bf16 operands, as DeepSeek's kernel; the Triton interpreter mishandles bf16 dots, so there
    they run on the same values in float32 (IEEE)."""
    t, hg = tl.program_id(0), tl.program_id(1)
    h = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(q_ptr + (t * H + h[:, None]) * D + d[None, :], mask=hmask[:, None] & dmask[None, :],
                other=0.0).to(tl.float32)
    if BF16_DOT:
        q = q.to(tl.bfloat16)
    m = tl.full((BLOCK_H,), -1e30, dtype=tl.float32)
    denom = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_ptr + t * K + kk, mask=kk < K, other=-1)
        valid = idx >= 0
        kv = tl.load(kv_ptr + idx[:, None] * D + d[None, :], mask=valid[:, None] & dmask[None, :],
                     other=0.0).to(tl.float32)
        if BF16_DOT:
            kv = kv.to(tl.bfloat16)
            s = tl.dot(q, tl.trans(kv), out_dtype=tl.float32)
        else:
            s = tl.dot(q, tl.trans(kv), input_precision="ieee")
        s = tl.where(valid[None, :], s, float("-inf")) * scale
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        if BF16_DOT:
            pv = tl.dot(_bf16(p).to(tl.bfloat16), kv, out_dtype=tl.float32)
        else:
            pv = tl.dot(_bf16(p), kv, input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m = m_new
    denom += tl.exp(tl.load(sinks_ptr + h, mask=hmask, other=0.0).to(tl.float32) - m)
    tl.store(out_ptr + (t * H + h[:, None]) * D + d[None, :], acc / denom[:, None], mask=hmask[:, None] & dmask[None, :])


def sparse_attention_bf16(q, kv, indices, sinks, scale, block_h: int = _ATTN_BLOCK_H):
    t, h, d = q.shape
    out = alloc.empty(t, h, d, dtype=torch.float32, device=q.device)
    if t:
        _sparse_attention_bf16_kernel[(t, triton.cdiv(h, block_h))](
            q.contiguous(), kv.contiguous(), indices.contiguous(), sinks.float().contiguous(), out,
            h, d, indices.shape[1], float(scale),
            BLOCK_H=block_h, BLOCK_K=_BF16_BLOCK_K, BLOCK_D=max(16, triton.next_power_of_2(d)),
            BF16_DOT=q.is_cuda)
    return out


@triton.jit
def _indexer_scores_kernel(q_ptr, w_ptr, keys_ptr, cand_ptr, out_ptr, H, D, M, scale,
                           BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BF16: tl.constexpr):
    """score[t, c] = sum_h w[t, h] * relu(q[t, h] . keys[cand[t, c]]) * scale; -inf where cand < 0.
    BF16 (DeepSeek-V4.1): the dot, each weighted head and the sum are rounded to bf16, scale unused."""
    t, pid = tl.program_id(0), tl.program_id(1)
    h = tl.arange(0, BLOCK_H)
    hmask = h < H
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(q_ptr + (t * H + h[:, None]) * D + d[None, :], mask=hmask[:, None] & dmask[None, :],
                other=0.0).to(tl.float32)
    c = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cand = tl.load(cand_ptr + t * M + c, mask=c < M, other=-1)
    valid = cand >= 0
    keys = tl.load(keys_ptr + cand[:, None] * D + d[None, :], mask=valid[:, None] & dmask[None, :],
                   other=0.0).to(tl.float32)
    s = tl.dot(q, tl.trans(keys), input_precision="ieee")  # [H, M]
    w = tl.load(w_ptr + t * H + h, mask=hmask, other=0.0).to(tl.float32)
    if BF16:
        score = _bf16(tl.sum(_bf16(tl.maximum(_bf16(s), 0.0) * w[:, None]), axis=0))
    else:
        score = tl.sum(tl.maximum(s, 0.0) * scale * w[:, None], axis=0)
    tl.store(out_ptr + t * M + c, tl.where(valid, score, float("-inf")), mask=c < M)


def _scores(q, weights, keys, candidates, scale, bf16: bool) -> torch.Tensor:
    t, h, d = q.shape
    m = candidates.shape[1]
    scores = alloc.empty(t, m, dtype=torch.float32, device=q.device)
    if t and m:
        _indexer_scores_kernel[(t, triton.cdiv(m, _INDEX_BLOCK_M))](
            q.contiguous(), weights.contiguous(), keys.contiguous(), candidates.contiguous(), scores,
            h, d, m, float(scale), BLOCK_H=max(16, triton.next_power_of_2(h)), BLOCK_M=_INDEX_BLOCK_M,
            BLOCK_D=max(16, triton.next_power_of_2(d)), BF16=bf16)
    return scores


def indexer_scores(q, weights, keys, candidates) -> torch.Tensor:
    """DeepSeek-V4.1's scores (base.py): bf16 rounding after the dot, the weighting and the head sum."""
    return _scores(q, weights, keys, candidates, 1.0, True)


def indexer_topk(q, weights, keys, candidates, topk, scale):
    num_tokens, num_cand = candidates.shape
    k = min(topk, num_cand)
    if k == 0 or num_tokens == 0:
        return torch.full((num_tokens, k), -1, dtype=torch.int64, device=q.device)
    scores = _scores(q, weights, keys, candidates, scale, False)
    # selection exactly as the reference: stable sort keeps the earlier column on ties
    values, order = scores.sort(dim=-1, descending=True, stable=True)
    picked = candidates.gather(1, order[:, :k])
    return torch.where(torch.isfinite(values[:, :k]), picked, torch.full_like(picked, -1))


@triton.jit
def _dense_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, starts_ptr, lens_ptr, H, D, scale,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (query block, head, sequence): online softmax over the sequence's keys in fixed
    BLOCK_N chunks, so a token's result depends on its own sequence only. A query block past the
    sequence's end runs no key block and stores nothing."""
    mb, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(starts_ptr + b)
    n = tl.load(lens_ptr + b)
    m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = m < n
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    rows = (start + m)[:, None] * H + h
    q = tl.load(q_ptr + rows * D + d[None, :], mask=mmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    hi = tl.where(mb * BLOCK_M < n, n, 0)
    for n0 in range(0, hi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        jmask = j < n
        cols = (start + j)[:, None] * H + h
        kmask = jmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + cols * D + d[None, :], mask=kmask, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        s = tl.where(jmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + cols * D + d[None, :], mask=kmask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    l_i = tl.where(l_i > 0.0, l_i, 1.0)  # a block past the sequence's end folded no key (and stores nothing)
    tl.store(out_ptr + rows * D + d[None, :], acc / l_i[:, None], mask=mmask[:, None] & dmask[None, :])


def dense_attention(q, k, v, lens, scale, block_m: int = _DENSE_BLOCK_M, block_n: int = _DENSE_BLOCK_N):
    """block_m / block_n: fixed per backend (ascend passes smaller tiles), never derived from the lengths."""
    t, h, d = q.shape
    lens = [int(n) for n in lens]
    if sum(lens) != t or min(lens, default=0) < 0:
        raise ValueError(f"dense_attention: lens {lens} must be >= 0 and sum to the {t} tokens")
    out = alloc.empty(t, h, d, dtype=torch.float32, device=q.device)
    if t:
        starts = [0]
        for n in lens[:-1]:
            starts.append(starts[-1] + n)
        meta = torch.tensor([starts, lens], dtype=torch.int64).to(q.device)
        _dense_attention_kernel[(triton.cdiv(max(lens), block_m), h, len(lens))](
            q.contiguous(), k.contiguous(), v.contiguous(), out, meta[0], meta[1], h, d, float(scale),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(d)))
    return out
