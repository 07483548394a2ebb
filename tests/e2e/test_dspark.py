"""DSpark speculative decoding is lossless: greedy outputs equal outputs without drafting, token
for token; sampled outputs follow the target's distribution; rejected drafts leave no trace in
the decode state."""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from scipy.stats import chisquare

from deepinfer import LLM, SamplingParams
from deepinfer.core.speculative.decoder import SpecDecoder
from tiny_models import CONFIGS, add_random_drafter

MODES = {"off": ("0", "0"), "fixed": ("5", "0"), "dynamic": ("5", "1")}


@pytest.fixture(scope="module")
def spec_model_dir(tiny_model_dir, tmp_path_factory):
    """The 'mixed_hc4_yarn' tiny model (window 32, CSA rate 4, HCA rate 64) + a random 2-stage drafter."""
    path = tmp_path_factory.mktemp("tiny_v4_dspark")
    shutil.copytree(tiny_model_dir[0], path, dirs_exist_ok=True)
    add_random_drafter(path, seed=5)
    return path


@pytest.fixture(autouse=True)
def perf_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DEEPINFER_DECODE_PERF_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "decode_perf"))


def _llm(path, monkeypatch, mode: str, **kw) -> LLM:
    nextn, varlen = MODES[mode]
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", nextn)
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", varlen)
    kw = {"max_num_seqs": 8, "max_num_batched_tokens": 256, **kw}
    llm = LLM(path, **kw)
    if mode == "dynamic":
        # the step-cost table timed at start-up depends on the machine's load (shared cores in CI):
        # tests plan with a fixed one where a verify token costs 1/128 of a step, so drafting pays
        from deepinfer.core.speculative.planner import StepCost

        llm.engine.spec.planner.cost = StepCost([1, 65], [1.0, 1.5])
    return llm


def _mixed_batch(seed: int = 0, n: int = 8):
    """Prompts that cross the window (32) and CSA/HCA windows; greedy and sampled requests mixed."""
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(n):
        prompts.append([0] + [rng.randint(3, 511) for _ in range(rng.choice([3, 30, 61, 100, 140]))])
        if i % 3 == 2:
            params.append(SamplingParams(temperature=0.9, top_k=50, max_tokens=rng.randint(20, 70),
                                         seq_seed=rng.getrandbits(64), ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=rng.randint(20, 90), ignore_eos=True,
                                         stop_token_ids=[rng.randint(3, 511)] if i % 4 == 3 else None))
    return prompts, params


def _tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                                          use_tqdm=False)]


def test_off_costs_nothing(spec_model_dir, monkeypatch):
    """NEXTN=0 on a checkpoint with a drafter: no drafter, no ring margin, overlapped steps kept."""
    monkeypatch.setenv("DEEPINFER_ZERO_OVERHEAD_SCHEDULING", "1")  # the cpu backend's default is off
    llm = _llm(spec_model_dir, monkeypatch, "off")
    assert llm.engine.spec is None
    view = llm.engine.model.view(llm.engine.cache)
    assert view.ring == 32 and all(layer.margin == 0 for layer in view.layers)
    assert llm.engine.zero_overhead and not llm.engine._needs_sync()
    on = _llm(spec_model_dir, monkeypatch, "fixed")
    # max(0, NEXTN + 1) of margin
    assert on.engine.spec is not None and on.engine.model.view(on.engine.cache).ring == 32 + 6


def test_unset_nextn_follows_the_backend(spec_model_dir, monkeypatch):
    """Unset DEEPINFER_USE_NEXTN_DECODE: the cpu backend does not draft (measured slower than plain
    steps there); a backend that drafts by default does, with the default length 5."""
    from deepinfer.backends.cpu import CpuAccelerator

    monkeypatch.delenv("DEEPINFER_USE_NEXTN_DECODE", raising=False)
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "0")
    llm = LLM(spec_model_dir, max_num_seqs=4)
    assert llm.engine.spec is None and llm.engine.model.view(llm.engine.cache).ring == 32
    monkeypatch.setattr(CpuAccelerator, "speculative_decoding", True)
    drafting = LLM(spec_model_dir, max_num_seqs=4)
    assert drafting.engine.spec is not None and drafting.engine.spec.max_draft == 5


@pytest.mark.parametrize("mode", ["fixed", "dynamic"])
def test_greedy_equals_no_drafting_random_drafter(spec_model_dir, monkeypatch, mode):
    prompts, params = _mixed_batch()
    reference = _tokens(_llm(spec_model_dir, monkeypatch, "off"), prompts, params)
    llm = _llm(spec_model_dir, monkeypatch, mode)
    got = _tokens(llm, prompts, params)
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    assert [got[i] for i in greedy] == [reference[i] for i in greedy]
    assert [len(got[i]) for i in range(len(got))] == [len(r) for r in reference]
    stats = llm.engine.spec.stats
    assert stats["verified"] > 100  # drafting really happened; random drafts are nearly all rejected


def test_dynamic_steps_that_skip_drafting_overlap(spec_model_dir, monkeypatch):
    """With a cost table where only near-certain drafts pay, dynamic mode drafts for new requests
    (survival 1.0), then stops: those steps skip the drafter and go back to zero-overhead
    (overlapped) scheduling; outputs stay the no-drafting ones throughout."""
    from deepinfer.core.speculative.planner import StepCost

    monkeypatch.setenv("DEEPINFER_ZERO_OVERHEAD_SCHEDULING", "1")  # the cpu backend's default is off
    prompts, params = _mixed_batch(seed=6)
    reference = _tokens(_llm(spec_model_dir, monkeypatch, "off"), prompts, params)
    llm = _llm(spec_model_dir, monkeypatch, "dynamic")
    engine = llm.engine
    engine.spec.planner.cost = StepCost([1, 65], [1.0, 33.0])  # a verify token costs half a step
    drafting = []
    plan = engine._plan
    monkeypatch.setattr(engine, "_plan", lambda chunks, draft=True: drafting.append(draft) or plan(chunks, draft))
    got = _tokens(llm, prompts, params)
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    assert [got[i] for i in greedy] == [reference[i] for i in greedy]
    assert engine.spec.stats["verified"] > 0 and drafting.count(False) > drafting.count(True) > 0


def _oracle_drafts(monkeypatch, continuation: dict[tuple, list[int]], seed: int):
    """Replace the drafter by one that proposes the true greedy continuation, corrupted at a random
    slot (sometimes none): partial acceptances of every length, rejections that cross compressor
    windows, and the rollback they need."""
    rng = random.Random(seed)

    def draft(self, reqs, depth):
        drafts = []
        for r in reqs:
            full = continuation.get(tuple(r.prompt_token_ids), [])
            pos = r.num_computed + 1 - len(r.prompt_token_ids)
            d = (full[pos:pos + depth] + [3] * depth)[:depth]
            wrong = rng.randint(0, depth)
            if wrong < depth:
                d[wrong] = (d[wrong] + 1) % 512
            drafts.append(d)
        survival = torch.rand(len(reqs), depth, generator=torch.Generator().manual_seed(rng.randint(0, 99)))
        return drafts, [None] * len(reqs), survival.sort(dim=1, descending=True).values

    monkeypatch.setattr(SpecDecoder, "_draft", draft)


@pytest.mark.parametrize("mode", ["fixed", "dynamic"])
def test_partial_acceptance_and_rollback(spec_model_dir, monkeypatch, mode):
    """Accepted prefixes of every length give the no-drafting outputs; and after a run full of
    rejections, continuing a request equals a fresh run from its committed tokens."""
    prompts, params = _mixed_batch(seed=1)
    params = [SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True) for _ in prompts]
    reference = _tokens(_llm(spec_model_dir, monkeypatch, "off"), prompts, params)
    _oracle_drafts(monkeypatch, {tuple(p): r for p, r in zip(prompts, reference)}, seed=2)
    llm = _llm(spec_model_dir, monkeypatch, mode)
    assert _tokens(llm, prompts, params) == reference
    stats = llm.engine.spec.stats
    assert stats["accepted"] > 0.4 * stats["verified"] and stats["accepted"] < stats["verified"]

    # continue each request 40 more tokens after the drafted run vs a fresh prefill of prompt + 80 outputs
    more = [SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True) for _ in prompts]
    ref_long = _tokens(_llm(spec_model_dir, monkeypatch, "off"), prompts, more)
    _oracle_drafts(monkeypatch, {tuple(p): r for p, r in zip(prompts, ref_long)}, seed=3)
    continued = _tokens(_llm(spec_model_dir, monkeypatch, mode), prompts, more)
    monkeypatch.undo()
    fresh = _tokens(_llm(spec_model_dir, monkeypatch, "off"), [p + r[:80] for p, r in zip(prompts, continued)],
                    [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True) for _ in prompts])
    assert [c[80:] for c in continued] == fresh


def test_preemption_and_abort_while_drafting(spec_model_dir, monkeypatch):
    """A cache too small for the batch forces preemption (recompute) between drafting steps, and
    aborts free slots mid-run: the surviving greedy outputs are still the no-drafting ones."""
    prompts, _ = _mixed_batch(seed=4, n=10)
    params = [SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True) for _ in prompts]

    def run(mode):
        llm = _llm(spec_model_dir, monkeypatch, mode, num_cache_pages=7, max_num_batched_tokens=192)
        engine = llm.engine
        reqs = [engine.add_request(p, sp, request_id=str(i)) for i, (p, sp) in enumerate(zip(prompts, params))]
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
            if steps == 25:
                engine.abort_request("3")
        engine.pop_finished()
        assert engine.cache.num_free_pages == engine.cache.num_pages
        return [r.output_token_ids for r in reqs if r.request_id != "3"], engine.scheduler.num_preemptions

    reference, _ = run("off")
    _oracle_drafts(monkeypatch, {tuple(p): r for p, r in zip(prompts[:3] + prompts[4:], reference)}, seed=5)
    got, preemptions = run("fixed")
    assert got == reference and preemptions > 0


def test_structured_outputs_with_drafts(spec_model_dir, monkeypatch):
    """One bitmask row per draft position: greedy grammar-constrained outputs are unchanged."""
    prompts = [[0, 17, 42, 99, 7], [0, 5] * 20]
    params = [SamplingParams(temperature=0.0, max_tokens=40, so_args={"schema_type": "regex", "schema": rx})
              for rx in (r"[0-9]{3}-[a-z]{2,12}", r"(yes|no|maybe)( [A-Z]+){0,4}")]
    reference = _tokens(_llm(spec_model_dir, monkeypatch, "off"), prompts, params)
    _oracle_drafts(monkeypatch, {tuple(p): r for p, r in zip(prompts, reference)}, seed=4)
    llm = _llm(spec_model_dir, monkeypatch, "fixed")
    assert _tokens(llm, prompts, params) == reference
    assert llm.engine.spec.stats["accepted"] > 0


@pytest.fixture(scope="module")
def vocab16_dir(tmp_path_factory):
    """A model with a 16-token vocabulary: the target's distribution over the first generated
    tokens can be enumerated exactly."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = dict(CONFIGS["csa_hc2"], vocab_size=16)
    torch.manual_seed(3)
    hf = DeepseekV4ForCausalLM(DeepseekV4Config(**cfg)).float().eval()
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for key, t in hf.state_dict().items():
            if key.endswith("tid2eid"):
                t.copy_(torch.stack([torch.randperm(cfg["n_routed_experts"], generator=gen)[:2] for _ in range(16)]))
            elif t.is_floating_point() and t.dim() >= 2:
                t.copy_(torch.randn(t.shape, generator=gen) * 0.15)
    path = tmp_path_factory.mktemp("vocab16")
    hf.save_pretrained(path, safe_serialization=True)
    add_random_drafter(path, seed=9, target_layer_ids=(0, 2), markov_rank=4, num_stages=1)
    return path, hf


PROMPT16 = [0, 5, 9, 3, 12, 7, 7, 4]


def _exact_marginals(hf, temperature: float, top_k: int):
    """P(second token) and P(third token) under the target, by enumerating the tokens before them."""
    def dist(logits):
        logits = logits / temperature
        if top_k > 0:
            kth = logits.topk(top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return torch.softmax(logits, -1)

    with torch.no_grad():
        p1 = dist(hf(torch.tensor([PROMPT16])).logits[0, -1])
        ctx2 = torch.tensor([PROMPT16 + [a] for a in range(16)])
        p2 = dist(hf(ctx2).logits[:, -1])  # [a, b]
        ctx3 = torch.tensor([PROMPT16 + [a, b] for a in range(16) for b in range(16)])
        p3 = dist(hf(ctx3).logits[:, -1]).view(16, 16, 16)
    joint12 = p1[:, None] * p2
    return joint12.sum(0), (joint12[:, :, None] * p3).sum((0, 1))


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 6)])
def test_sampled_distribution_matches_target(vocab16_dir, monkeypatch, temperature, top_k):
    """Chi-square goodness of fit of the 2nd and 3rd generated tokens (the first drafted positions)
    against the enumerated target marginals: 3000 fixed seq_seeds, each test must have p > 0.001."""
    path, hf = vocab16_dir
    n = 3000
    llm = _llm(path, monkeypatch, "fixed", max_num_seqs=64, max_num_batched_tokens=512)
    # max_tokens 5: the first drafting step verifies 3 drafts, so the 3rd token is often a chained draft
    params = [SamplingParams(temperature=temperature, top_k=top_k, max_tokens=5, seq_seed=s, ignore_eos=True)
              for s in range(n)]
    outs = _tokens(llm, [PROMPT16] * n, params)
    stats = llm.engine.spec.stats
    assert 0.1 * stats["verified"] < stats["accepted"] < 0.9 * stats["verified"]  # both branches exercised
    m2, m3 = _exact_marginals(hf, temperature, top_k)
    for k, marginal in ((1, m2), (2, m3)):
        counts = torch.bincount(torch.tensor([o[k] for o in outs]), minlength=16).double()
        expected = marginal.double() * n
        impossible = expected == 0  # e.g. outside every context's top-k: must never be drawn
        assert counts[impossible].sum() == 0, (k, counts)
        counts, expected = counts[~impossible], expected[~impossible]
        keep = expected >= 5  # pool rare cells so the chi-square approximation holds
        pooled = [counts[~keep].sum().view(1), expected[~keep].sum().view(1)] if bool((~keep).any()) else None
        f_obs = torch.cat([counts[keep]] + pooled[:1] if pooled else [counts[keep]]).numpy()
        f_exp = torch.cat([expected[keep]] + pooled[1:] if pooled else [expected[keep]]).numpy()
        f_exp = f_exp * f_obs.sum() / f_exp.sum()
        assert chisquare(f_obs, f_exp).pvalue > 1e-3, (k, f_obs, f_exp)


SHIPPED_PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\nclass Config:\n    def __init__(self",
                   "    for key, value in sorted(items):\n", "\"\"\"Utilities for parsing", "x = [",
                   "class Queue:\n    \"\"\"A FIFO queue.\"\"\"\n\n    def put(self, item):\n        "]


@pytest.mark.parametrize("mode", ["fixed", "dynamic"])
def test_shipped_model_greedy_equals_no_drafting(monkeypatch, mode):
    """The trained drafter shipped with tiny-dsv4: a mixed batch (lengths, max_tokens, a stop token,
    logprobs) is token-for-token the no-drafting output, and drafts are accepted."""
    from deepinfer.llm import TINY_DSV4_DIR

    params = [SamplingParams(temperature=0.0, max_tokens=24 + 12 * i, ignore_eos=True, top_logprobs=1 if i == 1 else 0,
                             stop_token_ids=[25] if i == 3 else None) for i in range(len(SHIPPED_PROMPTS))]
    off = _llm(TINY_DSV4_DIR, monkeypatch, "off").generate(SHIPPED_PROMPTS, params, use_tqdm=False)
    llm = _llm(TINY_DSV4_DIR, monkeypatch, mode)
    on = llm.generate(SHIPPED_PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    assert [o.outputs[0].finish_reason for o in on] == [o.outputs[0].finish_reason for o in off]
    lp_on, lp_off = on[1].outputs[0].logprobs, off[1].outputs[0].logprobs
    assert len(lp_on) == len(lp_off) and all(abs(a[t] - b[t]) < 1e-3 for a, b, t in
                                            zip(lp_on, lp_off, on[1].outputs[0].token_ids))
    stats = llm.engine.spec.stats
    assert stats["accepted"] > 0.1 * stats["verified"]
