"""Tiled fp32-accumulate matmuls: linear, grouped_linear and the MoE grouped GEMM.

Batch invariance: tile sizes come from `tiles(n, k)`, a table keyed on the weight shape
only, never on the token count, so every output element is reduced over K in the same
BLOCK_K chunks in the same order whatever the batch it is computed in.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.backends.quant import FP8, QuantizedWeight
from deepinfer.backends.triton import alloc, quant
from deepinfer.backends.triton.fp8 import e8m0_float
from deepinfer.backends.triton.quant import _bf16


def tiles(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for a weight of shape [n, k]. Fixed per weight shape."""
    block_n = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    block_k = 64 if k >= 256 else 32 if k >= 32 else 16
    return 32, block_n, block_k


@triton.jit
def _matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                   stride_ag, stride_am, stride_ak,
                   stride_bg, stride_bn, stride_bk,
                   stride_cg, stride_cm, stride_cn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BF16_DOT: tl.constexpr):
    """c[g] = a[g] @ b[g].T; grid (m tiles, n tiles, groups). BF16_DOT: both operands bf16, multiplied
    as such (tensor cores; each product exact in the float32 accumulator)."""
    pid_m, pid_n, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_base = a_ptr + g * stride_ag + rm[:, None] * stride_am
    b_base = b_ptr + g * stride_bg + rn[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(a_base + kk[None, :] * stride_ak, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(b_base + kk[:, None] * stride_bk, mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        if BF16_DOT:
            acc += tl.dot(a, b)
        else:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    c = c_ptr + g * stride_cg + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    tl.store(c, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def _batched(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """a [G, M, K], b [G, N, K], out [G, M, N] (any strides)."""
    groups, m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0:
        return out
    bm, bn, bk = tiles(n, k)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), groups)
    # the interpreter has no bf16 dot; its float32 upcast gives the same products
    bf16 = a.dtype == b.dtype == torch.bfloat16 and a.device.type == "cuda"
    _matmul_kernel[grid](a, b, out, m, n, k, *a.stride(), *b.stride(), *out.stride(),
                         BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BF16_DOT=bf16)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    out = alloc.empty(x2.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    _batched(x2.unsqueeze(0), weight.unsqueeze(0), out.unsqueeze(0))
    return out.view(*lead, weight.shape[0])


def grouped_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    t, groups, k = x.shape
    w = weight.view(groups, -1, k)
    out = alloc.empty(t, groups, w.shape[1], dtype=torch.float32, device=x.device)
    _batched(x.transpose(0, 1), w, out.transpose(0, 1))
    return out


# ------------------------------------------------------------------ MoE


@triton.jit
def _e2m1(code):
    """e2m1 codes (bit 3 the sign) -> float32 values, exactly."""
    mag = code & 7
    m = (mag & 1).to(tl.float32)
    e = mag >> 1
    v = tl.where(e == 0, 0.5 * m, tl.where(e == 1, 1.0 + 0.5 * m, tl.where(e == 2, 2.0 + m, 4.0 + 2.0 * m)))
    return tl.where(code >= 8, -v, v)


@triton.jit
def _weight_tile(w_ptr, s_ptr, rn, kk, mask, stride_wn, stride_sn, b0, b1,
                 W_FMT: tl.constexpr, E8M0: tl.constexpr):
    """[BLOCK_K, BLOCK_N] float32 tile of weight rows rn, inputs kk, widened in registers. W_FMT 0: a
    float tensor; 1: FP8 e4m3 and 2: FP4 e2m1 (two a byte, element 2i in the low nibble), each times
    its scale s[rn // b0, kk // b1] (float32 or ue8m0 bytes, E8M0)."""
    if W_FMT == 0:
        return tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None], mask=mask, other=0.0).to(tl.float32)
    if W_FMT == 1:
        v = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None], mask=mask, other=0.0).to(tl.float32)
    else:
        byte = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None] // 2, mask=mask, other=0).to(tl.int32)
        v = _e2m1((byte >> ((kk[:, None] % 2) * 4)) & 0xF)
    sc = tl.load(s_ptr + (rn[None, :] // b0) * stride_sn + kk[:, None] // b1, mask=mask, other=0)
    if E8M0:
        sc = e8m0_float(sc)
    return v * sc


@triton.jit
def _moe_gate_up_kernel(x_ptr, w_ptr, s_ptr, act_ptr, rows_ptr, scale_ptr, tile_expert_ptr, tile_start_ptr,
                        tile_end_ptr, I, K, limit, stride_xm, stride_we, stride_wn, stride_se, stride_sn, b0, b1,
                        stride_am, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        W_FMT: tl.constexpr, E8M0: tl.constexpr, BF16: tl.constexpr, ROUND_ACT: tl.constexpr):
    """act[p] = swiglu(x[rows[p]] @ w[e, :I].T, x[rows[p]] @ w[e, I:].T) for the sorted slots p of
    one (expert, row tile); grid (row tiles, I tiles). Weights as _weight_tile reads them. BF16
    (moe_experts_bf16): the products rounded to bf16 before the swiglu, whose output is scaled by
    the slot's routing weight scale[p], then rounded to bf16 too with ROUND_ACT (else the caller
    quantizes it)."""
    tile, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(tile_expert_ptr + tile)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    rp = start + tl.arange(0, BLOCK_M)
    rmask = rp < end
    rows = tl.load(rows_ptr + rp, mask=rmask, other=0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < I
    rk = tl.arange(0, BLOCK_K)
    w_base = w_ptr + e * stride_we
    s_base = s_ptr + e * stride_se
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        kmask = kk < K
        a = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        a = a.to(tl.float32)
        wmask = kmask[:, None] & nmask[None, :]
        wg = _weight_tile(w_base, s_base, rn, kk, wmask, stride_wn, stride_sn, b0, b1, W_FMT, E8M0)
        wu = _weight_tile(w_base, s_base, rn + I, kk, wmask, stride_wn, stride_sn, b0, b1, W_FMT, E8M0)
        acc_g += tl.dot(a, wg, input_precision="ieee")
        acc_u += tl.dot(a, wu, input_precision="ieee")
    if BF16:
        acc_g = _bf16(acc_g)
        acc_u = _bf16(acc_u)
    g = tl.minimum(acc_g, limit)
    u = tl.minimum(tl.maximum(acc_u, -limit), limit)
    act = g / (1.0 + tl.exp(-g)) * u
    if BF16:
        act = act * tl.load(scale_ptr + rp, mask=rmask, other=0.0)[:, None]
        if ROUND_ACT:
            act = _bf16(act)
    tl.store(act_ptr + rp[:, None] * stride_am + rn[None, :], act, mask=rmask[:, None] & nmask[None, :])


@triton.jit
def _moe_down_kernel(act_ptr, w_ptr, s_ptr, out_ptr, scale_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
                     N, K, stride_am, stride_we, stride_wn, stride_se, stride_sn, b0, b1, stride_om,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     W_FMT: tl.constexpr, E8M0: tl.constexpr, BF16: tl.constexpr):
    """out[p] = scale[p] * (act[p] @ w[e].T) for the sorted slots p of one (expert, row tile); BF16
    (moe_experts_bf16, the weight already in act): bf16(act[p] @ w[e].T)."""
    tile, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(tile_expert_ptr + tile)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    rp = start + tl.arange(0, BLOCK_M)
    rmask = rp < end
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    rk = tl.arange(0, BLOCK_K)
    w_base = w_ptr + e * stride_we
    s_base = s_ptr + e * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        kmask = kk < K
        a = tl.load(act_ptr + rp[:, None] * stride_am + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        w = _weight_tile(w_base, s_base, rn, kk, kmask[:, None] & nmask[None, :], stride_wn, stride_sn, b0, b1,
                         W_FMT, E8M0)
        acc += tl.dot(a.to(tl.float32), w, input_precision="ieee")
    if BF16:
        acc = _bf16(acc)
    else:
        acc = acc * tl.load(scale_ptr + rp, mask=rmask, other=0.0)[:, None]
    tl.store(out_ptr + rp[:, None] * stride_om + rn[None, :], acc, mask=rmask[:, None] & nmask[None, :])


@triton.jit
def _moe_combine_kernel(rows_ptr, slot_ptr, out_ptr, D, TOP_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[t] = sum_j rows[slot[t, j]], j in order: a fixed reduction order per token, no atomics."""
    t, pid_d = tl.program_id(0), tl.program_id(1)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in range(TOP_K):
        p = tl.load(slot_ptr + t * TOP_K + j)
        acc += tl.load(rows_ptr + p * D + d, mask=dmask, other=0.0)
    tl.store(out_ptr + t * D + d, acc, mask=dmask)


def _tile_schedule(sorted_ids: torch.Tensor, num_experts: int, block_m: int):
    """Per row tile of the expert-sorted slots: (expert, first slot, end slot), in fixed-shape tensors
    (no host read: a CUDA graph captures it). Each expert hit gets ceil(rows / block_m) tiles; the
    list is padded to the most tiles any routing of these slots can need, the padding empty
    (first slot = end slot: the kernels mask every row)."""
    device, n = sorted_ids.device, sorted_ids.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, sorted_ids, torch.ones_like(sorted_ids))
    ends = counts.cumsum(0)
    per = (counts + block_m - 1) // block_m
    tiles_end = per.cumsum(0)
    max_tiles = triton.cdiv(n, block_m) + min(num_experts, n)
    tile = torch.arange(max_tiles, device=device)
    expert = torch.searchsorted(tiles_end, tile, right=True)
    real = expert < num_experts
    expert = expert.clamp(max=num_experts - 1)
    local = tile - (tiles_end - per)[expert]
    end = torch.where(real, ends[expert], 0)
    start = torch.where(real, (ends - counts)[expert] + local * block_m, 0)
    return expert, start, end


def _expert_args(w) -> tuple:
    """(data, scales, expert stride of the scales, row stride of the scales, b0, b1, W_FMT, E8M0) of
    an [E, N, K] expert stack for the MoE kernels (strides in elements; data strides from .stride())."""
    if isinstance(w, QuantizedWeight):
        sc = w.scale.contiguous()
        return (w.data.contiguous(), sc, sc.stride(0), sc.stride(1), w.block[0], w.block[1],
                1 if w.format == FP8 else 2, sc.dtype == torch.uint8)
    w = w.contiguous()
    return w, w, 0, 0, 1, 1, 0, False


def moe_experts(x, weights, ids, gate_up, down, limit, bf16: bool = False, act_block: int = 0):
    """Routed experts (base.py moe_experts; with `bf16` moe_experts_bf16, act_block as there). Expert
    stacks may be float (any dtype) or QuantizedWeight (FP8 block-scaled, FP4 e2m1): widened in
    registers, float32 accumulation; activations as given (moe_experts) or rounded as moe_experts_bf16
    defines (the FP8 quantize-dequantize by quant.fp8_qdq, bit-exact). Every shape is fixed by the
    call's: no host read (a CUDA graph captures it)."""
    num_tokens, top_k = ids.shape
    d = x.shape[-1]
    num_experts, two_i, _ = gate_up.shape
    inter = two_i // 2
    out = alloc.empty(num_tokens, d, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out
    if bf16:  # each token's GEMM input, once
        x = quant.fp8_qdq(x, act_block) if act_block else x.to(torch.bfloat16).float()
    x = x.contiguous()
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # the reference's grouping by expert
    sorted_ids = flat_ids[order]
    rows = order // top_k  # token of each sorted slot
    slot_of = torch.empty_like(order)
    slot_of[order] = torch.arange(order.numel(), device=x.device)
    scale = weights.reshape(-1)[order].float().contiguous()
    gu, gu_s, gu_se, gu_sn, gu_b0, gu_b1, gu_fmt, gu_e8 = _expert_args(gate_up)
    dn, dn_s, dn_se, dn_sn, dn_b0, dn_b1, dn_fmt, dn_e8 = _expert_args(down)
    # strides of the packed rows (an FP4 row holds K/2 bytes)
    gu_we, gu_wn = gu.stride(0), gu.stride(1)
    dn_we, dn_wn = dn.stride(0), dn.stride(1)

    bm, bn, bk = tiles(inter, d)  # keyed on the expert weight shape, like linear
    tile_expert, tile_start, tile_end = _tile_schedule(sorted_ids, num_experts, bm)
    act = alloc.empty(order.numel(), inter, dtype=torch.float32, device=x.device)
    _moe_gate_up_kernel[(tile_expert.numel(), triton.cdiv(inter, bn))](
        x, gu, gu_s, act, rows, scale, tile_expert, tile_start, tile_end, inter, d, float(limit),
        x.stride(0), gu_we, gu_wn, gu_se, gu_sn, gu_b0, gu_b1, act.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, W_FMT=gu_fmt, E8M0=gu_e8, BF16=bf16, ROUND_ACT=not act_block)
    if bf16 and act_block:
        act = quant.fp8_qdq(act, act_block)

    bm2, bn2, bk2 = tiles(d, inter)
    if bm2 != bm:
        tile_expert, tile_start, tile_end = _tile_schedule(sorted_ids, num_experts, bm2)
    expert_rows = alloc.empty(order.numel(), d, dtype=torch.float32, device=x.device)
    _moe_down_kernel[(tile_expert.numel(), triton.cdiv(d, bn2))](
        act, dn, dn_s, expert_rows, scale, tile_expert, tile_start, tile_end, d, inter,
        act.stride(0), dn_we, dn_wn, dn_se, dn_sn, dn_b0, dn_b1, expert_rows.stride(0),
        BLOCK_M=bm2, BLOCK_N=bn2, BLOCK_K=bk2, W_FMT=dn_fmt, E8M0=dn_e8, BF16=bf16)

    block_d = min(1024, triton.next_power_of_2(d))
    _moe_combine_kernel[(num_tokens, triton.cdiv(d, block_d))](
        expert_rows, slot_of.view(num_tokens, top_k).contiguous(), out, d, TOP_K=top_k, BLOCK_D=block_d)
    return out


def moe_experts_bf16(x, weights, ids, gate_up, down, limit, act_block=0):
    """Accelerator.moe_experts_bf16: the MoE kernels above with its rounding points."""
    return moe_experts(x, weights, ids, gate_up, down, limit, True, act_block)
