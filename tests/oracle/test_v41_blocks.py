"""DeepSeek-V4.1, level 2 (blocks): each of deepinfer's blocks alone on the inputs DeepSeek's reference
recorded (tests/goldens/v41: blocks_<config>), against the outputs it recorded, in bf16 ulps
(`ulp_error`), within `block_tolerance` (README "Tolerances, level 2": twice what the reference's own
noise probes reached on that tensor).

deepinfer keeps the reference's bf16 rounding points and its 64-index online softmax, so the strict
bound (probes=SAME_DTYPE_PROBES) applies wherever the block selects the same compressed entries:

| block | picks | bound | measured worst (max / mean ulps, bit-equal share) |
|---|---|---|---|
| every layer, ced10 and mini6 | the reference's (recorded) | strict, e.g. ced10 L2 max 8 mean 1.46 | max 1, mean 0.0001; >= 99.9% of elements bit-equal (all but ced10 L5, mini6 L2: exact) |
| every layer | its own (ties at the k-th score break towards the earlier entry) | default (with the fp32 probe), e.g. ced10 L6 max 80.8 mean 6.2 | ced10 L4 max 11 / L6 max 14.5 (one query each with a tie at the cutoff, as the reference records), mini6 L3 max 6; means <= 0.11 |
| Engram (L1, L4 / L0, L3) | | strict | exact |
| final collapse, norm, head (logits) | | exact (float32) | exact |
| DSpark step: context row, ring write, 3 stages (ced10) / 1 stage (mini6), head + Markov, confidence | | strict | every tensor exact; logits, confidence within 2.4e-7 (fp32) |

A block that breaks the lagged hyper-connection schedule (collapsing with its own pre instead of the
previous sub-layer's) lands thousands of ulps out: `test_a_wrong_schedule_is_caught`.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.models.deepseek_v41.model import bf16
from v41_goldens import CONFIGS, SAME_DTYPE_PROBES, block_tolerance, load, ulp_error
from v41_models import model, run_block


def layers(config: str) -> list[int]:
    return list(range(model(config).config.num_hidden_layers))


CASES = [(c, i) for c in CONFIGS for i in layers(c)]


def within(actual: torch.Tensor, expected: torch.Tensor, bound: dict) -> bool:
    err = ulp_error(actual, expected)
    got = {"max": float(err.max()), "p999": float(err.quantile(0.999)), "mean": float(err.mean())}
    return all(got[k] <= bound[k] for k in got)


def bit_equal_share(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.to(expected.dtype) == expected).float().mean())


@pytest.mark.parametrize("config,layer", CASES)
def test_block_with_the_reference_picks_is_within_the_strict_bound(config, layer):
    g = load(f"blocks_{config}")
    x, pre = run_block(model(config), config, layer, recorded_picks=True)
    assert within(x, g[f"L{layer}.out.x"][0], block_tolerance(config, f"L{layer}.out.x", SAME_DTYPE_PROBES))
    pre_bound = block_tolerance(config, f"L{layer}.out.pre_mix", SAME_DTYPE_PROBES)
    assert within(pre, g[f"L{layer}.out.pre_mix"][0], pre_bound)
    assert bit_equal_share(x, g[f"L{layer}.out.x"][0]) >= 0.99  # what keeping the rounding points buys


@pytest.mark.parametrize("config,layer", CASES)
def test_block_with_its_own_picks_is_within_the_bound(config, layer):
    g = load(f"blocks_{config}")
    x, _ = run_block(model(config), config, layer)
    assert within(x, g[f"L{layer}.out.x"][0], block_tolerance(config, f"L{layer}.out.x"))


def test_the_block_types_are_the_reference_roles():
    for config in CONFIGS:
        roles = load(f"blocks_{config}").meta["roles"]
        cfg = model(config).config
        mine = [r.block_type for r in cfg.roles]
        assert mine == [r["type"] for r in roles]
        for r, role in zip(roles, cfg.roles):
            if r["compress_ratio"]:
                assert (role.kv_source, role.index_source) == (r["kv_source"], r["index_source"])


@pytest.mark.parametrize("config", CONFIGS)
def test_engram_blocks(config):
    m, g = model(config), load(f"blocks_{config}")
    cfg = m.config
    for i in cfg.engram_layer_ids:
        p = f"L{i}.engram."
        ids = g[p + "hash_ids"][0]
        hashes = torch.zeros(ids.shape[0], len(cfg.engram_layer_ids), ids.shape[1], dtype=torch.int64)
        hashes[:, cfg.engram_layer_ids.index(i)] = ids
        with torch.inference_mode():
            out = m._engram(i, g[p + "in.x"][0].float(), hashes)
        assert within(out, g[p + "out"][0], block_tolerance(config, f"L{i}.engram.out", SAME_DTYPE_PROBES))
        assert bit_equal_share(out, g[p + "out"][0]) == 1.0


@pytest.mark.parametrize("config", ["ced10"])
def test_final_collapse_and_head(config):
    m, g = model(config), load(f"blocks_{config}")
    x, pre = g["final.hc_pre_collapse.x"][0].float(), g["final.hc_pre_collapse.pre_mix"][0].float()
    with torch.inference_mode():
        h = bf16(m.accel.hc_collapse(x, pre))
        logits = m.accel.linear(m.norm(h, m.w["norm.weight"]), m.w["head.weight"])
    assert torch.equal(logits, g["final.logits"][0])


def test_a_wrong_schedule_is_caught():
    """Collapsing the attention input with the layer's own pre (V4's schedule) instead of the previous
    sub-layer's: outside the strict bound and almost no element bit-equal, so the block tests can fail.
    (The residual copies dominate a block's output: a wrong branch moves the mean by ~2.5 ulps here.)"""
    config, layer = "ced10", 3
    m, g = model(config), load(f"blocks_{config}")
    own_pre = g[f"L{layer}.hc_attn.pre"][0].float()
    x, _ = run_block(m, config, layer, recorded_picks=True, pre_in=own_pre)
    expected = g[f"L{layer}.out.x"][0]
    assert not within(x, expected, block_tolerance(config, f"L{layer}.out.x", SAME_DTYPE_PROBES))
    assert bit_equal_share(x, expected) < 0.5


@pytest.mark.parametrize("config", CONFIGS)
def test_dspark_step(config):
    """One DSpark draft step of the reference (blocks_<config>: dspark_step, at start_pos n): the context
    row of position n written into every stage's ring (ring_in -> ring_out), then the block anchored at
    the backbone's next token through every stage, the collapse, the head with the Markov bias, the
    drafted tokens and the confidence logits."""
    from deepinfer.models.deepseek_v41.dspark import DSparkDrafter

    m, g = model(config), load(f"blocks_{config}")
    drafter = DSparkDrafter.create(m, m.extra, max_seqs=2, margin=0)
    step = g.meta["dspark_step"]
    n, anchor = step["start_pos"], step["anchor"]
    s = "dspark_step."
    for k in range(drafter.dcfg.num_stages):
        drafter.kv[k][:drafter.ring] = g[f"{s}mtp{k}.ring_in"][0].float()
    slot = torch.tensor([0])
    with torch.inference_mode():
        ctx = drafter.context(g[s + "dspark.embed.main_hidden"][0].float())
        assert torch.equal(ctx, g[s + "dspark.embed.main_x"][0].float())
        drafter.write_context(ctx, slot, torch.tensor([n]))
        for k in range(drafter.dcfg.num_stages):
            assert torch.equal(drafter.kv[k][:drafter.ring], g[f"{s}mtp{k}.ring_out"][0].float())
        hidden = drafter.draft_block(torch.tensor([anchor]), slot, torch.tensor([n + 1]))[0]
        expected = g[s + "dspark.hc_pre_collapse.out"][0]
        assert within(hidden, expected, block_tolerance(config, f"{s}mtp{drafter.dcfg.num_stages - 1}.out.x",
                                                        SAME_DTYPE_PROBES))
        base, prev, tokens, confidence = drafter.logits(hidden), torch.tensor([anchor]), [], []
        for i in range(drafter.dcfg.block_size):
            e, bias = drafter.markov(prev)
            logits = base[i] + bias[0]
            assert torch.allclose(logits, g[s + "dspark.head.logits"][0, i], rtol=0, atol=1e-5)
            tokens.append(int(logits.argmax()))
            confidence.append(drafter.confidence_logit(hidden[i:i + 1], e, i))
            prev = torch.tensor([tokens[-1]])
    assert tokens == g[s + "dspark.head.output_ids"][0, 1:].tolist()
    assert torch.allclose(torch.cat(confidence), g[s + "dspark.head.confidence"][0], rtol=0, atol=1e-5)
    assert bit_equal_share(hidden, expected) == 1.0
