"""DeepSeek-V4.1's DSpark drafter: the checkpoint's `mtp.K` stages behind core/speculative's interface
(tests/goldens/v41/IMPLEMENTING.md, section 8: the stages as the reference computes them; the
DeepSeek-V4 drafter it follows: models/deepseek_v4/dspark.py).

Context: the input of the `dspark_target_layer_ids` layers (after Engram), averaged over the hc
copies, concatenated, projected (stage 0's main_proj, FP8) and normed: one row per position. Each
stage turns a position's context row into KV of its own window ring (its wkv, kv_norm, RoPE without
YaRN, FP8 QDQ).

Draft: the block [anchor, noise x (block - 1)] at positions anchor_pos .. anchor_pos + block - 1 runs
through the stages, each a V4.1 block (lagged hyper-connections, MoE with the DSpark expert counts)
whose attention sees the context window before the anchor and, non-causally, the whole block (its KV
FP8-QDQ'd, not stored). After the last stage the copies collapse with the lagged pre: that is the
hidden state a slot's logits (norm, the backbone's head) and its confidence (the raw projection of
[hidden ; Markov embedding], no norm: a logit) are made from; the Markov head adds a low-rank bias
from the previous token. Positions list their context keys in ring-slot order (position % window),
then the block, as DeepSeek's kernel does: the order decides the 64-index softmax blocks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from deepinfer.backends.quant import Weight, cat_rows, stack, widen
from deepinfer.models.base import Pool
from deepinfer.models.deepseek_v41.config import ACT_BLOCK
from deepinfer.models.deepseek_v41.model import bf16, fuse_shared_experts, quantize_inputs
from deepinfer.models.deepseek_v41.weights import dspark_tensors
from deepinfer.models.dspark_config import DSparkSettings, context_ring_pools, mtp_stages

_EXPERT = re.compile(r"(mtp\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.weight")


@dataclass(frozen=True, slots=True)
class DSparkConfig(DSparkSettings):
    num_experts: int
    top_k: int


def stage_weights(extra: dict[str, Weight], cfg, dcfg: DSparkConfig) -> dict[str, Weight]:
    """The stages' tensors with each stage's per-expert w1/w3/w2 fused into [E, 2I, D] / [E, D, I]
    stacks and the shared expert's w1/w3 into one [2I, D], shapes checked against the config. The
    matrices weight ops read stay as stored (FP8 / FP4 QuantizedWeight, bf16), as the backbone's
    (weights.py); the other tensors take their spec's dtype (float32; wo_a bf16)."""
    expected = dspark_tensors(cfg)
    out: dict[str, Weight] = {}
    experts: dict[str, dict[tuple[int, str], Weight]] = {}
    for name, t in extra.items():
        if not name.startswith("mtp."):
            continue
        if m := _EXPERT.fullmatch(name):
            experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
        elif name in expected and not expected[name].stored and t.is_floating_point():
            out[name] = widen(t).to(expected[name].dtype)
        else:
            out[name] = t
    for name, spec in expected.items():
        if name.endswith((".experts.gate_up", ".experts.down")):
            continue
        if name not in out:
            raise ValueError(f"DSpark drafter: missing tensor {name} (shape {spec.shape})")
        if tuple(out[name].shape) != tuple(spec.shape):
            raise ValueError(f"DSpark drafter: {name} has shape {tuple(out[name].shape)}, expected {spec.shape}")
    for k in range(dcfg.num_stages):
        p = f"mtp.{k}.ffn."
        per = experts.get(p + "experts", {})
        missing = [f"{p}experts.{e}.{w}.weight" for e in range(dcfg.num_experts) for w in ("w1", "w2", "w3")
                   if (e, w) not in per]
        if missing:
            raise ValueError(f"DSpark drafter: missing tensor {missing[0]}")
        out[p + "experts.gate_up"] = stack([cat_rows([per[(e, "w1")], per[(e, "w3")]],
                                                     f"DSpark {p}experts.{e} w1 / w3")
                                            for e in range(dcfg.num_experts)])
        out[p + "experts.down"] = stack([per[(e, "w2")] for e in range(dcfg.num_experts)])
    fuse_shared_experts(out, [f"mtp.{k}.ffn." for k in range(dcfg.num_stages)])
    return quantize_inputs(out) if cfg.quantized else out


class DSparkDrafter:
    """Stage weights, per-slot context rings, and the device functions core/speculative calls: `absorb`
    (context features -> ring KV) and `draft_block` (a block -> per-slot hidden states), plus the
    heads (`logits`, `markov`, `confidence_logit`)."""

    @classmethod
    def create(cls, model, extra: dict[str, torch.Tensor], max_seqs: int, margin: int) -> "DSparkDrafter | None":
        cfg = model.config
        stages = mtp_stages(extra)
        if not cfg.num_nextn_predict_layers or not stages:
            return None
        if stages != set(range(cfg.num_nextn_predict_layers)):
            raise ValueError(f"DSpark drafter: the checkpoint has stages {sorted(stages)}, the config "
                             f"num_nextn_predict_layers {cfg.num_nextn_predict_layers}")
        d = cfg.dspark
        n_experts, top_k = cfg.dspark_experts
        dcfg = DSparkConfig(int(d["dspark_block_size"]), int(d.get("dspark_noise_token_id", 0)),
                            tuple(int(i) for i in d["dspark_target_layer_ids"]), int(d.get("dspark_markov_rank", 256)),
                            cfg.num_nextn_predict_layers, n_experts, top_k)
        return cls(model, dcfg, stage_weights(extra, cfg, dcfg), max_seqs, margin)

    def __init__(self, model, dcfg: DSparkConfig, weights: dict[str, torch.Tensor], max_seqs: int, margin: int):
        from deepinfer.backends.base import WeightRole

        self.model, self.cfg, self.dcfg, self.accel = model, model.config, dcfg, model.accel
        self.w = {n: self.accel.prepare_weight(t, WeightRole.EXPERTS if n.endswith((".gate_up", ".down")) and
                                               ".experts." in n else WeightRole.PLAIN) for n, t in weights.items()}
        self.last = f"mtp.{dcfg.num_stages - 1}."
        self.window = self.cfg.sliding_window
        self.ring = self.window + margin
        self.max_seqs = max_seqs
        rows = max_seqs * self.ring + max_seqs * dcfg.block_size  # [slot rings | the block's scratch]
        self.kv = [torch.zeros(rows, self.cfg.head_dim, device=self.accel.device) for _ in range(dcfg.num_stages)]
        # RoPE computed on the device from position tensors (drafting and verify steps read no positions
        # into Python: core/graphs.py); its rates go to the device now, not inside a captured step
        self.cfg.rope_main.inv_freq(self.kv[0].device)
        # each stage's routed experts: the backbone's call (one fixed-shape op, recorded like any other)
        self.experts = [model._local_experts(self.w[f"mtp.{k}.ffn.experts.gate_up"],
                                             self.w[f"mtp.{k}.ffn.experts.down"]) for k in range(dcfg.num_stages)]

    # ------------------------------------------------------------ context
    def context(self, features: torch.Tensor) -> torch.Tensor:
        """features [T, L, D] (bf16 values) -> the context rows [T, D]: main_norm(main_proj(concat))."""
        m = self.model
        projected = m.qlinear(features.flatten(1), self.w["mtp.0.main_proj.weight"])
        return m.norm(projected, self.w["mtp.0.main_norm.weight"])

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cfg.rope_main.rotations(positions)

    def stage_kv(self, k: int, x: torch.Tensor, cos_sin) -> torch.Tensor:
        """Stage k's window KV of rows x [T, D]: FP8-QDQ'd after RoPE."""
        m, p = self.model, f"mtp.{k}.attn."
        kv = m.norm(m.qlinear(x, self.w[p + "wkv.weight"]), self.w[p + "kv_norm.weight"])
        return self.accel.fp8_qdq(m.rope(kv, *cos_sin), ACT_BLOCK)

    def slot_pools(self) -> list[Pool]:
        return context_ring_pools(self.kv, self.ring, self.max_seqs)

    @torch.inference_mode()
    def absorb(self, features: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Write the context KV of fed positions into every stage's ring. (slot, position % ring) pairs
        must be distinct: callers pass at most the last `ring` positions of a sequence."""
        if len(slots):
            self.write_context(self.context(features), slots, positions)

    def write_context(self, ctx: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> None:
        slots, positions = slots.to(ctx.device), positions.to(ctx.device)
        cos_sin = self._rope(positions)
        rows = slots * self.ring + positions.remainder(self.ring)
        for k in range(self.dcfg.num_stages):
            self.kv[k][rows] = self.stage_kv(k, ctx, cos_sin).to(self.kv[k].dtype)

    # ------------------------------------------------------------ the block
    def key_rows(self, slots: torch.Tensor, anchor_pos: torch.Tensor) -> torch.Tensor:
        """[B, window + block] rows each block position attends: the context positions before the anchor
        in ring-slot order (position % window), then the block's scratch rows; absent positions (-1) last."""
        b, g, w = len(slots), self.dcfg.block_size, self.window
        first = (anchor_pos - w)[:, None]
        pos = first + (torch.arange(w, device=slots.device)[None, :] - first).remainder(w)
        ctx = torch.where(pos >= 0, slots[:, None] * self.ring + pos.remainder(self.ring), -1)
        block = self.max_seqs * self.ring + torch.arange(b * g, device=slots.device).view(b, g)
        rows = torch.cat([ctx, block], dim=1)
        order = torch.sort((rows < 0).to(torch.int8), dim=1, stable=True).indices
        return rows.gather(1, order)

    @torch.inference_mode()
    def draft_block(self, anchors: torch.Tensor, slots: torch.Tensor, anchor_pos: torch.Tensor) -> torch.Tensor:
        """One block per sequence: anchors/slots/anchor_pos [B] -> the hidden states [B, block, D]
        (collapsed, before the final norm)."""
        b, g = len(anchors), self.dcfg.block_size
        ids = torch.full((b, g), self.dcfg.noise_token_id, dtype=torch.int64, device=anchors.device)
        ids[:, 0] = anchors
        positions = (anchor_pos[:, None] + torch.arange(g, device=anchors.device)).flatten()
        keys = self.key_rows(slots, anchor_pos).repeat_interleave(g, dim=0)
        x = bf16(self.accel.embedding(ids.flatten(), self.model.w["embed.weight"]))
        return self.stages(x, positions, keys).view(b, g, -1)

    def stages(self, x: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Block embeddings [T, D] at `positions` through every stage, attending `keys` rows of each
        stage's pool (the block's own KV goes to the scratch) -> the collapsed hidden [T, D]."""
        m, cfg = self.model, self.cfg
        cos_sin = self._rope(positions)
        streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        pre = torch.zeros(streams.shape[:2], device=x.device)
        pre[:, 0].fill_(1.0)  # (`= 1.0` would make a new tensor each step: a recording's constant)
        for k in range(self.dcfg.num_stages):
            streams, pre = m.block(f"mtp.{k}.", streams, pre, lambda h, k=k: self._attention(k, h, cos_sin, keys),
                                   lambda h, k=k: self._ffn(k, h), w=self.w)
        return bf16(self.accel.hc_collapse(streams, pre))

    def _attention(self, k: int, h: torch.Tensor, cos_sin, keys: torch.Tensor) -> torch.Tensor:
        m, cfg, ops, w, p = self.model, self.cfg, self.accel, self.w, f"mtp.{k}.attn."
        t = h.shape[0]
        qr = m.norm(m.qlinear(h, w[p + "wq_a.weight"]), w[p + "q_norm.weight"])
        q = m.rope(m.qlinear(qr, w[p + "wq_b.weight"]).view(t, cfg.num_attention_heads, cfg.head_dim), *cos_sin)
        pool = self.kv[k]
        scratch = self.max_seqs * self.ring
        pool[scratch:scratch + t] = self.stage_kv(k, h, cos_sin).to(pool.dtype)
        out = bf16(ops.sparse_attention_bf16(q, pool, keys, w[p + "attn_sink"], cfg.head_dim ** -0.5))
        out = m.rope(out, *cos_sin, inverse=True)
        out = bf16(ops.grouped_linear(out.reshape(t, cfg.o_groups, -1), w[p + "wo_a.weight"]))
        return m.qlinear(out.flatten(1), w[p + "wo_b.weight"])

    def _ffn(self, k: int, h: torch.Tensor) -> torch.Tensor:
        return self.model.ffn(f"mtp.{k}.ffn.", h, self.dcfg.top_k, self.experts[k], w=self.w)

    # ------------------------------------------------------------ heads
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The backbone's head on the last stage's norm of the hidden states [N, D] -> [N, V] float32."""
        return self.accel.linear(self.model.norm(h, self.w[self.last + "norm.weight"]), self.model.w["head.weight"])

    def markov(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(low-rank embedding [B, r] of the previous token, its logit bias [B, V])."""
        e = bf16(self.accel.embedding(prev, self.w[self.last + "markov_head.embed.weight"]))
        return e, self.accel.linear(e, self.w[self.last + "markov_head.head.weight"])

    def confidence_logit(self, h: torch.Tensor, e: torch.Tensor, slot: int | torch.Tensor) -> torch.Tensor:
        """The logit of c_k (accepted given all before it were) from the hidden h [B, D] (before the norm)
        and the Markov embedding e [B, r]: the raw projection (V4.1 ships no calibration temperature)."""
        proj = self.w[self.last + "confidence_head.proj.weight"]
        return self.accel.linear(torch.cat([h, e], dim=-1), proj).squeeze(-1)

