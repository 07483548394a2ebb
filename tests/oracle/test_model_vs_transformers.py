"""deepinfer's model graphs against transformers, in float32: DeepSeek-V4 (DeepseekV4ForCausalLM)
and DeepSeek-V3 (DeepseekV3ForCausalLM), each on tiny random configs.

Causal logits at a position do not depend on how the prompt was cut into steps, so the
reference for every schedule is one full forward of transformers. Tolerance: max |diff|
over all positions <= 1e-4 x max |logit| (measured ~1e-6, see test output with -s).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import tiny_models
import tiny_models_v3
from model_runner import build_model, new_cache, run_schedule
from v3_oracle import single_thread

TOL = 1e-4
# (family, config name) -> (transformers model maker, context its forward runs in). transformers'
# eager V3 MoE is hundreds of tiny ops: one thread runs it in seconds on a loaded machine.
MODELS = {("v4", name): (tiny_models.make_hf_model, contextlib.nullcontext) for name in tiny_models.CONFIGS} | \
         {("v3", name): (tiny_models_v3.make_hf_model, single_thread) for name in tiny_models_v3.CONFIGS}


@pytest.fixture(scope="module", params=sorted(MODELS), ids="/".join)
def models(request):
    make, context = MODELS[request.param]
    hf, cfg = make(request.param[1], seed=3)
    return "/".join(request.param), hf, build_model(hf, cfg), context


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=gen) for n in lengths]


def _reference(hf, prompt: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(prompt.unsqueeze(0)).logits[0].float()


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).abs().max() / ref.abs().max())


def _check(models, outs, prompts, what):
    name, hf, _, context = models
    for prompt, out in zip(prompts, outs):
        with context():
            err = _rel_err(out, _reference(hf, prompt))
        print(f"{name} {what} len={len(prompt)}: max rel err {err:.2e}")
        assert err <= TOL, f"{what}: rel err {err:.2e} > {TOL}"


def test_full_prefill(models):
    model = models[2]
    prompts = _prompts(model.config.vocab_size, [600], seed=1)
    outs = run_schedule(model, new_cache(model), prompts, [[(0, 600)]])
    _check(models, outs, prompts, "full prefill")


def test_chunked_prefill(models):
    model = models[2]
    prompts = _prompts(model.config.vocab_size, [530], seed=2)
    # uneven chunks that start and end inside compressor windows, the sliding window and pages
    chunks = [7, 61, 1, 128, 33, 200, 100]
    outs = run_schedule(model, new_cache(model), prompts, [[(0, n)] for n in chunks])
    _check(models, outs, prompts, "chunked prefill")


def test_prefill_then_decode(models):
    model = models[2]
    prompts = _prompts(model.config.vocab_size, [330], seed=3)
    steps = [[(0, 200)]] + [[(0, 1)]] * 130
    outs = run_schedule(model, new_cache(model), prompts, steps)
    _check(models, outs, prompts, "prefill+decode")


def test_mixed_batch(models):
    """Sequences of different lengths and phases share steps: one decodes while others prefill."""
    model = models[2]
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
    _check(models, outs, prompts, "mixed batch")
