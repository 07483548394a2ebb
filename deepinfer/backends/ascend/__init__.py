"""Ascend backend: torch_npu fused operators where one has exactly our semantics, AscendC kernels
(csrc/ascendc) for two hot ops torch_npu has no operator for, Triton kernels (run by triton-ascend on
an NPU) for the rest. torch_npu is imported when the backend is constructed, never at package import.

Batch invariance and deterministic sampling are NVIDIA-only: this backend declares both False
(`seq_seed` still seeds sampling here, but identical reruns are not guaranteed).

Op mapping (a torch_npu operator is used only where its documented semantics equal base.py's):

| op                  | runs as                                                                  |
|---------------------|--------------------------------------------------------------------------|
| rms_norm            | torch_npu.npu_rms_norm (gamma = ones for the unweighted norm)            |
| swiglu              | clamp (the limit), then torch_npu.npu_swiglu                             |
| moe_experts         | torch_npu.npu_grouped_matmul x2 + npu_swiglu; fixed-order combine        |
| moe_experts_bf16    | the same, with its bf16 rounding and Triton fp8_qdq at the GEMM inputs   |
| compress_windows    | AscendC `compress_windows` when built, else Triton (re-tiled)       [a]  |
| hc_pre              | AscendC `mhc_sinkhorn` + torch when built, else Triton              [a]  |
| hc_post, hc_head    | Triton (shared kernels)                                             [a]  |
| hc_mixes, hc_collapse | Triton (shared kernels; V4.1's lagged collapse)                   [a]  |
| fp8_qdq, fp4_qdq    | Triton (shared kernels, bit-exact integer rounding)                 [i]  |
| indexer_scores      | Triton (shared kernel)                                              [d]  |
| sparse_attention_bf16 | Triton (shared kernel, 8 heads a program)                         [c]  |
| rope                | Triton (shared kernel)                                              [b]  |
| sparse_attention    | Triton (shared kernel, re-tiled)                                    [c]  |
| dense_attention     | Triton (shared kernel, re-tiled)                                    [j]  |
| indexer_topk        | Triton scores + torch stable sort                                   [d]  |
| route_topk          | Triton scores + torch.topk                                          [e]  |
| route_grouped_topk  | Triton scores + torch.topk                                          [h]  |
| route_hash          | Triton scores                                                       [a]  |
| apply_token_bitmask | Triton (shared kernel)                                              [a]  |
| apply_penalties, apply_min_p, apply_logit_bias, count_tokens | Triton (shared kernels)     [a]  |
| linear, grouped_linear, embedding | reference: plain torch (aclnn matmul / gather on the NPU)  |
| FP8 / FP4 weights   | widened per call (row chunks; only the experts a call hits)         [g]  |
| sample              | reference: plain torch                                              [f]  |

Why not a fused torch_npu operator:
[a] torch_npu has none.
[b] npu_rotary_mul rotates the whole last dim of 4-D inputs (D a multiple of 64/128); ours rotates the
    trailing rope slice of [T, H, D] and is used inverted on attention outputs.
[c] npu_fused_infer_attention_score has no per-head sinks and no per-token index list;
    npu_sparse_flash_attention has the index list but no sinks.
[d] npu_lightning_indexer scores a contiguous or paged key sequence under a causal mode (fp16/bf16,
    64 heads x 128 dims only), not a per-token candidate list, and documents no tie order; ours breaks
    ties towards the earlier candidate column.
[e] npu_moe_gating_top_k normalises by softmax or sigmoid only (ours: sqrt(softplus)), and takes
    256 experts / k_group 4 only on A2/A3.
[f] npu_top_k_top_p (aclnnApplyTopKTopP) keeps every tie at the k-th value (ours: exactly k) and cuts
    top-p on the ascending cumsum <= 1-p; the nvidia Triton argmax needs uint64, which triton-ascend
    does not support.
[g] no torch_npu quantized matmul documents DeepSeek's formats (e4m3 / e2m1 values with 128 x 128,
    32 x 32 or 1 x 32 block scales): npu_weight_quant_batchmatmul takes int8 / int4 weights with
    per-channel or per-group scales, npu_quant_matmul int8 / int4 operands with 1-D per-channel and
    per-token scales, no block scales (torch_npu 7.0.0 API reference). Weights stay quantized in
    memory and are widened per call, never at load (npu_ops.py).
[h] npu_moe_gating_top_k with sigmoid is this router's fused operator, with [e]'s size limits and no
    documented tie order; not checked on hardware yet.
[i] npu_dynamic_quant gives int8 with float32 per-token scales; npu_dynamic_mx_quant (Ascend 950 only) takes
    OCP MX's shared exponent floor(log2 amax) - emax, not DeepSeek's 2^ceil(log2(amax * fp32(1/448))), and
    has no FP4 mode with E4M3 scales (the compressed KV's).
[j] npu_fused_infer_attention_score takes packed sequences (actual_seq_lengths) without a mask, but its
    query/key/value are float16, bfloat16 or int8 only; the Triton kernel keeps float32 as the reference.

The Triton kernels are the ones nvidia runs (backends/triton), launched with tile sizes that fit Ascend's 192 KB unified
buffer (triton_ops.py re-tiles sparse_attention and compress_windows; the rest fit as they are); none
relies on num_warps/num_stages, and `input_precision` is an NVIDIA-only hint triton-ascend ignores. Not
verified on triton-ascend itself (no NPU here). In CI all of this runs on CPU tensors: the torch_npu
calls through tests/ascend/shim, the Triton kernels through the Triton interpreter.
"""

from __future__ import annotations

import torch

from deepinfer import envs
from deepinfer.backends import reference
from deepinfer.backends.ascend import ascendc, npu_ops
from deepinfer.backends.base import Accelerator, WeightRole

try:
    from deepinfer.backends.ascend import triton_ops
    from deepinfer.backends.triton import attention, elementwise, quant, sampling
except ImportError:  # no triton: AscendAccelerator() explains
    attention = elementwise = quant = sampling = triton_ops = None


def _unavailable(message: str):
    from deepinfer.backends import AcceleratorUnavailable

    return AcceleratorUnavailable(message)


def _import_torch_npu():
    try:
        import torch_npu
    except ImportError as exc:
        raise _unavailable(
            f"DEEPINFER_ACCELERATOR=ascend but torch_npu cannot be imported ({exc}). Install CANN and the "
            "torch_npu build matching your torch, or set DEEPINFER_ACCELERATOR=cpu.") from None
    return torch_npu


def _kernel(module_name: str, fn: str):
    """A Triton op, resolved when called (so this module imports without triton)."""
    def call(*args, **kwargs):
        return getattr(globals()[module_name], fn)(*args, **kwargs)

    call.__name__ = fn
    return staticmethod(call)


class AscendAccelerator(Accelerator):
    """Huawei Ascend NPU through torch_npu. deterministic_sampling is False: `SamplingParams(seq_seed=...)`
    still seeds each request's sampling, but identical reruns are not guaranteed (no batch-invariant
    kernels: a token's numerics may depend on its batch)."""

    name = "ascend"
    dist_backend = "hccl"
    batch_invariant = False
    deterministic_sampling = False  # seq_seed still seeds sampling; identical reruns are not guaranteed
    preferred_dtype = torch.bfloat16

    # torch_npu fused operators
    rms_norm = staticmethod(npu_ops.rms_norm)
    swiglu = staticmethod(npu_ops.swiglu)
    moe_experts = staticmethod(npu_ops.moe_experts)
    # Triton kernels (triton-ascend on an NPU, the interpreter in CI)
    rope = _kernel("elementwise", "rope")
    hc_post = _kernel("elementwise", "hc_post")
    hc_head = _kernel("elementwise", "hc_head")
    hc_mixes = _kernel("elementwise", "hc_mixes")
    hc_collapse = _kernel("elementwise", "hc_collapse")
    fp8_qdq = _kernel("quant", "fp8_qdq")
    fp4_qdq = _kernel("quant", "fp4_qdq")
    indexer_scores = _kernel("attention", "indexer_scores")
    sparse_attention_bf16 = _kernel("triton_ops", "sparse_attention_bf16")
    sparse_attention = _kernel("triton_ops", "sparse_attention")
    dense_attention = _kernel("triton_ops", "dense_attention")
    indexer_topk = _kernel("attention", "indexer_topk")
    route_topk = _kernel("sampling", "route_topk")
    route_grouped_topk = _kernel("sampling", "route_grouped_topk")
    route_hash = _kernel("sampling", "route_hash")
    apply_token_bitmask = _kernel("sampling", "apply_token_bitmask")
    apply_penalties = _kernel("sampling", "apply_penalties")
    apply_min_p = _kernel("sampling", "apply_min_p")
    apply_logit_bias = _kernel("sampling", "apply_logit_bias")
    count_tokens = _kernel("sampling", "count_tokens")
    # the reference's plain torch (aclnn matmul / gather / sort on the NPU)
    linear = staticmethod(reference.linear)
    grouped_linear = staticmethod(reference.grouped_linear)
    embedding = staticmethod(reference.embedding)
    sample = staticmethod(reference.sample)

    def __init__(self) -> None:
        torch_npu = _import_torch_npu()
        self.shim = bool(getattr(torch_npu, "DEEPINFER_REFERENCE_SHIM", False))
        if self.shim:
            # tests/ascend: torch_npu is the plain-torch shim, so tensors live on the CPU and the
            # Triton kernels must run through the interpreter
            if not envs.triton_interpreter():
                raise _unavailable("the torch_npu test shim runs on CPU tensors: set TRITON_INTERPRET=1")
            self.device = torch.device("cpu")
        else:
            from deepinfer.backends import npu_usable

            if not npu_usable():
                raise _unavailable("DEEPINFER_ACCELERATOR=ascend but torch_npu sees no NPU "
                                   "(torch.npu.is_available() is False); set DEEPINFER_ACCELERATOR=cpu")
            self.device = torch.device("npu")
        if attention is None:
            raise _unavailable("the ascend backend needs triton-ascend (pip install triton-ascend)")
        npu_ops.bind(torch_npu)
        # the AscendC kernels exist only where setup.py built them (CANN present); never under the shim
        self.ascendc = not self.shim and ascendc.load()

    def compress_windows(self, kv, gate):
        return ascendc.compress_windows(kv, gate) if self.ascendc else triton_ops.compress_windows(kv, gate)

    def hc_pre(self, streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
        if self.ascendc:  # the Sinkhorn on the AscendC kernel, the mix GEMM and gates on this backend's ops
            return ascendc.hc_pre(self.rms_norm, self.linear, streams, fn, base, scale, norm_eps, hc_eps,
                                  sinkhorn_iters)
        return elementwise.hc_pre(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)

    def moe_experts_bf16(self, x, weights, ids, gate_up, down, limit, act_block=0):
        # moe_experts' grouped GEMMs with the bf16 rounding points; the FP8 quantize-dequantize the
        # shared Triton kernel (bit-exact)
        act = (lambda v: self.fp8_qdq(v, act_block)) if act_block else npu_ops.round_bf16
        return npu_ops.moe_experts(x, weights, ids, gate_up, down, limit, act)

    def prepare_weight(self, tensor, role: WeightRole = WeightRole.PLAIN):
        # Kept as loaded (bf16, FP8, FP4 are widened per call: npu_ops' doc); float expert stacks
        # transposed for npu_grouped_matmul.
        if role is WeightRole.EXPERTS and isinstance(tensor, torch.Tensor):
            tensor = npu_ops.prepare_expert_weight(tensor)
        return tensor.to(self.device).contiguous()

    def synchronize(self) -> None:
        if self.device.type == "npu":
            torch.npu.synchronize()

    def memory_info(self) -> tuple[int, int]:
        if self.device.type == "npu":
            free, total = torch.npu.mem_get_info()
            return int(free), int(total)
        return 4 << 30, 8 << 30  # the shim on CPU tensors: a nominal device
