"""deepinfer's DeepSeek-V4 graph against transformers' DeepseekV4ForCausalLM, in float32.

Causal logits at a position do not depend on how the prompt was cut into steps, so the
reference for every schedule is one full forward of transformers. Tolerance: max |diff|
over all positions <= 1e-4 x max |logit| (measured ~1e-6, see test output with -s).
"""

from __future__ import annotations

import pytest
import torch

from model_runner import build_model, new_cache, run_schedule
from tiny_models import CONFIGS, make_hf_model

TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def models(request):
    hf, cfg = make_hf_model(request.param, seed=3)
    return request.param, hf, build_model(hf, cfg)


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=gen) for n in lengths]


def _reference(hf, prompt: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(prompt.unsqueeze(0)).logits[0].float()


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).abs().max() / ref.abs().max())


def _check(name, hf, outs, prompts, what):
    for prompt, out in zip(prompts, outs):
        err = _rel_err(out, _reference(hf, prompt))
        print(f"{name} {what} len={len(prompt)}: max rel err {err:.2e}")
        assert err <= TOL, f"{what}: rel err {err:.2e} > {TOL}"


def test_full_prefill(models):
    name, hf, model = models
    prompts = _prompts(model.config.vocab_size, [600], seed=1)
    outs = run_schedule(model, new_cache(model), prompts, [[(0, 600)]])
    _check(name, hf, outs, prompts, "full prefill")


def test_chunked_prefill(models):
    name, hf, model = models
    prompts = _prompts(model.config.vocab_size, [530], seed=2)
    # uneven chunks that start and end inside compressor windows and the sliding window
    chunks = [7, 61, 1, 128, 33, 200, 100]
    outs = run_schedule(model, new_cache(model), prompts, [[(0, n)] for n in chunks])
    _check(name, hf, outs, prompts, "chunked prefill")


def test_prefill_then_decode(models):
    name, hf, model = models
    prompts = _prompts(model.config.vocab_size, [330], seed=3)
    steps = [[(0, 200)]] + [[(0, 1)]] * 130
    outs = run_schedule(model, new_cache(model), prompts, steps)
    _check(name, hf, outs, prompts, "prefill+decode")


def test_mixed_batch(models):
    """Sequences of different lengths and phases share steps: one decodes while others prefill."""
    name, hf, model = models
    lengths = [301, 45, 420, 140]
    prompts = _prompts(model.config.vocab_size, lengths, seed=4)
    steps = [[(0, 290), (1, 5)], [(0, 1), (1, 30), (2, 150)], [(0, 1), (1, 1), (2, 250), (3, 140)],
             [(0, 1), (1, 1), (2, 19)], [(0, 1), (1, 1), (2, 1)], [(0, 1), (1, 1)],
             [(0, 1), (1, 1)], [(0, 1), (1, 1)], [(0, 1), (1, 1)], [(0, 1), (1, 1)], [(0, 1), (1, 1)],
             [(0, 1), (1, 1)]]
    seen = [0] * len(lengths)
    for step in steps:
        for s, n in step:
            seen[s] += n
    assert seen == lengths
    outs = run_schedule(model, new_cache(model), prompts, steps)
    _check(name, hf, outs, prompts, "mixed batch")
