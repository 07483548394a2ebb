"""NVIDIA backend: Triton kernels, and the csrc/cuda sparse attention where it is built.

Weights stay as loaded: bf16 and float32 matrices through the tiled GEMMs (bf16 x bf16 on tensor
cores when the compute dtype is bf16), FP8 dense weights through DeepSeek's FP8 block GEMM
(triton/fp8.py: activations quantized per 1 x 128 group, the error stated there), routed experts
in FP4 or FP8 through the MoE GEMMs, which widen the weight in registers (weight-only: the
activations are used as given).

Not everything is a Triton kernel: indexer_topk and route_topk compute scores in Triton and select
with torch's (stable) sort/topk exactly as the reference; sample's top-k/top-p mask is the
reference's sort-based filter (temperature, the SplitMix64 Gumbel noise and argmax are Triton);
the MoE expert grouping is torch (argsort, a fixed-shape tile schedule) around Triton GEMMs; the base class's fused
sequences (hc_pre_norm, hc_post_pre_norm, rms_norm_rope, swiglu_mlp, compress_entries) run as
composites of the kernels.

The kernels run unchanged under the Triton interpreter (`TRITON_INTERPRET=1`) on CPU tensors;
that is how CI, which has no GPU, executes them. Batch invariance: every reduction is done
in fixed-size chunks chosen from the weight/feature shape, never from the token count.
"""

from __future__ import annotations

import torch

from deepinfer.backends.base import Accelerator, WeightRole
from deepinfer.backends.quant import QuantizedWeight, Weight

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
    preferred_dtype = torch.bfloat16

    def __init__(self) -> None:
        self.device = _device()
        # decode steps captured as CUDA graphs (graphs.py), on a GPU; batches padded to the captured sizes
        self.step_graphs = self.pad_graph_batches = self.device.type == "cuda"
        self._graph_pool = None
        # The csrc/cuda attention (built by setup.py / csrc/cuda/build.sh) replaces the Triton one
        # for every step size, so a token's result never depends on which kernel its batch picked.
        self.cuda_attention = self.device.type == "cuda" and cuda_ext.load() is not None

    def sparse_attention(self, q, kv, indices, sinks, scale):
        if self.cuda_attention:
            return cuda_ext.sparse_decode_attention(q, kv, indices, sinks, scale)
        return attention.sparse_attention(q, kv, indices, sinks, scale)

    def prepare_weight(self, tensor: Weight, role: WeightRole = WeightRole.PLAIN) -> Weight:
        # Kept as loaded (bf16, FP8, FP4): every kernel widens its loads in registers.
        return tensor.to(self.device).contiguous()

    @staticmethod
    def linear(x, weight):
        if isinstance(weight, QuantizedWeight):
            if fp8.takes(weight):  # DeepSeek's FP8 GEMM: activations quantized per 1 x 128 (fp8.py)
                return fp8.quantized_linear(x, weight)
            weight = weight.dequantize()  # no dense kernel for this format: widened for the call
        return gemm.linear(x, weight)

    @staticmethod
    def grouped_linear(x, weight):
        if isinstance(weight, QuantizedWeight):
            n = weight.shape[0] // x.shape[1]
            if fp8.takes(weight):
                return torch.stack([fp8.quantized_linear(x[:, g], weight.rows(g * n, (g + 1) * n))
                                    for g in range(x.shape[1])], dim=1)
            weight = weight.dequantize()
        return gemm.grouped_linear(x, weight)

    fp8_qdq = staticmethod(quant.fp8_qdq)
    fp4_qdq = staticmethod(quant.fp4_qdq)
    moe_experts = staticmethod(gemm.moe_experts)
    moe_experts_bf16 = staticmethod(gemm.moe_experts_bf16)
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
    route_grouped_topk = staticmethod(sampling.route_grouped_topk)
    route_hash = staticmethod(sampling.route_hash)
    sample = staticmethod(sampling.sample)
    apply_token_bitmask = staticmethod(sampling.apply_token_bitmask)
    apply_penalties = staticmethod(sampling.apply_penalties)
    apply_min_p = staticmethod(sampling.apply_min_p)
    apply_logit_bias = staticmethod(sampling.apply_logit_bias)
    count_tokens = staticmethod(sampling.count_tokens)

    def compile_step(self, recording, step_fn):
        if self.device.type != "cuda" or step_fn is None:
            return None
        from deepinfer.backends.nvidia import graphs

        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        return graphs.CapturedStep(recording, step_fn, self.device, graphs.cuda_capture(self._graph_pool))

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def memory_info(self) -> tuple[int, int]:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info()
            return int(free), int(total)
        return 4 << 30, 8 << 30  # the interpreter on CPU tensors: a nominal device
