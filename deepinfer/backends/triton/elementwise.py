"""Row-wise and elementwise kernels: rms_norm, rope, swiglu, embedding, the mHC ops."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.backends.triton import alloc

from deepinfer.backends.triton.gemm import linear

_MAX_BLOCK = 4096


def _block(n: int, cap: int = _MAX_BLOCK) -> int:
    return min(cap, triton.next_power_of_2(max(n, 1)))


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, eps, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
    """One row per program; the sum of squares is reduced in fixed BLOCK chunks."""
    row = tl.program_id(0)
    x_row = x_ptr + row * D
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK):
        d = d0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + d, mask=d < D, other=0.0).to(tl.float32)
        acc += x * x
    inv = tl.rsqrt(tl.sum(acc, axis=0) / D + eps)
    for d0 in range(0, D, BLOCK):
        d = d0 + tl.arange(0, BLOCK)
        mask = d < D
        y = tl.load(x_row + d, mask=mask, other=0.0).to(tl.float32) * inv
        if HAS_WEIGHT:
            y = y * tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * D + d, y, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    d = x.shape[-1]
    x2 = x.reshape(-1, d).contiguous()
    out = alloc.empty(*x2.shape, dtype=torch.float32, device=x.device)
    if x2.shape[0]:
        w = weight.contiguous() if weight is not None else x2
        _rms_norm_kernel[(x2.shape[0],)](x2, w, out, d, float(eps), HAS_WEIGHT=weight is not None,
                                         BLOCK=_block(d))
    return out.view(x.shape)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, ROWS, H, D, HALF, sign,
                 BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """BLOCK_ROWS (token, head) rows per program (pure elementwise, so batch invariant): copy the
    nope channels, rotate the trailing 2*HALF pairwise."""
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    rmask = row < ROWS
    t = row // H
    x_row, o_row = x_ptr + row[:, None] * D, out_ptr + row[:, None] * D
    nope = D - 2 * HALF
    for d0 in range(0, nope, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m = rmask[:, None] & (d[None, :] < nope)
        tl.store(o_row + d[None, :], tl.load(x_row + d[None, :], mask=m).to(tl.float32), mask=m)
    i = tl.arange(0, BLOCK_R)
    mask = rmask[:, None] & (i[None, :] < HALF)
    cs = t[:, None] * HALF + i[None, :]
    c = tl.load(cos_ptr + cs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + cs, mask=mask, other=0.0).to(tl.float32) * sign
    x0 = tl.load(x_row + nope + 2 * i[None, :], mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(x_row + nope + 2 * i[None, :] + 1, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_row + nope + 2 * i[None, :], x0 * c - x1 * s, mask=mask)
    tl.store(o_row + nope + 2 * i[None, :] + 1, x1 * c + x0 * s, mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    d = x.shape[-1]
    heads = x.shape[1] if x.dim() == 3 else 1
    half = cos.shape[-1]
    xc = x.contiguous()
    out = alloc.empty(*x.shape, dtype=torch.float32, device=x.device)
    rows = xc.numel() // d if d else 0
    if rows:
        block_rows = 32
        _rope_kernel[(triton.cdiv(rows, block_rows),)](
            xc, cos.contiguous(), sin.contiguous(), out, rows, heads, d, half, -1.0 if inverse else 1.0,
            BLOCK_ROWS=block_rows, BLOCK_D=_block(max(d - 2 * half, 1), 256), BLOCK_R=_block(half))
    return out


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, out_ptr, n, limit, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    g = tl.minimum(tl.load(g_ptr + i, mask=mask, other=0.0).to(tl.float32), limit)
    u = tl.load(u_ptr + i, mask=mask, other=0.0).to(tl.float32)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    tl.store(out_ptr + i, g / (1.0 + tl.exp(-g)) * u, mask=mask)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    out = alloc.empty(*gate.shape, dtype=torch.float32, device=gate.device)
    n = gate.numel()
    if n:
        _swiglu_kernel[(triton.cdiv(n, 1024),)](gate, up, out, n, float(limit), BLOCK=1024)
    return out


@triton.jit
def _embedding_kernel(ids_ptr, w_ptr, out_ptr, D, BLOCK: tl.constexpr):
    t, pid = tl.program_id(0), tl.program_id(1)
    row = tl.load(ids_ptr + t)
    d = pid * BLOCK + tl.arange(0, BLOCK)
    mask = d < D
    tl.store(out_ptr + t * D + d, tl.load(w_ptr + row * D + d, mask=mask).to(tl.float32), mask=mask)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    d = weight.shape[-1]
    ids_c = ids.reshape(-1).contiguous()
    out = alloc.empty(ids_c.numel(), d, dtype=torch.float32, device=weight.device)
    if ids_c.numel():
        block = _block(d, 1024)
        _embedding_kernel[(ids_c.numel(), triton.cdiv(d, block))](ids_c, weight.contiguous(), out, d, BLOCK=block)
    return out.view(*ids.shape, d)


# ------------------------------------------------------------------ mHC


@triton.jit
def _collapse(streams_ptr, out_ptr, pre, t, N, D, NP: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[t] = sum_n pre[n] * streams[t, n]; pre [NP] (zero past N)."""
    n = tl.arange(0, NP)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        mask = (n[:, None] < N) & (d[None, :] < D)
        s = tl.load(streams_ptr + (t * N + n[:, None]) * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * D + d, tl.sum(pre[:, None] * s, axis=0), mask=d < D)


@triton.jit
def _hc_pre_kernel(mix_ptr, base_ptr, scale_ptr, streams_ptr, collapsed_ptr, pre_ptr, post_ptr, comb_ptr,
                   N, D, hc_eps, iters, NP: tl.constexpr, BLOCK_D: tl.constexpr, COLLAPSE: tl.constexpr):
    """One token per program: gates, Sinkhorn on the N x N comb, and the pre-weighted collapse
    (COLLAPSE) or pre itself (hc_mixes)."""
    t = tl.program_id(0)
    width = (2 + N) * N
    mix = mix_ptr + t * width
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    n = tl.arange(0, NP)
    nmask = n < N
    pre = tl.sigmoid(tl.load(mix + n, mask=nmask, other=0.0) * s0 + tl.load(base_ptr + n, mask=nmask, other=0.0))
    pre = tl.where(nmask, pre + hc_eps, 0.0)
    post = 2.0 * tl.sigmoid(tl.load(mix + N + n, mask=nmask, other=0.0) * s1
                            + tl.load(base_ptr + N + n, mask=nmask, other=0.0))
    tl.store(post_ptr + t * N + n, post, mask=nmask)

    r, c = n[:, None], n[None, :]
    mask = (r < N) & (c < N)
    logits = tl.load(mix + 2 * N + r * N + c, mask=mask, other=0.0) * s2 \
        + tl.load(base_ptr + 2 * N + r * N + c, mask=mask, other=0.0)
    logits = tl.where(mask, logits, float("-inf"))
    row_max = tl.where(n < N, tl.max(logits, axis=1), 0.0)  # padded rows are all -inf
    e = tl.where(mask, tl.exp(logits - row_max[:, None]), 0.0)
    row_sum = tl.where(n < N, tl.sum(e, axis=1), 1.0)
    comb = tl.where(mask, e / row_sum[:, None] + hc_eps, 0.0)
    comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    tl.store(comb_ptr + t * N * N + r * N + c, comb, mask=mask)
    if COLLAPSE:
        _collapse(streams_ptr, collapsed_ptr, pre, t, N, D, NP, BLOCK_D)
    else:
        tl.store(pre_ptr + t * N + n, pre, mask=nmask)


def _mix(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    flat = rms_norm(streams.reshape(streams.shape[0], -1), None, norm_eps)
    return linear(flat, fn).contiguous()


@triton.jit
def _row_rsqrt_kernel(x_ptr, out_ptr, D, eps, BLOCK: tl.constexpr):
    """rsqrt(mean(x^2) + eps) of one row per program, the sum in fixed BLOCK chunks."""
    row = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK):
        d = d0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * D + d, mask=d < D, other=0.0).to(tl.float32)
        acc += x * x
    tl.store(out_ptr + row, tl.rsqrt(tl.sum(acc, axis=0) / D + eps))


def _mix_scaled_after(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """DeepSeek-V4.1's mixes: (flat @ fn.T) * rsqrt(mean(flat^2) + eps)."""
    flat = streams.reshape(streams.shape[0], -1).contiguous()
    inv = alloc.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
    _row_rsqrt_kernel[(flat.shape[0],)](flat, inv, flat.shape[1], float(norm_eps), BLOCK=_block(flat.shape[1]))
    return (linear(flat, fn) * inv[:, None]).contiguous()


def _hc_pre(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, collapse: bool):
    t, n, d = streams.shape
    streams = streams.contiguous()
    first = alloc.empty(t, d, dtype=torch.float32, device=streams.device) if collapse else \
        alloc.empty(t, n, dtype=torch.float32, device=streams.device)
    post = alloc.empty(t, n, dtype=torch.float32, device=streams.device)
    comb = alloc.empty(t, n, n, dtype=torch.float32, device=streams.device)
    if t:
        mix = _mix(streams, fn, norm_eps) if collapse else _mix_scaled_after(streams, fn, norm_eps)
        _hc_pre_kernel[(t,)](mix, base.float().contiguous(), scale.float().contiguous(), streams, first, first,
                             post, comb, n, d, float(hc_eps), int(sinkhorn_iters),
                             NP=triton.next_power_of_2(n), BLOCK_D=_block(d, 1024), COLLAPSE=collapse)
    return first, post, comb


def hc_pre(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
    return _hc_pre(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, True)


def hc_mixes(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
    return _hc_pre(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, False)


@triton.jit
def _hc_collapse_kernel(streams_ptr, w_ptr, out_ptr, N, D, NP: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    n = tl.arange(0, NP)
    w = tl.load(w_ptr + t * N + n, mask=n < N, other=0.0).to(tl.float32)
    _collapse(streams_ptr, out_ptr, w, t, N, D, NP, BLOCK_D)


def hc_collapse(streams, weights):
    t, n, d = streams.shape
    out = alloc.empty(t, d, dtype=torch.float32, device=streams.device)
    if t:
        _hc_collapse_kernel[(t,)](streams.contiguous(), weights.contiguous(), out, n, d,
                                  NP=triton.next_power_of_2(n), BLOCK_D=_block(d, 1024))
    return out


@triton.jit
def _hc_head_kernel(mix_ptr, base_ptr, scale_ptr, streams_ptr, out_ptr, N, D, hc_eps,
                    NP: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    n = tl.arange(0, NP)
    nmask = n < N
    pre = tl.sigmoid(tl.load(mix_ptr + t * N + n, mask=nmask, other=0.0) * tl.load(scale_ptr)
                     + tl.load(base_ptr + n, mask=nmask, other=0.0))
    pre = tl.where(nmask, pre + hc_eps, 0.0)
    _collapse(streams_ptr, out_ptr, pre, t, N, D, NP, BLOCK_D)


def hc_head(streams, fn, base, scale, norm_eps, hc_eps):
    t, n, d = streams.shape
    streams = streams.contiguous()
    out = alloc.empty(t, d, dtype=torch.float32, device=streams.device)
    if t:
        mix = _mix(streams, fn, norm_eps)
        _hc_head_kernel[(t,)](mix, base.float().contiguous(), scale.float().contiguous(), streams, out, n, d,
                              float(hc_eps), NP=triton.next_power_of_2(n), BLOCK_D=_block(d, 1024))
    return out


@triton.jit
def _hc_post_kernel(block_ptr, streams_ptr, post_ptr, comb_ptr, out_ptr, N, D,
                    NP: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[t, m] = post[t, m] * block[t] + sum_n comb[t, n, m] * streams[t, n]; grid (T, D blocks)."""
    t, pid = tl.program_id(0), tl.program_id(1)
    n = tl.arange(0, NP)
    nmask = n < N
    d = pid * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < D
    smask = nmask[:, None] & dmask[None, :]
    s = tl.load(streams_ptr + (t * N + n[:, None]) * D + d[None, :], mask=smask, other=0.0).to(tl.float32)
    comb = tl.load(comb_ptr + t * N * N + n[:, None] * N + n[None, :], mask=nmask[:, None] & nmask[None, :],
                   other=0.0)  # [n, m]
    mixed = tl.sum(comb[:, :, None] * s[:, None, :], axis=0)  # [m, d]
    post = tl.load(post_ptr + t * N + n, mask=nmask, other=0.0)
    b = tl.load(block_ptr + t * D + d, mask=dmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + (t * N + n[:, None]) * D + d[None, :], post[:, None] * b[None, :] + mixed, mask=smask)


def hc_post(block_out, streams, post, comb):
    t, n, d = streams.shape
    out = alloc.empty(t, n, d, dtype=torch.float32, device=streams.device)
    if t:
        block = _block(d, 256)
        _hc_post_kernel[(t, triton.cdiv(d, block))](block_out.contiguous(), streams.contiguous(),
                                                   post.float().contiguous(), comb.float().contiguous(), out,
                                                   n, d, NP=triton.next_power_of_2(n), BLOCK_D=block)
    return out
