"""The DeepSeek-V4.1 golden files are intact and self-consistent, checked without the reference.

tools/v41_goldens.py writes tests/goldens/v41/ from DeepSeek's reference code; deepinfer's V4.1 tests
compare against those files. These checks make a truncated, hand-edited or regenerated-wrong golden
fail here, before it misleads those tests: every file's digest, the checkpoint layout the released
model uses, and properties the quantizers, the Engram layout, the hyper-connections and the
cross-layer hand-off must have."""

from __future__ import annotations

import hashlib
import json
import math
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open

from v41_goldens import (CONFIGS, E2E_CONFIGS, GOLDENS, VL_CONFIG, WIDE_CONFIG, block_tolerance, checkpoint_dir,
                         e2e_tolerance, load, noise, real_token_map, same_topk_picks, token_map_sha256,
                         topk_boundary_ties, ulp_error, vision_e2e_tolerance, vision_tolerance)

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
FP4_TABLE = torch.cat([E2M1, -E2M1])


def manifest_problems(root) -> list[str]:
    manifest = json.loads((root / "MANIFEST.json").read_text())
    problems = []
    for name, entry in manifest.items():
        path = root / name
        if not path.is_file():
            problems.append(f"{name}: missing")
            continue
        data = path.read_bytes()
        if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            problems.append(f"{name}: content differs from MANIFEST.json")
    extra = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.suffix != ".md"}
    problems += [f"{name}: not in MANIFEST.json" for name in sorted(extra - set(manifest) - {"MANIFEST.json"})]
    return problems


def test_every_golden_file_matches_the_manifest():
    assert manifest_problems(GOLDENS) == []


def test_a_flipped_byte_is_caught(tmp_path):
    root = tmp_path / "v41"
    shutil.copytree(GOLDENS, root)
    target = root / "e2e_ced10.safetensors"
    data = bytearray(target.read_bytes())
    data[-5] ^= 0x01
    target.write_bytes(bytes(data))
    assert manifest_problems(root) == ["e2e_ced10.safetensors: content differs from MANIFEST.json"]


# --- the checkpoints ------------------------------------------------------------------------------------

RELEASED_TEXT_KEYS = {  # every key of the released text_config that the tiny configs must spell the same
    "vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "qk_rope_head_dim", "q_lora_rank", "o_lora_rank", "o_groups", "swiglu_limit",
    "rms_norm_eps", "rope_theta", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "scoring_func",
    "norm_topk_prob", "routed_scaling_factor", "sliding_window", "compress_ratios", "compress_rope_theta",
    "kv_source_layer_ids", "index_source_layer_ids", "index_n_heads", "index_head_dim", "index_topk",
    "candidate_source_layer_id", "candidate_topk_blocks", "candidate_block_size", "hc_mult", "hc_sinkhorn_iters",
    "hc_eps", "engram_layer_ids", "engram_num_embeddings", "engram_max_ngram_size", "engram_vocab_size",
    "engram_n_heads", "engram_head_dim", "engram_pad_token_id", "engram_compressed_vocab_size",
    "num_nextn_predict_layers", "dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids",
    "dspark_markov_rank"}


def text_config(config: str) -> dict:
    cfg = json.loads((checkpoint_dir(config) / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v41" and cfg["architectures"] == ["DeepseekV41ForCausalLM"]
    assert cfg["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "dynamic",
                                          "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
    return cfg["text_config"]


def checkpoint(config: str) -> dict[str, torch.Tensor]:
    with safe_open(checkpoint_dir(config) / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def expected_names(t: dict) -> dict[str, tuple]:
    """Every tensor the checkpoint must hold: bare names, (dtype, shape), derived from the config."""
    d, hc, L = t["hidden_size"], t["hc_mult"], t["num_hidden_layers"]
    heads, hd = t["num_attention_heads"], t["head_dim"]
    mix = (2 + hc) * hc
    fp8, e8, bf16, fp32, i8 = torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.bfloat16, torch.float32, torch.int8
    names = {}

    def dense(name, out, inp):
        names[name + ".weight"] = (fp8, (out, inp))
        names[name + ".scale"] = (e8, (math.ceil(out / 32), inp // 32))

    def block(p, layer, n_experts):
        ratio = t["compress_ratios"][layer]
        names[p + "attn_norm.weight"] = (bf16, (d,))
        names[p + "ffn_norm.weight"] = (bf16, (d,))
        for sub in ("attn", "ffn"):
            names[f"{p}hc_{sub}_fn"] = (fp32, (mix, hc * d))
            names[f"{p}hc_{sub}_base"] = (fp32, (mix,))
            names[f"{p}hc_{sub}_scale"] = (fp32, (3,))
        a = p + "attn."
        names[a + "attn_sink"] = (fp32, (heads,))
        dense(a + "wq_a", t["q_lora_rank"], d)
        names[a + "q_norm.weight"] = (bf16, (t["q_lora_rank"],))
        dense(a + "wq_b", heads * hd, t["q_lora_rank"])
        dense(a + "wkv", hd, d)
        names[a + "kv_norm.weight"] = (bf16, (hd,))
        dense(a + "wo_a", t["o_groups"] * t["o_lora_rank"], heads * hd // t["o_groups"])
        dense(a + "wo_b", d, t["o_groups"] * t["o_lora_rank"])
        backbone = layer < L
        if backbone and layer in t["kv_source_layer_ids"]:
            names[a + "compressor.wkv.weight"] = (bf16, (hd, d))
            names[a + "compressor.norm.weight"] = (bf16, (hd,))
            if ratio > 1:
                names[a + "compressor.wgate.weight"] = (bf16, (hd, d))
            names[a + "indexer.wk.weight"] = (bf16, (t["index_head_dim"], hd))
            names[a + "indexer.k_norm.weight"] = (bf16, (t["index_head_dim"],))
        if backbone and layer in t["index_source_layer_ids"]:
            dense(a + "indexer.wq_b", t["index_n_heads"] * t["index_head_dim"], t["q_lora_rank"])
            names[a + "indexer.weights_proj.weight"] = (bf16, (t["index_n_heads"], d))
        f = p + "ffn."
        names[f + "gate.weight"] = (bf16, (n_experts, d))
        names[f + "gate.bias"] = (fp32, (n_experts,))
        inter = t["moe_intermediate_size"]
        for e in range(n_experts):
            for w, out, inp in (("w1", inter, d), ("w3", inter, d), ("w2", d, inter)):
                names[f"{f}experts.{e}.{w}.weight"] = (i8, (out, inp // 2))
                names[f"{f}experts.{e}.{w}.scale"] = (e8, (out, inp // 32))
        for w, out, inp in (("w1", inter, d), ("w3", inter, d), ("w2", d, inter)):
            dense(f"{f}shared_experts.{w}", out, inp)

    names["embed.weight"] = (bf16, (t["vocab_size"], d))
    names["head.weight"] = (bf16, (t["vocab_size"], d))
    names["norm.weight"] = (bf16, (d,))
    for layer in range(L):
        block(f"layers.{layer}.", layer, t["n_routed_experts"])
    for i, layer in enumerate(t["engram_layer_ids"]):
        p = f"layers.{layer}.engram."
        rows, ehd = t["engram_num_embeddings"][i], t["engram_head_dim"]
        names[p + "embed.weight"] = (fp8, (rows, ehd))
        names[p + "embed.scale"] = (e8, (rows, ehd // 32))
        dense(p + "wkv", d * (hc + 1), (t["engram_max_ngram_size"] - 1) * t["engram_n_heads"] * ehd)
        names[p + "q_weight"] = (bf16, (hc, d))
        names[p + "k_weight"] = (bf16, (hc, d))
    stages = t["num_nextn_predict_layers"]
    for k in range(stages):
        block(f"mtp.{k}.", L + k, t.get("dspark_n_routed_experts") or t["n_routed_experts"])
    names["mtp.0.main_proj.weight"] = (fp8, (d, d * len(t["dspark_target_layer_ids"])))
    names["mtp.0.main_proj.scale"] = (e8, (math.ceil(d / 32), d * len(t["dspark_target_layer_ids"]) // 32))
    names["mtp.0.main_norm.weight"] = (bf16, (d,))
    last, rank = f"mtp.{stages - 1}.", t["dspark_markov_rank"]
    names[last + "norm.weight"] = (bf16, (d,))
    names[last + "markov_head.embed.weight"] = (bf16, (t["vocab_size"], rank))
    names[last + "markov_head.head.weight"] = (bf16, (t["vocab_size"], rank))
    names[last + "confidence_head.proj.weight"] = (bf16, (1, d + rank))
    return names


@pytest.mark.parametrize("config", CONFIGS)
def test_checkpoint_holds_the_released_layout(config):
    t = text_config(config)
    assert RELEASED_TEXT_KEYS <= set(t), RELEASED_TEXT_KEYS - set(t)
    assert t["model_type"] == "deepseek_v41_text"
    assert len(t["compress_ratios"]) == t["num_hidden_layers"] + t["num_nextn_predict_layers"]
    ckpt = checkpoint(config)
    expected = expected_names(t)
    assert set(ckpt) == set(expected), sorted(set(ckpt) ^ set(expected))[:8]
    for name, (dtype, shape) in expected.items():
        assert (ckpt[name].dtype, tuple(ckpt[name].shape)) == (dtype, shape), name
    for name, tensor in ckpt.items():
        if tensor.dtype == torch.float8_e8m0fnu:
            assert (tensor.view(torch.uint8) != 0xFF).all(), f"{name}: NaN scale"
        elif tensor.is_floating_point():
            assert torch.isfinite(tensor.float()).all(), name


@pytest.mark.parametrize("config", CONFIGS)
def test_checkpoint_engram_sizes_follow_the_tokenizer(config):
    from tokenizers import Tokenizer
    t = text_config(config)
    tok = Tokenizer.from_file(str(checkpoint_dir(config) / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == t["vocab_size"]
    engram = load("engram")
    assert t["engram_compressed_vocab_size"] == engram.meta["tiny"]["classes"]
    primes = engram[f"{config}.primes"]
    assert primes.shape == (len(t["engram_layer_ids"]), t["engram_max_ngram_size"] - 1, t["engram_n_heads"])
    assert primes.flatten(1).sum(-1).tolist() == t["engram_num_embeddings"]


# --- ops -------------------------------------------------------------------------------------------------

def blocks_of(x: torch.Tensor, block: int) -> torch.Tensor:
    return x.float().unflatten(-1, (-1, block))


def test_fp8_activation_quant_goldens_are_consistent():
    ops = load("ops")
    x, q, s, qdq = ops["act_quant.x"], ops["act_quant.q"], ops["act_quant.s"], ops["act_quant.qdq"]
    assert (q.dtype, s.dtype, qdq.dtype) == (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.bfloat16)
    assert s.shape == (x.size(0), x.size(1) // 32)
    scale = s.float().unsqueeze(-1)
    assert torch.equal((blocks_of(q, 32) * scale).flatten(-2).to(torch.bfloat16), qdq)
    # the scale is the smallest power of two that brings the block's amax (floored at 1e-4) to <= 448
    amax = blocks_of(x, 32).abs().amax(-1).clamp_min(1e-4)
    assert (amax / s.float() <= 448 * (1 + 2 ** -20)).all()
    assert (amax / (s.float() / 2) > 448 * (1 - 2 ** -20)).all()
    # round to nearest, ties to even: the tie row (scale 1) pins the e4m3 rounding
    row = x.float()[-2, :32].tolist()
    got = dict(zip(row, qdq.float()[-2, :32].tolist()))
    for value, rounded in ((1.0625, 1.0), (1.1875, 1.25), (2.125, 2.0), (2.375, 2.5), (12.5, 12.0), (13.5, 14.0),
                           (100.0, 96.0), (116.0, 112.0), (200.0, 192.0), (232.0, 224.0), (400.0, 384.0),
                           (432.0, 448.0), (-400.0, -384.0), (-1.1875, -1.25), (2 ** -10, 0.0), (2 ** -11, 0.0), (1.5 * 2 ** -9, 2 ** -8),
                           (2.5 * 2 ** -9, 2 ** -8), (3.5 * 2 ** -9, 2 ** -7), (7.5 * 2 ** -9, 2 ** -6),
                           (448.0, 448.0)):
        assert got[value] == rounded, (value, got[value])


@pytest.mark.parametrize("name,block,scale_dtype", [("fp4_e8m0", 32, torch.float8_e8m0fnu),
                                                     ("fp4_e4m3", 16, torch.float8_e4m3fn)])
def test_fp4_quant_goldens_are_consistent(name, block, scale_dtype):
    ops = load("ops")
    x, packed, s, qdq = (ops[f"{name}.{k}"] for k in ("x", "packed", "s", "qdq"))
    assert (packed.dtype, s.dtype) == (torch.uint8, scale_dtype) and packed.shape == (x.size(0), x.size(1) // 2)
    values = torch.stack([FP4_TABLE[(packed & 0xF).long()], FP4_TABLE[(packed >> 4).long()]], -1).flatten(-2)
    assert torch.equal((blocks_of(values, block) * s.float().unsqueeze(-1)).flatten(-2).to(torch.bfloat16), qdq)
    amax = blocks_of(x, block).abs().amax(-1)
    if scale_dtype == torch.float8_e8m0fnu:
        amax = amax.clamp_min(6 * 2 ** -126)
        assert (amax / s.float() <= 6 * (1 + 2 ** -20)).all() and (amax / (s.float() / 2) > 6 * (1 - 2 ** -20)).all()
    else:
        expect = (amax.clamp_min(6 * 2 ** -9) / 6).clamp(max=448).to(torch.float8_e4m3fn)
        assert torch.equal(s.view(torch.uint8), expect.view(torch.uint8))
    # e2m1 ties to the even code at scale 1: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    row = x.float()[5, :16].tolist()
    got = dict(zip(row, qdq.float()[5, :16].tolist()))
    for value, rounded in ((0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0),
                           (-1.75, -2.0), (-5.0, -4.0)):
        assert got[value] == rounded, (value, got[value])


def test_weight_format_goldens_are_consistent():
    ops = load("ops")
    q, s = ops["fp8_weight.q"], ops["fp8_weight.s"]
    scale = s.float().repeat_interleave(32, 0)[: q.size(0)].repeat_interleave(32, 1)
    assert torch.equal((q.float() * scale).to(torch.bfloat16), ops["fp8_weight.dequant"])
    codes, s = ops["fp4_weight.packed"].view(torch.uint8), ops["fp4_weight.s"]
    values = torch.stack([FP4_TABLE[(codes & 0xF).long()], FP4_TABLE[(codes >> 4).long()]], -1).flatten(-2)
    assert torch.equal((values * s.float().repeat_interleave(32, 1)).to(torch.bfloat16), ops["fp4_weight.dequant"])
    rows, rs, idx = ops["engram_rows.q"], ops["engram_rows.s"], ops["engram_rows.index"]
    expect = (blocks_of(rows[idx], 32) * rs[idx].float().unsqueeze(-1)).flatten(-2).to(torch.bfloat16)
    assert torch.equal(expect, ops["engram_rows.out"])
    for name in ("linear_fp8", "linear_fp4"):
        assert ops[f"{name}.y"].dtype == torch.bfloat16 and torch.isfinite(ops[f"{name}.y"].float()).all()


def test_sparse_attention_and_sinkhorn_goldens_are_consistent():
    ops = load("ops")
    out, idxs = ops["sparse_attn.out"], ops["sparse_attn.idxs"]
    assert out.dtype == torch.bfloat16 and out.shape == ops["sparse_attn.q"].shape
    assert (out[0, 2] == 0).all()  # the row without a valid index gives zeros
    assert (out[0, torch.arange(6) != 2].abs().sum(-1) > 0).all()
    assert idxs.size(-1) > 128  # crosses two 64-index online-softmax blocks
    for hc in (4, 2):
        pre, post, comb = (ops[f"sinkhorn.hc{hc}.{k}"] for k in ("pre", "post", "comb"))
        assert pre.shape[-1] == post.shape[-1] == hc and comb.shape[-2:] == (hc, hc)
        assert ((pre > 0) & (pre <= 1 + 1e-6)).all() and ((post >= 0) & (post <= 2)).all()
        assert torch.allclose(comb.sum(-2), torch.ones(()), atol=1e-5)  # the last normalisation is over columns
        # rows converge within 20 rounds for ordinary mixes (RMS 0.1, 1); saturated ones (RMS 30) do not
        assert torch.allclose(comb[:2].sum(-1), torch.ones(()), atol=1e-3)
        assert not torch.allclose(comb[2].sum(-1), torch.ones(()), atol=1e-3)


def test_candidate_block_goldens_are_consistent():
    ops = load("ops")
    scores, blocks = ops["candidates.released.scores"][0, 0].float(), ops["candidates.released.blocks"].long()
    n = scores.numel()
    assert blocks.numel() == 2048 and blocks.unique().numel() == 2048
    newest = (n - 1) // 8
    assert newest in blocks.tolist()  # pinned although partly filled
    best = torch.nn.functional.pad(scores, (0, -n % 8), value=-math.inf).view(-1, 8).amax(-1)
    best[newest] = math.inf
    assert set(blocks.tolist()) == set(best.topk(2048).indices.tolist())
    mask, lens = ops["candidates.prefill.mask"][0], ops["candidates.prefill.compress_lens"][:, 0]
    pad = mask[:, -1:].expand(-1, -mask.size(-1) % 4)  # the last block is partial: repeat its last entry
    kept = torch.cat([mask, pad], -1).view(mask.size(0), -1, 4)
    assert (kept.all(-1) | ~kept.any(-1)).all()  # whole blocks, the newest one's future entries too
    kept = kept.any(-1)
    assert (kept.sum(-1) == torch.clamp((lens + 3) // 4, max=3)).all()  # up to 3 reachable blocks
    assert kept[torch.arange(len(lens)), (lens - 1) // 4].all()  # the newest block is always kept


def test_rope_goldens_are_unit_rotations():
    ops = load("ops")
    for name in ("released", "ced10", "mini6"):
        for kind in ("swa", "compressed"):
            cos, sin = ops[f"rope.{name}.{kind}.cos"], ops[f"rope.{name}.{kind}.sin"]
            assert torch.allclose(cos ** 2 + sin ** 2, torch.ones(()), atol=1e-6)
            assert torch.equal(cos[0], torch.ones_like(cos[0]))  # position 0
    # YaRN only where configured: mini6 has none, so its compressed table is plain theta 160000
    assert ops.meta["rope"]["mini6"]["compressed"]["yarn"] is None
    assert ops.meta["rope"]["released"]["compressed"]["yarn"]["original_seq_len"] == 65536


# --- Engram --------------------------------------------------------------------------------------------

def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.3e24."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    if n in small:
        return True
    if any(n % p == 0 for p in small):
        return False
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def test_real_token_map_has_99092_classes():
    engram = load("engram")
    lookup = real_token_map()
    assert lookup.shape == (129280,) and lookup.max() + 1 == 99092 == engram.meta["real"]["classes"]
    assert token_map_sha256(lookup) == engram.meta["real"]["sha256_int32"]
    assert np.array_equal(lookup[engram["real.spot_ids"].numpy()], engram["real.spot_classes"].numpy())
    first = np.maximum.accumulate(lookup)
    assert (np.diff(first) <= 1).all()  # classes are numbered in first-seen order


def test_tiny_token_map_and_layouts():
    engram = load("engram")
    tiny = engram["tiny.token_map"].numpy()
    assert tiny.shape == (512,) and tiny.max() + 1 == engram.meta["tiny"]["classes"] < 512
    assert token_map_sha256(tiny) == engram.meta["tiny"]["sha256_int32"]
    for prefix, vocab in (("ced10", 97), ("mini6", 50), ("real.t0", 16_000_000)):
        primes = engram[f"{prefix}.primes"].flatten().tolist()
        # drawn in order: the next unused prime above vocab - 1, restarting per n-gram size, never reused
        assert len(set(primes)) == len(primes) and all(is_prime(p) for p in primes) and min(primes) >= vocab
        offsets = engram[f"{prefix}.offsets"]
        for layer, per_layer in enumerate(engram[f"{prefix}.primes"].flatten(1)):
            assert offsets[layer].tolist() == [0] + per_layer.cumsum(0)[:-1].tolist()
        assert (engram[f"{prefix}.multipliers"] % 2 == 1).all()
    assert engram.meta["released_layout"]["num_embeddings"] == [384006168, 384016682]


@pytest.mark.parametrize("prefix", ["ced10", "mini6", "real.t0", "real.t1", "real.t2"])
def test_hash_ids_land_in_their_own_buckets(prefix):
    engram = load("engram")
    hashes = engram[f"{prefix}.hash_ids"]
    low = engram[f"{prefix}.offsets"]
    high = low + engram[f"{prefix}.primes"].flatten(1)
    assert hashes.shape[:2] == engram[f"{prefix}.input_ids"].shape and hashes.shape[2:] == low.shape
    assert ((hashes >= low) & (hashes < high)).all()


# --- blocks ------------------------------------------------------------------------------------------

def on_fp8_grid(x: torch.Tensor, block: int = 32) -> bool:
    """Every block is e4m3 values times one power of two (what an E8M0-scaled FP8 QDQ leaves)."""
    b = blocks_of(x, block)
    s = torch.exp2(torch.ceil(torch.log2(b.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 448)))
    return torch.equal((b / s).to(torch.float8_e4m3fn).float() * s, b)


def on_fp4_grid(x: torch.Tensor, block: int, e4m3_scale: bool) -> bool:
    b = blocks_of(x, block)
    amax = b.abs().amax(-1, keepdim=True)
    if e4m3_scale:  # QDQ leaves the block's amax at exactly 6 * scale
        s = amax / 6
        if not torch.equal(s.to(torch.float8_e4m3fn).float(), s):
            return False
    else:
        s = torch.exp2(torch.ceil(torch.log2(amax.clamp_min(1e-30) / 6)))
    v = (b / s.clamp_min(1e-30)).abs()
    return bool(((v.unsqueeze(-1) == E2M1).any(-1) | (b == 0)).all())


@pytest.mark.parametrize("config", CONFIGS)
def test_block_goldens_chain_and_hold_their_invariants(config):
    blocks = load(f"blocks_{config}")
    t = text_config(config)
    L, hc, d = len(blocks.meta["input_ids"]), t["hc_mult"], t["hidden_size"]
    engram = set(t["engram_layer_ids"])
    for i in range(t["num_hidden_layers"]):
        p = f"L{i}."
        assert blocks[p + "in.x"].shape == (1, L, hc, d) and blocks[p + "in.x"].dtype == torch.bfloat16
        if i == 0:
            first = blocks[p + ("engram.in.x" if 0 in engram else "in.x")]
            assert torch.equal(first, first[:, :, :1].expand_as(first))  # the embedding, copied hc times
            assert torch.equal(blocks[p + "in.pre_mix"], torch.eye(hc)[0].expand(1, L, hc))  # copy 0
        else:
            nxt = blocks[p + ("engram.in.x" if i in engram else "in.x")]
            assert torch.equal(nxt, blocks[f"L{i - 1}.out.x"])
            assert torch.equal(blocks[p + "in.pre_mix"], blocks[f"L{i - 1}.out.pre_mix"])
        assert torch.equal(blocks[p + "out.pre_mix"], blocks[p + "hc_ffn.pre"])  # handed to the next layer
        for sub in ("hc_attn", "hc_ffn"):
            comb = blocks[f"{p}{sub}.comb"]
            assert torch.allclose(comb.sum(-2), torch.ones(()), atol=1e-5)
        weights = blocks[p + "ffn.gate.weights"]
        if t["num_experts_per_tok"] > 1:  # renormalised to route_scale (upstream skips it for top-1)
            assert torch.allclose(weights.sum(-1), torch.full((L,), t["routed_scaling_factor"]), atol=1e-5)
    last = t["num_hidden_layers"] - 1
    assert blocks["final.hc_pre_collapse.out"].shape == blocks["final.norm"].shape == (1, L, d)
    if "final.hc_pre_collapse.x" in blocks:  # the last FFN's pre collapses the stream: no hc head
        assert torch.equal(blocks["final.hc_pre_collapse.x"], blocks[f"L{last}.out.x"])
        assert torch.equal(blocks["final.hc_pre_collapse.pre_mix"], blocks[f"L{last}.out.pre_mix"])


@pytest.mark.parametrize("config", CONFIGS)
def test_block_goldens_hand_off_the_cross_layer_state(config):
    blocks = load(f"blocks_{config}")
    L = len(blocks.meta["input_ids"])
    for role in blocks.meta["roles"]:
        p, ratio = f"L{role['layer']}.", role["compress_ratio"]
        if not ratio:
            continue
        if role["index_source"] != role["layer"]:  # reuses its index source's picks, window offset included
            assert torch.equal(blocks[p + "state_in.topk_idxs"], blocks[f"L{role['index_source']}.attn.indexer.out"])
        if role["type"] == "candidate_index_source":
            assert torch.equal(blocks[p + "state_in.candidates"],
                               blocks[f"L{role['candidate_source']}.attn.indexer.candidates.out"])
        picks = blocks[f"L{role['index_source']}.attn.indexer.out"]
        valid = picks >= 0
        reach = (torch.arange(1, L + 1) // ratio).view(1, L, 1)
        assert ((picks - L < reach) | ~valid).all()  # prefill: offset L, never an entry not yet complete
    for name, t in blocks.items():
        if name.endswith(("attn.window_kv", "main_kv", "block_kv")):
            assert on_fp8_grid(t), name
        elif name.endswith("attn.compress_kv"):
            assert on_fp4_grid(t, 16, e4m3_scale=True), name
        elif name.endswith(("indexer.q", "indexer.k")):
            assert on_fp4_grid(t, 32, e4m3_scale=False), name


def test_dspark_goldens():
    blocks = load("blocks_ced10")
    t = text_config("ced10")
    k = t["dspark_block_size"]
    step = blocks.under("dspark_step")
    ids = step["dspark.head.output_ids"]
    assert ids.shape == (1, k + 1) and ids[0, 0] == blocks.meta["dspark_step"]["anchor"]
    assert torch.equal(step["dspark.embed.input_ids"], ids[:, 0])
    assert step["dspark.head.logits"].shape == (1, k, t["vocab_size"])
    assert torch.equal(step["dspark.head.logits"].argmax(-1), ids[:, 1:])  # greedy draws, Markov bias included
    assert step["mtp0.in.x"].shape == (1, k, t["hc_mult"], t["hidden_size"])
    ring = blocks.under("dspark_prefill")
    for stage in range(t["num_nextn_predict_layers"]):
        assert ring[f"mtp{stage}.ring_out"].shape == (1, t["sliding_window"], t["head_dim"])


# --- end to end ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config", E2E_CONFIGS)
def test_e2e_goldens_are_consistent(config):
    e2e = load(f"e2e_{config}")
    t = text_config(config)
    for prompt in e2e.meta["prompts"]:
        p = e2e.under(prompt["name"])
        ids = p["ids"]
        assert ids.shape == (prompt["length"],) and ids[0] == 0
        assert p["prefill.logprobs"].shape == (prompt["length"] - 1,) and (p["prefill.logprobs"] <= 0).all()
        assert p["greedy.tokens"][0] == p["prefill.last_logits"].argmax() == p["prefill.argmax"][-1]
        assert (p["greedy.top2_gap"] >= 0).all() and (p["prefill.top2_gap"] >= 0).all()
        n = e2e.meta["new_tokens"]
        assert p["dspark.tokens"].shape == p["dspark.confidence"].shape == (n - 1, t["dspark_block_size"])
        if prompt["split_prefill_len"]:
            assert p["split.logprobs"].shape == (prompt["length"] - prompt["split_prefill_len"],)
        if "prefill.logits" in p:
            lp = p["prefill.logits"].log_softmax(-1)
            assert torch.equal(lp[:-1].gather(-1, ids[1:, None])[:, 0], p["prefill.logprobs"])


def test_noise_covers_every_probe_and_gives_usable_tolerances():
    measured = noise()
    for config in CONFIGS:
        e2e = measured["e2e"][config]
        for probe in ("reordered", "ties", "rounding", "fp32"):
            assert e2e[probe]["prefill_token_logprob"]["n"] > 300
            assert set(measured["blocks"][config][probe]) >= {f"L{i}.out.x" for i in range(6)}
        # the upstream decode bug (fixed in the goldens) is larger than the reference's own decode noise
        assert e2e["decode_vs_prefill"]["token_logprob"]["mean"] < e2e["upstream_decode_bug"]["token_logprob_vs_fixed"]["mean"]
        tol = e2e_tolerance(config)
        assert 0 < tol["mean"] < 0.5 and 0 < tol["max"] < 5 and 0 < tol["greedy_gap"] < 2
        bound = block_tolerance(config, "L2.out.x")
        assert 1 <= bound["max"] < 1000 and bound["mean"] < bound["max"]


def test_wide_checkpoint_is_mini6_with_a_topk_wider_than_its_candidates():
    """mini6wide: mini6's tensors (through the shard index) and config, but a Reindex top-k wider than
    the candidate blocks, and no position where a token sees more entries than the top-k, not even
    in a draft block after the golden's greedy tokens: DeepSeek's picks are then every entry a token
    sees, with no choice left among -inf scores (the ties probe moves nothing)."""
    d = checkpoint_dir(WIDE_CONFIG)
    wide, mini6 = text_config(WIDE_CONFIG), text_config("mini6")
    changed = {k for k in wide.keys() | mini6.keys() if wide.get(k) != mini6.get(k)}
    assert changed == {"index_topk", "candidate_topk_blocks", "max_position_embeddings"}  # blocks of 8 as mini6
    assert wide["index_topk"] > wide["candidate_topk_blocks"] * wide["candidate_block_size"]
    rate = wide["compress_ratios"][wide["candidate_source_layer_id"]]
    assert wide["max_position_embeddings"] // rate <= wide["index_topk"]
    e2e = load(f"e2e_{WIDE_CONFIG}")
    longest = max(p["length"] for p in e2e.meta["prompts"]) + e2e.meta["new_tokens"] + wide["dspark_block_size"]
    assert longest <= wide["max_position_embeddings"]
    weight_map = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(weight_map.values()) == {"../mini6/model.safetensors"} and set(weight_map) == set(checkpoint("mini6"))
    ties = noise()["e2e"][WIDE_CONFIG]["ties"]
    assert ties["prefill_token_logprob"]["max"] == 0 and ties["argmax_flips"] == 0


# --- image input (mini6vl, vision.*) -----------------------------------------------------------------

def test_vl_checkpoint_is_mini6_with_a_vision_tower():
    """mini6vl's shard index maps mini6's text tensors to mini6's file and holds the vision tower, the
    span markers and each MoE gate's image-span routing bias, with the reference's names, shapes and
    dtypes (vision.py / model.py: bf16 projections with biases, fp32 norms and bias_vl)."""
    d = checkpoint_dir(VL_CONFIG)
    cfg = json.loads((d / "config.json").read_text())
    mini6 = json.loads((checkpoint_dir("mini6") / "config.json").read_text())
    assert {k: v for k, v in cfg["text_config"].items() if k != "engram_compressed_vocab_size"} == \
        {k: v for k, v in mini6["text_config"].items() if k != "engram_compressed_vocab_size"}
    v = cfg["vision_config"]
    tok = json.loads((d / "tokenizer.json").read_text())
    assert [t["id"] for t in tok["added_tokens"] if t["content"] == "<｜deepseek_image｜>"] == [cfg["image_token_id"]]
    weight_map = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    text = checkpoint("mini6")
    assert {k for k, f in weight_map.items() if f == "../mini6/model.safetensors"} == set(text)
    with safe_open(d / "model-vision.safetensors", "pt") as f:
        own = {k: f.get_tensor(k) for k in f.keys()}
    assert {k for k, f in weight_map.items() if f == "model-vision.safetensors"} == set(own)
    dim, inter, p, r, out = (v["hidden_size"], v["intermediate_size"], v["patch_size"], v["downsample_ratio"],
                             cfg["text_config"]["hidden_size"])
    bf16, fp32 = torch.bfloat16, torch.float32
    want = {"vision.patch_embed.proj.weight": (bf16, (dim, 3 * p * p)), "vision.patch_embed.proj.bias": (bf16, (dim,)),
            "vision.norm.weight": (fp32, (dim,)), "aligner.w1.weight": (bf16, (out, dim * r * r)),
            "aligner.w1.bias": (bf16, (out,)), "aligner.w2.weight": (bf16, (out, out)), "aligner.w2.bias": (bf16, (out,)),
            "image_start": (bf16, (out,)), "image_end": (bf16, (out,)), "image_newline": (bf16, (out,))}
    for b in range(v["num_hidden_layers"]):
        q = f"vision.blocks.{b}."
        want.update({q + "norm1.weight": (fp32, (dim,)), q + "norm2.weight": (fp32, (dim,)),
                     q + "attn.wqkv.weight": (bf16, (3 * dim, dim)), q + "attn.wqkv.bias": (bf16, (3 * dim,)),
                     q + "attn.wo.weight": (bf16, (dim, dim)), q + "attn.wo.bias": (bf16, (dim,)),
                     q + "mlp.w1.weight": (bf16, (2 * inter, dim)), q + "mlp.w2.weight": (bf16, (dim, inter))})
    for gate in [k for k in text if k.endswith("ffn.gate.bias")]:
        want[gate + "_vl"] = (fp32, tuple(text[gate].shape))
    assert {k: (t.dtype, tuple(t.shape)) for k, t in own.items()} == want


def test_vision_goldens_are_consistent():
    g = load("vision")
    for name, settings in g.meta["grids"].items():
        rows = g[f"grids.{name}"]
        p, r = settings["vision_patch_size"], settings["vision_downsample_ratio"]
        llm_h, llm_w, height, width, vit_h, vit_w = rows[:, 2:8].unbind(1)
        assert torch.equal(vit_h * p, height) and torch.equal(vit_w * p, width)
        assert torch.equal(llm_h, -(-vit_h // r)) and torch.equal(llm_w, -(-vit_w // r))
        assert int((llm_h * (llm_w + 1) + 2).max()) <= settings["vision_max_n_token"]
        assert int(llm_h.min()) >= 1 and int(llm_w.min()) >= 1
    ids, types = g["prompt.ids"], g["prompt.token_types"]
    assert torch.equal(ids[types >= 0], torch.full_like(ids[types >= 0], g.meta["image_token_id"]))
    assert (ids[types < 0] != g.meta["image_token_id"]).all()
    for j, meta in enumerate(g.meta["images"]):
        span = g[f"image{j}.types"]
        assert torch.equal(types[meta["start"]:meta["start"] + meta["span"]], span)
        h, w = meta["vit_grid"]
        assert g[f"image{j}.vit"].shape[0] == h * w
        assert g[f"image{j}.aligner"].shape[0] == int((span == 1).sum()) == -(-h // 3) * -(-w // 3)
    n = ids.numel()
    assert g["prompt.prefill.logprobs"].shape == (n - 1,) and g["prompt.greedy.tokens"].shape == (g.meta["new_tokens"],)
    assert g["prompt.split.logprobs"].shape == (n - g.meta["prompt"]["split_prefill_len"],)
    tol = vision_e2e_tolerance()
    assert 0 < tol["mean"] < 0.5 and 0 < tol["max"] < 5 and 0 < tol["greedy_gap"] < 2
    for j in range(len(g.meta["images"])):
        bound = vision_tolerance(f"image{j}.aligner")
        assert 1 <= bound["max"] < 100 and bound["mean"] < bound["max"]


# --- the helpers the implementers' tests use ---------------------------------------------------------

def test_ulp_error_counts_bf16_ulps():
    x = torch.tensor([1.0, -1.5, 1.25, 2 ** -10], dtype=torch.bfloat16)
    assert ulp_error(x, x).max() == 0
    y = x.float() + torch.tensor([2 ** -7, -(2 ** -7), 2 ** -6, 2 ** -8])
    # one and two ulps at 1.0-2.0; the tiny element counts in ulps of the RMS (~1.1): 2^-8 is half an ulp
    assert ulp_error(y.to(torch.bfloat16), x).tolist() == [1.0, 1.0, 2.0, 0.5]
    assert ulp_error(y, x.float(), mantissa_bits=23)[0] == 2 ** 16


def test_topk_comparison_allows_only_tied_swaps():
    score = torch.tensor([[5.0, 3.0, 3.0, 1.0]])
    assert topk_boundary_ties(score, 2).tolist() == [True]
    assert same_topk_picks(score, torch.tensor([[0, 1]]), torch.tensor([[0, 2]])).all()  # tie at the boundary
    assert not same_topk_picks(score, torch.tensor([[0, 1]]), torch.tensor([[0, 3]])).any()
    assert not same_topk_picks(score, torch.tensor([[0, 1]]), torch.tensor([[0, -1]])).any()
