"""End-to-end generation through LLM, on the tiny DeepSeek-V4 and DeepSeek-V3 models: equality with
transformers, preemption, leaks, bad input."""

from __future__ import annotations

import random

import pytest
import torch

from tiny_models import hf_greedy
from deepinfer import LLM, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def llm(family_model_dir):
    path, _ = family_model_dir
    return LLM(path, max_num_seqs=8, max_num_batched_tokens=256, num_cache_pages=64)


def _assert_matches_hf(hf, prompts, outputs, max_tokens):
    for prompt, out in zip(prompts, outputs):
        ref = hf_greedy(hf, prompt, max_tokens)
        ours = out.outputs[0].token_ids
        if ours != ref:
            i = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)
            lp = out.outputs[0].logprobs[i]
            gap = abs(lp[ours[i]] - lp.get(ref[i], float("-inf")))
            # a genuine near-tie flips argmax on float noise; anything else is a bug
            assert gap < 1e-4, f"diverged at token {i}: ours {ours[i]} vs transformers {ref[i]}, logprob gap {gap}"


def test_greedy_matches_transformers_mixed_batch(llm, family_model_dir):
    _, hf = family_model_dir
    # V4: past the 32-token window, several CSA windows and the 64-token HCA windows; V3: past a page
    prompts = _prompts(512, [3, 50, 130, 290], seed=1)
    params = SamplingParams(max_tokens=40, top_logprobs=1, **GREEDY)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 4
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
    _assert_matches_hf(hf, prompts, outs, 40)


def test_preemption_gives_identical_outputs(family_model_dir):
    path, hf = family_model_dir
    prompts = _prompts(512, [100, 140, 120, 90, 60], seed=2)
    params = SamplingParams(max_tokens=50, top_logprobs=1, **GREEDY)
    roomy = LLM(path, max_num_seqs=8, max_num_batched_tokens=512, num_cache_pages=64)
    ref = roomy.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    # 5 pages for 5 sequences that each need 2 pages at the end: the scheduler must preempt
    tight = LLM(path, max_num_seqs=8, max_num_batched_tokens=64, num_cache_pages=5)
    outs = tight.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions >= 2
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in ref]
    assert tight.engine.cache.num_free_pages == 5
    _assert_matches_hf(hf, prompts[:2], outs[:2], 50)


def test_prompt_logprobs_match_transformers(llm, family_model_dir):
    _, hf = family_model_dir
    # the first prompt takes three prefill chunks under the 256-token budget and shares its last
    # step with the second one, whose rows follow it in the logits
    prompts = _prompts(512, [600, 100], seed=3)
    params = SamplingParams(max_tokens=3, prompt_logprobs=2, ignore_eos=True)  # sampled: EOS could end it early
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=[params, params], use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for pos in range(1, len(prompt)):
            entry = out.prompt_logprobs[pos]
            assert abs(entry[prompt[pos]] - float(ref[pos - 1, prompt[pos]])) < 1e-4
            assert len(entry) >= 2  # the actual token plus the top 2 (which may include it)
        assert len(out.outputs[0].token_ids) == 3
    free = llm.generate(prompt_token_ids=prompts[1:], sampling_params=SamplingParams(max_tokens=2), use_tqdm=False)
    assert free[0].prompt_logprobs is None


def test_seeded_sampling_is_independent_of_batch(llm):
    prompts = _prompts(512, [20, 35], seed=4)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=20, ignore_eos=True, seq_seed=1234)
    alone = llm.generate(prompt_token_ids=prompts[:1], sampling_params=params, use_tqdm=False)[0]
    others = _prompts(512, [70, 5, 33], seed=5)
    mixed = llm.generate(prompt_token_ids=others + prompts[:1],
                         sampling_params=[SamplingParams(temperature=1.0, max_tokens=25, ignore_eos=True)] * 3 + [params],
                         use_tqdm=False)[-1]
    assert alone.outputs[0].token_ids == mixed.outputs[0].token_ids
    different = llm.generate(prompt_token_ids=prompts[:1], use_tqdm=False,
                             sampling_params=SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True,
                                                            seq_seed=99))[0]
    assert different.outputs[0].token_ids != alone.outputs[0].token_ids


def test_stops(llm):
    prompt = _prompts(512, [10], seed=6)[0]
    free = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=30, **GREEDY),
                        use_tqdm=False)[0].outputs[0]
    stop_id = free.token_ids[5]
    first = free.token_ids.index(stop_id)
    out = llm.generate(prompt_token_ids=[prompt], use_tqdm=False,
                       sampling_params=SamplingParams(max_tokens=30, stop_token_ids=[stop_id], **GREEDY))[0].outputs[0]
    assert out.token_ids == free.token_ids[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    # a stop string is cut from the text
    text = free.text
    needle = text[len(text) // 2:len(text) // 2 + 3]
    if needle.strip():
        out = llm.generate(prompt_token_ids=[prompt], use_tqdm=False,
                           sampling_params=SamplingParams(max_tokens=30, stop=[needle], **GREEDY))[0].outputs[0]
        assert out.finish_reason == "stop" and out.text == text[:text.index(needle)]


def test_max_model_len_stops_generation(family_model_dir):
    path, _ = family_model_dir
    small = LLM(path, max_num_seqs=2, max_model_len=64, num_cache_pages=8)
    out = small.generate(prompt_token_ids=[list(range(2, 52))],
                         sampling_params=SamplingParams(max_tokens=100, **GREEDY), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 14


@pytest.mark.parametrize("temperatures, requests, max_num_seqs", [((0.0, 0.8), 200, 16), ((0.0,), 48, 64)],
                         ids=["mixed", "greedy, multi-step calls"])
def test_random_workload_with_aborts_frees_everything(family_model_dir, temperatures, requests, max_num_seqs):
    path, _ = family_model_dir
    llm = LLM(path, max_num_seqs=max_num_seqs, max_num_batched_tokens=256, num_cache_pages=12)
    engine = llm.engine
    calls = []  # multi-step calls that ran (greedy rows, nobody waiting)
    decode_steps = engine.runner.decode_steps
    engine.runner.decode_steps = lambda *a, **kw: calls.append(1) or decode_steps(*a, **kw)
    rng = random.Random(7)
    reqs = []
    for i in range(requests):
        n = rng.randint(1, 150)
        params = SamplingParams(temperature=rng.choice(temperatures), max_tokens=rng.randint(1, 40), ignore_eos=True)
        reqs.append(engine.add_request([rng.randint(2, 511) for _ in range(n)], params))
    aborted = set()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps % 3 == 0:
            victim = rng.choice(reqs)
            if not victim.is_finished:
                engine.abort_request(victim.request_id)
                aborted.add(victim.request_id)
    for r in reqs:
        assert r.is_finished
        if r.request_id in aborted:
            assert r.finish_reason == "abort"
        else:
            assert r.finish_reason == "length" and len(r.output_token_ids) == r.params.max_tokens
    assert aborted, "the workload should have aborted some requests"
    assert calls or len(temperatures) > 1, "the greedy workload should have run multi-step calls"
    engine.pop_finished()
    assert engine.cache.num_free_pages == engine.cache.num_pages
    assert engine.cache.num_free_slots == engine.cache.max_seqs
    assert not engine.scheduler.running and not engine.scheduler.waiting


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(max_tokens=-1), "max_tokens"),
    (dict(top_k=-3), "top_k"),
    (dict(max_tokens="8"), "max_tokens"),
    (dict(stop_token_ids=[1.5]), "stop_token_ids"),
    (dict(seq_seed=-1), "seq_seed"),
    (dict(so_args={"schema_type": "json", "schema": "{}", "colour": 1}), "unknown keys"),
    (dict(so_args={"schema_type": "yaml", "schema": "x"}), "schema_type"),
    (dict(so_args={"schema_type": "json", "schema": "{not json"}), "schema"),
    (dict(so_args={"schema_type": "regex", "schema": "a+", "bound_token_id": 3}), "bound_token_id"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_requests_leave_the_llm_working(llm):
    good = SamplingParams(max_tokens=3, **GREEDY)
    with pytest.raises(ValueError, match="empty"):
        llm.generate(prompt_token_ids=[[]], sampling_params=good, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(prompt_token_ids=[[5] * (llm.engine.max_model_len + 1)], sampling_params=good, use_tqdm=False)
    with pytest.raises(ValueError, match="vocab_size"):
        llm.generate(prompt_token_ids=[[5, 100000]], sampling_params=good, use_tqdm=False)
    with pytest.raises(ValueError, match="prompts"):
        llm.generate(prompts=[""], sampling_params=good, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(prompt_token_ids=[[5], [6]], sampling_params=[good], use_tqdm=False)
    with pytest.raises(TypeError, match="sampling_params"):
        llm.generate(prompt_token_ids=[[5]], sampling_params=[{"temperature": 0}], use_tqdm=False)
    out = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=good, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert llm.engine.cache.num_free_pages == llm.engine.cache.num_pages


def test_text_prompts_are_tokenized_and_detokenized(llm):
    outs = llm.generate(["def fib(n):", "import os"], SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)
    for out in outs:
        assert out.prompt_token_ids[0] == 0  # bos
        assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)


def test_bad_model_dirs(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(tmp_path / "missing")
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v4", "num_hidden_layers": "four"}')
    with pytest.raises(ValueError, match="num_hidden_layers"):
        LLM(tmp_path)
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(ValueError, match="not valid JSON"):
        LLM(tmp_path)
