"""Launchers that re-tile four of the shared Triton kernels (backends/triton) for triton-ascend.

A triton-ascend program keeps its live tiles in the AI core's unified buffer (192 KB on Atlas A2/A3,
loads may be double-buffered), so tile sizes here are chosen from a byte budget rather than from
GPU occupancy; no launch relies on num_warps / num_stages. Every other Triton op of the backend
launches the shared kernels with their own sizes, which already fit (largest live sets, at V4-Flash
sizes: indexer scores with 64 heads x 128 dims ~60 KB, rms_norm's 4096-float chunks 48 KB).
"""

from __future__ import annotations

import torch
import triton

from deepinfer.backends.triton import alloc
from deepinfer.backends.triton import attention as triton_attention
from deepinfer.backends.triton.attention import _compress_kernel

# sparse_attention at head_dim 512: q [16, 512] + kv [16, 512] + acc [16, 512] + p.kv [16, 512] floats
# = 128 KB (the nvidia launch's BLOCK_K = 32 would need 160 KB + a second kv buffer).
_ATTN_BLOCK_H = 16
_ATTN_BLOCK_K = 16
# sparse_attention_bf16 (DeepSeek-V4.1) keeps its 64-index softmax blocks (its numerics) and loads bf16:
# at head_dim 512, q [8, 512] + kv [64, 512] bf16 + acc [8, 512] fp32 = 88 KB, 152 KB with kv double-buffered.
_BF16_ATTN_BLOCK_H = 8
# dense_attention at head_dim 64 (the V4.1 ViT): q, k, v and acc tiles [32, 64] + scores [32, 32] = 36 KB.
_DENSE_BLOCK_M = 32
_DENSE_BLOCK_N = 32
# compress_windows: gate, exp, weights and kv tiles of _COMPRESS_TILE floats each = 32 KB.
_COMPRESS_TILE = 2048


def sparse_attention(q, kv, indices, sinks, scale):
    return triton_attention.sparse_attention(q, kv, indices, sinks, scale, block_h=_ATTN_BLOCK_H,
                                             block_k=_ATTN_BLOCK_K)


def sparse_attention_bf16(q, kv, indices, sinks, scale):
    return triton_attention.sparse_attention_bf16(q, kv, indices, sinks, scale, block_h=_BF16_ATTN_BLOCK_H)


def dense_attention(q, k, v, lens, scale):
    return triton_attention.dense_attention(q, k, v, lens, scale, block_m=_DENSE_BLOCK_M, block_n=_DENSE_BLOCK_N)


def compress_windows(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    w, length, d = kv.shape
    out = alloc.empty(w, d, dtype=torch.float32, device=kv.device)
    if w and length:
        block_l = triton.next_power_of_2(length)
        block_d = max(8, min(triton.next_power_of_2(d), _COMPRESS_TILE // block_l))
        _compress_kernel[(w, triton.cdiv(d, block_d))](kv.contiguous(), gate.contiguous(), out, length, d,
                                                       BLOCK_L=block_l, BLOCK_D=block_d)
    elif w:
        out.fill_(float("nan"))  # softmax over no slots, as the reference
    return out
