"""Held-out perplexity of a shipped model: each of the 16 held-out CPython files on its own (bos +
its first 1024 tokens), scored through prompt_logprobs, against an add-one unigram baseline of the
same tokenizer. tests/e2e/test_shipped_model.py bounds it; benchmarks/heldout.py stores it (the
figure docs/shipped-models.md and the model card quote)."""

from __future__ import annotations

import collections
import math
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def corpus():
    """(train, validation, held-out) (name, text) lists of tools/train_tiny.py's corpus."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    try:
        from train_tiny import collect_corpus
    finally:
        sys.path.pop(0)
    return collect_corpus()


def heldout_perplexity(llm, max_tokens: int = 1024) -> dict:
    from deepinfer import SamplingParams

    _, train, held = corpus()
    tok = llm.tokenizer
    docs = [tok.encode(text)[:max_tokens] for _, text in held]
    outs = llm.generate(prompt_token_ids=docs, sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    nll = count = 0
    for doc, out in zip(docs, outs):
        for pos in range(1, len(doc)):
            nll -= out.prompt_logprobs[pos][doc[pos]]
            count += 1
    # unigram baseline of the same tokenizer: add-one smoothed counts over (part of) the training split
    counts = collections.Counter()
    for _, text in train[::10]:
        counts.update(tok.encode(text))
    total, vocab = sum(counts.values()), llm.engine.model_config.vocab_size
    unigram = math.exp(-sum(math.log((counts[t] + 1) / (total + vocab)) for d in docs for t in d[1:]) / count)
    return dict(files=len(docs), tokens=count, perplexity=math.exp(nll / count), unigram_perplexity=unigram)
