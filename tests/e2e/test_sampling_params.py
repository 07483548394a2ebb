"""vLLM's SamplingParams fields end to end: penalties, logit bias, bad words and min_tokens give
transformers' greedy generate with the same processors; the same tokens with step graphs on or off,
multi-step decode on or off, overlapped scheduling on or off and with DSpark drafting; `n` seeded
completions; stop strings kept on request; special tokens; bans inside a grammar."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from deepinfer import LLM, SamplingParams
from tiny_models import add_random_drafter


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lengths]


def _llm(path, monkeypatch, eager="0", multi_step="8", overlap="0", nextn="0") -> LLM:
    monkeypatch.setenv("DEEPINFER_ENFORCE_EAGER", eager)
    monkeypatch.setenv("DEEPINFER_MULTI_STEP_DECODE", multi_step)
    monkeypatch.setenv("DEEPINFER_ZERO_OVERHEAD_SCHEDULING", overlap)
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", nextn)
    return LLM(path, max_num_seqs=8, max_num_batched_tokens=512, num_cache_pages=64)


def _tokens(llm, prompts, params) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _hf_generate(hf, prompt: list[int], max_new_tokens: int, **processors) -> list[int]:
    from transformers import GenerationConfig

    from v3_oracle import single_thread

    gc = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                          **processors)
    hf.generation_config.eos_token_id = None
    with torch.no_grad(), single_thread():
        out = hf.generate(torch.tensor([prompt]), generation_config=gc)
    return out[0, len(prompt):].tolist()


# The batch every mode runs: penalized, biased and banned greedy rows, a seeded sampled row with
# min_p and penalties, and a plain greedy row beside them (multi-step would take it alone).
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.5),
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, frequency_penalty=1.2, presence_penalty=0.5,
                   logit_bias={7: 3.0, 9: -100.0}),
    SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True, seq_seed=11, min_p=0.05, repetition_penalty=1.2,
                   frequency_penalty=0.3),
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, allowed_token_ids=list(range(100, 300)),
                   presence_penalty=1.5),
]
PROMPT_LENGTHS = [5, 40, 70, 12, 33]


@pytest.fixture(scope="module")
def reference_run(tiny_model_dir):
    """The batch on an engine with graphs, multi-step decode 8, synchronous steps, no drafting."""
    mp = pytest.MonkeyPatch()
    try:
        llm = _llm(tiny_model_dir[0], mp)
        yield llm, _tokens(llm, _prompts(PROMPT_LENGTHS, 1), PARAMS)
    finally:
        mp.undo()


def test_greedy_penalties_equal_transformers(tiny_model_dir, reference_run):
    """repetition_penalty and logit_bias against transformers' generate(repetition_penalty=...,
    sequence_bias=...) on the same checkpoint (RepetitionPenaltyLogitsProcessor over prompt and output)."""
    _, hf = tiny_model_dir
    llm, ref = reference_run
    prompts = _prompts(PROMPT_LENGTHS, 1)
    plain = ref[3]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    assert ref[0] != _tokens(llm, prompts[:1], greedy)[0], "the penalty changed nothing"
    assert ref[0] == _hf_generate(hf, prompts[0], 24, repetition_penalty=1.5)
    biased = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3,
                            logit_bias={int(plain[0]): -4.0, 21: 2.0})
    assert _tokens(llm, prompts[3:4], biased)[0] == _hf_generate(
        hf, prompts[3], 16, repetition_penalty=1.3, sequence_bias={(int(plain[0]),): -4.0, (21,): 2.0})
    assert all(100 <= t < 300 for t in ref[4]) and 9 not in ref[1]


def test_frequency_and_presence_follow_the_counts(reference_run):
    """OpenAI's definition on the engine's own raw log-probs (top_logprobs report the unadjusted
    distribution): each greedy token maximises logprob - f * count - p * (count > 0) over the output so far."""
    llm, _ = reference_run
    prompt = _prompts([9], 3)
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, frequency_penalty=0.8,
                            presence_penalty=0.6, top_logprobs=vocab)
    out = llm.generate(prompt_token_ids=prompt, sampling_params=params, use_tqdm=False)[0].outputs[0]
    for i, token in enumerate(out.token_ids):
        counts = torch.bincount(torch.tensor(out.token_ids[:i], dtype=torch.int64), minlength=vocab).float()
        logprobs = torch.full((vocab,), float("-inf"))
        for t, lp in out.logprobs[i].items():
            logprobs[t] = lp
        adjusted = logprobs - 0.8 * counts - 0.6 * (counts > 0).float()
        assert token == int(adjusted.argmax()), f"token {i}"
    assert len(set(out.token_ids)) > 1


@pytest.mark.parametrize("mode", [dict(eager="1"), dict(multi_step="1"), dict(overlap="1")],
                         ids=["graphs-off", "multi-step-off", "overlap"])
def test_same_tokens_in_every_step_mode(tiny_model_dir, reference_run, monkeypatch, mode):
    _, ref = reference_run
    llm = _llm(tiny_model_dir[0], monkeypatch, **mode)
    assert _tokens(llm, _prompts(PROMPT_LENGTHS, 1), PARAMS) == ref
    # alone, a penalized row gives what it gave in the batch (batch-invariant counts and ops)
    assert _tokens(llm, _prompts(PROMPT_LENGTHS, 1)[1:2], PARAMS[1:2])[0] == ref[1]


@pytest.fixture(scope="module")
def drafter_dir(tiny_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_v4_sampling_dspark")
    shutil.copytree(tiny_model_dir[0], path, dirs_exist_ok=True)
    add_random_drafter(path, seed=5)
    return path


def test_drafting_keeps_penalized_greedy_tokens(drafter_dir, monkeypatch, tmp_path):
    """DSpark verifies a penalized request against the penalized target, with the counts each draft
    position would have: greedy tokens equal those without drafting."""
    monkeypatch.setenv("DEEPINFER_DECODE_PERF_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "0")
    prompts = _prompts([20, 45, 8], 5)
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, repetition_penalty=1.6,
                             frequency_penalty=0.4),
              SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, presence_penalty=1.0, min_tokens=30,
                             logit_bias={5: 2.0}),
              SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)]
    off = _tokens(_llm(drafter_dir, monkeypatch, nextn="0"), prompts, params)
    drafting = _llm(drafter_dir, monkeypatch, nextn="3")
    assert drafting.engine.spec is not None
    assert _tokens(drafting, prompts, params) == off
    assert drafting.engine.spec.stats["verified"] > 0  # drafts really were verified


def test_n_seeded_completions(reference_run):
    llm, _ = reference_run
    prompt = _prompts([10], 7)
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seq_seed=42, n=3, presence_penalty=0.5)
    outs = llm.generate(prompt_token_ids=prompt, sampling_params=params, use_tqdm=False)
    assert len(outs) == 1 and [c.index for c in outs[0].outputs] == [0, 1, 2]
    samples = [c.token_ids for c in outs[0].outputs]
    assert len({tuple(s) for s in samples}) > 1  # each completion its own seed
    again = llm.generate(prompt_token_ids=prompt, sampling_params=params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == samples  # reproducible
    one = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seq_seed=43, presence_penalty=0.5)
    assert _tokens(llm, prompt, one)[0] == samples[1]  # completion i samples with seq_seed + i


def test_min_tokens_and_stop_strings(reference_run):
    llm, _ = reference_run
    prompt = _prompts([15], 9)
    free = llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(
        temperature=0.0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    stop_id = free.token_ids[2]
    early = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id])
    assert len(_tokens(llm, prompt, early)[0]) == 3
    late = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id], min_tokens=10)
    tokens = _tokens(llm, prompt, late)[0]
    assert len(tokens) >= 10 and stop_id not in tokens[:10]
    stop = free.text[4:7]
    if stop.strip():
        kept = llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(
            temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
            use_tqdm=False)[0].outputs[0]
        dropped = llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(
            temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop]), use_tqdm=False)[0].outputs[0]
        assert kept.text == dropped.text + stop and kept.text.endswith(stop)


def test_skip_special_tokens(reference_run):
    llm, _ = reference_run
    bos = llm.engine.tokenizer.bos_token_id
    prompt = _prompts([6], 2)
    forced = dict(temperature=0.0, max_tokens=4, ignore_eos=True, allowed_token_ids=[bos])
    shown = llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(**forced, skip_special_tokens=False),
                         use_tqdm=False)[0].outputs[0]
    hidden = llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(**forced),
                          use_tqdm=False)[0].outputs[0]
    assert shown.token_ids == hidden.token_ids == [bos] * 4
    assert hidden.text == "" and shown.text == "<|bos|>" * 4


def test_bad_words_never_generated(reference_run):
    """A single-token and a multi-token bad word (its last token banned after the others), vLLM's
    spellings (as written and after a space)."""
    llm, _ = reference_run
    tok = llm.engine.tokenizer
    prompt = _prompts([12], 4)
    free = _tokens(llm, prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
    word = tok.decode(free[3:5])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, bad_words=[word])
    tokens = _tokens(llm, prompt, params)[0]
    for seq in tok.bad_words_ids([word]):
        n = len(seq)
        assert all(tokens[i:i + n] != seq for i in range(len(tokens) - n + 1)), (seq, tokens)
    assert tokens[:3] == free[:3]


def test_bans_compose_with_a_grammar(reference_run):
    """logit_bias under a grammar (a regex): the output still matches it and never holds the banned token."""
    import re

    llm, _ = reference_run
    so_args = {"schema_type": "regex", "schema": "[a-c]{8}"}
    free = llm.generate(["x"], SamplingParams(temperature=0.0, max_tokens=20, so_args=so_args),
                        use_tqdm=False)[0].outputs[0]
    assert re.fullmatch("[a-c]{8}", free.text)
    banned = free.token_ids[0]
    out = llm.generate(["x"], SamplingParams(temperature=0.0, max_tokens=20, logit_bias={banned: -100.0},
                                              so_args=so_args), use_tqdm=False)[0].outputs[0]
    assert banned not in out.token_ids and re.fullmatch("[a-c]{8}", out.text), out.text


def test_bad_input_names_the_field(reference_run):
    llm, _ = reference_run
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(prompt_token_ids=[[1, 2]], sampling_params=SamplingParams(logit_bias={vocab: 1.0}))
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate(prompt_token_ids=[[1, 2]], sampling_params=SamplingParams(allowed_token_ids=[vocab + 5]))
    assert _tokens(llm, [[1, 2]], SamplingParams(temperature=0.0, max_tokens=2))  # the engine still serves
