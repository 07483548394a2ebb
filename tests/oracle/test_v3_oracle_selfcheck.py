"""The V3 oracle (tests/v3_oracle.py) agrees with itself: transformers' logits for a position do
not depend on how the sequence was cut into steps (full prefill, chunked prefill through a
DynamicCache, decode one token at a time, a mixed-batch schedule), and its greedy decode is what
transformers' generate() produces. Measured ~1e-6 relative (printed with -s); SELF_TOL leaves
two orders of headroom below the 1e-4 deepinfer is held to. A last test shows the comparison
catches a cache that loses its history."""

from __future__ import annotations

import pytest
import torch

from tiny_models_v3 import CONFIGS, make_hf_model
from v3_oracle import (chunked_logits, full_logits, greedy_decode, hf_generate, prompts, rel_err,
                       schedule_logits, single_thread)

SELF_TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def hf(request, one_thread):
    return make_hf_model(request.param, seed=3)[0]


def _check(what, out, ref, tol=SELF_TOL):
    err = rel_err(out, ref)
    print(f"{what}: max rel err {err:.1e}")
    assert out.shape == ref.shape
    assert err <= tol, f"{what}: rel err {err:.2e} > {tol}"


def test_chunked_prefill_equals_full(hf):
    (p,) = prompts(hf.config.vocab_size, [530], seed=2)
    chunks = [7, 61, 1, 128, 33, 200, 100]  # uneven, a 1-token chunk inside the prompt
    _check("chunked", chunked_logits(hf, p, chunks), full_logits(hf, p))


def test_decode_equals_full(hf):
    (p,) = prompts(hf.config.vocab_size, [330], seed=3)
    tokens, logits = greedy_decode(hf, p, steps=16, prefill_chunks=[200, 130])
    seq = torch.cat([p, torch.tensor(tokens[:-1])])
    ref = full_logits(hf, seq)
    _check("prefill+decode", logits, ref)
    assert tokens == ref[len(p) - 1:].argmax(-1).tolist()


def test_mixed_schedule_equals_full(hf):
    """Sequences at different phases share steps; sequence 1 decodes past its 45-token prompt."""
    ps = prompts(hf.config.vocab_size, [301, 45, 420], seed=4)
    steps = [[(0, 290), (1, 5)], [(0, 11), (1, 30), (2, 150)], [(0, 1), (1, 10), (2, 250)],
             [(1, 1), (2, 19), (0, 1)], [(1, 1), (2, 1)], [(1, 1), (2, 1)], [(1, 1)], [(1, 1)]]
    for s, (tokens, logits) in enumerate(schedule_logits(hf, ps, steps)):
        n = sum(k for step in steps for seq, k in step if seq == s)
        assert len(tokens) == n and torch.equal(tokens[:min(n, len(ps[s]))], ps[s][:n])
        _check(f"mixed seq {s} ({n} tokens)", logits, full_logits(hf, tokens))


def test_greedy_decode_is_generate(hf):
    (p,) = prompts(hf.config.vocab_size, [300], seed=5)
    tokens, _ = greedy_decode(hf, p, steps=12)
    assert tokens == hf_generate(hf, p, 12)


def test_a_cache_that_loses_history_is_caught(hf):
    """Chunks that each start a fresh cache (positions restart, earlier tokens unseen) must fail
    the same comparison by a wide margin: the tolerance is not too loose to notice."""
    (p,) = prompts(hf.config.vocab_size, [300], seed=6)
    broken = torch.cat([chunked_logits(hf, p[i:i + 100], [100]) for i in range(0, 300, 100)])
    assert rel_err(broken, full_logits(hf, p)) > 1e-2
