"""The cpu backend's fused C++ kernels (fused_ops.cpp), compiled on first use.

The reference ops (backends/reference.py) are plain torch: dozens of small ops per call, which is what a
decode step of a small model spends its time on (the mHC mix alone is ~80 ops, 8 calls a step).
`fused_ops.cpp` does seventeen of them in one pass each: hc_pre, hc_mixes, hc_collapse, hc_post, hc_head, rms_norm,
rope, compress_entries, sparse_attention and indexer_topk always; linear, moe_experts, swiglu_mlp
(the shared expert), grouped_linear and the three routers for decode-sized batches (larger ones go to
the reference, whose GEMMs win there). The fused sequences hc_pre_norm, hc_post_pre_norm and
rms_norm_rope chain those kernels in one call; `quant_ops.cpp` holds the weight ops on narrow weights
(quant_kernels.py), the experts kernel with DeepSeek-V4.1's rounding points (moe_experts_bf16) and
its FP8 activation quantization (fp8_qdq); `sampling_ops.cpp` and `pool_ops.cpp`, in the same
library, are greedy sampling's argmax (and the LM head fused with it, which the step replay
substitutes for that pair of calls) and the row copies that commit a step's staged rows. It is
built with torch's C++ extension loader on the machine that runs it (so `-march=native` is safe)
into ~/.cache/deepinfer/cpu_kernels/<hash>, once per source/torch/compiler version; later
processes only load the library.

`DEEPINFER_CPU_KERNELS=0` keeps the reference ops. Without a working C++ compiler the build
fails, a warning says why, and the reference ops are used.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import threading
import warnings

import torch

from deepinfer import envs
from deepinfer.backends import reference as ops
from deepinfer.backends.cpu import quant_kernels as quant
from deepinfer.backends.cpu.extension_build import load_extension

_HERE = os.path.dirname(__file__)
_SOURCES = [os.path.join(_HERE, name) for name in ("fused_ops.cpp", "quant_ops.cpp", "sampling_ops.cpp", "pool_ops.cpp")]
_HEADERS = [os.path.join(_HERE, name) for name in ("fused_ops.h", "kernel_util.h")]
# -fopenmp: at::parallel_for splits a kernel's rows over torch's intra-op threads only in code built
# with OpenMP (ATen's header falls back to one thread otherwise); with one thread (small models,
# tune_for_model) nothing changes.
# The kernels target the instruction set torch dispatches its own kernels to: -march=native, less
# AVX-512 where torch runs AVX2 (a CPU without it, or ATEN_CPU_CAPABILITY=avx2 on one with it, which
# is how the AVX2 register tiles are built and tested on an AVX-512 machine).
_CAPABILITY = torch.backends.cpu.get_cpu_capability()
_FLAGS = ["-O3", "-march=native", "-fopenmp"] + (["-mno-avx512f"] if _CAPABILITY == "AVX2" else [])
_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet


def build_digest(sources: list[str] | None = None) -> str:
    """Names one build of C++ sources (default: the kernels): their text, torch and the compiler flags."""
    digest = hashlib.sha256(torch.__version__.encode() + " ".join(_FLAGS).encode())
    for path in (_SOURCES + _HEADERS if sources is None else sources):
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


def build_dir(name: str = "cpu_kernels", sources: list[str] | None = None) -> str:
    """Where a build of `sources` lives: ~/.cache/deepinfer/<name>/<digest> (XDG_CACHE_HOME honoured)."""
    path = os.path.join(envs.cache_root(), "deepinfer", name, build_digest(sources))
    os.makedirs(path, exist_ok=True)
    return path


def load() -> bool:
    """Build (first time) and load the kernels; False (with a warning) when they cannot be."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _try_load(build_dir())
        return _loaded


def _try_load(path: str) -> bool:
    built = os.path.exists(os.path.join(path, "deepinfer_cpu_kernels.so"))
    if not built:
        print("deepinfer: compiling the cpu backend's C++ kernels (once, ~30 s)...", file=sys.stderr, flush=True)
    try:
        load_extension(path, name="deepinfer_cpu_kernels", sources=_SOURCES, extra_cflags=_FLAGS,
                       extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except Exception as exc:  # no compiler, no ninja, a broken toolchain: the reference ops still work
        warnings.warn(f"deepinfer: the cpu C++ kernels could not be built ({type(exc).__name__}: "
                      f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}); using the reference "
                      "ops (slower). Set DEEPINFER_CPU_KERNELS=0 to skip the attempt.", RuntimeWarning, stacklevel=3)
        return False
    return True


# ---------------------------------------------------------------- the ops (same signatures as the reference)
# Each falls back to `reference` (reference.py, or invariant.py in batch-invariant mode) for inputs the
# kernels do not take (non-float32 tensors, e.g. a bfloat16 cache): the kernels are an
# optimisation, never a second set of semantics.
_F32 = torch.float32
# The projection kernels run a token alone as a GEMV and two tokens or more as register tiles of
# tokens x weight rows (fused_ops.cpp, gemm_rows; with AVX-512 or AVX2), where each weight chunk feeds
# several FMAs: at 4-32 tokens they run at 50-100% of MKL's large-GEMM rate, where MKL's own skinny
# GEMMs (plus the reference's einsum / chunk / swiglu ops around them) reach a half of it or less.
# The limits are multiply-adds per call (tokens for linear), set where the reference's GEMMs catch
# up, measured at the shipped-model, v3 bench (hidden 512) and LM-head shapes on 1 and 2 threads
# (`python benchmarks/cpu_kernels.py --crossover --threads 1,2` and `--linear-crossover`).
# Batch-invariant mode lifts them: a switch by batch size would change a row's rounding.
# The tiles are compiled where the compiler targets AVX-512 or AVX2 + FMA (what torch reports:
# _FLAGS). The AVX2 tiles (3 tokens x 4 rows of 256-bit accumulators) win where the AVX-512 ones do:
# measured on this machine with AVX-512 turned off for both sides (ATEN_CPU_CAPABILITY=avx2
# MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2; benchmarks/results/cpu_crossover_avx2.json),
# so the limits are the same. Elsewhere each token is a GEMV of its own, and the limits are those
# measured before the tiles (the second value of each pair).
_TILES = _CAPABILITY.startswith("AVX512") or _CAPABILITY == "AVX2"
# grouped_linear wins at every batch measured (to 512 tokens; 2^24 MACs is 256 tokens of the v3
# bench model's 8 heads of 128 x 64).
_GEMV_MAX_MACS = 1 << 24 if _TILES else 1 << 20
# The shared expert (and a dense MLP): the reference catches up at 48-64 tokens whatever the width
# (hidden 256-512, intermediate 256-1024: 1.1-2.4x for the kernel at 8-32 tokens). Untiled: 2^20
# multiply-adds per call, whatever the tokens.
_MLP_MAX_TOKENS, _MLP_MAX_MACS = (48, math.inf) if _TILES else (math.inf, 1 << 20)
# A plain linear is one MKL GEMM (~2-5 us fixed cost, nothing around it): the kernel wins 1.0-2.5x
# from 4 to 32 tokens (LM head 129,280 x 256 at 16 tokens: 1.4-1.6x), MKL leads by up to 1.2x at 64;
# at 2 tokens it is even (LM heads) to 1.2x slower (the 0.2-0.8 MMAC projections, 2-4 us), at 1
# token 1.5x faster.
_LINEAR_MAX_TOKENS = 32 if _TILES else 2
_ROUTER_MAX_MACS = 1 << 18  # routers: an exp, log1p and sqrt per expert besides the dot
# The reference MoE runs a GEMM pair per expert hit (a fixed cost each, in Python); the kernel has no
# per-expert cost and tiled dots: it wins at every batch measured (up to 512 tokens, 1.3-3x), so the
# limit only keeps prefills of many rows per expert on the GEMMs.
_MOE_MAX_MACS_PER_EXPERT = 1 << 25 if _TILES else 1 << 22


def hc_pre(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, *, reference=ops.hc_pre):
    if streams.dtype != _F32 or fn.dtype != _F32:
        return reference(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)
    return torch.ops.deepinfer_cpu.hc_pre(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)


def hc_mixes(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, *, reference=ops.hc_mixes):
    """DeepSeek-V4.1's mixes (its collapse comes a sub-layer later): hc_pre's kernel without the collapse."""
    if streams.dtype != _F32 or fn.dtype != _F32 or streams.dim() != 3:
        return reference(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)
    return torch.ops.deepinfer_cpu.hc_mixes(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)


def hc_collapse(streams, weights, *, reference=ops.hc_collapse):
    if streams.dtype != _F32 or weights.dtype != _F32 or streams.dim() != 3 or weights.dim() != 2:
        return reference(streams, weights)
    return torch.ops.deepinfer_cpu.hc_collapse(streams, weights)


def hc_post(block_out, streams, post, comb, *, reference=ops.hc_post):
    if block_out.dtype != _F32 or streams.dtype != _F32:
        return reference(block_out, streams, post, comb)
    return torch.ops.deepinfer_cpu.hc_post(block_out, streams, post, comb)


def rms_norm(x, weight, eps, *, reference=ops.rms_norm):
    if x.dtype != _F32 or (weight is not None and weight.dtype != _F32):
        return reference(x, weight, eps)
    return torch.ops.deepinfer_cpu.rms_norm(x, weight, eps)


def rope(x, cos, sin, inverse=False, *, reference=ops.rope):
    if x.dtype != _F32 or x.dim() not in (2, 3):
        return reference(x, cos, sin, inverse)
    return torch.ops.deepinfer_cpu.rope(x, cos, sin, inverse)


def sparse_attention(q, kv, indices, sinks, scale, *, reference=ops.sparse_attention):
    if kv.dtype != _F32 or q.dtype != _F32 or kv.stride(-1) != 1:
        return reference(q, kv, indices, sinks, scale)
    return torch.ops.deepinfer_cpu.sparse_attention(q, kv, indices, sinks, scale)


def sparse_attention_bf16(q, kv, indices, sinks, scale, *, reference=ops.sparse_attention_bf16):
    if kv.dtype != _F32 or q.dtype != _F32 or kv.dim() != 2 or kv.stride(-1) != 1 or q.dim() != 3:
        return reference(q, kv, indices, sinks, scale)
    return torch.ops.deepinfer_cpu.sparse_attention_bf16(q, kv, indices, sinks, scale)


def indexer_topk(q, weights, keys, candidates, topk, scale, *, reference=ops.indexer_topk):
    if keys.dtype != _F32 or q.dtype != _F32 or weights.dtype != _F32 or keys.stride(-1) != 1:
        return reference(q, weights, keys, candidates, topk, scale)
    return torch.ops.deepinfer_cpu.indexer_topk(q, weights, keys, candidates, topk, scale)


def linear(x, weight, *, reference=ops.linear, max_tokens=_LINEAR_MAX_TOKENS, max_qtokens=quant.MAX_TOKENS):
    if not quant.is_plain_f32(weight):
        out = quant.linear(x, weight, max_qtokens)
        return out if out is not None else reference(x, weight)
    if x.dim() == 0 or x.numel() > max_tokens * x.shape[-1] or x.dtype != _F32 or weight.dtype != _F32:
        return reference(x, weight)
    if x.dim() == 2:
        return torch.ops.deepinfer_cpu.linear(x, weight)
    # any leading shape as rows: a row's result must not depend on how its batch is shaped
    return torch.ops.deepinfer_cpu.linear(x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])


def hc_head(streams, fn, base, scale, norm_eps, hc_eps, *, reference=ops.hc_head):
    if streams.dtype != _F32 or fn.dtype != _F32:
        return reference(streams, fn, base, scale, norm_eps, hc_eps)
    return torch.ops.deepinfer_cpu.hc_head(streams, fn, base, scale, norm_eps, hc_eps)


def grouped_linear(x, weight, *, reference=ops.grouped_linear, max_macs=_GEMV_MAX_MACS,
                   max_qtokens=quant.MAX_TOKENS):
    if not quant.is_plain_f32(weight):
        out = quant.grouped_linear(x, weight, max_qtokens)
        return out if out is not None else reference(x, weight)
    if x.shape[0] * weight.numel() > max_macs or x.dtype != _F32 or weight.dtype != _F32:
        return reference(x, weight)
    return torch.ops.deepinfer_cpu.grouped_linear(x, weight)


def swiglu_mlp(x, gate_up, down, limit, *, reference=ops.swiglu_mlp, max_tokens=_MLP_MAX_TOKENS,
               max_macs=_MLP_MAX_MACS, max_qtokens=quant.MAX_TOKENS):
    if not (quant.is_plain_f32(gate_up) and quant.is_plain_f32(down)):
        out = quant.swiglu_mlp(x, gate_up, down, limit, max_qtokens)
        return out if out is not None else reference(x, gate_up, down, limit)
    if (x.shape[0] > max_tokens or x.shape[0] * (gate_up.numel() + down.numel()) > max_macs
            or x.dtype != _F32 or gate_up.dtype != _F32
            or down.dtype != _F32 or x.dim() != 2):
        return reference(x, gate_up, down, limit)
    return torch.ops.deepinfer_cpu.swiglu_mlp(x, gate_up, down, limit)


def route_topk(x, gate, bias, top_k, scaling, *, reference=ops.route_topk, max_macs=_ROUTER_MAX_MACS):
    if not quant.is_plain_f32(gate):
        out = quant.route_topk(x, gate, bias, top_k, scaling)
        return out if out is not None else reference(x, gate, bias, top_k, scaling)
    if x.shape[0] * gate.numel() > max_macs or x.dtype != _F32 or gate.dtype != _F32:
        return reference(x, gate, bias, top_k, scaling)
    return tuple(torch.ops.deepinfer_cpu.route_topk(x, gate, bias, top_k, scaling))


def route_grouped_topk(x, gate, bias, top_k, n_group, topk_group, normalize, scaling, *,
                       reference=ops.route_grouped_topk, max_macs=_ROUTER_MAX_MACS):
    if x.shape[0] * gate.numel() > max_macs or x.dtype != _F32 or gate.dtype != _F32:
        return reference(x, gate, bias, top_k, n_group, topk_group, normalize, scaling)
    return tuple(torch.ops.deepinfer_cpu.route_grouped_topk(x, gate, bias, top_k, n_group, topk_group, normalize,
                                                            scaling))


def route_hash(x, gate, ids, scaling, *, reference=ops.route_hash, max_macs=_ROUTER_MAX_MACS):
    if not quant.is_plain_f32(gate):
        out = quant.route_hash(x, gate, ids, scaling)
        return out if out is not None else reference(x, gate, ids, scaling)
    if x.shape[0] * gate.numel() > max_macs or x.dtype != _F32 or gate.dtype != _F32:
        return reference(x, gate, ids, scaling)
    return torch.ops.deepinfer_cpu.route_hash(x, gate, ids, scaling)


def moe_experts(x, weights, ids, gate_up, down, limit, *, reference=ops.moe_experts,
                max_macs_per_expert=_MOE_MAX_MACS_PER_EXPERT, max_qrows_per_expert=quant.MOE_GEMM_FROM_ROWS):
    if not (quant.is_plain_f32(gate_up) and quant.is_plain_f32(down)):
        out = quant.moe_experts(x, weights, ids, gate_up, down, limit, gemm_from_rows=max_qrows_per_expert)
        return out if out is not None else reference(x, weights, ids, gate_up, down, limit)
    per_row = gate_up[0].numel() + down[0].numel() if gate_up.shape[0] else 0
    if (ids.numel() * per_row > max_macs_per_expert * gate_up.shape[0] or x.dtype != _F32
            or gate_up.dtype != _F32 or down.dtype != _F32 or x.shape[0] == 0):
        return reference(x, weights, ids, gate_up, down, limit)
    return torch.ops.deepinfer_cpu.moe_experts(x, weights, ids, gate_up, down, limit)


def moe_experts_bf16(x, weights, ids, gate_up, down, limit, act_block=0, *, reference,
                     gemm_from_rows=quant.MOE_GEMM_FROM_ROWS):
    """Accelerator.moe_experts_bf16 in one call of the experts kernel (quant_ops.cpp), on float32, bf16
    and quantized stacks, at every size: one fixed-shape call, so a step that holds it is recorded
    and replayed whatever its rows (DSpark's drafting blocks at batch 8 put 20 rows on each of a
    stage's 4 experts). An expert with more than `gemm_from_rows` rows (prefill) has its GEMMs on
    widened tiles + MKL inside the call; batch-invariant mode passes inf (a switch by batch size would
    change a row's rounding). `reference` is the base class's composite (bound to the accelerator),
    for inputs the kernel does not take."""
    out = quant.moe_experts(x, weights, ids, gate_up, down, limit, True, act_block, gemm_from_rows)
    return out if out is not None else reference(x, weights, ids, gate_up, down, limit, act_block)


def fp8_qdq(x, block, *, reference=ops.fp8_qdq):
    out = quant.fp8_qdq(x, block)
    return out if out is not None else reference(x, block)


def argmax(logits, *, reference=ops.argmax):
    """Greedy sampling (Accelerator.argmax): the kernel for float32 [B, V]."""
    if logits.dim() != 2 or logits.dtype != _F32 or logits.shape[-1] == 0:
        return reference(logits)
    return torch.ops.deepinfer_cpu.argmax_rows(logits)


def copy_rows(pool, src, dst, *, reference=ops.copy_rows):
    """Accelerator.copy_rows: the kernel for pools with contiguous rows."""
    if pool.dim() != 2 or pool.stride(1) != 1 or src.dtype != torch.int64 or dst.dtype != torch.int64:
        return reference(pool, src, dst)
    torch.ops.deepinfer_cpu.copy_rows(pool, src, dst)


def sample(logits, temperature, top_k, top_p, seeds, positions, *, reference=ops.sample):
    return reference(logits, temperature, top_k, top_p, seeds, positions, argmax=argmax)


# The fused sequences of models/deepseek_v4/fused.py (Accelerator.fused_*): None
# declines an input (not float32) and the model runs the composite instead.
def compress_entries(ring, rows, bias, overlap, norm_weight, eps, cos, sin):
    if ring.dtype != _F32 or bias.dtype != _F32 or norm_weight.dtype != _F32 or ring.stride(-1) != 1:
        return None
    return torch.ops.deepinfer_cpu.compress_entries(ring, rows, bias, overlap, norm_weight, eps, cos, sin)


def hc_pre_norm(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, norm_weight):
    if streams.dtype != _F32 or fn.dtype != _F32 or norm_weight.dtype != _F32:
        return None
    return torch.ops.deepinfer_cpu.hc_pre_norm(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, norm_weight)


def hc_post_pre_norm(block_out, streams, post, comb, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, norm_weight):
    args = (block_out, streams, post, comb, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, norm_weight)
    if block_out.dtype != _F32 or streams.dtype != _F32 or fn.dtype != _F32 or norm_weight.dtype != _F32:
        return None
    return torch.ops.deepinfer_cpu.hc_post_pre_norm(*args)


def rms_norm_rope(x, weight, eps, cos, sin):
    if x.dtype != _F32 or x.dim() not in (2, 3) or (weight is not None and weight.dtype != _F32):
        return None
    return torch.ops.deepinfer_cpu.rms_norm_rope(x, weight, eps, cos, sin)


OPS = ("hc_pre", "hc_mixes", "hc_collapse", "hc_post", "hc_head", "rms_norm", "rope", "sparse_attention",
       "sparse_attention_bf16", "indexer_topk", "moe_experts",
       "grouped_linear", "route_topk", "route_grouped_topk", "route_hash", "swiglu_mlp", "linear", "argmax", "sample",
       "copy_rows", "fp8_qdq")


def batch_invariant_ops() -> dict:
    """The kernels for DEEPINFER_BATCH_INVARIANT=1. Every kernel computes a token with a fixed
    order of operations whatever else is in the batch (tests/unit/test_batch_invariance.py), so
    the mode takes all of them at every batch size: switching to a GEMM above a batch size would
    change a row's rounding with the batch. Inputs they do not take go to the mode's own ops."""
    import functools

    from deepinfer.backends.cpu import invariant

    out = {}
    for name in OPS:
        reference = getattr(invariant, name, getattr(ops, name))  # invariant.py redefines only what it must
        # linear: the GEMV kernel at every size. invariant.py's alternative pads rows to blocks of
        # 16 for a fixed-shape GEMM, ~9x the GEMV's time for a decode row; the GEMV loses only on
        # prefills of narrow matrices (1.5x at 64 x 512, 256 rows; it wins at every size at 256 wide;
        # `python benchmarks/cpu_kernels.py --invariant-linear`).
        limits = {"max_macs_per_expert": math.inf, "max_qrows_per_expert": math.inf} if name == "moe_experts" else \
            {"max_macs": math.inf} if name in ("route_topk", "route_grouped_topk", "route_hash") else \
            {"max_macs": math.inf, "max_qtokens": math.inf} if name == "grouped_linear" else \
            {"max_tokens": math.inf, "max_macs": math.inf, "max_qtokens": math.inf} if name == "swiglu_mlp" else \
            {"max_tokens": math.inf, "max_qtokens": math.inf} if name == "linear" else {}
        out[name] = functools.partial(globals()[name], reference=reference, **limits)
    return out
