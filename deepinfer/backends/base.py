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

import dataclasses
import enum
from abc import ABC, abstractmethod

import torch


class WeightRole(enum.Enum):
    """Which op reads a weight: a backend may store a weight in the layout that op wants (ascend
    keeps expert stacks transposed for npu_grouped_matmul). The model, which owns its tensor names,
    says the role; a backend never guesses it from a name."""

    PLAIN = "plain"  # read by linear, embedding, norms, routers, tables: the checkpoint layout
    EXPERTS = "experts"  # [E, N, K] stacks of routed experts, read only by moe_experts and moe_experts_bf16


@dataclasses.dataclass(frozen=True, slots=True)
class Var:
    """In a recorded step (core/graphs.py): a tensor of the step, an input (0 .. num_inputs-1) or
    what an earlier instruction returned."""

    index: int


@dataclasses.dataclass(frozen=True, slots=True)
class Const:
    """In a recorded step: a tensor that outlives it (a weight, a cache pool, a view of them),
    `recording.constants[index]`."""

    index: int


@dataclasses.dataclass(slots=True)
class Instruction:
    """One operator call of a recorded step."""

    op: torch._ops.OpOverload
    args: tuple  # tensors replaced by Var / Const, nested in lists and tuples as the call had them
    kwargs: dict
    outs: list[int]  # slot of each returned tensor (tensor lists flattened), -1: an argument returned

    def writes_state(self, num_inputs: int) -> bool:
        """Whether the call writes a tensor that outlives the step (a Const: a cache pool, a view of
        one) or one of the step's inputs: what a replay that stops after it has changed for the eager
        step run again. A written argument that is neither (a step's own intermediate) does not count;
        one that is not a recorded tensor at all counts."""
        arguments = self.op._schema.arguments
        for i, arg in enumerate(arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            if i < len(self.args):
                value = self.args[i]
            elif arg.name in self.kwargs:
                value = self.kwargs[arg.name]
            else:
                continue  # left at its default (an out= not given)
            values = value if isinstance(value, (list, tuple)) else [value]
            if any(isinstance(v, Const) or (isinstance(v, Var) and v.index < num_inputs)
                   or not isinstance(v, (Var, Const, type(None))) for v in values):
                return True
        return False


class ReplayError(RuntimeError):
    """A compiled step's replay (Accelerator.compile_step) that failed. `state_written`: whether it
    had written a cache pool or another tensor that outlives the step before it stopped; if not, the
    step can run again eagerly from the state it found. Any other exception from a replay counts as
    state_written (nothing says otherwise)."""

    def __init__(self, message: str, state_written: bool):
        super().__init__(message)
        self.state_written = state_written


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
    # LLM(dtype="auto")'s compute dtype on this backend, and the one in use (set_compute_dtype): the
    # dtype a model rounds the inputs of its weight ops to, and the decode state's storage dtype
    preferred_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    # Plan step N+1 on the host while step N runs (DEEPINFER_ZERO_OVERHEAD_SCHEDULING's default):
    # pays where the device runs asynchronously to the Python thread that launches its work.
    overlap_scheduling: bool = True
    # Draft with DSpark when the checkpoint has a drafter (DEEPINFER_USE_NEXTN_DECODE's default):
    # pays where a step's cost hardly grows with its tokens (a memory- or launch-bound device).
    speculative_decoding: bool = True
    # compile_step can replay recorded steps (core/graphs.py records them only where this is True)
    step_graphs: bool = False
    # decode batches are padded up to a few captured sizes (DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL):
    # pays where each captured bucket is costly (a CUDA graph and its memory pool), not where a
    # recording is a list of calls (cpu)
    pad_graph_batches: bool = False

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
        """silu(min(gate, limit)) * clamp(up, -limit, limit), elementwise. limit may be inf (no
        clamp: DeepSeek-V3's plain SwiGLU); so may the limit of every op that takes one."""

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

    # -------------------------------------------------------------- cache pools
    def copy_rows(self, pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """In place: pool[dst[i]] = pool[src[i]] for every i (a ring keeping the rows a step staged
        in its scratch). pool [R, W] any dtype; src, dst [N] int64, every row valid, the src rows
        and the dst rows disjoint sets. This default (reference.py's index_select, then index_copy_)
        is the definition; a backend may override it with a kernel."""
        from deepinfer.backends import reference

        reference.copy_rows(pool, src, dst)

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
        that join every softmax but carry no value; -inf = no sink (a plain softmax over the
        indices: DeepSeek-V3's MLA).
        out[t, h] = sum_k p[t, h, k] kv[indices[t, k]], p = softmax over (q.kv * scale, sink).
        A token with no valid index gets zeros (with or without a sink). -> [T, H, D]."""

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
    def route_grouped_topk(self, x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, top_k: int,
                           n_group: int, topk_group: int, normalize: bool,
                           scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3 routing (sigmoid scores, group-limited top-k, "noaux_tc").
        x [T, D], gate [E, D], bias [E] float32 (e_score_correction_bias: chooses, never weighs).
        s = sigmoid(x @ gate.T) in float32 [T, E]; b = s + bias.
        The E experts form n_group contiguous groups of E / n_group experts; a group's score is the
        sum of its two largest b; the topk_group highest-scoring groups are kept (all of them when
        topk_group == n_group, e.g. n_group 1). ids = the top_k experts by b among the kept groups'
        experts (top_k <= topk_group * E / n_group). w = s[ids] (unbiased); if normalize:
        w = w / (sum_k w + 1e-20); w = w * scaling.
        Returns (weights [T, top_k] float32, ids [T, top_k] int64), columns in any order (only
        sum_k w_k E_k(x) is used). Exact ties in b or in a group score may go either way
        (transformers' torch.topk defines no order)."""

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

    def moe_experts_bf16(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                         down: torch.Tensor, limit: float, act_block: int = 0) -> torch.Tensor:
        """Routed experts as a model trained with bfloat16 activations computes them (DeepSeek-V4.1).
        x [T, D] float32, weights [T, k], ids [T, k] (each in [0, E)), gate_up [E, 2I, D], down
        [E, D, I] (float, bf16 or QuantizedWeight stacks, as stored) -> [T, D] float32. With
        q(v) = fp8_qdq(v, act_block) when act_block > 0 (FP8 per act_block before each GEMM; D and I
        multiples of it), else bf16(v) (rounded to the nearest bfloat16), for each slot (t, j), e = ids[t, j]:
            gate, up = split(bf16(gate_up[e] @ q(x[t])))
            y[t, j] = bf16(down[e] @ q(swiglu(gate, up, limit) * weights[t, j]))
        (the routing weight scales the intermediate before it is quantized, not the output), and
        out[t] = y[t, 0] + y[t, 1] + ... + y[t, k-1] in float32, in slot order: a token's result does
        not depend on which other tokens share the call. This composite is the definition (a loop
        over the experts the call hits, reading the ids into Python); a backend overrides it with a
        fixed-shape kernel (tolerances in tests/op_checks.py: check_moe_experts_bf16)."""
        num_tokens, top_k = ids.shape
        if not num_tokens:
            return torch.zeros(0, x.shape[-1], device=x.device)

        def q(v: torch.Tensor) -> torch.Tensor:
            return self.fp8_qdq(v, act_block) if act_block else v.to(torch.bfloat16).float()

        xq = q(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        hit, counts = torch.unique_consecutive(flat[order], return_counts=True)
        token_of = order // top_k
        slot_weight = weights.reshape(-1).float()
        rows = torch.empty(num_tokens * top_k, x.shape[-1], dtype=torch.float32, device=x.device)
        begin = 0
        for expert, count in zip(hit.tolist(), counts.tolist()):  # only the experts hit
            sel = order[begin:begin + count]
            gate, up = self.linear(xq[token_of[begin:begin + count]], gate_up[expert]).to(torch.bfloat16).float().chunk(2, -1)
            h = self.swiglu(gate, up, limit) * slot_weight[sel].unsqueeze(-1)
            rows[begin:begin + count] = self.linear(q(h), down[expert]).to(torch.bfloat16).float()
            begin += count
        per_slot = torch.empty_like(rows)
        per_slot[order] = rows
        per_slot = per_slot.view(num_tokens, top_k, -1)
        out = per_slot[:, 0]
        for j in range(1, top_k):
            out = out + per_slot[:, j]
        return out

    def swiglu_mlp(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, limit: float) -> torch.Tensor:
        """A dense SwiGLU MLP (the shared expert): down @ swiglu(gate, up, limit) with
        (gate, up) = split(gate_up @ x). x [T, D], gate_up [2I, D], down [D, I] -> [T, D].
        This composite is the definition; a backend may override it with a fused kernel."""
        gate, up = self.linear(x, gate_up).chunk(2, dim=-1)
        return self.linear(self.swiglu(gate, up, limit), down)

    # -------------------------------------------------------------- sampling
    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy sampling: the index of each row's largest logit, the first one on ties, a NaN
        counting as the largest (torch.argmax's rule). logits [B, V] float32 -> [B] int64. This
        default is the definition; a backend may override it with a kernel."""
        from deepinfer.backends import reference

        return reference.argmax(logits)

    @abstractmethod
    def sample(self, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
               top_p: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token per row. logits [B, V] float32; temperature [B] (< 1e-5 = greedy argmax);
        top_k [B] int64 (<= 0 = off); top_p [B] (1.0 = off); seeds [B] int64 (uint64 bit pattern),
        positions [B] int64. Noise is counter-based: row b draws from hash(seeds[b], positions[b])
        only, so a row's token never depends on other rows. -> [B] int64."""

    # Logit adjustments of SamplingParams (core/logits.py composes them, only for the rows that ask:
    # a batch without them calls none). Each returns a new [B, V] float32 tensor and reads row b only
    # for row b (batch-invariant). The defaults (reference.py) are the definitions; a backend may
    # override them with kernels (conformance: tests/conformance, tests/ascend; against transformers'
    # logits processors: tests/unit/test_logits_ops.py).
    def apply_penalties(self, logits: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor,
                        rows: torch.Tensor, repetition: torch.Tensor, frequency: torch.Tensor,
                        presence: torch.Tensor) -> torch.Tensor:
        """vLLM's penalties. logits [B, V] float32; counts [R, V] int32 (how often each token is in a
        request's output) and prompt_mask [R, V] bool (in its prompt), pools of R request rows;
        rows [B] int64, the pool row of logit row b (-1: row b passes through unchanged);
        repetition, frequency, presence [B] float32. For row b with r = rows[b], c = counts[r]:
        x = where(prompt_mask[r] | c > 0, where(x < 0, x * repetition, x / repetition), x) (CTRL's
        repetition penalty, as transformers' RepetitionPenaltyLogitsProcessor), then
        x = x - frequency * c - presence * (c > 0) (OpenAI's). -> [B, V] float32."""
        from deepinfer.backends import reference

        return reference.apply_penalties(logits, counts, prompt_mask, rows, repetition, frequency, presence)

    def apply_min_p(self, logits: torch.Tensor, min_p: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
        """Min-p filtering before `sample`. logits [B, V] float32, min_p and temperature [B]. A row with
        min_p > 0 and temperature >= 1e-5 gets -inf where exp(x / T - max(x / T)) < min_p, i.e. where
        softmax(x / T) is below min_p times its largest value (transformers' MinPLogitsWarper on the
        tempered logits); other rows pass through. The kept logits are not divided by T. -> [B, V]."""
        from deepinfer.backends import reference

        return reference.apply_min_p(logits, min_p, temperature)

    def apply_logit_bias(self, logits: torch.Tensor, token_ids: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Sparse additive bias (logit_bias, bad words and min_tokens' bans as -inf).
        logits [B, V] float32; token_ids [B, K] int64 (-1 = no entry), bias [B, K] float32:
        out[b, token_ids[b, k]] = logits[b, token_ids[b, k]] + bias[b, k], repeated ids summed.
        -> [B, V] float32."""
        from deepinfer.backends import reference

        return reference.apply_logit_bias(logits, token_ids, bias)

    def count_tokens(self, counts: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """In place: counts[rows[i], tokens[i]] += 1 for every i with rows[i] >= 0 and tokens[i] >= 0,
        repeated pairs counted each time. counts [R, V] int32, rows and tokens [N] int64."""
        from deepinfer.backends import reference

        reference.count_tokens(counts, rows, tokens)

    @abstractmethod
    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """In place: logits[b, v] = -inf where bit v of bitmask[b] is 0. bitmask [B, ceil(V/32)]
        int32, little-endian bits within each word (xgrammar's layout)."""

    # -------------------------------------------------------------- fused sequences
    # Sequences of the ops above that a model defines as composites (DeepSeek-V4's, in
    # models/deepseek_v4/fused.py, where each argument is described) and a backend may run as one
    # kernel: each takes the composite's arguments and returns its result, or None (no kernel here,
    # or an input the kernel does not take): the model then runs the composite. Only a backend that
    # has such kernels overrides these (cpu: its C++ kernels).
    def fused_hc_pre_norm(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                          norm_eps: float, hc_eps: float, sinkhorn_iters: int, norm_weight: torch.Tensor):
        """hc_pre, then rms_norm of the collapsed input -> (input [T, D], post [T, N], comb [T, N, N]), or None."""
        return None

    def fused_hc_post_pre_norm(self, block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
                               comb: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                               norm_eps: float, hc_eps: float, sinkhorn_iters: int, norm_weight: torch.Tensor):
        """hc_post, then fused_hc_pre_norm with the next block's weights -> (streams, input, post, comb), or None."""
        return None

    def fused_rms_norm_rope(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                            sin: torch.Tensor):
        """rope(rms_norm(x, weight, eps), cos, sin), or None."""
        return None

    def fused_compress_entries(self, ring: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor, overlap: bool,
                               norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor):
        """A compressor's entries [W, dim] for finished windows from its staged ring rows, or None."""
        return None

    # -------------------------------------------------------------- step graphs
    def compile_step(self, recording, step_fn):
        """A replay of a recorded step (core/graphs.py), or None. `recording`: the operators one step
        called, in order (`instructions`: Instruction), its tensors as Var (`num_inputs` inputs,
        shaped `input_specs` [(shape, stride, dtype)], then instruction results, `num_vars` in all)
        and Const (`constants`), and the slots it returned (`outputs`). `step_fn(inputs) -> outputs`
        runs the same step eagerly on other input tensors of the same shapes. The replay is a callable
        `inputs -> outputs` with the eager step's results and in-place writes; a backend may replay the
        instructions (cpu: a C++ tape) or capture step_fn (nvidia: a CUDA graph on static buffers).
        Compiling may raise, and so may a replay (the engine then runs the bucket eagerly, with a
        warning); a replay raises ReplayError saying whether it had already written state."""
        return None

    # -------------------------------------------------------------- device
    def synchronize(self) -> None:
        """Wait for all queued work on the device."""

    def tune_for_model(self, hidden_size: int, processes: int = 1) -> None:
        """Adjust process-wide execution settings to the model once it is known (no-op by default).
        `processes`: engine processes sharing this machine (parallel ranks), each with its share."""

    def kernel_signature(self) -> str:
        """What a timing measured on this backend depends on besides the shapes: which kernels run
        (their version, build and mode). Keys profiles cached on disk (DSpark's step-cost table),
        so a new kernel build re-profiles instead of planning with a stale table."""
        import deepinfer

        return f"{self.name} deepinfer {deepinfer.__version__} torch {torch.__version__} invariant {self.batch_invariant}"

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of the memory this backend allocates weights and cache from: the
        device's, or the host's on cpu (free = available RAM). core/memory.py plans with it."""
        raise NotImplementedError

    def set_compute_dtype(self, dtype: torch.dtype) -> None:
        """The dtype GEMM inputs are rounded to (LLM(dtype=...); the engine calls this once)."""
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"compute dtype must be float32 or bfloat16, got {dtype}")
        self.compute_dtype = dtype
