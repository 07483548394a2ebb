"""The cpu backend: plain float32 torch (the reference ops), or the fused C++ kernels for the hot
ops (kernels.py, compiled on first use), each also in a batch-invariant form. `make()` picks the
class from DEEPINFER_CPU_KERNELS, DEEPINFER_BATCH_INVARIANT and whether the kernels build; the
ops of each class are its methods."""

from __future__ import annotations

import math
import os

import torch

from deepinfer.backends import reference
from deepinfer.backends.base import Accelerator, WeightRole
from deepinfer.backends.quant import Weight
from deepinfer.backends.cpu import invariant, kernels


class CpuAccelerator(Accelerator):
    """The reference ops (backends/reference.py)."""

    name = "cpu"
    device = torch.device("cpu")
    dist_backend = "gloo"
    # The fast ops are not batch-invariant (MKL picks GEMM kernels by row count: a 1-row linear
    # differs from the same row in a batch of 40 by ~1e-6). DEEPINFER_BATCH_INVARIANT=1 selects the
    # invariant classes below, which alone claim both capabilities.
    batch_invariant = False
    deterministic_sampling = False
    batch_invariant_mode = True
    # The "device" is the host: a forward on a worker thread and the next step's planning contend
    # for the GIL, and the overlap measured 0.76x (batch 32) to 0.95x (batch 1) of synchronous steps.
    overlap_scheduling = False
    # With the fused kernels a step's remaining cost grows with its tokens (one core's fp32
    # arithmetic): on the shipped model a 6-token verify step plus the drafter costs ~3 plain steps
    # for 2.98 tokens, and dynamic mode, which then nearly stops drafting, still ran 3-12% under no
    # drafting at concurrency 1-64 (benchmarks/dspark.py). DEEPINFER_USE_NEXTN_DECODE=5 turns it on.
    speculative_decoding = False
    # decode steps are recorded once per shape and replayed from C++ (replay.py)
    step_graphs = True

    linear = staticmethod(reference.linear)
    grouped_linear = staticmethod(reference.grouped_linear)
    embedding = staticmethod(reference.embedding)
    rms_norm = staticmethod(reference.rms_norm)
    rope = staticmethod(reference.rope)
    swiglu = staticmethod(reference.swiglu)
    swiglu_mlp = staticmethod(reference.swiglu_mlp)
    fp8_qdq = staticmethod(reference.fp8_qdq)
    fp4_qdq = staticmethod(reference.fp4_qdq)
    hc_pre = staticmethod(reference.hc_pre)
    hc_mixes = staticmethod(reference.hc_mixes)
    hc_collapse = staticmethod(reference.hc_collapse)
    indexer_scores = staticmethod(reference.indexer_scores)
    sparse_attention_bf16 = staticmethod(reference.sparse_attention_bf16)
    hc_post = staticmethod(reference.hc_post)
    hc_head = staticmethod(reference.hc_head)
    compress_windows = staticmethod(reference.compress_windows)
    indexer_topk = staticmethod(reference.indexer_topk)
    sparse_attention = staticmethod(reference.sparse_attention)
    dense_attention = staticmethod(reference.dense_attention)
    route_topk = staticmethod(reference.route_topk)
    route_grouped_topk = staticmethod(reference.route_grouped_topk)
    route_hash = staticmethod(reference.route_hash)
    moe_experts = staticmethod(reference.moe_experts)
    argmax = staticmethod(reference.argmax)
    copy_rows = staticmethod(reference.copy_rows)
    sample = staticmethod(reference.sample)
    apply_token_bitmask = staticmethod(reference.apply_token_bitmask)

    def prepare_weight(self, tensor: Weight, role: WeightRole = WeightRole.PLAIN) -> Weight:
        # Kept as loaded: bf16 and quantized weights are widened by the ops, a block at a time (bf16
        # matmuls run ~100x slower than fp32 on these CPUs, so nothing computes in bf16).
        return tensor.contiguous()

    def tune_for_model(self, hidden_size: int, processes: int = 1) -> None:
        # Small models are bound by per-op overhead: one intra-op thread beats two on the tiny
        # shipped model (3.0 s vs 4.2 s for a 32 x 40-token batch) and does not collapse when
        # another process shares the cores (2.0 s vs 47 s measured, OpenMP oversubscription).
        # A replayed step still runs on every core of this process's share where its first replay
        # measured a call faster there (an LM head over a real vocabulary, a decode step's split
        # GEMVs: replay.py). DEEPINFER_CPU_THREADS fixes the count everywhere instead.
        from deepinfer import envs

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        cores = max(1, cores // max(1, processes))
        threads = envs.get("DEEPINFER_CPU_THREADS")
        fixed = threads > 0
        if not fixed:
            threads = 1 if hidden_size <= 1024 else cores
        torch.set_num_threads(threads)
        self.step_threads = [] if fixed or cores <= threads else [threads, cores]

    # thread counts a replayed step's calls choose from (tune_for_model): none to choose before it
    step_threads: list[int] = []
    # whether a replay may fuse pairs of calls into the C++ kernels' (replay.fuse_calls): not on the
    # reference ops, which DEEPINFER_CPU_KERNELS=0 asks for
    fuses_calls = False

    def compile_step(self, recording, step_fn):
        from deepinfer.backends.cpu import replay

        return replay.compile_recording(recording, self.step_threads, fuse=self.fuses_calls)

    def memory_info(self) -> tuple[int, int]:
        # MemAvailable (free + reclaimable page cache): what this process can still allocate
        try:
            with open("/proc/meminfo") as f:
                info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
            return info["MemAvailable"], info["MemTotal"]
        except (OSError, KeyError, ValueError, IndexError):
            try:
                page = os.sysconf("SC_PAGE_SIZE")
                return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
            except (ValueError, OSError):
                return 4 << 30, 8 << 30


class CpuInvariantAccelerator(CpuAccelerator):
    """The reference ops, with invariant.py's versions of those whose rows depend on the batch."""

    batch_invariant = True
    deterministic_sampling = True


for _name in invariant.OPS:
    setattr(CpuInvariantAccelerator, _name, staticmethod(getattr(invariant, _name)))


class _Kernels:
    """What the kernel classes share: the fused sequences, and the experts kernel with the base
    class's composite as its fallback."""

    _expert_gemm_from_rows = kernels.quant.MOE_GEMM_FROM_ROWS  # rows per expert (kernels.moe_experts_bf16)
    fuses_calls = True

    def moe_experts_bf16(self, x, weights, ids, gate_up, down, limit, act_block=0):
        return kernels.moe_experts_bf16(x, weights, ids, gate_up, down, limit, act_block,
                                        reference=super().moe_experts_bf16,
                                        gemm_from_rows=self._expert_gemm_from_rows)

    # the fused sequences (Accelerator.fused_*)
    fused_compress_entries = staticmethod(kernels.compress_entries)
    fused_hc_pre_norm = staticmethod(kernels.hc_pre_norm)
    fused_hc_post_pre_norm = staticmethod(kernels.hc_post_pre_norm)
    fused_rms_norm_rope = staticmethod(kernels.rms_norm_rope)

    def kernel_signature(self) -> str:
        return f"{super().kernel_signature()} fused {kernels.build_digest()}"


class CpuKernelAccelerator(_Kernels, CpuAccelerator):
    """The fused C++ kernels for the hot ops (the reference ops for the rest)."""


for _name in kernels.OPS:
    setattr(CpuKernelAccelerator, _name, staticmethod(getattr(kernels, _name)))


class CpuInvariantKernelAccelerator(_Kernels, CpuInvariantAccelerator):
    """The kernels at every batch size (each computes a row in a fixed order), invariant.py's ops for
    inputs they do not take."""

    _expert_gemm_from_rows = math.inf


for _name, _op in kernels.batch_invariant_ops().items():
    setattr(CpuInvariantKernelAccelerator, _name, staticmethod(_op))


def make() -> CpuAccelerator:
    """The cpu accelerator the environment asks for (read at construction)."""
    from deepinfer import envs

    use_kernels = bool(envs.get("DEEPINFER_CPU_KERNELS")) and kernels.load()
    if envs.batch_invariant():
        return CpuInvariantKernelAccelerator() if use_kernels else CpuInvariantAccelerator()
    return CpuKernelAccelerator() if use_kernels else CpuAccelerator()
