"""Held-out perplexity after a prefix-cache hit on the shipped model: compact replay against the
exact cold run. tests/e2e/test_prefix_cache.py bounds it; `benchmarks/prefix_cache.py --quality`
stores it (the quality table of docs/prefix-cache.md)."""

from __future__ import annotations

import math
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HITS, CONTINUATION, NUM_DOCS = (256, 512, 768), 127, 6


def heldout_quality(llm, keep: int) -> list[dict]:
    """`llm` serves the shipped model with DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE=compact and KEEP
    `keep`. Each of NUM_DOCS held-out files is scored cold (every position computed: mode off's
    numbers, and its pages are left cached), then again from each hit position in HITS; per hit:
    perplexity of the CONTINUATION positions after it, both ways, and compact's per-token logprob
    deviation as a fraction of what dropping all context before the replay start causes."""
    from deepinfer import SamplingParams

    sys.path.insert(0, os.path.join(REPO, "tools"))
    try:
        from train_tiny import collect_corpus
    finally:
        sys.path.pop(0)
    _, _, held = collect_corpus()
    bos = llm.engine.model_config.bos_token_id
    docs = [d for d in (llm.tokenizer.encode(t) for _, t in held) if len(d) > max(HITS) + CONTINUATION][:NUM_DOCS]
    assert len(docs) == NUM_DOCS
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    cold = llm.generate(prompt_token_ids=[d[:max(HITS) + CONTINUATION + 1] for d in docs], sampling_params=params,
                        use_tqdm=False)
    warm = llm.generate(prompt_token_ids=[d[:h + CONTINUATION] for h in HITS for d in docs], sampling_params=params,
                        use_tqdm=False)
    assert llm.stats()["prefix_cache_hit_tokens"] == len(docs) * sum(HITS)
    cut = llm.generate(prompt_token_ids=[[bos] + d[h - keep:h + CONTINUATION] for h in HITS for d in docs],
                       sampling_params=params, use_tqdm=False)
    rows = []
    for j, h in enumerate(HITS):
        positions = range(h + 1, h + CONTINUATION)
        exact, hit, truncated = [], [], []
        for d, c, w, t in zip(docs, cold, warm[j * len(docs):], cut[j * len(docs):]):
            exact += [c.prompt_logprobs[p][d[p]] for p in positions]
            hit += [w.prompt_logprobs[p][d[p]] for p in positions]
            truncated += [t.prompt_logprobs[p - h + keep + 1][d[p]] for p in positions]
        off, compact = math.exp(-sum(exact) / len(exact)), math.exp(-sum(hit) / len(hit))
        deviation = sum(abs(a - b) for a, b in zip(hit, exact))
        rows.append(dict(keep=keep, hit=h, ppl_off=off, ppl_compact=compact, rel_change=(compact - off) / off,
                         deviation_fraction=deviation / sum(abs(a - b) for a, b in zip(truncated, exact))))
    return rows
