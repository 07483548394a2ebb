"""The accelerator interface: identity, capabilities and the complete op set.

`core/` talks to hardware only through an `Accelerator`. Every numeric kernel
the model graph and the sampler call is a method here, documented once: shapes,
dtypes and semantics. The cpu backend (`backends/cpu`) is the reference that
every other backend is tested against (`tests/conformance/`).

Conventions for all ops:
- T is the number of tokens in the step (all sequences flattened), H heads,
  D a feature size. Activations are float32 on the cpu reference; other
  backends may store bf16 but accumulate in float32.
- Index tensors are int64; -1 marks "no entry" and must be ignored.
- Weights are whatever `prepare_weight` returned for the backend (the cpu
  backend keeps float32 tensors).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod

import torch


class WeightRole(enum.Enum):
    """Which op reads a weight: a backend may store a weight in the layout that op wants (ascend
    keeps expert stacks transposed for npu_grouped_matmul). The model, which owns its tensor names,
    says the role; a backend never guesses it from a name."""

    PLAIN = "plain"  # read by linear, embedding, norms, routers, tables: the checkpoint layout
    EXPERTS = "experts"  # [E, N, K] stacks of routed experts, read only by moe_experts


class Accelerator(ABC):
    # identity
    name: str = "base"
    device: torch.device = torch.device("cpu")
    dist_backend: str = "gloo"

    # capabilities (core gates features on these, never on `name`)
    batch_invariant: bool = False  # every op gives a row the same result in any batch (as constructed)
    # seq_seed reruns are identical whatever shares the batch (batch-invariant ops + counter-based
    # noise). The one gate core checks: DEEPINFER_BATCH_INVARIANT=1 on a backend without it is
    # refused, and a seeded request's warning says what is missing.
    deterministic_sampling: bool = False
    # DEEPINFER_BATCH_INVARIANT=1 at construction switches this backend to batch-invariant ops (cpu:
    # its fast ops are not). A backend whose ops are always invariant (nvidia) or never (ascend)
    # has nothing to switch.
    batch_invariant_mode: bool = False
    fp8_weights: bool = False  # can run FP8 block-scaled GEMMs natively
    # Plan step N+1 on the host while step N runs (DEEPINFER_ZERO_OVERHEAD_SCHEDULING's default):
    # pays where the device runs asynchronously to the Python thread that launches its work.
    overlap_scheduling: bool = True
    # Draft with DSpark when the checkpoint has a drafter (DEEPINFER_USE_NEXTN_DECODE's default):
    # pays where a step's cost hardly grows with its tokens (a memory- or launch-bound device).
    speculative_decoding: bool = True

    # -------------------------------------------------------------- weights
    def prepare_weight(self, tensor: torch.Tensor, role: WeightRole = WeightRole.PLAIN) -> torch.Tensor:
        """Move a loaded float32 (or int64) checkpoint tensor to the device, in the layout and
        dtype this backend computes with for the op `role` names. Called once per tensor at load."""
        return tensor.to(self.device)

    # -------------------------------------------------------------- dense
    @abstractmethod
    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """y = x @ weight.T. x [..., K], weight [N, K] -> [..., N]."""

    @abstractmethod
    def grouped_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Block-diagonal projection. x [T, G, K], weight [G*N, K] viewed as G blocks of
        [N, K] -> [T, G, N]; group g only sees x[:, g]."""

    @abstractmethod
    def fp8_block_linear(self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         block: int = 128) -> torch.Tensor:
        """DeepSeek's FP8 block-scaled GEMM. x [T, K] float32 (leading dims allowed, as linear);
        weight [N, K] float8_e4m3fn, weight_scale [ceil(N/block), ceil(K/block)] float32, one scale
        per block x block tile (edge tiles may be partial). Activations are quantized per token per
        1 x block group of input channels (DeepSeek's act_quant): s[t, kb] = max(amax|x|, 1e-4) / 448,
        x_q = e4m3fn(x / s), round to nearest even. Then
        y[t, n] = sum_kb (x_q[t, kb] . w_q[n, kb]) * s[t, kb] * weight_scale[n // block, kb],
        accumulated in float32 -> [T, N] float32. The cpu reference evaluates the same sum as
        dequant(x_q) @ dequant(w_q).T in float32 (another rounding order: tolerances in
        tests/conformance/test_fp8_gemm.py)."""

    @abstractmethod
    def fp8_qdq(self, x: torch.Tensor, block: int) -> torch.Tensor:
        """DeepSeek-V4.1's FP8 activation quantization, quantized and dequantized (what an FP8 GEMM
        input, or a window KV entry, holds). x [..., K] float32 is first rounded to bfloat16 (the
        quantizer's input format, as trained); then per group of `block` consecutive elements of
        the last dim: amax = max(|x|, 1e-4); s = 2^ceil(log2(amax * fp32(1/448))) (an E8M0 scale,
        taken from the exponent bits of the float32 product); q = e4m3(clamp(x / s, +-448)),
        round to nearest even (subnormals included). Returns q * s [..., K] float32 (exact).
        Bit-exact on every backend (tests/goldens/v41 ops: act_quant)."""

    @abstractmethod
    def fp4_qdq(self, x: torch.Tensor, block: int, e4m3_scale: bool = False) -> torch.Tensor:
        """DeepSeek-V4.1's FP4 (e2m1) quantize-dequantize. x [..., K] float32, rounded to bfloat16
        first; per group of `block`: with E8M0 scales (e4m3_scale False; the indexer's queries and
        keys, block 32) amax = max(|x|, 6 * 2^-126), s = 2^ceil(log2(amax * fp32(1/6))); with E4M3
        scales (compressed KV, block 16) amax = max(|x|, 6 * 2^-9), s = e4m3(min(amax / 6, 448)).
        v = clamp(x / s, +-6) (a float32 division), rounded to {0, .5, 1, 1.5, 2, 3, 4, 6} (signed)
        to nearest, ties to the even code. Returns v * s float32. Bit-exact on every backend."""

    @abstractmethod
    def embedding(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """ids [T] int64, weight [V, D] -> [T, D] float32."""

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        """x * rsqrt(mean(x^2, -1) + eps) (* weight) over the last dim, in float32.
        weight None = the unweighted norm (per-head q norm, mHC input norm)."""

    @abstractmethod
    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Interleaved RoPE on the trailing rope slice of x. x [T, H, D] (or [T, D]),
        cos/sin [T, R/2] (one angle per channel pair) rotate channels D-R..D pairwise
        ((x0, x1) -> (x0 c - x1 s, x1 c + x0 s)); the leading D-R channels pass through.
        inverse=True rotates by -angle (undoes the rope on attention outputs)."""

    @abstractmethod
    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
        """silu(min(gate, limit)) * clamp(up, -limit, limit), elementwise."""

    # -------------------------------------------------------------- mHC
    @abstractmethod
    def hc_pre(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
               norm_eps: float, hc_eps: float, sinkhorn_iters: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Manifold-constrained hyper-connection, entering a block.
        streams [T, N, D]; fn [(2+N)*N, N*D]; base [(2+N)*N]; scale [3].
        mix = unweighted_rms_norm(flatten(streams)) @ fn.T split into pre N, post N, comb N*N;
        pre = sigmoid(mix_pre*scale0 + b) + hc_eps; post = 2 sigmoid(mix_post*scale1 + b);
        comb = softmax(mix_comb*scale2 + b, -1) + hc_eps, then Sinkhorn: one column
        normalisation, then (iters-1) x (row, column) normalisations, each dividing by sum + hc_eps.
        Returns (collapsed [T, D] = sum_n pre_n stream_n, post [T, N], comb [T, N, N])."""

    @abstractmethod
    def hc_mixes(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                 norm_eps: float, hc_eps: float, sinkhorn_iters: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hc_pre's mixes without the collapse: (pre [T, N], post [T, N], comb [T, N, N]) as hc_pre
        defines them, the mixes computed in DeepSeek-V4.1's order: (flat @ fn.T) * rsqrt(mean(flat^2)
        + norm_eps). DeepSeek-V4.1 collapses a sub-layer's input with the previous sub-layer's pre."""

    @abstractmethod
    def hc_collapse(self, streams: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_n weights[t, n] * streams[t, n]: streams [T, N, D], weights [T, N] -> [T, D] float32."""

    @abstractmethod
    def hc_post(self, block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
                comb: torch.Tensor) -> torch.Tensor:
        """Leaving a block: out[t, m] = post[t, m] * block_out[t] + sum_n comb[t, n, m] * streams[t, n].
        block_out [T, D], streams [T, N, D], post [T, N], comb [T, N, N] -> [T, N, D]."""

    @abstractmethod
    def hc_head(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                norm_eps: float, hc_eps: float) -> torch.Tensor:
        """Final collapse: pre = sigmoid(unweighted_rms_norm(flatten(streams)) @ fn.T * scale + base) + hc_eps;
        streams [T, N, D], fn [N, N*D], base [N], scale [1] -> sum_n pre_n stream_n [T, D]."""

    # -------------------------------------------------------------- attention
    @abstractmethod
    def compress_windows(self, kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Compressor reduction: out[w] = sum_j softmax_j(gate[w, j]) * kv[w, j] per channel.
        kv, gate [W, L, D] (gate already includes the position bias; -inf slots get weight 0)
        -> [W, D] float32."""

    @abstractmethod
    def indexer_topk(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                     candidates: torch.Tensor, topk: int, scale: float) -> torch.Tensor:
        """Lightning Indexer selection. q [T, H, Di], weights [T, H], keys [P, Di] (a pool),
        candidates [T, M] rows of `keys` each token may use (-1 = none).
        score(t, c) = sum_h weights[t, h] * relu(q[t, h] . keys[c]) * scale.
        Returns [T, min(topk, M)] the rows of the highest-scoring candidates, -1 where a token
        has fewer valid candidates. Equal scores are broken towards the earlier candidate column,
        so the selection does not depend on how far `candidates` is padded. Order within a row
        is unspecified."""

    @abstractmethod
    def indexer_scores(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                       candidates: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V4.1's indexer scores, with its bfloat16 rounding points. q [T, H, Di], weights
        [T, H] (the head weights, scale folded in), keys [P, Di] (a pool), candidates [T, M] rows of
        `keys` (-1 = none). score(t, c) = bf16(sum_h bf16(relu(bf16(q[t, h] . k)) * weights[t, h])),
        k = keys[candidates[t, c]], the head sum in float32. Returns [T, M] float32, -inf where
        candidates < 0. Bit-exact to the reference except, rarely, 1 bf16 ulp from the head sum's order."""

    @abstractmethod
    def sparse_attention_bf16(self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                              sinks: torch.Tensor, scale: float) -> torch.Tensor:
        """sparse_attention as DeepSeek-V4.1's kernel computes it: an online softmax over the index list
        in blocks of 64 (running max from -1e30, -1 entries skipped), the probabilities rounded to
        bfloat16 relative to the running max before P.V while the denominator sums them in float32,
        the sink added to the denominator (exp(sink - max)) after the last block. Same shapes and
        result as sparse_attention up to that rounding (<= 1 bf16 ulp of the output apart)."""

    @abstractmethod
    def sparse_attention(self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                         sinks: torch.Tensor, scale: float) -> torch.Tensor:
        """Shared-KV MQA over an index list (K == V): q [T, H, D], kv [P, D] pool,
        indices [T, K] rows of kv each token attends to (-1 = masked), sinks [H] logits
        that join every softmax but carry no value.
        out[t, h] = sum_k p[t, h, k] kv[indices[t, k]], p = softmax over (q.kv * scale, sink).
        A token with no valid index gets zeros. -> [T, H, D]."""

    @abstractmethod
    def dense_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int],
                        scale: float) -> torch.Tensor:
        """Bidirectional (non-causal) multi-head attention within each of several sequences packed back
        to back: a vision encoder's patch grids, one sequence per image. q, k, v [T, H, D]; `lens`
        (host ints, summing to T) the sequences' lengths in order. A token attends to every token of
        its own sequence and to nothing else:
        out[t, h] = sum_s softmax_s(q[t, h] . k[s, h] * scale) v[s, h] over s in t's sequence.
        -> [T, H, D] float32."""

    # -------------------------------------------------------------- MoE
    @abstractmethod
    def route_topk(self, x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, top_k: int,
                   scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Score-based routing. x [T, D], gate [E, D], bias [E] (selection only).
        s = sqrt(softplus(x @ gate.T)); ids = topk(s + bias); w = s[ids] / sum * scaling.
        Returns (weights [T, k] float32, ids [T, k] int64)."""

    @abstractmethod
    def route_hash(self, x: torch.Tensor, gate: torch.Tensor, ids: torch.Tensor,
                   scaling: float) -> torch.Tensor:
        """Hash routing: experts given (ids [T, k] from the tid2eid table); weights as route_topk."""

    @abstractmethod
    def moe_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    gate_up: torch.Tensor, down: torch.Tensor, limit: float) -> torch.Tensor:
        """Routed experts: out[t] = sum_k weights[t, k] * E_ids[t,k](x[t]) with
        E_e(x) = down[e] @ swiglu(gate, up, limit), (gate, up) = split(gate_up[e] @ x).
        x [T, D], gate_up [E, 2I, D], down [E, D, I] -> [T, D]."""

    def swiglu_mlp(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, limit: float) -> torch.Tensor:
        """A dense SwiGLU MLP (the shared expert): down @ swiglu(gate, up, limit) with
        (gate, up) = split(gate_up @ x). x [T, D], gate_up [2I, D], down [D, I] -> [T, D].
        This composite is the definition; a backend may override it with a fused kernel."""
        gate, up = self.linear(x, gate_up).chunk(2, dim=-1)
        return self.linear(self.swiglu(gate, up, limit), down)

    # -------------------------------------------------------------- sampling
    @abstractmethod
    def sample(self, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
               top_p: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token per row. logits [B, V] float32; temperature [B] (< 1e-5 = greedy argmax);
        top_k [B] int64 (<= 0 = off); top_p [B] (1.0 = off); seeds [B] int64 (uint64 bit pattern),
        positions [B] int64. Noise is counter-based: row b draws from hash(seeds[b], positions[b])
        only, so a row's token never depends on other rows. -> [B] int64."""

    @abstractmethod
    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """In place: logits[b, v] = -inf where bit v of bitmask[b] is 0. bitmask [B, ceil(V/32)]
        int32, little-endian bits within each word (xgrammar's layout)."""

    # -------------------------------------------------------------- fused sequences
    def kernel(self, name: str):
        """This backend's single kernel for a model's fused op sequence `name` (e.g. DeepSeek-V4's
        hc_pre_norm, defined as a composite in models/deepseek_v4/fused.py), or None: the model
        then runs its composite. A kernel takes the composite's arguments and returns its result,
        or None for an input it does not take. Only a backend that has such kernels overrides this."""
        return None

    # -------------------------------------------------------------- step programs
    def step_program(self, model, cache):
        """A faster way to run `model.forward` on `cache`, or None (the default: the model's Python
        graph, op by op). What it returns has `runs(meta) -> bool` (whether it takes this step) and
        `__call__(meta, logit_rows) -> logits`, with the same results and cache updates as the
        graph; optionally `plan(meta) -> bool` (StepMeta's index arrays, the same values, or False to
        leave them to numpy) and `decode(ids, slots, starts, steps) -> tokens [steps, B] | None`
        (greedy multi-step decoding). A backend may replay a captured graph here (CUDA graphs); the
        cpu backend runs the step as one C++ call (backends/cpu/step_program.py)."""
        return None

    # -------------------------------------------------------------- device
    def synchronize(self) -> None:
        """Wait for all queued work on the device."""

    def tune_for_model(self, hidden_size: int) -> None:
        """Adjust process-wide execution settings to the model once it is known (no-op by default)."""

    def kernel_signature(self) -> str:
        """What a timing measured on this backend depends on besides the shapes: which kernels run
        (their version, build and mode). Keys profiles cached on disk (DSpark's step-cost table),
        so a new kernel build re-profiles instead of planning with a stale table."""
        import deepinfer

        return f"{self.name} deepinfer {deepinfer.__version__} torch {torch.__version__} invariant {self.batch_invariant}"

    def memory_available(self) -> int:
        """Bytes this backend may use for the state cache."""
        raise NotImplementedError
