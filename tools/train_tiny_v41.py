#!/usr/bin/env python
"""Train a tiny DeepSeek-V4.1 (`DeepseekV41ForCausalLM`, text only) for ``deepinfer/assets/tiny-dsv41``.

The same recipe as tools/train_tiny.py (tiny-dsv4), with V4.1's architecture:

1. corpus    -- the CPython standard library's ``*.py`` (train_tiny.collect_corpus: the same files and
                held-out split).
2. tokenizer -- byte-level BPE, vocab 8192, bos/eos/pad 0/1/2 (train_tiny.train_tokenizer); Engram's
                token classes are then built from it exactly as deepinfer builds them at load
                (deepinfer/models/deepseek_v41/engram.py), and the config records their count.
3. model     -- every V4.1 feature at a tiny size (`text_config`, the released keys): 10 layers on the
                released schedule in miniature (SWA 0-1; ratio-2 KV+index sources 2 and 4 with
                consumers 3 and 5; the candidate source 6, ratio 1; consumers 7 and 9; Reindex 8), so
                layers 7-9 are the CED decoder; 4 hyper-connection copies with the lagged schedule;
                MoE 8 experts top-2 + shared; Engram on layers 1 and 4; three DSpark stages
                (block 5, targets 7-9, Markov head, confidence head). The forward is written here in
                plain differentiable torch, step for step what deepinfer computes at prefill
                (IMPLEMENTING.md): window + indexer-picked compressed entries, candidate blocks and
                Reindex, the quantization points as straight-through fake quantization (FP8 GEMM inputs
                and weights per 32 / 32x32, FP4 experts, FP8 window KV, FP4 index keys and queries, FP4
                E4M3 compressed entries), Engram with its n-gram hashes.
4. training  -- AdamW + warmup/cosine, grad clip 1.0, packed sequences (--seq-len), fp32 on CPU. Loss:
                next-token CE + the indexers' KL to their layer's attention over the compressed entries
                (DSA; --indexer-loss) + DSpark's loss on --anchors blocks per sequence (0.1 CE + 0.9
                L1(p_draft, p_target) + BCE(confidence, 1 - 0.5 L1), position weights exp(-k/4); the
                target's distribution, embedding and head detached; --dspark-loss). Routers' biases
                follow DeepSeek's auxiliary-loss-free balancing (bias += rate * sign(mean load - load)).
5. output    -- config.json (nested text_config, quantization_config), model.safetensors in the
                released layout (bare names; FP8 32x32 E8M0 dense weights, FP4 experts, bf16 / fp32 where
                the release keeps them, the Engram tables FP8 with E8M0 per 32), the tokenizer files,
                train_log.json. The written checkpoint is loaded back through deepinfer and its held-out
                loss measured by deepinfer's own model (the number that matters).

Smoke run (a few minutes): python tools/train_tiny_v41.py --out /tmp/tiny-dsv41 --steps 30
Full run (about an hour on 2 cores): python tools/train_tiny_v41.py --out deepinfer/assets/tiny-dsv41 --minutes 60
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import sys
import time

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from deepinfer.backends import reference as ref  # noqa: E402
from deepinfer.models.deepseek_v41.config import DeepseekV41Config  # noqa: E402
from deepinfer.models.deepseek_v41.engram import EngramHash, bucket_primes, engram_update, token_classes  # noqa: E402
from deepinfer.models.deepseek_v41.weights import checkpoint_tensors, dspark_tensors  # noqa: E402
from train_tiny import BOS, EOS, PAD, collect_corpus, encode_docs, eval_targets, lr_at, train_tokenizer, \
    unigram_ppl  # noqa: E402
from train_tiny import heldout_nll as chunked_nll, run_options, start_run  # noqa: E402

NOISE_TOKEN = PAD  # the DSpark block's filler


def text_config(vocab: int, classes: int) -> dict:
    cfg = {
        "model_type": "deepseek_v41_text", "vocab_size": vocab, "hidden_size": 256, "moe_intermediate_size": 256,
        "num_hidden_layers": 10, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64,
        "qk_rope_head_dim": 16, "q_lora_rank": 128, "o_lora_rank": 64, "o_groups": 2, "hidden_act": "silu",
        "swiglu_limit": 10.0, "rms_norm_eps": 1e-20, "attention_bias": False, "tie_word_embeddings": False,
        "max_position_embeddings": 4096, "rope_theta": 10000,
        "rope_scaling": {"rope_type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 512},
        "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "sliding_window": 128,
        "compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0], "compress_rope_theta": 160000,
        "kv_source_layer_ids": [2, 4, 6], "index_source_layer_ids": [2, 4, 6, 8], "index_n_heads": 4,
        "index_head_dim": 32, "index_topk": 64, "candidate_source_layer_id": 6, "candidate_topk_blocks": 24,
        "candidate_block_size": 8, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "engram_layer_ids": [1, 4], "engram_max_ngram_size": 4, "engram_vocab_size": 4093, "engram_n_heads": 4,
        "engram_head_dim": 32, "engram_pad_token_id": PAD, "engram_compressed_vocab_size": classes,
        "num_nextn_predict_layers": 3, "dspark_block_size": 5, "dspark_noise_token_id": NOISE_TOKEN,
        "dspark_target_layer_ids": [7, 8, 9], "dspark_markov_rank": 32, "dspark_n_routed_experts": 4,
        "dspark_num_experts_per_tok": 2,
    }
    primes = bucket_primes(len(cfg["engram_layer_ids"]), cfg["engram_max_ngram_size"], cfg["engram_n_heads"],
                           cfg["engram_vocab_size"])
    cfg["engram_num_embeddings"] = [int(layer.sum()) for layer in primes]
    return cfg


def hf_config(text: dict, quantized: bool = True) -> dict:
    out = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "bfloat16",
           "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD, "text_config": text}
    if quantized:
        out["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                      "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
    return out


# ----------------------------------------------------------------------------- fake quantization
_CPU = None


def qdq8(x: torch.Tensor) -> torch.Tensor:
    """FP8 e4m3 per 32 of the last dim (bf16 first, power-of-two scales): the cpu backend's one-pass
    kernel where it builds, bit for bit the reference (tests/unit/test_quant_kernels.py)."""
    global _CPU
    if _CPU is None:
        from deepinfer.backends import get_accelerator
        _CPU = get_accelerator("cpu")
    return _CPU.fp8_qdq(x.contiguous(), 32)


class _STE(torch.autograd.Function):
    """Straight-through: the forward sees q exactly, the gradient flows to x unchanged."""

    @staticmethod
    def forward(ctx, x, q):
        return q.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def ste(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return _STE.apply(x, q) if x.requires_grad else q


def fq_act(x):  # FP8 e4m3 per 32 along the last dim, power-of-two scales (GEMM inputs, window KV)
    return ste(x, qdq8(x.detach()))


def fq_fp4(x, block=32, e4m3=False):  # index queries / keys (E8M0, 32), compressed entries (E4M3, 16)
    return ste(x, ref.fp4_qdq(x.detach(), block, e4m3))


def fp8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (e4m3 [N, K], E8M0 scale [ceil(N/32), K/32]): 32x32 tiles, 2^ceil(log2(amax/448))."""
    n, k = w.shape
    rb = -(-n // 32)
    tiles = F.pad(w.float(), (0, 0, 0, rb * 32 - n)).view(rb, 32, k // 32, 32)
    amax = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-4)
    s = ref.pow2_scale(amax, torch.tensor(1 / 448, dtype=torch.float32))
    q = (tiles / s[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.view(rb * 32, k)[:n], s


def fp8_dequant(q, s):
    n, k = q.shape
    rb = s.shape[0]
    full = F.pad(q.float(), (0, 0, 0, rb * 32 - n)).view(rb, 32, k // 32, 32) * s[:, None, :, None]
    return full.view(rb * 32, k)[:n]


def fp4_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (int8 [N, K/2] two e2m1 codes a byte, even element low, E8M0 [N, K/32])."""
    codes, s = ref.fp4_quantize(w.float(), 32, False)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(torch.int8), s


def fq_weight(w: torch.Tensor, kind: str) -> torch.Tensor:
    """kind fp8: 32x32 tiles of a matrix; fp4: per 32 of the last dim (a stack of experts at once)."""
    if kind == "fp8":
        return ste(w, fp8_dequant(*fp8_weight(w.detach())))
    if kind == "fp4":
        return ste(w, ref.fp4_qdq(w.detach(), 32))
    return w


# ---------------------------------------------------------------------------------------- model
def rms(x, w=None, eps=1e-20):
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def rope(x, cos, sin, inverse=False, heads=False):
    """Interleaved pairs of the last 2*cos.shape[-1] dims at the tokens cos/sin [..., L, R/2] stand for
    (heads: x has a heads dim after the token dim)."""
    r = 2 * cos.shape[-1]
    if heads:
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    sin = -sin if inverse else sin
    keep, rot = x[..., :-r], x[..., -r:]
    x0, x1 = rot[..., 0::2], rot[..., 1::2]
    return torch.cat([keep, torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), -1).flatten(-2)], -1)


def hc_split(mix, base, scale, n: int, eps: float, iters: int):
    """reference.hc_split with the Sinkhorn iterations on comb laid out [N, N, T]: its row and column sums
    are then sums of contiguous T-vectors, not of 4 strided floats (about 10x fewer seconds for this
    part of a step, forward and backward); the same operations in the same order."""
    pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.reshape(-1, n, n) * scale[2] + comb_b.view(n, n), dim=-1) + eps
    comb = comb.permute(1, 2, 0).contiguous()  # [N (from), N (to), T]
    comb = comb / (comb.sum(dim=0, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=0, keepdim=True) + eps)
    return pre, post, comb.permute(2, 0, 1).contiguous()


class TinyV41(torch.nn.Module):
    """Parameters under their checkpoint names (dots as '__'), the V4.1 forward of a prefill."""

    def __init__(self, cfg: DeepseekV41Config, token_map: torch.Tensor, quantized: bool, seed: int):
        super().__init__()
        self.cfg, self.quantized = cfg, quantized
        specs = {**checkpoint_tensors(cfg), **dspark_tensors(cfg)}
        gen = torch.Generator().manual_seed(seed)
        for name, spec in specs.items():
            self.register_parameter(name.replace(".", "__"), torch.nn.Parameter(self._init(name, spec.shape, gen)))
        for name in specs:
            if name.endswith("gate.bias"):
                getattr(self, name.replace(".", "__")).requires_grad_(False)  # moved by the balancing rule
        self.hasher = EngramHash(cfg, token_map.numpy(), torch.device("cpu"))  # deepinfer's own hashing
        self.load = {}  # router name -> expert counts of the step (balancing)

    @staticmethod
    def _init(name: str, shape, gen) -> torch.Tensor:
        if name.endswith(("norm.weight", "q_weight", "k_weight", "hc_attn_scale", "hc_ffn_scale")):
            return torch.ones(shape)
        if name.endswith(("attn_sink", "gate.bias", "hc_attn_base", "hc_ffn_base")):
            return torch.zeros(shape)
        if name.endswith(("hc_attn_fn", "hc_ffn_fn")):
            return torch.randn(shape, generator=gen) * 0.01
        if "engram.embed.weight" in name:
            return torch.randn(shape, generator=gen) * 0.05
        if name.endswith("engram.embed.scale"):
            return torch.ones(shape)
        fan_in = shape[-1]
        return torch.randn(shape, generator=gen) * min(0.02, fan_in ** -0.5)

    def p(self, name: str) -> torch.Tensor:
        return getattr(self, name.replace(".", "__"))

    def w(self, name: str, kind: str | None = None) -> torch.Tensor:
        """A weight as the forward sees it: fake-quantized where the checkpoint stores it FP8/FP4."""
        t = self.p(name)
        return fq_weight(t, kind or "fp8") if self.quantized and kind != "plain" else t

    def qlinear(self, x, name):
        return F.linear(fq_act(x) if self.quantized else x, self.w(name))

    # ------------------------------------------------------------------ pieces
    def hc_mixes(self, x, p):
        cfg, n = self.cfg, self.cfg.hc_mult
        flat = x.flatten(-2)
        mix = F.linear(flat, self.p(p + "fn")) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + cfg.rms_norm_eps)
        return hc_split(mix.reshape(-1, mix.shape[-1]), self.p(p + "base"), self.p(p + "scale"), n, cfg.hc_eps,
                        cfg.hc_sinkhorn_iters)

    def block(self, p, x, pre, attention, ffn):
        """x [B, L, N, D], pre [B, L, N]: the lagged schedule (deepinfer's DeepseekV41Model.block)."""
        b, length, n, d = x.shape
        a_pre, post, comb = self.hc_mixes(x, p + "hc_attn_")
        h = rms((pre.unsqueeze(-1) * x).sum(-2), self.p(p + "attn_norm.weight"))
        x = post.view(b, length, n, 1) * attention(h).unsqueeze(-2) + \
            torch.einsum("blij,blid->bljd", comb.reshape(b, length, n, n), x)
        f_pre, post, comb = self.hc_mixes(x, p + "hc_ffn_")
        h = rms((a_pre.view(b, length, n, 1) * x).sum(-2), self.p(p + "ffn_norm.weight"))
        x = post.view(b, length, n, 1) * ffn(h).unsqueeze(-2) + \
            torch.einsum("blij,blid->bljd", comb.reshape(b, length, n, n), x)
        return x, f_pre.view(b, length, n)

    def moe(self, p, h, top_k):
        cfg = self.cfg
        x = h.reshape(-1, h.shape[-1])
        scores = F.softplus(F.linear(x, self.p(p + "gate.weight"))).sqrt()
        ids = (scores + self.p(p + "gate.bias")).topk(top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) if top_k > 1 else weights
        weights = weights * cfg.routed_scaling_factor
        self.load[p] = torch.bincount(ids.flatten(), minlength=scores.shape[1]).float()
        xq = fq_act(x) if self.quantized else x
        kind = "fp4" if self.quantized else "plain"
        out = torch.zeros_like(x)
        gate_up, down = fq_weight(self.p(p + "experts.gate_up"), kind), fq_weight(self.p(p + "experts.down"), kind)
        for e in range(scores.shape[1]):
            rows, slot = torch.where(ids == e)
            if not len(rows):
                continue
            g, u = F.linear(xq[rows], gate_up[e]).chunk(2, -1)
            inner = F.silu(g.clamp(max=cfg.swiglu_limit)) * u.clamp(-cfg.swiglu_limit, cfg.swiglu_limit)
            inner = inner * weights[rows, slot, None]
            out = out.index_add(0, rows, F.linear(fq_act(inner) if self.quantized else inner, down[e]))
        s = p + "shared_experts."
        g, u = F.linear(xq, self.w(s + "w1.weight")), F.linear(xq, self.w(s + "w3.weight"))
        inner = F.silu(g.clamp(max=cfg.swiglu_limit)) * u.clamp(-cfg.swiglu_limit, cfg.swiglu_limit)
        return (out + self.qlinear(inner, s + "w2.weight")).view_as(h)

    def engram(self, i, x, ids):
        """x [B, L, N, D] += gate * value of the n-gram rows of layer i."""
        cfg, p = self.cfg, f"layers.{i}.engram."
        classes = self.hasher.classes(ids)  # [B, L]
        cols = [classes]
        for k in range(1, cfg.engram_max_ngram_size):
            cols.append(torch.cat([torch.full_like(classes[:, :k], self.hasher.pad), classes[:, :-k]], 1))
        c = torch.stack(cols, -1)  # [B, L, ngram]
        rows_ids = self.hasher(c.flatten(0, 1))[:, cfg.engram_layer_ids.index(i)].unflatten(0, c.shape[:2])
        table = self.p(p + "embed.weight")
        if self.quantized:  # FP8 with E8M0 per 32 of a row, as stored
            table = ste(table, qdq8(table.detach()))
        rows = table[rows_ids].flatten(-2)  # [B, L, cols * ehd]
        kv = self.qlinear(rows, p + "wkv.weight")
        return engram_update(x, kv, self.p(p + "q_weight") * self.p(p + "k_weight"), cfg.rms_norm_eps)

    # ------------------------------------------------------------------ attention
    def attention(self, i, h, state, tables, losses):
        cfg, role, a = self.cfg, self.cfg.roles[i], f"layers.{i}.attn."
        b, length, _ = h.shape
        heads, hd, win = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
        cos, sin = tables["compress" if role.rate else "main"]
        qr = rms(self.qlinear(h, a + "wq_a.weight"), self.p(a + "q_norm.weight"))
        q = rope(self.qlinear(qr, a + "wq_b.weight").view(b, length, heads, hd), cos, sin, heads=True)
        kv = rms(self.qlinear(h, a + "wkv.weight"), self.p(a + "kv_norm.weight"))
        kv = rope(kv, cos, sin)
        kv = fq_act(kv)
        # one score matrix [B, L, H, S] over every key a query may see: the window's KV, the compressed
        # entries (rate layers) and a sink key whose value is zero. Queries carry H more dims, one-hot in
        # their head, and the sink key there the sinks, so its logit is the head's sink (the real keys are
        # zero there: their logits are unchanged)
        t = torch.arange(length)
        window = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - win)  # [L, L]
        keys, allowed = [kv], [window.expand(b, length, length)]
        if role.rate:
            if role.owns_kv:
                self.compress(i, h, state, tables)
            entries, index_keys = state["kv"][role.kv_source]
            visible = (torch.arange(entries.shape[1])[None, :] + 1) * role.rate <= t[:, None] + 1  # [L, E]
            if role.owns_index:
                self.index(i, h, qr, index_keys, visible, state)
            keys.append(entries)
            allowed.append(state["picks"][role.index_source])  # [B, L, E]
        keys.append(kv.new_zeros(b, 1, hd))
        allowed.append(torch.ones(b, length, 1, dtype=torch.bool))
        keys = torch.cat(keys, 1)  # [B, S, D]: also the values (one KV head)
        sinks = torch.zeros(b, keys.shape[1], heads)
        sinks = torch.cat([sinks[:, :-1], self.p(a + "attn_sink").expand(b, 1, heads)], 1)
        one_hot = torch.eye(heads).expand(b, length, heads, heads)
        # q scaled by 2^-3 (exact), so the logits are (q . k) * hd^-0.5
        q_aug = torch.cat([q * hd ** -0.5, one_hot], -1).flatten(1, 2)  # [B, L * H, D + H]
        logits = torch.bmm(q_aug, torch.cat([keys, sinks], -1).transpose(1, 2)).view(b, length, heads, -1)
        if role.rate and role.owns_index:  # DSA: the indexer learns where its layer's attention goes
            with torch.no_grad():
                comp = logits[..., length:length + entries.shape[1]].masked_fill(~visible[:, None, :], float("-inf"))
                target = comp.softmax(-1).nan_to_num().sum(2)  # [B, L, E], summed over heads
                target = target / target.sum(-1, keepdim=True).clamp_min(1e-20)
            score = state["scores"][i].masked_fill(~visible, float("-inf")).log_softmax(-1).nan_to_num(neginf=0.0)
            has = visible.any(-1)
            kl = (target * (target.clamp_min(1e-20).log() - score)).sum(-1)
            losses.setdefault("indexer", []).append(kl[:, has].mean())
        probs = logits.masked_fill(~torch.cat(allowed, -1).unsqueeze(2), float("-inf")).softmax(-1)
        out = torch.bmm(probs.flatten(1, 2), keys).view(b, length, heads, hd)
        out = rope(out, cos, sin, inverse=True, heads=True)
        groups = out.reshape(b, length, cfg.o_groups, -1)
        wo_a = self.w(a + "wo_a.weight").view(cfg.o_groups, cfg.o_lora_rank, -1)
        out = torch.einsum("blgd,grd->blgr", groups, wo_a).flatten(2)
        return self.qlinear(out, a + "wo_b.weight")

    def compress(self, i, h, state, tables):
        role, c = self.cfg.roles[i], f"layers.{i}.attn."
        length = h.shape[1]
        if role.rate == 1:
            latent = F.linear(h, self.p(c + "compressor.wkv.weight"))
        else:
            e = length // role.rate
            kv = F.linear(h[:, :e * role.rate], self.p(c + "compressor.wkv.weight")).unflatten(1, (e, role.rate))
            gate = F.linear(h[:, :e * role.rate], self.p(c + "compressor.wgate.weight")).unflatten(1, (e, role.rate))
            latent = (kv * gate.softmax(2)).sum(2)
        latent = rms(latent, self.p(c + "compressor.norm.weight"))
        cos, sin = tables["compress"]
        ecos, esin = cos[::role.rate][:latent.shape[1]], sin[::role.rate][:latent.shape[1]]
        keys = rms(F.linear(latent, self.p(c + "indexer.wk.weight")), self.p(c + "indexer.k_norm.weight"))
        keys = fq_fp4(rope(keys, ecos, esin))
        entries = fq_fp4(rope(latent, ecos, esin), 16, e4m3=True)
        state["kv"][i] = (entries, keys)

    def index(self, i, h, qr, keys, visible, state):
        cfg, role, x = self.cfg, self.cfg.roles[i], f"layers.{i}.attn.indexer."
        b, length, _ = h.shape
        cos, sin = state["tables"]["compress"]
        q = fq_fp4(rope(self.qlinear(qr, x + "wq_b.weight").view(b, length, cfg.index_n_heads, -1), cos, sin,
                        heads=True))
        w = F.linear(h, self.p(x + "weights_proj.weight")) * (cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5)
        score = (torch.einsum("blhd,bed->blhe", q, keys).relu() * w.unsqueeze(-1)).sum(2)  # [B, L, E]
        state["scores"][i] = score
        with torch.no_grad():
            s = score.masked_fill(~visible, float("-inf"))
            if role.candidates:
                vis = visible.sum(-1).expand(b, length).reshape(-1)
                from deepinfer.models.deepseek_v41.indexer import select_candidate_blocks
                state["candidates"] = select_candidate_blocks(s.reshape(b * length, -1), vis, cfg.candidate_topk_blocks,
                                                              cfg.candidate_block_size).view(b, length, -1)
            elif role.reindex:
                s = s.masked_fill(~state["candidates"], float("-inf"))
            k = min(cfg.index_topk, s.shape[-1])
            top = s.topk(k, dim=-1)
            picked = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, top.indices, torch.isfinite(top.values))
        state["picks"][i] = picked & visible

    # ------------------------------------------------------------------ forward
    def forward(self, ids, anchors: int = 0):
        """ids [B, L] -> (logits [B, L, V], losses dict, the DSpark stages' loss)."""
        cfg = self.cfg
        b, length = ids.shape
        pos = torch.arange(length).numpy()
        tables = {"main": cfg.rope_main.cos_sin(pos), "compress": cfg.rope_compress.cos_sin(pos)}
        state = {"kv": {}, "picks": {}, "scores": {}, "tables": tables}
        losses: dict = {}
        x = self.p("embed.weight")[ids].unsqueeze(2).expand(b, length, cfg.hc_mult, -1)
        pre = torch.zeros(b, length, cfg.hc_mult)
        pre[..., 0] = 1.0
        features = []
        for i, role in enumerate(cfg.roles):
            if role.engram:
                x = self.engram(i, x, ids)
            if i in cfg.dspark["dspark_target_layer_ids"]:
                features.append(x.mean(2))
            x, pre = self.block(f"layers.{i}.", x, pre, lambda h, i=i: self.attention(i, h, state, tables, losses),
                                lambda h, i=i: self.moe(f"layers.{i}.ffn.", h, cfg.num_experts_per_tok))
        h = rms((pre.unsqueeze(-1) * x).sum(-2), self.p("norm.weight"))
        logits = F.linear(h, self.p("head.weight"))
        # the drafter learns from the backbone, frozen for its loss (its context, targets, embedding, head)
        dspark = None
        if anchors:
            dspark = self.dspark(ids, torch.cat(features, -1).detach(), logits.detach(), tables, anchors)
        return logits, losses, dspark

    # ------------------------------------------------------------------ DSpark
    def dspark(self, ids, features, target_logits, tables, anchors: int):
        """The stages on `anchors` blocks per sequence: [token at p, noise x (g-1)] at positions p .. p+g-1,
        attending the context KV of positions p - window .. p - 1 (main_x of the target layers' inputs)
        and the whole block; slot k predicts the token at p + k + 1."""
        cfg = self.cfg
        g, win = cfg.dspark["dspark_block_size"], cfg.sliding_window
        b, length = ids.shape
        n_stages = cfg.num_nextn_predict_layers
        gen = torch.Generator().manual_seed(int(ids.sum()))
        p = torch.randint(1, length - g, (b, anchors), generator=gen)  # anchor positions
        main_x = rms(self.qlinear(features, "mtp.0.main_proj.weight"), self.p("mtp.0.main_norm.weight"))
        bi = torch.arange(b)[:, None].expand(b, anchors)
        block_pos = p[..., None] + torch.arange(g)  # [B, A, g]
        block_ids = torch.full((b, anchors, g), NOISE_TOKEN)
        block_ids[..., 0] = ids[bi, p]
        ctx_pos = p[..., None] - win + torch.arange(win)  # [B, A, W]
        ctx_ok = ctx_pos >= 0
        cos, sin = tables["main"]
        flat = block_ids.view(-1, g)
        x = self.p("embed.weight").detach()[flat].unsqueeze(2).expand(-1, g, cfg.hc_mult, -1)
        pre = torch.zeros(x.shape[:3])
        pre[..., 0] = 1.0
        bcos, bsin = cos[block_pos.view(-1, g)], sin[block_pos.view(-1, g)]
        for k in range(n_stages):
            s = f"mtp.{k}."
            ctx_kv = rms(self.qlinear(main_x, s + "attn.wkv.weight"), self.p(s + "attn.kv_norm.weight"))
            ctx_kv = fq_act(rope(ctx_kv, cos, sin))[bi[..., None], ctx_pos.clamp(min=0)].view(-1, win, cfg.head_dim)
            mask = ctx_ok.view(-1, win)

            def attend(h, s=s, ctx_kv=ctx_kv, mask=mask):
                a = s + "attn."
                n = h.shape[0]
                qr = rms(self.qlinear(h, a + "wq_a.weight"), self.p(a + "q_norm.weight"))
                q = rope(self.qlinear(qr, a + "wq_b.weight").view(n, g, cfg.num_attention_heads, -1), bcos, bsin,
                         heads=True)
                kv = fq_act(rope(rms(self.qlinear(h, a + "wkv.weight"), self.p(a + "kv_norm.weight")), bcos, bsin))
                keys = torch.cat([ctx_kv, kv], 1)
                logit = torch.einsum("nghd,nsd->nhgs", q, keys) * cfg.head_dim ** -0.5
                ok = torch.cat([mask, torch.ones(n, g, dtype=torch.bool)], 1)
                logit = logit.masked_fill(~ok[:, None, None, :], float("-inf"))
                sink = self.p(a + "attn_sink").view(1, -1, 1, 1).expand(n, -1, g, 1)
                probs = torch.cat([logit, sink], -1).softmax(-1)[..., :-1]
                out = rope(torch.einsum("nhgs,nsd->nghd", probs, keys), bcos, bsin, inverse=True, heads=True)
                wo_a = self.w(a + "wo_a.weight").view(cfg.o_groups, cfg.o_lora_rank, -1)
                out = torch.einsum("ngcd,crd->ngcr", out.reshape(n, g, cfg.o_groups, -1), wo_a).flatten(2)
                return self.qlinear(out, a + "wo_b.weight")

            x, pre = self.block(s, x, pre, attend, lambda h, s=s: self.moe(s + "ffn.", h, cfg.dspark_experts[1]))
        last = f"mtp.{n_stages - 1}."
        hidden = (pre.unsqueeze(-1) * x).sum(-2)  # [n, g, D]
        logits = F.linear(rms(hidden, self.p(last + "norm.weight")), self.p("head.weight").detach())
        prev = torch.cat([block_ids[..., :1], ids[bi[..., None], (block_pos[..., 1:]).clamp(max=length - 1)]], -1)
        embed = self.p(last + "markov_head.embed.weight")[prev.view(-1, g)]
        logits = logits + F.linear(embed, self.p(last + "markov_head.head.weight"))
        conf = F.linear(torch.cat([hidden, embed], -1), self.p(last + "confidence_head.proj.weight")).squeeze(-1)
        truth = ids[bi[..., None], (block_pos + 1).clamp(max=length - 1)].view(-1, g)
        p_target = target_logits[bi[..., None], block_pos].view(-1, g, target_logits.shape[-1]).softmax(-1)
        p_draft = logits.softmax(-1)
        l1 = (p_draft - p_target).abs().sum(-1)  # [n, g]
        ce = F.cross_entropy(logits.flatten(0, 1), truth.flatten(), reduction="none").view(-1, g)
        bce = F.binary_cross_entropy_with_logits(conf, (1 - 0.5 * l1).detach(), reduction="none")
        weight = torch.exp(-torch.arange(g).float() / 4)
        return ((0.1 * ce + 0.9 * l1 + bce) * weight).sum(-1).mean() / weight.sum()

    def balance(self, rate: float) -> float:
        worst = 1.0
        with torch.no_grad():
            for p, counts in self.load.items():
                bias = self.p(p + "gate.bias")
                bias.add_(rate * torch.sign(counts.mean() - counts))
                worst = max(worst, float(counts.max() / counts.mean().clamp_min(1e-9)))
        self.load = {}
        return worst

    # ------------------------------------------------------------------ checkpoint
    def export(self) -> dict[str, torch.Tensor]:
        """The released layout: FP8 32x32 (E8M0) dense weights, FP4 experts (int8 packed, E8M0 per 32),
        bf16 / fp32 where the release keeps them, the Engram tables FP8 with E8M0 per 32."""
        cfg = self.cfg
        bf16_names = ("norm.weight", "embed.weight", "head.weight", "wk.weight", "weights_proj.weight",
                      "compressor.wkv.weight", "compressor.wgate.weight", "gate.weight", "q_weight", "k_weight",
                      "markov_head.embed.weight", "markov_head.head.weight", "confidence_head.proj.weight")
        fp32_names = ("attn_sink", "gate.bias", "hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn",
                      "hc_ffn_base", "hc_ffn_scale")
        out = {}
        for name in {**checkpoint_tensors(cfg), **dspark_tensors(cfg)}:
            t = self.p(name).detach().float()
            if name.endswith("engram.embed.scale"):
                continue
            if name.endswith("engram.embed.weight"):
                q, s = ref.fp8_quantize(t, 32)
                out[name], out[name.removesuffix("weight") + "scale"] = q, s.to(torch.float8_e8m0fnu)
            elif name.endswith(("experts.gate_up", "experts.down")):
                prefix = name.rsplit(".", 1)[0]
                for e in range(t.shape[0]):
                    halves = t[e].chunk(2)
                    parts = {"w1": halves[0], "w3": halves[1]} if name.endswith("gate_up") else {"w2": t[e]}
                    for w, part in parts.items():
                        key = f"{prefix}.{e}.{w}."
                        if self.quantized:
                            packed, s = fp4_weight(part)
                            out[key + "weight"], out[key + "scale"] = packed, s.to(torch.float8_e8m0fnu)
                        else:
                            out[key + "weight"] = part.to(torch.bfloat16)
            elif name.endswith(fp32_names):
                out[name] = t
            elif name.endswith(bf16_names) and not name.endswith("attn.wo_a.weight") or not self.quantized:
                out[name] = t.to(torch.bfloat16)
            else:
                q, s = fp8_weight(t)
                out[name], out[name.removesuffix("weight") + "scale"] = q, s.to(torch.float8_e8m0fnu)
        return out


# ----------------------------------------------------------------------------- training
def heldout_nll(model, stream, seq_len, batch=2):
    return chunked_nll(model, stream, seq_len, batch, logits_of=lambda m, x: m(x)[0])


def deepinfer_nll(out_dir: pathlib.Path, stream: torch.Tensor, seq_len: int) -> tuple[float, int]:
    """The held-out loss of the written checkpoint through deepinfer's own model (cpu, one prefill per chunk)."""
    from deepinfer.backends import get_accelerator
    from deepinfer.core.cache import StateCache
    from deepinfer.core.loader import load_checkpoint
    from deepinfer.models.base import StepInput
    from deepinfer.models.registry import load_config

    cfg, cls = load_config(out_dir)
    weights, _ = load_checkpoint(out_dir, cls.checkpoint_tensors(cfg), cls, keep_prefixes=cls.extra_prefixes)
    model = cls(cfg, weights, get_accelerator("cpu"))
    tot, cnt = 0.0, 0
    for i in range(max(1, (len(stream) - 1) // seq_len)):
        x = stream[i * seq_len:(i + 1) * seq_len].long()
        cache = StateCache(model.cache_spec(0), max_seqs=1, num_pages=-(-seq_len // 128), max_step_tokens=seq_len,
                           max_model_len=seq_len, page_tokens=128)
        slot = cache.allocate_slot()
        cache.grow(slot, len(x))
        inp = StepInput(x, torch.tensor([slot]), torch.tensor([0]), torch.tensor([len(x)]))
        logits = model.forward(inp, cache, torch.arange(len(x)))
        nll = -logits[:-1].double().log_softmax(-1).gather(-1, x[1:, None]).squeeze(-1)
        tot, cnt = tot + nll.sum().item(), cnt + nll.numel()
    return tot, cnt


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="deepinfer/assets/tiny-dsv41")
    ap.add_argument("--steps", type=int, default=None, help="total optimizer steps (overrides --minutes)")
    ap.add_argument("--minutes", type=float, default=None, help="estimate --steps from a timed probe")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--bias-rate", type=float, default=5e-3, help="per step; a few hundred steps an hour here")
    ap.add_argument("--indexer-loss", type=float, default=0.1)
    ap.add_argument("--dspark-loss", type=float, default=0.5)
    ap.add_argument("--anchors", type=int, default=8, help="DSpark blocks per sequence and step")
    ap.add_argument("--bf16", action="store_true", help="no FP8/FP4: a bf16 checkpoint (no quantization_config)")
    ap.add_argument("--eval-tokens", type=int, default=None, help="score only the first N held-out tokens")
    run_options(ap)
    args = ap.parse_args()
    out, t_start = start_run(args)

    root, train_docs, held_docs = collect_corpus()
    tok = train_tokenizer([t for _, t in train_docs], args.vocab, str(out))
    train_stream = encode_docs(tok, [t for _, t in train_docs])
    held_stream = encode_docs(tok, [t for _, t in held_docs])
    if args.eval_tokens:
        held_stream = held_stream[:args.eval_tokens]
    lookup = token_classes(out / "tokenizer.json")
    classes = int(lookup.max()) + 1
    text = text_config(args.vocab, classes)
    config = hf_config(text, quantized=not args.bf16)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    cfg = DeepseekV41Config.from_dict(config, source=str(out / "config.json"))
    print(f"corpus: {len(train_docs)} train files ({len(train_stream)} tokens), {len(held_docs)} held out; "
          f"{classes} Engram token classes ({time.time() - t_start:.0f}s)", flush=True)
    uni = unigram_ppl(train_stream, eval_targets(held_stream, args.eval_seq_len), args.vocab)

    model = TinyV41(cfg, torch.from_numpy(lookup[:args.vocab]), not args.bf16, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M params", flush=True)
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if p.requires_grad and not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd}, {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    data_gen = torch.Generator().manual_seed(args.seed + 2)
    n_seq = len(train_stream) // args.seq_len

    def batches():
        epoch = 0
        while True:
            perm = torch.randperm(n_seq, generator=data_gen)
            for i in range(0, n_seq - args.batch + 1, args.batch):
                yield torch.stack([train_stream[j * args.seq_len:(j + 1) * args.seq_len]
                                   for j in perm[i:i + args.batch].tolist()]).long(), epoch
            epoch += 1

    it = batches()
    total = args.steps or 10 ** 9
    log, step, t_train, t_probe, c_train = [], 0, time.time(), None, time.process_time()
    while step < total:
        if args.steps is None and step == 5:
            per_step = (time.time() - t_probe) / 3
            total = max(20, int((args.minutes * 60 - (time.time() - t_start) - 300) / per_step))
            print(f"probe: {per_step:.2f}s/step -> {total} steps", flush=True)
        if step == 2:
            t_probe = time.time()
        x, epoch = next(it)
        lr = lr_at(step, total, args.lr, args.warmup, args.lr * args.min_lr_frac)
        for group in opt.param_groups:
            group["lr"] = lr
        logits, aux, draft = model(x, args.anchors)
        ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        idx = torch.stack(aux["indexer"]).mean() if aux.get("indexer") else torch.zeros(())
        loss = ce + args.indexer_loss * idx + (args.dspark_loss * draft if draft is not None else 0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        imbalance = model.balance(args.bias_rate)
        step += 1
        if not math.isfinite(loss.item()):
            raise SystemExit(f"non-finite loss at step {step}")
        if step % args.log_every == 0 or step == 1 or step == total:
            rec = dict(step=step, loss=round(ce.item(), 4), indexer_kl=round(idx.item(), 4),
                       dspark=round(float(draft.detach()), 4) if draft is not None else None, lr=lr,
                       grad_norm=round(gn.item(), 3),
                       max_load_ratio=round(imbalance, 3), epoch=epoch, elapsed_s=round(time.time() - t_train, 1),
                       cpu_s=round(time.process_time() - c_train, 1))
            log.append(rec)
            print(json.dumps(rec), flush=True)
    train_time, train_cpu = time.time() - t_train, time.process_time() - c_train

    tot, cnt = heldout_nll(model, held_stream, args.eval_seq_len)
    loss_train = tot / cnt
    print(f"held-out (training forward, fake-quantized): loss {loss_train:.4f} ppl {math.exp(loss_train):.2f}",
          flush=True)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.export().items()}, str(out / "model.safetensors"))
    gen_cfg = {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=1))
    tot_d, cnt_d = deepinfer_nll(out, held_stream, args.eval_seq_len)
    loss_d = tot_d / cnt_d
    print(f"held-out through deepinfer: loss {loss_d:.4f} ppl {math.exp(loss_d):.2f} over {cnt_d} tokens", flush=True)
    summary = dict(command="python " + " ".join(sys.argv), steps=total, train_wall_s=round(train_time, 1),
                   train_cpu_s=round(train_cpu, 1),
                   total_wall_s=round(time.time() - t_start, 1), params=n_params, engram_classes=classes,
                   heldout_tokens_scored=cnt_d, heldout_loss_training_forward=loss_train,
                   heldout_loss_deepinfer=loss_d, heldout_ppl_deepinfer=math.exp(loss_d), unigram_ppl=uni,
                   final_train_loss=log[-1]["loss"], safetensors_bytes=os.path.getsize(out / "model.safetensors"),
                   env=dict(python=platform.python_version(), torch=torch.__version__, threads=args.threads),
                   args=vars(args))
    (out / "train_log.json").write_text(json.dumps({"summary": summary, "log": log}, indent=1))
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
