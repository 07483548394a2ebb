"""The tiered prefix store across server processes (docs/kv-store.md): a `deepinfer serve --kv-store
file:///dir` computes a prompt and is stopped; a second server started on the same directory serves
the prompt's prefix from L3 (its /metrics count the L3 hit) and computes what the first computed
after a hit in its own pool (exactly), which is the cold run's output within the prefix cache's
quality bound (tiny-dsv4 replays the window under compact replay: approximate by design,
docs/prefix-cache.md)."""

from __future__ import annotations

import math
import os
import sys

import pytest

from conftest import REPO, running_server
from deepinfer.core.tokenizer import Tokenizer
from deepinfer.llm import TINY_DSV4_DIR

PAGE = 128  # tiny-dsv4's page
HIT = 3 * PAGE  # the prompt's cached prefix
KEEP = 140  # DEEPINFER_YOCO_PREFILL_KEEP_TOKENS' default: replay starts HIT - KEEP
MORE = 128  # prompt tokens after the hit, scored (tests/prefix_quality.py scores 127)
# tests/e2e/test_prefix_cache.py's bounds on compact replay (measured here: 0.04% and 0.15): the
# continuation's perplexity within 0.2% of the cold run's, and its per-token logprob deviation from the
# cold run at most a quarter of what dropping all context before the replay start causes
PPL_REL_BOUND = 0.002
DEVIATION_FRACTION_BOUND = 0.25


def _complete(server, prompt: list[int]) -> tuple[list[float | None], list[str]]:
    """Greedy 6 tokens of `prompt` (token ids): (logprob of every prompt and output token, None where a
    prompt position was restored, not computed), the output tokens."""
    status, body = server.post("/v1/completions", {"model": "tiny-dsv4", "prompt": prompt, "max_tokens": 6,
                                                   "temperature": 0.0, "echo": True, "logprobs": 1,
                                                   "ignore_eos": True})
    assert status == 200, body
    lp = body["choices"][0]["logprobs"]
    return lp["token_logprobs"], lp["tokens"][len(prompt):]


@pytest.mark.slow  # two server start-ups: 50-100 s on 2 cores
def test_a_second_server_serves_the_prefix_from_the_file_store(tmp_path):
    bos = 0
    tokenizer = Tokenizer(TINY_DSV4_DIR, bos_token_id=bos)
    sys.path.insert(0, os.path.join(REPO, "tools"))
    try:
        from train_tiny import collect_corpus  # the held-out files the shipped models never saw
    finally:
        sys.path.pop(0)
    _, _, held = collect_corpus()
    doc = next(d for d in (tokenizer.encode(t) for _, t in held) if len(d) > HIT + MORE)
    prompt = [bos] + doc[:HIT + MORE - 1]
    args = ("--model", TINY_DSV4_DIR, "--kv-store", f"file://{tmp_path}", "--max-num-seqs", "2")
    env = {"DEEPINFER_USE_NEXTN_DECODE": "0"}
    with running_server(*args, env=env) as first:
        cold, cold_out = _complete(first, prompt)
        warm_l1, l1_out = _complete(first, prompt)  # a hit in its own pool
        metrics = first.metrics()
        assert metrics['deepinfer:kv_store_hit_tokens_total{tier="L1"}'] == HIT
        assert metrics["deepinfer:kv_store_written_pages_total"] >= HIT // PAGE
    assert sum(len(files) for _, _, files in os.walk(tmp_path)) >= HIT // PAGE  # its pages outlive it

    with running_server(*args, env=env) as second:
        warm_l3, l3_out = _complete(second, prompt)
        truncated, _ = _complete(second, [bos] + prompt[HIT - KEEP:])  # no hit: another first token
        metrics = second.metrics()
    assert metrics['deepinfer:kv_store_hit_tokens_total{tier="L3"}'] == HIT
    assert metrics['deepinfer:kv_store_hit_tokens_total{tier="L1"}'] == 0
    assert metrics["deepinfer:kv_store_bad_records_total"] == 0

    # the restored positions were not computed; the first after the hit was
    assert all(lp is None for lp in warm_l3[1:HIT + 1]) and warm_l3[HIT + 1] is not None
    # an L3 hit computes what an L1 hit of the same length computes
    assert l3_out == l1_out
    assert max(abs(a - b) for a, b in zip(warm_l3[HIT + 1:], warm_l1[HIT + 1:])) < 1e-5
    # and the cold run's output within compact replay's bound
    assert l3_out == cold_out
    scored = range(HIT + 1, len(prompt))  # the prompt positions after the hit
    deviation = sum(abs(warm_l3[i] - cold[i]) for i in scored)
    dropped = sum(abs(truncated[i - (HIT - KEEP) + 1] - cold[i]) for i in scored)  # truncated[0] is its bos
    ppl_cold, ppl_hit = (math.exp(-sum(x[i] for i in scored) / len(scored)) for x in (cold, warm_l3))
    assert abs(ppl_hit - ppl_cold) / ppl_cold < PPL_REL_BOUND
    assert deviation > 0  # compact replay does approximate here (else the bound below checks nothing)
    assert deviation < DEVIATION_FRACTION_BOUND * dropped, (deviation, dropped)
