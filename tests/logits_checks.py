"""SamplingParams' logit ops on a backend against transformers' logits processors on the same logits
(tests/unit: cpu; tests/conformance: nvidia's Triton kernels through the interpreter; tests/ascend:
the torch_npu shim): the same adjusted logits (1e-6 relative, the same -inf entries), the same greedy
token, and tokens drawn by the backend's `sample` op distributed as softmax of transformers' scores
(chi-square, p > 1e-3 on fixed seeds, and no token transformers gives probability 0)."""

from __future__ import annotations

import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
                                                    NoBadWordsLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                                                    SequenceBiasLogitsProcessor, TemperatureLogitsWarper)

from deepinfer.core.logits import banned_after

VOCAB = 24
DRAWS = 2000
PROMPT = [3, 5, 5, 11]
OUTPUT = [7, 11, 11, 2, 5]
EOS = [0, 1]


def _logits(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, VOCAB, generator=gen) * 2.0


def _pools(acc, prompt, output):
    counts = torch.zeros(3, VOCAB, dtype=torch.int32, device=acc.device)
    prompt_mask = torch.zeros(3, VOCAB, dtype=torch.bool, device=acc.device)
    prompt_mask[2, torch.tensor(prompt)] = True
    acc.count_tokens(counts, torch.full((len(output),), 2, device=acc.device), torch.tensor(output, device=acc.device))
    return counts, prompt_mask


def _penalize(acc, logits, rep=1.0, freq=0.0, pres=0.0):
    counts, prompt_mask = _pools(acc, PROMPT, OUTPUT)  # the request's row is 2 of a 3-row pool
    f = lambda v: torch.tensor([v], dtype=torch.float32, device=acc.device)  # noqa: E731
    return acc.apply_penalties(logits, counts, prompt_mask, torch.tensor([2], device=acc.device), f(rep), f(freq), f(pres))


def _bias(acc, logits, bias: dict):
    ids = torch.tensor([list(bias)], dtype=torch.int64, device=acc.device)
    values = torch.tensor([list(bias.values())], dtype=torch.float32, device=acc.device)
    return acc.apply_logit_bias(logits, ids, values)


def _hf_ids():
    return torch.tensor([PROMPT + OUTPUT])


def cases():
    """(name, temperature, ours(acc, logits) -> adjusted logits the sampler divides by T,
    theirs(logits) -> transformers' scores, whose softmax the sample must follow)."""
    ids = _hf_ids()
    bad_words = [[4], [11, 9], [2, 5, 13], [6, 6]]  # after ... 11, 2, 5: bans 4 and 13
    out = [
        ("repetition_penalty", 1.0, lambda acc, x: _penalize(acc, x, rep=1.4),
         lambda x: RepetitionPenaltyLogitsProcessor(1.4)(ids, x.clone())),
        ("repetition_penalty<1", 0.8, lambda acc, x: _penalize(acc, x, rep=0.6),
         lambda x: TemperatureLogitsWarper(0.8)(ids, RepetitionPenaltyLogitsProcessor(0.6)(ids, x.clone()))),
        # OpenAI's definition (transformers has no processor for these two)
        ("frequency_presence", 1.0, lambda acc, x: _penalize(acc, x, freq=0.7, pres=-0.4),
         lambda x: x - 0.7 * torch.bincount(torch.tensor(OUTPUT), minlength=VOCAB).float()
         - (-0.4) * (torch.bincount(torch.tensor(OUTPUT), minlength=VOCAB) > 0).float()),
        ("min_p", 0.7, lambda acc, x: acc.apply_min_p(x, torch.tensor([0.15], device=acc.device),
                                                      torch.tensor([0.7], device=acc.device)),
         lambda x: MinPLogitsWarper(0.15)(ids, TemperatureLogitsWarper(0.7)(ids, x.clone()))),
        ("bad_words", 1.0, lambda acc, x: _bias(acc, x, {t: float("-inf") for t in banned_after(OUTPUT, bad_words)}),
         lambda x: NoBadWordsLogitsProcessor(bad_words, eos_token_id=EOS)(ids, x.clone())),
        ("logit_bias", 1.0, lambda acc, x: _bias(acc, x, {4: 2.5, 9: -3.0, 17: 100.0 - 97.5}),
         lambda x: SequenceBiasLogitsProcessor({(4,): 2.5, (9,): -3.0, (17,): 2.5})(ids, x.clone())),
        ("min_tokens", 1.0, lambda acc, x: _bias(acc, x, {t: float("-inf") for t in EOS}),
         lambda x: MinNewTokensLengthLogitsProcessor(len(PROMPT), len(OUTPUT) + 1, EOS)(ids, x.clone())),
        # vLLM's order: bias, then penalties, then temperature and min-p
        ("composed", 0.9,
         lambda acc, x: acc.apply_min_p(_penalize(acc, _bias(acc, x, {4: 1.5, 8: -2.0}), rep=1.3),
                                        torch.tensor([0.05], device=acc.device), torch.tensor([0.9], device=acc.device)),
         lambda x: MinPLogitsWarper(0.05)(ids, TemperatureLogitsWarper(0.9)(ids, RepetitionPenaltyLogitsProcessor(1.3)(
             ids, SequenceBiasLogitsProcessor({(4,): 1.5, (8,): -2.0})(ids, x.clone()))))),
    ]
    return out


def check_case(acc, name, temperature, ours, theirs, seed: int) -> None:
    logits = _logits(seed)
    adjusted = ours(acc, logits.to(acc.device)).cpu()
    expected = theirs(logits)  # transformers' scores (tempered where it tempers)
    tempered = adjusted / temperature
    assert torch.equal(torch.isinf(tempered), torch.isinf(expected)), f"{name}: different tokens masked"
    finite = ~torch.isinf(expected)
    err = float((tempered[finite] - expected[finite]).abs().max())
    assert err <= 1e-6 * float(expected[finite].abs().max()), f"{name}: max abs err {err:.2e}"
    # greedy: the backend's sample op at temperature 0 on the adjusted logits
    one = lambda v, dtype=torch.float32: torch.tensor([v], dtype=dtype, device=acc.device)  # noqa: E731
    greedy = acc.sample(adjusted.to(acc.device), one(0.0), one(-1, torch.int64), one(1.0), one(seed, torch.int64),
                        one(0, torch.int64))
    assert int(greedy) == int(expected.argmax()), f"{name}: greedy token {int(greedy)} != {int(expected.argmax())}"
    # sampled: DRAWS counter-based draws (one seed, DRAWS positions) against softmax(transformers' scores)
    rows = adjusted.to(acc.device).expand(DRAWS, -1).contiguous()
    full = lambda v, dtype=torch.float32: torch.full((DRAWS,), v, dtype=dtype, device=acc.device)  # noqa: E731
    tokens = acc.sample(rows, full(temperature), full(-1, torch.int64), full(1.0), full(seed, torch.int64),
                        torch.arange(DRAWS, device=acc.device)).cpu()
    probs = expected.softmax(-1)[0].double()
    observed = torch.bincount(tokens, minlength=VOCAB).double()
    assert float(observed[probs == 0].sum()) == 0, f"{name}: sampled a token transformers masks"
    keep = probs * DRAWS >= 5  # chi-square's rule of thumb; the rest pooled into one bin
    obs = torch.cat([observed[keep], observed[~keep].sum().view(1)])
    exp = torch.cat([probs[keep] * DRAWS, (probs[~keep] * DRAWS).sum().view(1)])
    if float(exp[-1]) < 5:
        obs, exp = obs[:-1], exp[:-1]
    exp = exp * obs.sum() / exp.sum()  # sums equal to rounding, as chisquare requires
    p_value = chisquare(obs.numpy(), exp.numpy()).pvalue
    print(f"\n{name}: max abs err {err:.1e}, chi-square p {p_value:.3f}", end="")
    assert p_value > 1e-3, f"{name}: sampled distribution differs from transformers' (chi-square p = {p_value:.2e})"


def check_all(acc) -> None:
    for i, (name, temperature, ours, theirs) in enumerate(cases()):
        check_case(acc, name, temperature, ours, theirs, seed=100 + i)


def check_op_conformance(acc) -> None:
    """Each op on the backend against the cpu reference on a batch with pass-through rows (-1 pool rows,
    min_p 0, greedy rows), repeated bias ids and -inf entries: penalties within 1e-6 relative (the
    order of x - f * c - p may fuse on a GPU), the rest exact."""
    from deepinfer.backends import reference as ref

    gen = torch.Generator().manual_seed(7)
    batch, vocab, pool = 6, 3000, 5
    x = torch.randn(batch, vocab, generator=gen) * 3
    counts = (torch.randint(0, 4, (pool, vocab), generator=gen) * (torch.rand(pool, vocab, generator=gen) < 0.1)).int()
    prompt_mask = torch.rand(pool, vocab, generator=gen) < 0.05
    rows = torch.tensor([0, -1, 4, 1, 0, 2])
    rep = torch.tensor([1.3, 1.0, 0.7, 1.1, 2.0, 1.0])
    freq = torch.tensor([0.5, 0.0, -0.3, 1.0, 2.0, 0.0])
    pres = torch.tensor([0.2, 0.0, 1.0, -1.0, 0.0, 0.3])
    d = lambda *ts: [t.to(acc.device) for t in ts]  # noqa: E731
    out = acc.apply_penalties(*d(x, counts, prompt_mask, rows, rep, freq, pres)).cpu()
    expected = ref.apply_penalties(x, counts, prompt_mask, rows, rep, freq, pres)
    assert float((out - expected).abs().max()) <= 1e-6 * float(expected.abs().max())
    assert torch.equal(out[1], x[1])
    min_p = torch.tensor([0.1, 0.0, 0.5, 0.05, 1.0, 0.3])
    temp = torch.tensor([1.0, 1.0, 0.5, 0.0, 2.0, 0.8])
    out = acc.apply_min_p(*d(x, min_p, temp)).cpu()
    assert torch.equal(out, ref.apply_min_p(x, min_p, temp)) and torch.equal(out[1], x[1]) and torch.equal(out[3], x[3])
    ids = torch.randint(-1, vocab, (batch, 9), generator=gen)
    ids[0, 1] = ids[0, 0] = 17  # a repeated id sums
    values = torch.randn(batch, 9, generator=gen)
    values[2, 3] = float("-inf")
    out = acc.apply_logit_bias(*d(x, ids, values)).cpu()
    expected = ref.apply_logit_bias(x, ids, values)
    assert torch.equal(out.isinf(), expected.isinf())
    finite = expected.isfinite()
    assert float((out[finite] - expected[finite]).abs().max()) <= 1e-6 * float(expected[finite].abs().max())
    assert abs(float(out[0, 17] - x[0, 17] - values[0, 0] - values[0, 1])) < 1e-5
    tokens = torch.tensor([5, 5, 7, 9, -1, 2999])
    count_rows = torch.tensor([0, 0, 2, -1, 3, 4])
    mine, theirs = counts.clone().to(acc.device), counts.clone()
    acc.count_tokens(mine, *d(count_rows, tokens))
    ref.count_tokens(theirs, count_rows, tokens)
    assert torch.equal(mine.cpu(), theirs) and int(theirs[0, 5] - counts[0, 5]) == 2
