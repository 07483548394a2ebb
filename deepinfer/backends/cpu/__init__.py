"""The cpu backend: plain float32 torch (the reference ops), or the fused C++ kernels for the hot
ops (kernels.py, compiled on first use), each also in a batch-invariant form. `make()` picks the
class from DEEPINFER_CPU_KERNELS, DEEPINFER_BATCH_INVARIANT and whether the kernels build; the
ops of each class are its methods."""

from __future__ import annotations

import os

import torch

from deepinfer.backends import reference
from deepinfer.backends.base import Accelerator, WeightRole
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
    fp8_weights = False
    # The "device" is the host: a forward on a worker thread and the next step's planning contend
    # for the GIL, and the overlap measured 0.76x (batch 32) to 0.95x (batch 1) of synchronous steps.
    overlap_scheduling = False
    # With the fused kernels a step's remaining cost grows with its tokens (one core's fp32
    # arithmetic): on the shipped model a 6-token verify step plus the drafter costs ~3 plain steps
    # for 2.98 tokens, and dynamic mode, which then nearly stops drafting, still ran 3-12% under no
    # drafting at concurrency 1-64 (benchmarks/dspark.py). DEEPINFER_USE_NEXTN_DECODE=5 turns it on.
    speculative_decoding = False

    linear = staticmethod(reference.linear)
    grouped_linear = staticmethod(reference.grouped_linear)
    fp8_block_linear = staticmethod(reference.fp8_block_linear)
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
    route_hash = staticmethod(reference.route_hash)
    moe_experts = staticmethod(reference.moe_experts)
    sample = staticmethod(reference.sample)
    apply_token_bitmask = staticmethod(reference.apply_token_bitmask)

    def prepare_weight(self, tensor: torch.Tensor, role: WeightRole = WeightRole.PLAIN) -> torch.Tensor:
        # bf16 matmuls run ~100x slower than fp32 on these CPUs: compute in float32.
        if tensor.is_floating_point():
            tensor = tensor.float()
        return tensor.contiguous()

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


class CpuInvariantAccelerator(CpuAccelerator):
    """The reference ops, with invariant.py's versions of those whose rows depend on the batch."""

    batch_invariant = True
    deterministic_sampling = True


for _name in invariant.OPS:
    setattr(CpuInvariantAccelerator, _name, staticmethod(getattr(invariant, _name)))


class _Kernels:
    """What the kernel classes share: the fused sequences and the step program."""

    def kernel(self, name: str):
        return kernels.FUSED.get(name)

    def step_program(self, model, cache):
        from deepinfer import envs
        from deepinfer.backends.cpu.step_program import StepProgram

        return StepProgram.build(model, cache, self) if envs.get("DEEPINFER_CPU_STEP_PROGRAM") else None

    def kernel_signature(self) -> str:
        return f"{super().kernel_signature()} fused {kernels.build_digest()}"


class CpuKernelAccelerator(_Kernels, CpuAccelerator):
    """The fused C++ kernels for the hot ops (the reference ops for the rest)."""


for _name in kernels.OPS:
    setattr(CpuKernelAccelerator, _name, staticmethod(getattr(kernels, _name)))


class CpuInvariantKernelAccelerator(_Kernels, CpuInvariantAccelerator):
    """The kernels at every batch size (each computes a row in a fixed order), invariant.py's ops for
    inputs they do not take."""


for _name, _op in kernels.batch_invariant_ops().items():
    setattr(CpuInvariantKernelAccelerator, _name, staticmethod(_op))


def make() -> CpuAccelerator:
    """The cpu accelerator the environment asks for (read at construction)."""
    from deepinfer import envs

    use_kernels = bool(envs.get("DEEPINFER_CPU_KERNELS")) and kernels.load()
    if envs.batch_invariant():
        return CpuInvariantKernelAccelerator() if use_kernels else CpuInvariantAccelerator()
    return CpuKernelAccelerator() if use_kernels else CpuAccelerator()
