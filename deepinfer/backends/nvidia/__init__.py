"""NVIDIA backend: Triton kernels, and the csrc/cuda sparse attention where it is built.

Not everything is a Triton kernel: indexer_topk and route_topk compute scores in Triton and select
with torch's (stable) sort/topk exactly as the reference; sample's top-k/top-p mask is the
reference's sort-based filter (temperature, the SplitMix64 Gumbel noise and argmax are Triton);
the MoE expert grouping is torch (argsort + bincount) around Triton GEMMs; the base class's fused
sequences (hc_pre_norm, hc_post_pre_norm, rms_norm_rope, swiglu_mlp, compress_entries) run as
composites of the kernels.

The kernels run unchanged under the Triton interpreter (`TRITON_INTERPRET=1`) on CPU tensors;
that is how CI, which has no GPU, executes them. Batch invariance: every reduction is done
in fixed-size chunks chosen from the weight/feature shape, never from the token count.
"""

from __future__ import annotations

import torch

from deepinfer.backends.base import Accelerator, WeightRole

try:
    import triton  # noqa: F401
except ImportError as exc:  # the registry turns this into the user-facing error
    raise ImportError("the nvidia backend needs Triton: pip install triton") from exc

from deepinfer.backends.nvidia import cuda_ext  # noqa: E402
from deepinfer.backends.triton import attention, elementwise, fp8, gemm, quant, sampling  # noqa: E402

def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() and torch.cuda.device_count() > 0 \
        else torch.device("cpu")


class NvidiaAccelerator(Accelerator):
    name = "nvidia"
    dist_backend = "nccl"
    # Always: every kernel's tiles and reduction order are fixed by the weight/feature shape, never
    # by the token count, so DEEPINFER_BATCH_INVARIANT has nothing to switch here.
    batch_invariant = True
    deterministic_sampling = True
    fp8_weights = False  # FP8 block-scaled GEMMs land with csrc/cuda; weights are dequantized at load

    def __init__(self) -> None:
        self.device = _device()
        # The csrc/cuda attention (built by setup.py / csrc/cuda/build.sh) replaces the Triton one
        # for every step size, so a token's result never depends on which kernel its batch picked.
        self.cuda_attention = self.device.type == "cuda" and cuda_ext.load() is not None

    def sparse_attention(self, q, kv, indices, sinks, scale):
        if self.cuda_attention:
            return cuda_ext.sparse_decode_attention(q, kv, indices, sinks, scale)
        return attention.sparse_attention(q, kv, indices, sinks, scale)

    def prepare_weight(self, tensor: torch.Tensor, role: WeightRole = WeightRole.PLAIN) -> torch.Tensor:
        # float32 storage keeps the kernels comparable to the cpu reference; bf16 storage is a
        # later, measured step (every kernel already casts loads to fp32).
        if tensor.is_floating_point():
            tensor = tensor.float()
        return tensor.to(self.device).contiguous()

    linear = staticmethod(gemm.linear)
    grouped_linear = staticmethod(gemm.grouped_linear)
    fp8_block_linear = staticmethod(fp8.fp8_block_linear)
    fp8_qdq = staticmethod(quant.fp8_qdq)
    fp4_qdq = staticmethod(quant.fp4_qdq)
    moe_experts = staticmethod(gemm.moe_experts)
    embedding = staticmethod(elementwise.embedding)
    rms_norm = staticmethod(elementwise.rms_norm)
    rope = staticmethod(elementwise.rope)
    swiglu = staticmethod(elementwise.swiglu)
    hc_pre = staticmethod(elementwise.hc_pre)
    hc_mixes = staticmethod(elementwise.hc_mixes)
    hc_collapse = staticmethod(elementwise.hc_collapse)
    hc_post = staticmethod(elementwise.hc_post)
    hc_head = staticmethod(elementwise.hc_head)
    compress_windows = staticmethod(attention.compress_windows)
    indexer_topk = staticmethod(attention.indexer_topk)
    indexer_scores = staticmethod(attention.indexer_scores)
    sparse_attention_bf16 = staticmethod(attention.sparse_attention_bf16)
    dense_attention = staticmethod(attention.dense_attention)
    route_topk = staticmethod(sampling.route_topk)
    route_hash = staticmethod(sampling.route_hash)
    sample = staticmethod(sampling.sample)
    apply_token_bitmask = staticmethod(sampling.apply_token_bitmask)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def memory_available(self) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info()
            return int(free * 0.9)
        return 4 << 30
