"""DeepSeek-V4's fused op sequences: the definitions, as composites of Accelerator ops.

A decode step of a small model is bound by the cost per op call, so a backend may run one of
these sequences as a single kernel: `Accelerator.fused_<name>` (backends/base.py declares them; the
cpu backend's C++ kernels implement them) returns its result, or None where the backend has no such
kernel or the kernel declines the input. Then the composite below runs. Conformance tests hold each kernel to its composite.
"""

from __future__ import annotations

import torch


def hc_pre_norm(ops, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                norm_eps: float, hc_eps: float, sinkhorn_iters: int, norm_weight: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Entering a block: hc_pre, then RMSNorm (norm_weight, norm_eps) of the collapsed input.
    -> (the block's input [T, D], post [T, N], comb [T, N, N])."""
    args = (streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, norm_weight)
    out = ops.fused_hc_pre_norm(*args)
    if out is not None:
        return out
    collapsed, post, comb = ops.hc_pre(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)
    return ops.rms_norm(collapsed, norm_weight, norm_eps), post, comb


def hc_post_pre_norm(ops, block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                     fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float, hc_eps: float,
                     sinkhorn_iters: int, norm_weight: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Leaving a block and entering the next: hc_post, then hc_pre_norm with the next block's
    weights. -> (streams [T, N, D], the next block's input [T, D], post, comb)."""
    args = (block_out, streams, post, comb, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, norm_weight)
    out = ops.fused_hc_post_pre_norm(*args)
    if out is not None:
        return out
    streams = ops.hc_post(block_out, streams, post, comb)
    return (streams, *hc_pre_norm(ops, streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, norm_weight))


def rms_norm_rope(ops, x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """rope(rms_norm(x, weight, eps), cos, sin): a query or key entering attention."""
    out = ops.fused_rms_norm_rope(x, weight, eps, cos, sin)
    return out if out is not None else ops.rope(ops.rms_norm(x, weight, eps), cos, sin)


def compress_entries(ops, ring: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor, overlap: bool,
                     norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The compressor's entries for finished windows, from its staged rows. ring [R, 2C]: each
    token's [kv | gate]; rows [W, S]: a window's tokens (-1 = absent, weight 0); bias [rate, C]:
    the gate's position bias (token j gets row j % rate). Without overlap (HCA) S = rate and
    C = dim; with it (CSA) S = 2 rate and C = 2 dim: the first rate tokens (the previous window)
    contribute their first dim channels, the last rate their second. Entry =
    rope(rms_norm(compress_windows(kv, gate + bias), norm_weight, eps), cos, sin): [W, dim]
    float32, dim = len(norm_weight), cos/sin [W, R] at each window's position."""
    out = ops.fused_compress_entries(ring, rows, bias, overlap, norm_weight, eps, cos, sin)
    if out is not None:
        return out
    raw = ring[rows.clamp(min=0)].float()  # [W, S, 2C]
    width, dim, rate = raw.shape[-1] // 2, norm_weight.shape[0], bias.shape[0]
    kv, gate = raw[..., :width], raw[..., width:]
    if overlap:
        gate = gate + bias.repeat(2, 1)
        kv = torch.cat([kv[:, :rate, :dim], kv[:, rate:, dim:]], dim=1)
        gate = torch.cat([gate[:, :rate, :dim], gate[:, rate:, dim:]], dim=1)
    else:
        gate = gate + bias
    absent = (rows < 0).unsqueeze(-1)
    entry = ops.compress_windows(kv.masked_fill(absent, 0.0), gate.masked_fill(absent, float("-inf")))
    return ops.rope(ops.rms_norm(entry, norm_weight, eps), cos, sin)
