"""The DSpark drafter for DeepSeek-V4 (DeepSeek's block drafter for speculative decoding; the engine
side is core/speculative/), written only against Accelerator ops.

Context: at every target forward the attention input of the `dspark_target_layer_ids`
layers (averaged over hc streams) is concatenated, projected back to D (main_proj) and
normed (main_norm). Each drafter stage turns these context features into KV of its own
sliding-window ring, one row per position (`absorb`).

Draft: a block of `block_size` tokens [anchor, noise x (block_size-1)] at positions
anchor_pos .. anchor_pos+block_size-1 runs once through the stages (full V4 blocks:
mHC, shared-KV MQA with sinks and partial RoPE, top-k MoE). Block tokens attend to the
context window before the anchor and, non-causally, to each other. Slot k predicts the
token at anchor_pos+k+1 with the target's (frozen) LM head plus the Markov head's low-rank
bias from the previous token; tokens are chosen left to right. The confidence head gives
c_k = P(draft k accepted | drafts before it accepted).

Checkpoint names are upstream's (`mtp.{k}.*`, DEEPSEEK_V4.md): stage k repeats a layer's
keys; stage 0 adds main_proj/main_norm; the last stage adds norm, hc_head_*,
markov_head.{embed,head}, confidence_head.proj and (ours) confidence_head.temperature,
the per-position calibration temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.backends.base import Accelerator, WeightRole
from deepinfer.backends.quant import Weight, fuse_rows, stack, widen
from deepinfer.models.base import Pool
from deepinfer.models.deepseek_v4 import fused
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.dspark_config import DSparkSettings, context_ring_pools, mtp_stages


@dataclass(frozen=True, slots=True)
class DSparkConfig(DSparkSettings):
    @classmethod
    def from_model(cls, cfg: DeepseekV4Config, extra: dict[str, torch.Tensor]) -> "DSparkConfig | None":
        """None when the checkpoint has no DSpark drafter (no dspark_* keys or no mtp.* tensors)."""
        stages = mtp_stages(extra)
        if not cfg.dspark or not stages:
            return None
        d = cfg.dspark
        layers = tuple(sorted(int(i) for i in d.get("dspark_target_layer_ids", [cfg.num_hidden_layers - 1])))
        if any(not 0 <= i < cfg.num_hidden_layers for i in layers):
            raise ValueError(f"dspark_target_layer_ids {layers} outside the model's {cfg.num_hidden_layers} layers")
        if stages != set(range(len(stages))):
            raise ValueError(f"mtp stages {sorted(stages)} are not numbered 0..{len(stages) - 1}")
        return cls(int(d.get("dspark_block_size", 5)), int(d.get("dspark_noise_token_id", 0)), layers,
                   int(d.get("dspark_markov_rank", 256)), len(stages))


def stage_names(cfg: DeepseekV4Config, dcfg: DSparkConfig) -> dict[str, tuple[int, ...]]:
    """Every drafter tensor in upstream naming with its shape (for training and loading checks)."""
    d, hd, h, n, e = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.hc_mult, cfg.n_routed_experts
    inter, mix, r, v = cfg.moe_intermediate_size, (2 + n) * n, dcfg.markov_rank, cfg.vocab_size
    out: dict[str, tuple[int, ...]] = {}
    for k in range(dcfg.num_stages):
        p = f"mtp.{k}."
        out.update({
            p + "attn_norm.weight": (d,), p + "ffn_norm.weight": (d,),
            p + "hc_attn_fn": (mix, n * d), p + "hc_attn_base": (mix,), p + "hc_attn_scale": (3,),
            p + "hc_ffn_fn": (mix, n * d), p + "hc_ffn_base": (mix,), p + "hc_ffn_scale": (3,),
            p + "attn.wq_a.weight": (cfg.q_lora_rank, d), p + "attn.q_norm.weight": (cfg.q_lora_rank,),
            p + "attn.wq_b.weight": (h * hd, cfg.q_lora_rank), p + "attn.wkv.weight": (hd, d),
            p + "attn.kv_norm.weight": (hd,),
            p + "attn.wo_a.weight": (cfg.o_groups * cfg.o_lora_rank, h * hd // cfg.o_groups),
            p + "attn.wo_b.weight": (d, cfg.o_groups * cfg.o_lora_rank), p + "attn.attn_sink": (h,),
            p + "ffn.gate.weight": (e, d), p + "ffn.gate.bias": (e,),
            p + "ffn.shared_experts.w1.weight": (inter, d), p + "ffn.shared_experts.w3.weight": (inter, d),
            p + "ffn.shared_experts.w2.weight": (d, inter),
        })
        for j in range(e):
            out.update({p + f"ffn.experts.{j}.w1.weight": (inter, d), p + f"ffn.experts.{j}.w3.weight": (inter, d),
                        p + f"ffn.experts.{j}.w2.weight": (d, inter)})
    last = f"mtp.{dcfg.num_stages - 1}."
    out.update({
        "mtp.0.main_proj.weight": (d, len(dcfg.target_layer_ids) * d), "mtp.0.main_norm.weight": (d,),
        last + "norm.weight": (d,), last + "hc_head_fn": (n, n * d), last + "hc_head_base": (n,),
        last + "hc_head_scale": (1,), last + "markov_head.embed.weight": (v, r),
        last + "markov_head.head.weight": (v, r), last + "confidence_head.proj.weight": (1, d + r),
        last + "confidence_head.temperature": (dcfg.block_size,),
    })
    return out


def fuse_experts(weights: dict[str, Weight], num_stages: int, num_experts: int) -> dict[str, Weight]:
    """Per-expert w1/w3/w2 -> the fused [E, 2I, D] / [E, D, I] tensors moe_experts takes, in the
    checkpoint's storage (bf16, FP8, FP4 stay so). The mixing matrices (`*_fn`) become float32:
    hc_pre / hc_head read them as float32 parameters, not through a weight op."""
    out = {n: widen(t) if n.endswith("_fn") else t for n, t in weights.items()
           if ".experts." not in n and ".shared_experts.w" not in n}

    def cat(*parts: Weight) -> Weight:
        fused = fuse_rows(list(parts))
        if len(fused) != 1:
            raise ValueError("DSpark drafter: w1 and w3 of an expert are stored differently")
        return fused[0]

    for k in range(num_stages):
        p = f"mtp.{k}.ffn."
        out[p + "experts.gate_up"] = stack([cat(weights[p + f"experts.{j}.w1.weight"], weights[p + f"experts.{j}.w3.weight"])
                                            for j in range(num_experts)])
        out[p + "experts.down"] = stack([weights[p + f"experts.{j}.w2.weight"] for j in range(num_experts)])
        out[p + "shared.gate_up"] = cat(weights[p + "shared_experts.w1.weight"], weights[p + "shared_experts.w3.weight"])
        out[p + "shared.down"] = weights[p + "shared_experts.w2.weight"]
    return out


class DSparkDrafter:
    """Drafter weights, per-slot context rings, and the two device functions: `absorb`
    (context features -> ring KV) and `draft_block` (one block -> per-slot hidden + logits)."""

    def __init__(self, cfg: DeepseekV4Config, dcfg: DSparkConfig, extra: dict[str, torch.Tensor],
                 target_weights: dict[str, torch.Tensor], accel: Accelerator, *, max_seqs: int = 0,
                 margin: int = 0):
        self.cfg, self.dcfg, self.accel = cfg, dcfg, accel
        expected = stage_names(cfg, dcfg)
        weights = {n: t for n, t in extra.items() if n.startswith("mtp.")}
        last = f"mtp.{dcfg.num_stages - 1}.confidence_head.temperature"
        weights.setdefault(last, torch.ones(dcfg.block_size))  # uncalibrated: temperature 1
        for name, shape in expected.items():
            if name not in weights:
                raise ValueError(f"DSpark drafter: missing tensor {name} (shape {shape})")
            if tuple(weights[name].shape) != shape:
                raise ValueError(f"DSpark drafter: {name} has shape {tuple(weights[name].shape)}, expected {shape}")
        experts = {f"mtp.{k}.ffn.experts.{n}" for k in range(dcfg.num_stages) for n in ("gate_up", "down")}
        self.w = {n: accel.prepare_weight(t, WeightRole.EXPERTS if n in experts else WeightRole.PLAIN)
                  for n, t in fuse_experts(weights, dcfg.num_stages, cfg.n_routed_experts).items()}
        self.embed = target_weights["model.embed_tokens.weight"]  # frozen, shared with the target
        self.lm_head = target_weights["lm_head.weight"]
        self.window = cfg.sliding_window
        self.ring = self.window + margin
        self.max_seqs = max_seqs
        # per stage: [slot rings | block scratch] of context KV; the block's own KV goes to the scratch
        rows = max_seqs * self.ring + max_seqs * dcfg.block_size
        self.kv = [torch.zeros(rows, cfg.head_dim, device=accel.device) for _ in range(dcfg.num_stages)]
        cfg.rope_main.inv_freq(self.kv[0].device)  # RoPE rates on the device once, not per step

    # ------------------------------------------------------------ shared pieces
    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cfg.rope_main.rotations(positions)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """features [T, L, D] -> context [T, D] (main_proj + main_norm)."""
        ops, w = self.accel, self.w
        return ops.rms_norm(ops.linear(features.flatten(1), w["mtp.0.main_proj.weight"]),
                            w["mtp.0.main_norm.weight"], self.cfg.rms_norm_eps)

    def context_kv(self, k: int, ctx: torch.Tensor, cos_sin) -> torch.Tensor:
        """Stage k's KV for context rows [T, D] -> [T, head_dim]."""
        ops, w, p = self.accel, self.w, f"mtp.{k}.attn."
        return fused.rms_norm_rope(ops, ops.linear(ctx, w[p + "wkv.weight"]), w[p + "kv_norm.weight"],
                                   self.cfg.rms_norm_eps, *cos_sin)

    def stages(self, ids: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """Block tokens `ids` [T] at `positions` through every stage; `attend(k, q, kv)` does
        stage k's attention given the block's queries [T, H, hd] and KV [T, hd].
        Returns the final hidden [T, D] (hc head + norm)."""
        cfg, ops, w = self.cfg, self.accel, self.w
        cos_sin = self._cos_sin(positions)
        x = ops.embedding(ids, self.embed)
        streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        for k in range(self.dcfg.num_stages):
            p = f"mtp.{k}."
            streams = self._residual(streams, p + "hc_attn_", p + "attn_norm.weight",
                                     lambda h: self._attention(k, h, cos_sin, attend))
            streams = self._residual(streams, p + "hc_ffn_", p + "ffn_norm.weight", lambda h: self._moe(k, h))
        last = f"mtp.{self.dcfg.num_stages - 1}."
        h = ops.hc_head(streams, w[last + "hc_head_fn"], w[last + "hc_head_base"], w[last + "hc_head_scale"],
                        cfg.rms_norm_eps, cfg.hc_eps)
        return ops.rms_norm(h, w[last + "norm.weight"], cfg.rms_norm_eps)

    def _residual(self, streams, hc: str, norm: str, block) -> torch.Tensor:
        cfg, ops, w = self.cfg, self.accel, self.w
        h, post, comb = fused.hc_pre_norm(ops, streams, w[hc + "fn"], w[hc + "base"], w[hc + "scale"],
                                          cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters, w[norm])
        return ops.hc_post(block(h), streams, post, comb)

    def _attention(self, k: int, h: torch.Tensor, cos_sin, attend) -> torch.Tensor:
        cfg, ops, w, p = self.cfg, self.accel, self.w, f"mtp.{k}.attn."
        t = h.shape[0]
        q = ops.rms_norm(ops.linear(h, w[p + "wq_a.weight"]), w[p + "q_norm.weight"], cfg.rms_norm_eps)
        q = ops.linear(q, w[p + "wq_b.weight"]).view(t, cfg.num_attention_heads, cfg.head_dim)
        q = fused.rms_norm_rope(ops, q, None, cfg.rms_norm_eps, *cos_sin)
        kv = fused.rms_norm_rope(ops, ops.linear(h, w[p + "wkv.weight"]), w[p + "kv_norm.weight"], cfg.rms_norm_eps,
                                 *cos_sin)
        out = ops.rope(attend(k, q, kv), *cos_sin, inverse=True)
        out = ops.grouped_linear(out.reshape(t, cfg.o_groups, -1), w[p + "wo_a.weight"])
        return ops.linear(out.flatten(1), w[p + "wo_b.weight"])

    def _moe(self, k: int, h: torch.Tensor) -> torch.Tensor:
        cfg, ops, w, p = self.cfg, self.accel, self.w, f"mtp.{k}.ffn."
        weights, ids = ops.route_topk(h, w[p + "gate.weight"], w[p + "gate.bias"], cfg.num_experts_per_tok,
                                      cfg.routed_scaling_factor)
        routed = ops.moe_experts(h, weights, ids, w[p + "experts.gate_up"], w[p + "experts.down"], cfg.swiglu_limit)
        return routed + ops.swiglu_mlp(h, w[p + "shared.gate_up"], w[p + "shared.down"], cfg.swiglu_limit)

    def sink(self, k: int) -> torch.Tensor:
        return self.w[f"mtp.{k}.attn.attn_sink"]

    def markov(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(low-rank embedding [B, r] of the previous token, its logit bias [B, V])."""
        last = f"mtp.{self.dcfg.num_stages - 1}.markov_head."
        e = self.accel.embedding(prev, self.w[last + "embed.weight"])
        return e, self.accel.linear(e, self.w[last + "head.weight"])

    def confidence_logit(self, h: torch.Tensor, e: torch.Tensor, slot: int | torch.Tensor) -> torch.Tensor:
        """Calibrated logit of c_k for hidden h [B, D] and Markov embedding e [B, r] at block slot(s)."""
        last = f"mtp.{self.dcfg.num_stages - 1}.confidence_head."
        z = self.accel.linear(torch.cat([h, e], dim=-1), self.w[last + "proj.weight"]).squeeze(-1)
        return z / self.w[last + "temperature"][slot]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.accel.linear(h, self.lm_head)

    # ------------------------------------------------------------ inference
    def slot_pools(self) -> list[Pool]:
        return context_ring_pools(self.kv, self.ring, self.max_seqs)

    @torch.inference_mode()
    def absorb(self, features: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Write the context KV of fed positions into each stage's ring. (slot, position % ring)
        pairs must be distinct: callers pass at most the last `ring` positions of a sequence."""
        if not len(slots):
            return
        slots, positions = slots.to(features.device), positions.to(features.device)
        ctx = self.context(features)
        cos_sin = self._cos_sin(positions)
        rows = slots * self.ring + positions.remainder(self.ring)
        for k in range(self.dcfg.num_stages):
            self.kv[k][rows] = self.context_kv(k, ctx, cos_sin).to(self.kv[k].dtype)

    @torch.inference_mode()
    def draft_block(self, anchors: torch.Tensor, slots: torch.Tensor, anchor_pos: torch.Tensor) -> torch.Tensor:
        """One block per sequence: anchors/slots/anchor_pos [B] -> hidden [B, block, D]."""
        b, g = len(anchors), self.dcfg.block_size
        ids = torch.full((b, g), self.dcfg.noise_token_id, dtype=torch.int64, device=anchors.device)
        ids[:, 0] = anchors
        offsets = torch.arange(g, device=anchors.device)
        positions = (anchor_pos[:, None] + offsets).flatten()
        # keys: the context window [anchor_pos - window, anchor_pos) from the ring, then the block
        ctx_pos = anchor_pos[:, None] + torch.arange(-self.window, 0, device=anchors.device)
        ctx_rows = torch.where(ctx_pos >= 0, slots[:, None] * self.ring + ctx_pos.remainder(self.ring), -1)
        scratch = self.max_seqs * self.ring
        block_rows = scratch + torch.arange(b * g, device=anchors.device).view(b, g)
        indices = torch.cat([ctx_rows, block_rows], dim=1).repeat_interleave(g, dim=0)

        def attend(k: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            pool = self.kv[k]
            pool[scratch:scratch + b * g] = kv.to(pool.dtype)
            return self.accel.sparse_attention(q, pool, indices, self.sink(k), self.cfg.head_dim ** -0.5)

        return self.stages(ids.flatten(), positions, attend).view(b, g, -1)
