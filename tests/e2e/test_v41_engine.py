"""Engine features on DeepSeek-V4.1, through `LLM` on the golden tiny checkpoints (tests/goldens/v41:
ced10, the released schedule in miniature; mini6; mini6wide, a top-k wider than its candidate blocks):
greedy against the reference, continuous batching and batch invariance, preemption, the prefix cache
with bounded replay, the CED split (decoder layers on each prompt's tail), structured outputs, seeded
sampling, lossless DSpark drafting."""

from __future__ import annotations

import random
import re

import pytest

from deepinfer import LLM, SamplingParams
from v41_goldens import checkpoint_dir, e2e_tolerance, load

GREEDY = dict(temperature=0.0, ignore_eos=True)


def model_dir(config: str = "ced10") -> str:
    return str(checkpoint_dir(config))


def prompts(lengths, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[0] + [rng.randint(3, 511) for _ in range(n - 1)] for n in lengths]


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def max_gap(a, b) -> float:
    """Largest |logprob| difference over the tokens both sets of logprobs hold, position by position."""
    return max(abs(x[t] - y[t]) for x, y in zip(a, b) for t in x.keys() & y.keys())


@pytest.fixture
def invariant(monkeypatch):
    """Batch-invariant ops: a row's numbers do not depend on what shares its step (exact comparisons)."""
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")


@pytest.mark.parametrize("config", ["ced10", "mini6", "mini6wide"])
def test_greedy_generation_against_the_reference(config):
    """LLM.generate on the golden prompts, all in one batch: the reference's greedy tokens while its top-2
    gap exceeds the bound (e2e_tolerance: a legitimate flip below it changes what follows)."""
    g = load(f"e2e_{config}")
    bound = e2e_tolerance(config)["greedy_gap"]
    outs = LLM(model_dir(config)).generate(prompt_token_ids=[g[f"p{j}.ids"].tolist() for j in range(5)],
                                           sampling_params=SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)
    checked = 0
    for j, out in enumerate(outs):
        for mine, ref, gap in zip(out.outputs[0].token_ids, g[f"p{j}.greedy.tokens"].tolist(),
                                  g[f"p{j}.greedy.top2_gap"].tolist()):
            if gap <= bound:
                break
            assert mine == ref
            checked += 1
    assert len(outs) == 5 and all(len(o.outputs[0].token_ids) == 12 for o in outs)


def test_continuous_batching_is_batch_invariant(invariant):
    """Requests arriving together, of lengths past the window, the ratio-2 pairs and the candidate blocks,
    some prefilled in chunks (a 64-token budget) while others decode: every request's tokens and
    logprobs equal its run alone, bit for bit."""
    llm = LLM(model_dir(), max_num_seqs=8, max_num_batched_tokens=64)
    ps = prompts([3, 40, 130, 290, 17], seed=1)
    params = SamplingParams(max_tokens=20, top_logprobs=2, **GREEDY)
    together = llm.generate(prompt_token_ids=ps, sampling_params=params, use_tqdm=False)
    for p, out in zip(ps, together):
        alone = llm.generate(prompt_token_ids=[p], sampling_params=params, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
        assert alone.outputs[0].logprobs == out.outputs[0].logprobs


def test_preemption_gives_identical_outputs(invariant):
    ps = prompts([100, 140, 120, 90, 60], seed=2)
    params = SamplingParams(max_tokens=50, top_logprobs=1, **GREEDY)
    roomy = LLM(model_dir(), max_num_seqs=8, max_num_batched_tokens=512, num_cache_pages=64)
    ref = roomy.generate(prompt_token_ids=ps, sampling_params=params, use_tqdm=False)
    tight = LLM(model_dir(), max_num_seqs=8, max_num_batched_tokens=64, num_cache_pages=5)
    outs = tight.generate(prompt_token_ids=ps, sampling_params=params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions >= 3
    assert tokens(outs) == tokens(ref)
    assert tight.engine.cache.num_free_pages == 5


# ------------------------------------------------------------------ prefix cache, CED split


def _llm(monkeypatch, mode: str, keep: int = 140, config: str = "ced10", **kwargs) -> LLM:
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", mode)
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", str(keep))
    return LLM(model_dir(config), **{"max_num_seqs": 8, "max_num_batched_tokens": 512, **kwargs})


HITS = (128, 256, 384)


def _hits_after_priming(llm: LLM) -> list:
    """Cache a 500-token document, then continue it from each hit position: 40 more prompt tokens
    (scored) and 6 greedy tokens."""
    doc = prompts([520], seed=3)[0]
    llm.generate(prompt_token_ids=[doc[:500]], sampling_params=SamplingParams(max_tokens=1), use_tqdm=False)
    llm.generate(prompt_token_ids=prompts([300], seed=4), sampling_params=SamplingParams(max_tokens=1), use_tqdm=False)
    params = SamplingParams(max_tokens=6, top_logprobs=2, prompt_logprobs=2, **GREEDY)
    return llm.generate(prompt_token_ids=[doc[:h + 40] for h in HITS], sampling_params=params, use_tqdm=False)


def _scored(out) -> list:
    return [lp for lp in out.prompt_logprobs if lp is not None] + out.outputs[0].logprobs


def test_prefix_cache_hits_replay_only_the_tail(invariant, monkeypatch):
    """A hit restores the KV sources' pages (compressed entries, index keys) and replays KEEP positions
    for the window rings (and Engram's look-back); compact computes what mask (a full recompute with the
    same masking) computes; off restores nothing and equals a cold run."""
    keep = 16 + 6  # ced10's window + the backtracking margin: the coarsest replay allowed
    compact = _llm(monkeypatch, "compact", keep, max_num_batched_tokens=48)
    outs = _hits_after_priming(compact)
    stats = compact.stats()
    assert stats["prefix_cache_hit_tokens"] == sum(HITS)
    assert stats["prefix_cache_replayed_tokens"] == keep * len(HITS)
    masked = _hits_after_priming(_llm(monkeypatch, "mask", keep))
    exact = _hits_after_priming(_llm(monkeypatch, "off", keep))
    cold = LLM(model_dir(), max_num_seqs=8, max_num_batched_tokens=512)  # no priming: nothing cached
    doc = prompts([520], seed=3)[0]
    params = SamplingParams(max_tokens=6, top_logprobs=2, prompt_logprobs=2, **GREEDY)
    fresh = cold.generate(prompt_token_ids=[doc[:h + 40] for h in HITS], sampling_params=params, use_tqdm=False)
    for h, c, m, e, f in zip(HITS, outs, masked, exact, fresh):
        assert all(lp is None for lp in c.prompt_logprobs[:h + 1]) and c.prompt_logprobs[h + 1] is not None
        assert c.outputs[0].token_ids == m.outputs[0].token_ids, f"hit at {h}"
        assert max_gap(_scored(c), _scored(m)) == 0.0, f"hit at {h}"
        assert e.outputs[0].token_ids == f.outputs[0].token_ids and e.prompt_logprobs == f.prompt_logprobs
        # and the approximation is really there (else the check above proves nothing)
        assert max_gap(_scored(c), [lp for lp in e.prompt_logprobs[h + 1:]] + e.outputs[0].logprobs) > 1e-4


@pytest.mark.parametrize("config", ["ced10", "mini6"])
def test_ced_split_runs_the_decoder_on_the_tail(invariant, monkeypatch, config):
    """Prompts longer than KEEP (140): compact runs the decoder layers (ced10: 7-9; mini6: 4-5) on the
    last 140 positions only, mask computes every row with the same masking, off is exact. Here the tail
    covers the decoder's whole receptive field (decoder layers x window <= 140), so compact equals off
    at the sampled positions, bit for bit; a request with prompt logprobs gets every position."""
    ps = prompts([200, 333, 141], seed=5)
    params = SamplingParams(max_tokens=8, top_logprobs=3, **GREEDY)
    outs = {mode: _llm(monkeypatch, mode, config=config).generate(prompt_token_ids=ps, sampling_params=params,
                                                                  use_tqdm=False)
            for mode in ("compact", "mask", "off")}
    for mode in ("mask", "off"):
        assert tokens(outs["compact"]) == tokens(outs[mode])
        for a, b in zip(outs["compact"], outs[mode]):
            assert a.outputs[0].logprobs == b.outputs[0].logprobs
    scored = SamplingParams(max_tokens=2, prompt_logprobs=1, **GREEDY)
    full = {mode: _llm(monkeypatch, mode, config=config).generate(prompt_token_ids=ps[:1], sampling_params=scored,
                                                                  use_tqdm=False)[0] for mode in ("compact", "off")}
    assert full["compact"].prompt_logprobs == full["off"].prompt_logprobs
    assert all(lp is not None for lp in full["compact"].prompt_logprobs[1:])


def test_ced_split_with_a_short_keep_is_approximate(invariant, monkeypatch):
    """KEEP 22 (window + backtracking) is below the decoder's receptive field (3 layers x 16): compact
    still runs and equals mask, but no longer off: the truncation is real."""
    ps = prompts([200], seed=6)
    params = SamplingParams(max_tokens=4, top_logprobs=2, **GREEDY)
    outs = {mode: _llm(monkeypatch, mode, keep=22).generate(prompt_token_ids=ps, sampling_params=params,
                                                            use_tqdm=False)[0] for mode in ("compact", "mask", "off")}
    assert outs["compact"].outputs[0].logprobs == outs["mask"].outputs[0].logprobs
    assert max_gap(outs["compact"].outputs[0].logprobs[:1], outs["off"].outputs[0].logprobs[:1]) > 1e-4


# ------------------------------------------------------------------ sampling, structure, drafting


def test_seeded_sampling_is_independent_of_the_batch(invariant):
    llm = LLM(model_dir(), max_num_seqs=8)
    ps = prompts([20, 35], seed=7)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=20, ignore_eos=True, seq_seed=1234)
    alone = llm.generate(prompt_token_ids=ps[:1], sampling_params=params, use_tqdm=False)[0]
    others = prompts([70, 5, 33], seed=8)
    mixed = llm.generate(prompt_token_ids=others + ps[:1], use_tqdm=False,
                         sampling_params=[SamplingParams(temperature=1.0, max_tokens=25, ignore_eos=True)] * 3
                         + [params])
    assert alone.outputs[0].token_ids == mixed[-1].outputs[0].token_ids
    other = llm.generate(prompt_token_ids=ps[:1], use_tqdm=False,
                         sampling_params=SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seq_seed=99))
    assert other[0].outputs[0].token_ids != alone.outputs[0].token_ids


def test_structured_outputs():
    llm = LLM(model_dir(), max_num_seqs=16)
    regex = r"[0-9]{3}-[a-z]{2,5}"
    so_args = {"schema_type": "regex", "schema": regex}
    params = [SamplingParams(temperature=1.0, max_tokens=48, seq_seed=s, so_args=so_args) for s in range(8)]
    outs = llm.generate(prompt_token_ids=[[0, 17, 42, 99, 7]] * len(params), sampling_params=params, use_tqdm=False)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        assert re.fullmatch(regex, out.outputs[0].text), out.outputs[0].text


@pytest.mark.parametrize("config", ["ced10", "mini6"])
def test_dspark_drafting_is_lossless(invariant, monkeypatch, config):
    """The checkpoint's DSpark stages draft (fixed length 5 and confidence-scheduled); greedy outputs equal
    those without drafting, and the drafts were really verified. Batch-invariant ops: a verify step
    holds more rows than a plain decode step, and V4.1's bf16 rounding points turn the row-count
    dependence of the fast GEMMs into occasional flips of near-tied greedy tokens."""
    ps = prompts([5, 40, 150, 300], seed=9)
    params = SamplingParams(max_tokens=24, **GREEDY)
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "0")
    plain = tokens(LLM(model_dir(config)).generate(prompt_token_ids=ps, sampling_params=params, use_tqdm=False))
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "5")
    for varlen in ("0", "1"):
        monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", varlen)
        llm = LLM(model_dir(config))
        assert tokens(llm.generate(prompt_token_ids=ps, sampling_params=params, use_tqdm=False)) == plain
        assert llm.stats()["spec_verified"] > 0
