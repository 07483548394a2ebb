"""The reference backend: plain float32 torch on the CPU."""

from __future__ import annotations

import os

import torch

from deepinfer.backends.base import Accelerator, WeightRole
from deepinfer.backends.cpu import invariant, kernels, ops


class CpuAccelerator(Accelerator):
    name = "cpu"
    device = torch.device("cpu")
    dist_backend = "gloo"
    # The fast ops are not batch-invariant (MKL picks GEMM kernels by row count: a 1-row linear
    # differs from the same row in a batch of 40 by ~1e-6). DEEPINFER_BATCH_INVARIANT=1 at
    # construction swaps in the ops of `invariant.py` and only then claims both capabilities.
    batch_invariant = False
    deterministic_sampling = False
    batch_invariant_mode = True
    fp8_weights = False
    # The "device" is the host: a forward on a worker thread and the next step's planning contend
    # for the GIL, and the overlap measured 0.76x (batch 32) to 0.95x (batch 1) of synchronous steps.
    overlap_scheduling = False
    # With the fused kernels a step's remaining cost grows with its tokens (one core's fp32
    # arithmetic): on the shipped model a 6-token verify step plus the drafter costs ~3 plain steps
    # for 2.98 tokens, and dynamic mode, which then nearly stops drafting, still ran 3-12% under no
    # drafting at concurrency 1-64 (benchmarks/dspark.py). DEEPINFER_USE_NEXTN_DECODE=5 turns it on.
    speculative_decoding = False

    def __init__(self) -> None:
        from deepinfer import envs

        self.fused_kernels = use_kernels = bool(envs.get("DEEPINFER_CPU_KERNELS")) and kernels.load()
        if envs.batch_invariant():
            for op in invariant.OPS:
                setattr(self, op, getattr(invariant, op))
            if use_kernels:  # row-wise with a fixed order: invariant by construction, and faster
                for op, fn in kernels.batch_invariant_ops().items():
                    setattr(self, op, fn)
            self.batch_invariant = True
            self.deterministic_sampling = True
        elif use_kernels:
            for op in kernels.OPS:
                setattr(self, op, getattr(kernels, op))

    def prepare_weight(self, tensor: torch.Tensor, role: WeightRole = WeightRole.PLAIN) -> torch.Tensor:
        # bf16 matmuls run ~100x slower than fp32 on these CPUs: compute in float32.
        if tensor.is_floating_point():
            tensor = tensor.float()
        return tensor.contiguous()

    linear = staticmethod(ops.linear)
    grouped_linear = staticmethod(ops.grouped_linear)
    fp8_block_linear = staticmethod(ops.fp8_block_linear)
    embedding = staticmethod(ops.embedding)
    rms_norm = staticmethod(ops.rms_norm)
    rope = staticmethod(ops.rope)
    swiglu = staticmethod(ops.swiglu)
    swiglu_mlp = staticmethod(ops.swiglu_mlp)
    hc_pre = staticmethod(ops.hc_pre)
    hc_post = staticmethod(ops.hc_post)
    hc_head = staticmethod(ops.hc_head)
    compress_windows = staticmethod(ops.compress_windows)
    compress_entries = staticmethod(ops.compress_entries)
    hc_pre_norm = staticmethod(ops.hc_pre_norm)
    hc_post_pre_norm = staticmethod(ops.hc_post_pre_norm)
    rms_norm_rope = staticmethod(ops.rms_norm_rope)
    indexer_topk = staticmethod(ops.indexer_topk)
    sparse_attention = staticmethod(ops.sparse_attention)
    route_topk = staticmethod(ops.route_topk)
    route_hash = staticmethod(ops.route_hash)
    moe_experts = staticmethod(ops.moe_experts)
    sample = staticmethod(ops.sample)
    apply_token_bitmask = staticmethod(ops.apply_token_bitmask)

    def step_program(self, model, cache):
        from deepinfer import envs
        from deepinfer.backends.cpu.step_program import StepProgram

        if not self.fused_kernels or not envs.get("DEEPINFER_CPU_STEP_PROGRAM"):
            return None
        return StepProgram.build(model, cache, self)

    def kernel_signature(self) -> str:
        return f"{super().kernel_signature()} fused {kernels.build_digest() if self.fused_kernels else 'off'}"

    def tune_for_model(self, hidden_size: int) -> None:
        # Small models are bound by per-op overhead: one intra-op thread beats two on the tiny
        # shipped model (3.0 s vs 4.2 s for a 32 x 40-token batch) and does not collapse when
        # another process shares the cores (2.0 s vs 47 s measured, OpenMP oversubscription).
        # DEEPINFER_CPU_THREADS overrides the choice.
        from deepinfer import envs

        threads = envs.get("DEEPINFER_CPU_THREADS")
        if threads <= 0:
            threads = 1 if hidden_size <= 1024 else (os.cpu_count() or 1)
        torch.set_num_threads(threads)

    def memory_available(self) -> int:
        try:
            pages = os.sysconf("SC_AVPHYS_PAGES")
            return int(pages * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError):
            return 4 << 30
